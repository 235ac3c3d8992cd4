"""The draft step and c before and after the cheaper-draft-step candidates, side by side in one run.

    flock /tmp/mlxspec-bench.lock python scripts/bench_draft_step.py \
        --model models/offline/qwen2.5-coder --vocab 0,100000,65536,32768 --per-kind 1 --max-tokens 48

Part 1, costs (one process, interleaved repeats, medians, after a prompt is in the KV caches):
- the target's one-token step, and its forward over k+1 = 5 tokens (v(5));
- the draft's one-token step (forward + argmax): the full model, each reduced draft vocabulary
  (`--vocab`, 0 = full), and the full model with every layer's MLP under `mx.compile`;
- the host time to build one draft step's graph (Python), apart.
Part 2, acceptance (greedy, k = --num-draft): every prompt runs the target alone once; the
draft's greedy proposal at every position of that output (one draft pass, teacher-forced) says
which drafts a round would accept, exactly for greedy drafting, for every vocabulary and k at
once. Reported: the share of the target's tokens outside the kept ids, acceptance, tokens per
target pass, and the speedup predicted from c, v(k+1) and that acceptance. --generate also runs
the engine with each vocabulary (achieved tokens/s; output identical to the target alone).

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


def simulate_greedy(match: list[bool], k: int) -> tuple[int, int, list[int], list[int]]:
    """Rounds of greedy speculation along the target's own output: the draft's proposal at each
    position is its argmax given the target's prefix (match[t]: it equals the target's token),
    exactly what a round sees as long as its drafts are accepted. Returns (rounds, accepted,
    accepted per position, drafted per position)."""
    t, rounds, accepted = 0, 0, 0
    acc, dr = [0] * k, [0] * k
    while t < len(match):
        kk = min(k, len(match) - t - 1)
        n = 0
        while n < kk and match[t + n]:
            n += 1
        for i in range(kk):
            dr[i] += 1
        for i in range(n):
            acc[i] += 1
        rounds, accepted, t = rounds + 1, accepted + n, t + n + 1
    return rounds, accepted, acc, dr


def acceptance_by_vocab(pair, encoded, vocabs, costs, k, max_tokens, generate) -> dict:
    """Greedy acceptance of each draft vocabulary along the target's own outputs (teacher-forced:
    one target generation and one draft pass per prompt), and the speedup predicted from it."""
    import mlx.core as mx

    from mlxspec.bench import expected_tokens, survival
    from mlxspec.drafters.model import ReducedHead, draft_vocab_ids

    heads = {n: ReducedHead(pair.draft, draft_vocab_ids(n, pair.vocab_size, pair.eos_token_ids)) for n in vocabs if n}
    kept = {n: set(h.ids) for n, h in heads.items()}
    per = {n: {"rounds": 0, "accepted": 0, "acc": [0] * k, "dr": [0] * k, "outside": 0, "tokens": 0} for n in vocabs}
    base_tokens = base_time = 0.0
    gen = {n: {"tokens": 0, "time": 0.0, "identical": True, "rounds": 0, "accepted": 0} for n in vocabs}
    for p, ids in encoded:
        res = pair.generate(ids, max_tokens=max_tokens, drafter="none")
        out = res.tokens
        base_tokens, base_time = base_tokens + len(out), base_time + res.stats.decode_time
        seq = mx.array(ids + out, mx.uint32)[None]
        first = len(ids) - 1  # the position whose logits predict out[0]
        h = pair.draft.model(seq)[0][first: first + len(out)]
        for n in vocabs:
            if n:
                head = heads[n]
                prop = head.index[mx.argmax(head(h), axis=-1)]
            else:
                prop = mx.argmax(pair.draft(seq)[0][first: first + len(out)], axis=-1)
            match = [int(a) == b for a, b in zip(prop.tolist(), out)]
            r, a, acc, dr = simulate_greedy(match, k)
            e = per[n]
            e["rounds"] += r
            e["accepted"] += a
            e["acc"] = [x + y for x, y in zip(e["acc"], acc)]
            e["dr"] = [x + y for x, y in zip(e["dr"], dr)]
            e["tokens"] += len(out)
            e["outside"] += sum(t not in kept[n] for t in out) if n else 0
            if generate:
                g = pair.generate(ids, max_tokens=max_tokens, num_draft=k, draft_vocab=n)
                gen[n]["tokens"] += g.stats.generation_tokens
                gen[n]["time"] += g.stats.decode_time
                gen[n]["identical"] &= g.tokens == out
                gen[n]["rounds"] += g.stats.rounds
                gen[n]["accepted"] += g.stats.accepted
        print(f"  {p.id}: {len(out)} target tokens", flush=True)
    base_tps = base_tokens / base_time
    rows = {}
    print(f"\n{'draft vocab':>11} {'outside':>7} {'accept':>7} {'tok/pass':>8} {'c':>6} {'predicted':>9}"
          + (f" {'tok/s':>6} {'speedup':>7} {'identical':>9} {'engine tok/pass':>8}" if generate else ""))
    for n in vocabs:
        e = per[n]
        c = costs["draft"][f"draft vocab {n or 'full'}"]["c"]
        surv = survival(e["acc"], e["dr"])
        pred = expected_tokens(surv, k) / (k * c + costs["v"])
        row = {"target_tokens_outside": e["outside"] / max(1, e["tokens"]),
               "acceptance": e["accepted"] / max(1, sum(e["dr"])),
               "tokens_per_pass": 1 + e["accepted"] / max(1, e["rounds"]), "c": c,
               "position_acceptance": surv, "predicted_speedup": pred}
        line = (f"{n or 'full':>11} {row['target_tokens_outside']:7.2%} {row['acceptance']:7.3f} "
                f"{row['tokens_per_pass']:8.2f} {c:6.3f} {pred:8.2f}x")
        if generate:
            g = gen[n]
            row.update(tokens_per_second=g["tokens"] / g["time"], speedup=g["tokens"] / g["time"] / base_tps,
                       identical_to_target=g["identical"], engine_tokens_per_pass=1 + g["accepted"] / max(1, g["rounds"]))
            line += (f" {row['tokens_per_second']:6.2f} {row['speedup']:6.2f}x {str(g['identical']):>9}"
                     f" {row['engine_tokens_per_pass']:8.2f}")
        rows[str(n)] = row
        print(line)
    print(f"target alone: {base_tps:.2f} tok/s; {len(encoded)} prompts, {max_tokens} tokens, greedy, k={k}; "
          "acceptance along the target's own output (teacher-forced), exact for greedy drafting")
    return {"target_tokens_per_second": base_tps, "by_vocab": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "offline" / "qwen2.5-coder"))
    ap.add_argument("--draft", default=None, help="draft model (default: the pair folder's)")
    ap.add_argument("--vocab", default="0,100000,65536,32768", help="draft vocabularies (0 = full)")
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--kinds", default="code,chat,edit,summarize")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-draft", "-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--generate", action="store_true",
                    help="also run the engine with each vocabulary (achieved tokens/s, output identity)")
    ap.add_argument("--out", default=None, help="write every number here (JSON)")
    args = ap.parse_args()
    maybe_reexec_with_openblas()

    import mlxspec
    from mlxspec.bench import load_prompts
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
        report["acceptance"] = acceptance_by_vocab(pair, encoded, vocabs, costs, k, args.max_tokens, args.generate)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
