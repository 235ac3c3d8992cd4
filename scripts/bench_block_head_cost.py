"""c for DFlash and DSpark block heads of the published shapes on a real (or synthetic) target:
the cost of drafting one block over the cost of one target decode step, side by side in one run.

    flock /tmp/mlxspec-bench.lock python scripts/bench_block_head_cost.py \
        --target models/offline/qwen2.5-coder/target --dtype float32 --blocks 16,7
    python scripts/bench_block_head_cost.py --target synthetic:qwen3-8b --dtype bfloat16   # GPU machine

The heads are random (cost does not depend on the values), of the published shape: 5 layers of
the target's width (hidden, MLP, heads), fc over 5 taps; DFlash uses the target's embedding and
lm_head and drafts block - 1 tokens; DSpark has its own embedding and lm_head, a Markov head of
rank 256 and a confidence head, and drafts block tokens slot after slot. Both are timed through
the drafter's own code (drafters/block_head.py), greedy, after a --context-token prompt is in the
caches: per round, the k + 1 = 4 new context rows enter the head's cache, then the block forward,
the slots' logits and the argmax (the new rows are trimmed again after each repeat).

Reported per configuration: block seconds, c = block / target step, and the target's forward over
the block's verify width (v = its time over one step's), all medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxspec.platform import maybe_reexec_with_openblas  # noqa: E402

NEW_ROWS = 4  # context rows a round adds (the anchor and 3 accepted drafts)


def load_target(spec: str, dtype: str):
    import mlx.core as mx

    from mlxspec import synthetic
    from mlxspec.loading import DTYPES

    if synthetic.is_synthetic(spec):
        return synthetic.build(spec, dtype)
    from mlx_lm import load

    model, _ = load(spec)
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model


def random_head(target, arch: str, block: int, layers: int, markov_rank: int, dtype):
    import mlx.core as mx
    from mlx.utils import tree_map

    from mlxspec.heads.dflash import DSPARK, BlockHead, head_config_for

    dspark = arch == DSPARK
    cfg = head_config_for(target, arch, block, num_layers=layers, markov_rank=markov_rank if dspark else 0,
                          confidence_head=dspark)
    head = BlockHead(cfg)
    head.set_dtype(dtype)
    small = (mx.random.normal((1 << 16,), key=mx.random.key(1)) * 0.02).astype(dtype)  # values do not change the time

    def fill(p):
        return mx.tile(small, (-(-p.size // small.size),))[: p.size].reshape(p.shape) if p.ndim > 1 else p

    if dspark:  # its own embedding and lm_head have the target's shapes: borrow the arrays (memory)
        from mlxspec.heads.dflash import target_embedding_and_head

        emb, lm = target_embedding_and_head(target)
        head.embed_tokens.weight = emb.weight
        head.lm_head.weight = lm.weight if hasattr(lm, "weight") else emb.weight
    own = {k: v for k, v in tree_map(fill, head.parameters()).items() if k not in ("embed_tokens", "lm_head")}
    head.update(own)
    mx.eval(head.parameters())
    if not dspark:
        head.bind(target)
    return head


def main() -> None:
    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/offline/qwen2.5-coder/target")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--blocks", default="16,7", help="block sizes, each timed for DFlash and DSpark")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--markov-rank", type=int, default=256)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens in the caches")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    from mlxspec.bench import _prefill
    from mlxspec.drafters.block_head import BlockHeadDrafter
    from mlxspec.heads.dflash import DFLASH, DSPARK
    from mlxspec.loading import DTYPES
    from mlxspec.sampling import SamplingParams
    from mlxspec.synthetic import context_ids

    target = load_target(args.target, args.dtype)
    vocab = int(target(mx.array([[0]], mx.uint32)).shape[-1])
    ids = context_ids(args.context, min(vocab, 32000))
    tcache = _prefill(target, ids)
    blocks = [int(b) for b in args.blocks.split(",")]
    widths = sorted({1, *[b for b in blocks], *[b + 1 for b in blocks]})
    hidden = target.args.hidden_size
    sp = SamplingParams()
    key = mx.random.key(0)

    configs = []
    for b in blocks:
        for arch in (DFLASH, DSPARK):
            head = random_head(target, arch, b, args.layers, args.markov_rank, DTYPES[args.dtype])
            drafter = BlockHeadDrafter(head, None, "dspark" if arch == DSPARK else "dflash")
            taps = mx.zeros((1, args.context, len(head.config.tap_layers) * hidden), DTYPES[args.dtype])
            head.add_context(taps, drafter.cache)  # the prompt's context
            mx.eval([c.keys for c in drafter.cache])
            configs.append((f"{'DSpark' if arch == DSPARK else 'DFlash'} block {b}", b, arch, head, drafter))

    def target_step(n: int):
        x = mx.array((ids * (n // len(ids) + 1))[:n], mx.uint32)[None]
        mx.eval(x)
        t0 = time.perf_counter()
        mx.eval(target(x, cache=tcache))
        dt = time.perf_counter() - t0
        trim_prompt_cache(tcache, n)
        return dt

    def block_round(b: int, arch: str, head, drafter) -> float:
        new = mx.random.normal((1, NEW_ROWS, len(head.config.tap_layers) * hidden)).astype(DTYPES[args.dtype])
        block = mx.array([ids[-1]] + [head.config.mask_token_id] * (b - 1), mx.uint32)[None]
        mx.eval(new, block)
        t0 = time.perf_counter()
        h = head(block, new, drafter.cache)[0]
        k = head.config.drafts_per_block
        if arch == DSPARK:
            tokens, _, _ = drafter._dspark_slots(h[:k], ids[-1], k, sp, key, vocab)
        else:
            tokens, _, _ = drafter._dflash_slots(h[1 : 1 + k], sp, key, vocab)
        mx.eval(tokens)
        dt = time.perf_counter() - t0
        for c in drafter.cache:
            c.trim(NEW_ROWS)
        return dt

    times: dict[str, list[float]] = {}
    for rep in range(args.repeats + 1):  # the first round warms up
        for n in widths:
            t = target_step(n)
            if rep:
                times.setdefault(f"target {n}", []).append(t)
        for name, b, arch, head, drafter in configs:
            t = block_round(b, arch, head, drafter)
            if rep:
                times.setdefault(name, []).append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    step = med["target 1"]
    rows = []
    for name, b, arch, head, _ in configs:
        k = head.config.drafts_per_block
        rows.append({"head": name, "drafts": k, "block_s": med[name], "c": med[name] / step,
                     "verify_v": med[f"target {k + 1}"] / step})
    report = {"target": args.target, "dtype": args.dtype, "context": args.context, "layers": args.layers,
              "target_step_s": step, "heads": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"target {args.target} ({args.dtype}), context {args.context}: one step {step * 1e3:.1f} ms")
    print(f"{'head':<20} {'drafts':>6} {'block ms':>9} {'c':>6} {'v(k+1)':>7}")
    for r in rows:
        print(f"{r['head']:<20} {r['drafts']:>6} {r['block_s'] * 1e3:>9.1f} {r['c']:>6.3f} {r['verify_v']:>7.2f}")


if __name__ == "__main__":
    main()
