#!/usr/bin/env python
"""A trained EAGLE-3 head against the pair's draft model and the target alone, side by side in one
run (one process, one target in memory, settings alternated per prompt, order reversed every
other prompt), greedy, on the built-in code prompts.

    flock /tmp/mlxspec-bench.lock python scripts/bench_trained_head.py \
        --pair models/offline/qwen2.5-coder --head models/offline/qwen2.5-coder-head \
        --head-k 2,3 --draft-k 4 --max-tokens 32 --repeats 2 --per-kind 3

Reports per setting: median tokens/s, the median over prompts and repeats of the speedup over
the target alone on the same prompt and repeat, tokens per target pass, acceptance per draft
position (P(position i accepted) over rounds), and whether the output equals the target alone's.
The head's taps stay installed on the target for every setting (recording a layer's output costs
no compute). Writes --json and --markdown.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxspec.platform import maybe_reexec_with_openblas  # noqa: E402


def _ints(ctx, param, value: str) -> tuple[int, ...]:
    return tuple(int(x) for x in value.split(",") if x.strip())


@click.command()
@click.option("--pair", default=str(ROOT / "models/offline/qwen2.5-coder"), show_default=True)
@click.option("--head", "head_dir", default=str(ROOT / "models/offline/qwen2.5-coder-head"), show_default=True)
@click.option("--head-k", default="3", callback=_ints, show_default=True, help="Draft lengths for the head.")
@click.option("--draft-k", default="4", callback=_ints, show_default=True, help="Draft lengths for the draft model.")
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--repeats", default=2, show_default=True)
@click.option("--kinds", default="code", show_default=True)
@click.option("--per-kind", default=3, show_default=True)
@click.option("--json", "json_out", default=str(ROOT / "models/qwen2.5-coder-head-bench.json"), show_default=True)
@click.option("--markdown", "md_out", default=str(ROOT / "models/qwen2.5-coder-head-bench.md"), show_default=True)
def main(pair, head_dir, head_k, draft_k, max_tokens, repeats, kinds, per_kind, json_out, md_out) -> None:
    maybe_reexec_with_openblas()
    import mlxspec
    from mlxspec.bench import load_prompts, run_mlxspec
    from mlxspec.engine import Pair
    from mlxspec.heads import load_trained_head
    from mlxspec.platform import machine_description

    base = mlxspec.load(pair, dtype="float32")
    target, draft, tok = base.target, base.draft, base.tokenizer
    head = load_trained_head(head_dir, target)
    pairs = {"target": Pair(target, None, tok), "draft": Pair(target, draft, tok), "head": Pair(target, None, tok, head=head)}
    settings = [("target", 0)] + [("head", k) for k in head_k] + [("draft", k) for k in draft_k]
    label = {s: ("target alone" if s[0] == "target" else f"{'0.5B draft model' if s[0] == 'draft' else 'trained head'} k={s[1]}")
             for s in settings}
    prompts = load_prompts(kinds=kinds.split(","), per_kind=per_kind)
    encoded = [(p, base.encode(p.input(tok))) for p in prompts]
    load_start = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else None

    def run(s, ids, n):
        return run_mlxspec(pairs[s[0]], ids, s[1], n, 0.0, 0)

    click.echo("warm-up", err=True)
    for s in settings:
        run(s, encoded[0][1], 8)
    runs = []
    block = 0
    for rep in range(repeats):
        for p, ids in encoded:
            order = settings if block % 2 == 0 else settings[::-1]
            block += 1
            done = {}
            for s in order:
                r = run(s, ids, max_tokens)
                done[s] = r
                click.echo(f"repeat {rep + 1} {p.id:<16} {label[s]:<22} {r.tokens_per_second:6.2f} tok/s "
                           f"{1 + r.accepted / r.rounds if r.rounds else 1:.2f} tok/pass", err=True)
            plain = done[("target", 0)]
            for s, r in done.items():
                runs.append({"setting": label[s], "prompt": p.id, "repeat": rep, "tokens_per_s": r.tokens_per_second,
                             "speedup": r.tokens_per_second / plain.tokens_per_second, "rounds": r.rounds,
                             "accepted": r.accepted, "drafted": r.drafted, "tokens": r.tokens,
                             "accepted_per_position": r.accepted_per_position,
                             "drafted_per_position": r.drafted_per_position,
                             "identical_to_target": r.output == plain.output})
    head.recorder.remove()
    rows = []
    for s in settings:
        rs = [r for r in runs if r["setting"] == label[s]]
        acc = [sum(x) for x in zip(*[r["accepted_per_position"] for r in rs])] if s[1] else []
        drf = [sum(x) for x in zip(*[r["drafted_per_position"] for r in rs])] if s[1] else []
        rounds = sum(r["rounds"] for r in rs)
        rows.append({
            "setting": label[s], "k": s[1],
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 3),
            "speedup": round(statistics.median(r["speedup"] for r in rs), 3),
            "speedup_range": [round(min(r["speedup"] for r in rs), 3), round(max(r["speedup"] for r in rs), 3)],
            "tokens_per_pass": round(1 + sum(r["accepted"] for r in rs) / rounds, 3) if rounds else 1.0,
            "acceptance_per_position": [round(a / d, 3) if d else None for a, d in zip(acc, drf)],
            "identical_to_target": all(r["identical_to_target"] for r in rs),
        })
    report = {"pair": pair, "head": head_dir, "max_tokens": max_tokens, "repeats": repeats,
              "prompts": [p.id for p, _ in encoded], "rows": rows, "runs": runs, "machine": machine_description(),
              "load_average_start": load_start,
              "load_average_end": open("/proc/loadavg").read().split()[:3] if load_start else None,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
    lines = ["| setting | tokens/s | speedup (median, range) | tokens/pass | acceptance per position | identical |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x "
                     f"({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}) | {r['tokens_per_pass']:.2f} | "
                     f"{', '.join(f'{a:.2f}' for a in r['acceptance_per_position'] if a is not None) or '-'} | "
                     f"{'yes' if r['identical_to_target'] else 'NO'} |")
    md = "\n".join(lines) + "\n"
    Path(md_out).write_text(md)
    click.echo(md)


if __name__ == "__main__":
    main()
