#!/usr/bin/env python
"""Time to first token across a multi-turn chat, with and without KV cache reuse.

Each turn of one conversation is answered twice, alternating which goes first:
    reuse      `mlxspec chat`'s own path: one engine session for the whole conversation,
               so only the new message is prefilled
    no reuse   a fresh session given the same prompt tokens: the whole history is prefilled
               again (what a chat without a persistent cache does)
With reuse the time to first token stays flat as the history grows; without, it grows with it.
Each turn also checks that the chat template, re-rendering the conversation, gives the same
tokens as the ones the session holds (when it does not, the chat keeps the session's tokens).

    python scripts/bench_chat_ttft.py                 # the default pair (offline Qwen2.5-Coder 1.5B/0.5B)
    python scripts/bench_chat_ttft.py --tiny          # SmolLM2-135M alone: quick
    python scripts/bench_chat_ttft.py --target T --draft D --turns 8 --max-tokens 24 --json out.json
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

from mlxspec.platform import machine_description, maybe_reexec_with_openblas  # noqa: E402

MESSAGES = [
    "In one sentence: what is a Python list?",
    "And a tuple? One sentence.",
    "Which of the two can be a dictionary key, and why? Briefly.",
    "Write a one-line expression that reverses a list xs.",
    "How do I sort a list of words by length? One line.",
    "What does enumerate return? One sentence.",
    "Give a one-line list comprehension for the squares of 0 to 9.",
    "What is the difference between == and is? One sentence.",
    "How do I read a text file into a list of lines? One line.",
    "What does zip do with lists of unequal length? One sentence.",
    "Name one use of collections.Counter. One sentence.",
    "Thanks! Summarize our chat in one sentence.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="model spec (default: the default pair recipe)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tiny", action="store_true", help="SmolLM2-135M alone (models/offline/smollm2-135m)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24, help="reply length cap per turn")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", type=Path, default=None, help="write the rows and machine description here")
    args = ap.parse_args()
    maybe_reexec_with_openblas()

    import mlxspec
    from mlxspec.chat import Conversation, auto_dtype
    from mlxspec.options import GenerateOptions
    from mlxspec.resolve import resolve_pair

    target = str(ROOT / "models" / "offline" / "smollm2-135m") if args.tiny else args.target
    res = resolve_pair(target, args.draft, args.num_draft > 0)
    tic = time.perf_counter()
    pair = mlxspec.load(res.target, res.draft, dtype=auto_dtype(args.dtype))
    print(f"loaded {res.label} in {time.perf_counter() - tic:.1f} s; draft: {res.draft or pair.draft_path}", file=sys.stderr)
    num_draft = args.num_draft if pair.draft is not None else 0
    conv = Conversation(pair, None, GenerateOptions(max_tokens=args.max_tokens, num_draft=num_draft))
    pair.generate("Hello", max_tokens=2, num_draft=num_draft)  # warm-up: first-call costs out of the table

    def cold(ids: list[int]) -> tuple[float, int]:
        """The same first round as the chat's, from a fresh session (empty caches)."""
        tic = time.perf_counter()
        gen = pair.stream(ids, max_tokens=args.max_tokens, num_draft=num_draft, session=pair.new_session(num_draft=num_draft))
        first = next(gen)
        ttft = time.perf_counter() - tic
        gen.close()
        return ttft, first.stats.prefill_tokens

    rows = []
    hdr = "| turn | history (tokens) | prefilled, reuse | TTFT reuse (s) | prefilled, no reuse | TTFT no reuse (s) | reply tokens | template re-render = session |"
    print(hdr)
    print("|---" * 8 + "|")
    for i in range(args.turns):
        msg = MESSAGES[i % len(MESSAGES)]
        ids, text, reused = conv.prompt_ids(msg)
        same = conv._encode(text) == ids
        if i % 2:  # alternate the order: machine drift hits both columns alike
            t_cold, p_cold = cold(ids)
            reply = conv.turn(msg)
        else:
            reply = conv.turn(msg)
            t_cold, p_cold = cold(ids)
        row = dict(
            turn=i + 1, history=len(ids), prefill_reuse=reply.stats.prefill_tokens, ttft_reuse=reply.ttft,
            prefill_cold=p_cold, ttft_cold=t_cold, reply_tokens=len(reply.tokens), template_same=same,
            reused_prefix=reused, reply=reply.text,
        )
        rows.append(row)
        print(
            f"| {row['turn']} | {row['history']} | {row['prefill_reuse']} | {row['ttft_reuse']:.2f} | "
            f"{row['prefill_cold']} | {row['ttft_cold']:.2f} | {row['reply_tokens']} | {'yes' if same else 'no'} |",
            flush=True,
        )
    half = len(rows) // 2
    for name, key in (("reuse", "ttft_reuse"), ("no reuse", "ttft_cold")):
        early = statistics.median(r[key] for r in rows[:half])
        late = statistics.median(r[key] for r in rows[half:])
        print(f"{name}: median TTFT first half {early:.2f} s, second half {late:.2f} s ({late / early:.2f}x)")
    t = conv.totals
    rate = t.accepted / t.drafted if t.drafted else 0.0
    print(f"chat totals: {t.tokens} tokens, {t.tokens / t.decode_time:.2f} tok/s, acceptance {rate:.0%}, "
          f"{t.tokens / max(t.rounds, 1):.2f} tokens/pass")
    if args.json:
        args.json.write_text(json.dumps({
            "model": res.label, "target": str(pair.target_path), "draft": str(pair.draft_path) if pair.draft else None,
            "max_tokens": args.max_tokens, "num_draft": num_draft, "machine": machine_description(), "rows": rows,
        }, indent=2))


if __name__ == "__main__":
    main()
