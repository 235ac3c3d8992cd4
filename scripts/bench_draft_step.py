"""The draft step and c before and after the cheaper-draft-step candidates, side by side in one run.

    flock /tmp/mlxspec-bench.lock python scripts/bench_draft_step.py \
        --model models/offline/qwen2.5-coder --vocab 0,65536,32768,16384 --per-kind 1 --max-tokens 32

Part 1, costs (one process, interleaved repeats, medians, after a prompt is in the KV caches):
- the target's one-token step, and its forward over k+1 = 5 tokens (v(5));
- the draft's one-token step (forward + argmax): the full model, each reduced draft vocabulary
  (`--vocab`, 0 = full), and the full model with every layer's MLP under `mx.compile`;
- the host time to build one draft step's graph (Python), apart.
Part 2, acceptance (greedy, k = --num-draft): every prompt runs the target alone, then each
vocabulary in turn; outputs are checked token for token against the target alone; reported:
acceptance, tokens per target pass, the speedup predicted from c, v and the measured per-position
acceptance, and the achieved tokens/s.

Run it under OpenBLAS (this script re-executes itself with it, like the `mlxspec` command).
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


def _timed(fn, cache, n_trim) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    t0 = time.perf_counter()
    mx.eval(fn())
    dt = time.perf_counter() - t0
    trim_prompt_cache(cache, n_trim)
    return dt


class CompiledMLP:
    """A layer's MLP under mx.compile (norm, activation and residual ops fused where MLX can)."""

    def __init__(self, mlp):
        import mlx.core as mx

        self.mlp = mlp
        self.fn = mx.compile(lambda x: mlp(x))

    def __call__(self, x):
        return self.fn(x)


def measure_steps(pair, ids: list[int], vocabs: list[int], repeats: int, k: int) -> dict:
    import mlx.core as mx

    from mlxspec.bench import _prefill
    from mlxspec.drafters.model import ReducedHead, draft_vocab_ids

    target, draft = pair.target, pair.draft
    tcache, dcache = _prefill(target, ids), _prefill(draft, ids)
    heads = {n: ReducedHead(draft, draft_vocab_ids(n, pair.vocab_size, pair.eos_token_ids)) for n in vocabs if n}
    x1 = mx.array(ids[-1:], mx.uint32)[None]
    xk = mx.array((ids * (k + 1))[: k + 1], mx.uint32)[None]

    def full_step():
        return mx.argmax(draft(x1, cache=dcache)[0, -1])

    def reduced_step(head):
        return lambda: head.index[mx.argmax(head(head.hidden(x1[0], dcache)[-1:])[0])]

    layers = draft.model.layers
    plain_mlps = [layer.mlp for layer in layers]
    compiled_mlps = [CompiledMLP(m) for m in plain_mlps]

    def compiled_step():
        for layer, m in zip(layers, compiled_mlps):
            layer.mlp = m
        try:
            return full_step()
        finally:
            for layer, m in zip(layers, plain_mlps):
                layer.mlp = m

    steps = {f"draft vocab {n or 'full'}": (reduced_step(heads[n]) if n else full_step) for n in vocabs}
    steps["draft full, compiled MLPs"] = compiled_step
    times: dict[str, list[float]] = {"target step": [], f"target v({k + 1})": [], **{s: [] for s in steps}}
    build: dict[str, list[float]] = {s: [] for s in steps}
    for rep in range(repeats + 1):
        t1 = _timed(lambda: target(x1, cache=tcache), tcache, 1)
        tk = _timed(lambda: target(xk, cache=tcache), tcache, k + 1)
        if rep:
            times["target step"].append(t1)
            times[f"target v({k + 1})"].append(tk)
        for name, fn in steps.items():
            t0 = time.perf_counter()
            out = fn()  # graph only
            b = time.perf_counter() - t0
            mx.eval(out)
            from mlx_lm.models.cache import trim_prompt_cache

            trim_prompt_cache(dcache, 1)
            dt = _timed(fn, dcache, 1)
            if rep:
                times[name].append(dt)
                build[name].append(b)
    med = {n: statistics.median(v) for n, v in times.items()}
    tstep = med["target step"]
    return {
        "context_tokens": len(ids),
        "target_step_s": tstep,
        "v": med[f"target v({k + 1})"] / tstep,
        "draft": {n: {"step_s": med[n], "c": med[n] / tstep, "graph_build_s": statistics.median(build[n])} for n in steps},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "offline" / "qwen2.5-coder"))
    ap.add_argument("--draft", default=None, help="draft model (default: the pair folder's)")
    ap.add_argument("--vocab", default="0,65536,32768,16384", help="draft vocabularies (0 = full)")
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--kinds", default="code,chat,edit,summarize")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-draft", "-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--out", default=None, help="write every number here (JSON)")
    args = ap.parse_args()
    maybe_reexec_with_openblas()

    import mlxspec
    from mlxspec.bench import expected_tokens, load_prompts, survival
    from mlxspec.platform import machine_description

    vocabs = [int(v) for v in args.vocab.split(",")]
    pair = mlxspec.load(args.model, draft=args.draft, dtype="float32")
    prompts = load_prompts(None, args.kinds.split(","), args.per_kind)
    encoded = [(p, pair.encode(p.input(pair.tokenizer))) for p in prompts]
    ctx = sorted((ids for _, ids in encoded), key=len)[len(encoded) // 2]
    k = args.num_draft
    costs = measure_steps(pair, ctx, vocabs, args.repeats, k)
    print(f"context {costs['context_tokens']} tokens; target step {costs['target_step_s'] * 1e3:.1f} ms, "
          f"v({k + 1}) = {costs['v']:.2f}")
    print(f"{'draft step':<28} {'ms':>7} {'c':>6} {'graph build ms':>15}")
    for name, d in costs["draft"].items():
        print(f"{name:<28} {d['step_s'] * 1e3:7.1f} {d['c']:6.3f} {d['graph_build_s'] * 1e3:15.2f}")
    report = {"machine": machine_description(), "model": args.model, "num_draft": k, "costs": costs, "acceptance": {}}

    if not args.skip_acceptance:
        per = {n: {"tokens": 0, "time": 0.0, "drafted": 0, "accepted": 0, "rounds": 0, "identical": True,
                   "acc": [0] * k, "dr": [0] * k} for n in ["target", *vocabs]}
        for p, ids in encoded:
            ref = None
            for n in ["target", *vocabs]:
                opts = dict(max_tokens=args.max_tokens, num_draft=0 if n == "target" else k,
                            drafter="none" if n == "target" else "model", draft_vocab=0 if n == "target" else n)
                res = pair.generate(ids, **opts)
                s, e = res.stats, per[n]
                if n == "target":
                    ref = res.tokens
                e["identical"] &= res.tokens == ref
                e["tokens"] += s.generation_tokens
                e["time"] += s.decode_time
                e["drafted"] += s.drafted
                e["accepted"] += s.accepted
                e["rounds"] += s.rounds
                for i, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position)):
                    e["acc"][i] += a
                    e["dr"][i] += d
                print(f"  {p.id:<18} {str(n):>7}: {s.generation_tokens} tokens, {s.tokens_per_second:.2f} tok/s, "
                      f"accepted {s.accepted}/{s.drafted}", flush=True)
        base_tps = per["target"]["tokens"] / per["target"]["time"]
        print(f"\n{'draft vocab':>11} {'accept':>7} {'tok/pass':>8} {'predicted':>9} {'tok/s':>6} {'speedup':>7} {'identical':>9}")
        for n in vocabs:
            e = per[n]
            d = costs["draft"][f"draft vocab {n or 'full'}"]
            surv = survival(e["acc"], e["dr"])
            pred = expected_tokens(surv, k) / (k * d["c"] + costs["v"])
            tps = e["tokens"] / e["time"]
            row = {"acceptance": e["accepted"] / max(1, e["drafted"]), "tokens_per_pass": 1 + e["accepted"] / max(1, e["rounds"]),
                   "predicted_speedup": pred, "tokens_per_second": tps, "speedup": tps / base_tps,
                   "identical_to_target": e["identical"], "position_acceptance": surv}
            report["acceptance"][str(n)] = row
            print(f"{n or 'full':>11} {row['acceptance']:7.3f} {row['tokens_per_pass']:8.2f} {pred:8.2f}x "
                  f"{tps:6.2f} {row['speedup']:6.2f}x {str(e['identical']):>9}")
        report["acceptance"]["target"] = {"tokens_per_second": base_tps}
        print(f"target alone: {base_tps:.2f} tok/s; {len(encoded)} prompts, {args.max_tokens} tokens, greedy, k={k}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
