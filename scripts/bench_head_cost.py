"""What a trained EAGLE-3 head's draft step costs next to the target's step (c), side by side with
the pair's small draft model, in one run.

    flock /tmp/mlxspec-bench.lock python scripts/bench_head_cost.py \
        --pair models/offline/qwen2.5-coder --repeats 15

No trained head exists for the offline pair, so the head has random weights of the real shapes
(EAGLE-3 as SpecForge sizes it for the target: one decoder layer of the target's width and MLP,
fc over three taps, a 32000-token draft vocabulary; also the full vocabulary). Cost does not
depend on the weights' values. One process, interleaved repeats, medians, after a prompt of the
built-in suite (median length) is in every KV cache:

- target one-token step (forward + argmax), with the head's taps installed and without;
- 0.5B draft one-token step (forward + argmax);
- head one-token draft step (embedding, the layer over its own cache, lm_head, argmax, id map);
- head catch-up of 3 accepted positions (fc over their features, the layer) then 4 draft steps:
  a whole propose of k = 4, over 4 tokens;
- in the engine: draft time per drafted token with profile=True (host graph building included),
  k = 4, from a greedy generation (acceptance of a random head is ~0; only the time is used).

Run it under OpenBLAS (this script re-executes itself with it, like the `mlxspec` command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxspec.platform import maybe_reexec_with_openblas  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default=str(ROOT / "models/offline/qwen2.5-coder"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens of the engine run (profiled draft time)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    maybe_reexec_with_openblas()

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    import mlxspec
    from mlxspec.bench import _prefill, load_prompts
    from mlxspec.drafters.eagle3 import Eagle3Drafter, HeadStep
    from mlxspec.heads import load_trained_head, target_embedding
    from mlxspec.heads.eagle3 import Eagle3Head, head_config_for, save_head, vocab_maps
    from mlxspec.platform import loaded_blas

    pair = mlxspec.load(args.pair, dtype=args.dtype)
    target, draft = pair.target, pair.draft
    prompts = load_prompts(None, None, 1)
    encoded = sorted((pair.encode(p.input(pair.tokenizer)) for p in prompts), key=len)
    ids = encoded[len(encoded) // 2]
    print(f"BLAS: {loaded_blas()}; context {len(ids)} tokens; dtype {args.dtype}", flush=True)

    heads = {}
    tmp = Path(tempfile.mkdtemp())
    for name, dv in (("head-32k", 32000), ("head-full", 0)):
        cfg = head_config_for(target, draft_vocab_size=dv or target.args.vocab_size)
        mx.random.seed(0)
        head = Eagle3Head(cfg)
        if dv:
            d2t, t2d = vocab_maps(range(dv), target.args.vocab_size)
            head.set_vocab(mx.array(d2t), mx.array(t2d))
        save_head(head, tmp / name)
        heads[name] = tmp / name

    # each head loaded in turn (taps installed, then removed): steps timed over a head cache of the context
    results: dict[str, list[float]] = {}

    def record(key, dt):
        results.setdefault(key, []).append(dt)

    def timed(fn):
        t0 = time.perf_counter()
        mx.eval(fn())
        return time.perf_counter() - t0

    tcache = _prefill(target, ids)
    dcache = _prefill(draft, ids)
    x = mx.array([[ids[-1]]], mx.uint32)

    def target_step():
        dt = timed(lambda: mx.argmax(target(x, cache=tcache)[0, -1]))
        trim_prompt_cache(tcache, 1)
        return dt

    def draft_step():
        dt = timed(lambda: mx.argmax(draft(x, cache=dcache)[0, -1]))
        trim_prompt_cache(dcache, 1)
        return dt

    params = {}
    for name, folder in heads.items():
        th = load_trained_head(folder, target)
        hs = HeadStep(th, target)
        hcache = hs.make_cache(len(ids))
        ids_map = Eagle3Drafter(th, target)._ids
        n_taps = len(th.tap_layers)
        feats = mx.random.normal((1, 3, n_taps * target.args.hidden_size)).astype(hs.h.dtype)
        embed = target_embedding(target)
        params[name] = sum(v.size for _, v in __import__("mlx.utils").utils.tree_flatten(th.module.parameters()))

        def head_step():
            dt = timed(lambda: ids_map[mx.argmax(hs(x, hcache)[0, -1])])
            trim_prompt_cache(hcache, 1)
            return dt

        def head_propose4():
            """catch-up of 3 rows + 4 draft steps (k = 4), one graph as in the engine."""
            def run():
                lg, h = th.module(embed(mx.array([ids[-3:]], mx.uint32)), th.module.fuse(feats), mask="causal",
                                  cache=hcache[0])
                toks = []
                logits, h = lg[0, -1], h[:, -1:]
                for i in range(4):
                    t = ids_map[mx.argmax(logits)]
                    toks.append(t)
                    if i < 3:
                        lg, h = th.module(embed(t.reshape(1, 1)), h, cache=hcache[0])
                        logits = lg[0, -1]
                return mx.stack(toks)
            dt = timed(run)
            trim_prompt_cache(hcache, 6)
            return dt

        for rep in range(args.repeats + 1):
            t = target_step()
            d = draft_step()
            h1 = head_step()
            h4 = head_propose4()
            if rep:
                record(f"{name}_target_step", t)
                record(f"{name}_draft_step", d)
                record(f"{name}_step", h1)
                record(f"{name}_propose4", h4)

        # the engine: draft time per drafted token (profile), and the whole loop's speed
        res = pair_with(th, pair).generate(ids, max_tokens=args.max_tokens, num_draft=4, adaptive=False, profile=True)
        st = res.stats
        results[f"{name}_engine_draft_per_token"] = [st.draft_time / max(st.drafted, 1)]
        results[f"{name}_engine_acceptance"] = [st.acceptance_rate]
        th.recorder.remove()

    for rep in range(args.repeats + 1):  # the target without taps, and the draft model again
        t = target_step()
        d = draft_step()
        if rep:
            record("untapped_target_step", t)
            record("untapped_draft_step", d)

    res = pair.generate(ids, max_tokens=args.max_tokens, num_draft=4, adaptive=False, profile=True)
    results["draft_engine_draft_per_token"] = [res.stats.draft_time / max(res.stats.drafted, 1)]

    med = {k: statistics.median(v) for k, v in results.items()}
    tstep = med["untapped_target_step"]
    tapped = statistics.median([med[f"{n}_target_step"] for n in heads])
    tparams = sum(v.size for _, v in __import__("mlx.utils").utils.tree_flatten(target.parameters()))
    print(f"target step {tstep * 1e3:.1f} ms untapped, {tapped * 1e3:.1f} ms with a head's taps "
          f"(other loops); target {tparams / 1e6:.0f}M parameters")
    print("c = drafter step / target step, both medians of the same interleaved loop")
    print(f"{'drafter':<30} {'step ms':>8} {'c':>7} {'propose k=4 c/token':>20} {'engine c/token':>15}")
    out = {"context": len(ids), "target_step_untapped_s": tstep, "target_step_tapped_s": tapped,
           "medians_s": med, "rows": []}
    rows = [("0.5B draft model", med["untapped_draft_step"], med["untapped_target_step"], None,
             med["draft_engine_draft_per_token"])]
    for name in heads:
        rows.append((f"EAGLE-3 {name} ({params[name] / 1e6:.0f}M)", med[f"{name}_step"], med[f"{name}_target_step"],
                     med[f"{name}_propose4"], med[f"{name}_engine_draft_per_token"]))
        rows.append((f"  0.5B draft, same loop", med[f"{name}_draft_step"], med[f"{name}_target_step"], None, None))
    for label, step, tgt, prop, eng in rows:
        c = step / tgt
        pc = f"{prop / 4 / tgt:.3f}" if prop else "-"
        ec = f"{eng / tgt:.3f}" if eng else "-"
        print(f"{label:<30} {step * 1e3:8.1f} {c:7.3f} {pc:>20} {ec:>15}")
        out["rows"].append({"drafter": label.strip(), "step_s": step, "target_step_s": tgt, "c": c,
                            "propose4_c_per_token": prop / 4 / tgt if prop else None,
                            "engine_c_per_token": eng / tgt if eng else None})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


def pair_with(head, pair):
    import mlxspec

    p = mlxspec.Pair(pair.target, None, pair.tokenizer, head=head)
    return p


if __name__ == "__main__":
    main()
