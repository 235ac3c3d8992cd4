"""Compare drafters and draft lengths on a real pair, prompt kind by prompt kind.

    flock /tmp/mlxspec-heavy.lock python scripts/bench_drafters.py \
        --model models/offline/qwen2.5-coder --per-kind 2 --max-tokens 40 --out /tmp/drafters.json

For each prompt, every configuration runs once, in turn (A B C ... on the same prompt, so drift
on a shared machine hits them alike), greedy, from one target cache (the prompt is prefilled
once). Reported per prompt kind: decode tokens/s, tokens per target pass, and the speedup over
the target alone (geometric mean over the kind's prompts of the per-prompt ratios). Every
configuration's output is checked token for token against the target alone.

Run it under OpenBLAS (this script re-executes itself with it, like the `mlxspec` command).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxspec.platform import maybe_reexec_with_openblas  # noqa: E402

# (name, drafter, num_draft, adaptive)
CONFIGS = [
    ("target", "none", 0, False),
    ("model k=2", "model", 2, False),
    ("model k=4", "model", 4, False),
    ("model adaptive", "model", 4, True),
    ("lookup k=4", "lookup", 4, False),
    ("lookup adaptive", "lookup", 4, True),
    ("model+lookup k=4", "model+lookup", 4, False),
    ("model+lookup adaptive", "model+lookup", 4, True),
]

FALLBACK_PROMPTS = [
    {"kind": "code", "prompt": "Write a Python function `fib(n)` that returns the n-th Fibonacci number."},
    {"kind": "edit", "prompt": "Add type hints to this function and return the whole function:\n\n"
     "```python\ndef scale(values, factor):\n    result = []\n    for v in values:\n"
     "        result.append(v * factor)\n    return result\n```"},
    {"kind": "chat", "prompt": "When should I use a tuple instead of a list in Python?"},
    {"kind": "summarize", "prompt": "Summarize in one sentence: A cache stores the results of "
     "expensive operations so that later requests for the same data can be served faster."},
]


def load_prompts(per_kind: int, kinds: list[str] | None = None) -> list[dict]:
    path = ROOT / "mlxspec" / "data" / "prompts.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else FALLBACK_PROMPTS
    out, seen = [], {}
    for r in rows:
        if seen.get(r["kind"], 0) < per_kind and (not kinds or r["kind"] in kinds):
            seen[r["kind"]] = seen.get(r["kind"], 0) + 1
            out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/offline/qwen2.5-coder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--kinds", default="", help="comma-separated prompt kinds (default: all)")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--configs", default="", help="comma-separated subset of config names")
    ap.add_argument("--out", default=None, help="write every run as JSON here")
    ap.add_argument("--simulate", default=None, metavar="JSON",
                    help="no models: replay lookup's greedy proposals on the target outputs saved by --out")
    args = ap.parse_args()
    if args.simulate:
        simulate_file(args.simulate)
        return
    maybe_reexec_with_openblas()

    import mlxspec
    from mlxspec.drafters import LookupDrafter, ModelLookupDrafter
    from mlxspec.platform import machine_description

    configs = [c for c in CONFIGS if not args.configs or c[0] in args.configs.split(",")]
    if configs[0][0] != "target":
        configs.insert(0, CONFIGS[0])
    t0 = time.perf_counter()
    pair = mlxspec.load(args.model, dtype=args.dtype)
    print(f"loaded in {time.perf_counter() - t0:.0f}s on {machine_description()}", flush=True)
    runs = []
    for row in load_prompts(args.per_kind, [k for k in args.kinds.split(",") if k]):
        messages = [{"role": "user", "content": row["prompt"]}]
        session = pair.new_session(drafter="none")
        model = pair.make_drafter(drafter="model")  # one draft cache, shared by the model configs
        drafters = {
            "none": None,
            "model": model,
            "lookup": LookupDrafter(),
            "model+lookup": ModelLookupDrafter(model, LookupDrafter(), min_match=2),
        }
        ref = None
        for name, kind, k, adaptive in configs:
            session.drafter = drafters[kind]
            res = pair.generate(messages, max_tokens=args.max_tokens, num_draft=k, adaptive=adaptive,
                                session=session)
            s = res.stats
            if ref is None:
                ref = res.tokens
                ids = pair.encode(messages)
            run = {
                "id": row.get("id", row["prompt"][:20]), "kind": row["kind"], "config": name,
                "tokens": s.generation_tokens, "tok_s": s.tokens_per_second, "tok_pass": 1 + s.accepted / s.rounds if s.rounds else 0.0,
                "passes": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                "by_source": dict(s.tokens_by_source), "prompt_tokens": s.prompt_tokens,
                "identical": res.tokens == ref,
            }
            print(json.dumps(run), flush=True)
            if name == "target":  # what --simulate needs (not printed)
                run.update(prompt_ids=ids, output=res.tokens)
            runs.append(run)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    summarize(runs, [c[0] for c in configs])


def simulate_lookup(prompt: list[int], output: list[int], k: int, adaptive: bool, ngram_max: int = 4) -> dict:
    """Greedy lookup decoding replayed without models: a proposal is accepted up to its first
    token that differs from the target's own output, so tokens per target pass follow from the
    prompt and the output alone (exactly what the engine would count)."""
    from mlxspec.adaptive import AdaptiveLength, FixedLength
    from mlxspec.drafters import LookupDrafter

    d = LookupDrafter(1, ngram_max)
    pol = AdaptiveLength(first=k, costs=d.costs) if adaptive else FixedLength(k)
    seq, done, passes, accepted, drafted = list(prompt), 0, 0, 0, 0
    while done < len(output):
        key = d.next_source(seq)
        kk = min(pol.k(key), len(output) - done - 1)
        toks, _ = d.index.propose(seq, kk)
        n = 0
        while n < len(toks) and toks[n] == output[done + n]:
            n += 1
        if toks:
            pol.update(key, len(toks), n)
        passes, accepted, drafted = passes + 1, accepted + n, drafted + len(toks)
        seq += output[done : done + n + 1]
        done += n + 1
    return {"passes": passes, "tok_pass": 1 + accepted / passes, "drafted": drafted, "accepted": accepted}


def simulate_file(path: str) -> None:
    runs = [r for r in json.loads(Path(path).read_text()) if r["config"] == "target" and "output" in r]
    settings = [("lookup k=4", 4, False), ("lookup k=8", 8, False), ("lookup adaptive", 4, True)]
    print("| prompt | kind | " + " | ".join(n for n, _, _ in settings) + " |")
    print("|---|---|" + "---|" * len(settings))
    for r in runs:
        cells = [f"{simulate_lookup(r['prompt_ids'], r['output'], k, a)['tok_pass']:.2f}" for _, k, a in settings]
        print(f"| {r['id']} | {r['kind']} | " + " | ".join(cells) + " |")


def summarize(runs: list[dict], names: list[str]) -> None:
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    base = {(r["id"]): r["tok_s"] for r in runs if r["config"] == "target"}
    print("\n| config | " + " | ".join(f"{k}: tok/s, tok/pass, speedup" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for name in names:
        cells = []
        for kind in kinds:
            rs = [r for r in runs if r["config"] == name and r["kind"] == kind]
            if not rs:
                cells.append("")
                continue
            sp = math.exp(statistics.mean(math.log(r["tok_s"] / base[r["id"]]) for r in rs))
            cells.append(f"{statistics.median(r['tok_s'] for r in rs):.2f}, "
                         f"{statistics.mean(r['tok_pass'] for r in rs):.2f}, {sp:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")
    bad = [f"{r['id']}/{r['config']}" for r in runs if not r["identical"]]
    print("\noutputs identical to the target alone:", "all" if not bad else f"NOT for {bad}")


if __name__ == "__main__":
    main()
