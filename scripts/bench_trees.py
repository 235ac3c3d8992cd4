"""Token trees and the suffix drafter against chains and lookup, side by side on a real pair.

    flock /tmp/mlxspec-bench.lock python scripts/bench_trees.py --set model --kinds code,edit
    flock /tmp/mlxspec-bench.lock python scripts/bench_trees.py --set suffix --kinds edit,repeat

`--set model`: the draft model as a chain (fixed k=4 and adaptive) and as trees of 8 and 16
nodes. `--set suffix`: lookup and the suffix drafter (chains with adaptive length, trees of
16 nodes) and model+suffix. For each prompt every configuration runs once, in turn, greedy,
from one target cache; the output of each is checked token for token against the target
alone. Kind "repeat" is a two-turn chat: the model writes code, then is asked for the same
code with a change (measured on the second turn, the "repeat with changes" of coding work).
Reported per kind: decode tokens/s, tokens per target pass and the speedup over the target
alone (geometric mean of per-prompt ratios).
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

# (name, drafter, options)
SETS = {
    "model": [
        ("target", "none", {}),
        ("model k=4", "model", dict(num_draft=4)),
        ("model adaptive", "model", dict(adaptive=True)),
        ("model tree 8", "model", dict(tree_nodes=8)),
        ("model tree 16", "model", dict(tree_nodes=16)),
    ],
    "suffix": [
        ("target", "none", {}),
        ("lookup adaptive", "lookup", dict(adaptive=True)),
        ("suffix adaptive", "suffix", dict(adaptive=True)),
        ("suffix tree 16", "suffix", dict(tree_nodes=16)),
        ("model+suffix tree 16", "model+suffix", dict(tree_nodes=16)),
    ],
}

REPEAT = [
    ("Write a Python function `word_counts(text)` that returns a dict mapping each word to its count.",
     "Now write the same function again, but lower-case the words first. Return the whole function."),
    ("Write a Python class `Point` with x and y attributes, `__repr__`, and a `distance(other)` method.",
     "Repeat the class exactly, but add a `__eq__` method. Return the whole class."),
]


def prompts(kinds: list[str], per_kind: int) -> list[dict]:
    rows = [json.loads(l) for l in (ROOT / "mlxspec" / "data" / "prompts.jsonl").read_text().splitlines() if l.strip()]
    out = []
    for kind in kinds:
        if kind == "repeat":
            out += [{"id": f"repeat-{i}", "kind": "repeat", "turns": list(t)} for i, t in enumerate(REPEAT[:per_kind])]
        else:
            out += [{"id": r["id"], "kind": kind, "turns": [r["prompt"]]} for r in rows if r["kind"] == kind][:per_kind]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/offline/qwen2.5-coder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--set", choices=list(SETS), default="model")
    ap.add_argument("--kinds", default="code,edit")
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    ap.add_argument("--simulate", default=None, metavar="JSON",
                    help="no models: replay lookup and suffix (greedy) on the target outputs saved by --out")
    args = ap.parse_args()
    if args.simulate:
        simulate_file(args.simulate)
        return
    maybe_reexec_with_openblas()

    import mlxspec
    from mlxspec.platform import machine_description

    configs = SETS[args.set]
    t0 = time.perf_counter()
    pair = mlxspec.load(args.model, dtype=args.dtype)
    print(f"loaded in {time.perf_counter() - t0:.0f}s on {machine_description()}", flush=True)
    runs = []
    for row in prompts(args.kinds.split(","), args.per_kind):
        messages = [{"role": "user", "content": row["turns"][0]}]
        target = pair.new_session(drafter="none")
        if len(row["turns"]) > 1:  # the first turn (greedy: the target's own reply) becomes the prompt
            target.drafter = pair.make_drafter(drafter="model")
            first = pair.generate(messages, max_tokens=80, adaptive=True, session=target)
            messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": row["turns"][1]}]
        ref = None
        for name, kind, opts in configs:
            # a fresh drafter per configuration: the suffix drafter remembers earlier outputs,
            # and the previous configuration's output is this one's answer
            target.drafter = pair.make_drafter(drafter=kind) if kind != "none" else None
            res = pair.generate(messages, max_tokens=args.max_tokens, session=target, **opts)
            s = res.stats
            ref = res.tokens if ref is None else ref
            run = {
                "id": row["id"], "kind": row["kind"], "config": name, "tokens": s.generation_tokens,
                "tok_s": s.tokens_per_second, "tok_pass": s.tokens_per_round, "passes": s.rounds,
                "drafted": s.drafted, "accepted": s.accepted, "by_source": dict(s.tokens_by_source),
                "prompt_tokens": s.prompt_tokens, "identical": res.tokens == ref,
            }
            print(json.dumps(run), flush=True)
            if name == "target":  # what --simulate replays (not printed)
                run.update(prompt_ids=pair.encode(messages), output=res.tokens)
            runs.append(run)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    summarize(runs, [c[0] for c in configs])


SIMULATED = [
    ("lookup adaptive", "lookup", dict(adaptive=True)),
    ("suffix adaptive", "suffix", dict(adaptive=True)),
    ("suffix tree 8", "suffix", dict(tree_nodes=8)),
    ("suffix tree 16", "suffix", dict(tree_nodes=16)),
]


def simulate(kind: str, opts: dict, prompt: list[int], output: list[int]) -> float:
    """Tokens per target pass of a model-free drafter at temperature 0, replayed without models:
    a proposal (chain or tree) is accepted along the path that matches the target's own output,
    which is exactly what the engine's greedy rule accepts."""
    from mlxspec.drafters import LookupDrafter, SuffixDrafter
    from mlxspec.options import GenerateOptions
    from mlxspec.sampling import SamplingParams
    from mlxspec.tree_accept import children_of

    cfg = GenerateOptions(drafter=kind, **opts)
    d = LookupDrafter() if kind == "lookup" else SuffixDrafter()
    d.tree_nodes = cfg.tree_nodes if kind == "suffix" else 0
    policy = cfg.length_policy(d.costs)
    d.prefill(prompt)
    seq, done, passes, accepted = list(prompt), 0, 0, 0
    while done < len(output):
        source = d.next_source(seq)
        k = min(cfg.tree_nodes if d.tree_nodes else policy.k(source), len(output) - done - 1)
        draft = d.propose(seq, k, SamplingParams(), None, 1 << 20) if k > 0 else None
        n = 0
        if draft is not None:
            toks = draft.tokens.tolist()
            kids = children_of(draft.parents if draft.parents is not None else list(range(-1, len(toks) - 1)))
            row = 0
            while done + n < len(output):
                nxt = next((c for c in kids[row] if toks[c] == output[done + n]), None)
                if nxt is None:
                    break
                n, row = n + 1, nxt + 1
            if not d.tree_nodes:
                policy.update(source, len(toks), n)
        passes, accepted = passes + 1, accepted + n
        seq += output[done : done + n + 1]
        done += n + 1
    return 1 + accepted / passes


def simulate_file(path: str) -> None:
    runs = [r for r in json.loads(Path(path).read_text()) if r["config"] == "target" and "output" in r]
    print("| prompt | kind | " + " | ".join(n for n, _, _ in SIMULATED) + " |")
    print("|---|---|" + "---|" * len(SIMULATED))
    for r in runs:
        cells = [f"{simulate(k, o, r['prompt_ids'], r['output']):.2f}" for _, k, o in SIMULATED]
        print(f"| {r['id']} | {r['kind']} | " + " | ".join(cells) + " |")


def summarize(runs: list[dict], names: list[str]) -> None:
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    base = {r["id"]: r["tok_s"] for r in runs if r["config"] == "target"}
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
