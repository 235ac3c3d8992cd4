#!/usr/bin/env python
"""`mlxspec serve` on a real pair: API overhead, second-turn time to first token with and without
the prompt cache, and greedy text through the API against `mlxspec generate`.

Phase 1, the server (`mlxspec serve`, one process, its own numbers in `timings`):
    completions   each prompt streamed greedily (cache_prompt off, so each prefills in full);
                  the client's wall time against the server's own prefill + decode time of the
                  same generation (the HTTP/SSE overhead, free of run-to-run noise)
    chat          each conversation's first turn, then its second turn twice, with the prompt
                  cache and without (cache_prompt: false), alternating which goes first
Phase 2, in-process (`mlxspec generate --json`, one process per prompt, after the server has
stopped so that only one copy of the models is in memory): the same prompts and options; its
text must equal the API's, and its prefill + decode time is the in-process baseline.

    flock /tmp/mlxspec-bench.lock python scripts/bench_server.py
    python scripts/bench_server.py --target models/offline/smollm2-135m --max-tokens 32   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxspec.platform import machine_description, maybe_reexec_with_openblas  # noqa: E402

PROMPTS = [
    "def quicksort(arr):\n",
    "# Read a CSV file and print the average of the column 'price'\nimport csv\n\n",
]
CHATS = [
    ("Write a Python function is_palindrome(s) that ignores case and spaces.",
     "Now add a docstring and two doctests."),
    ("Write a Python function that returns the n-th Fibonacci number iteratively.",
     "Make it raise ValueError for negative n."),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(c: httpx.Client, path: str, body: dict) -> dict:
    """One streamed request: text, client times (first token, total) and the last chunk's timings."""
    tic = time.perf_counter()
    first, text, last, usage = None, [], None, None
    with c.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            if not doc["choices"]:
                continue
            ch = doc["choices"][0]
            piece = ch.get("text") if "text" in ch else ch["delta"].get("content")
            if piece:
                first = first or time.perf_counter() - tic
                text.append(piece)
            if ch.get("finish_reason"):
                last = doc
    return {"text": "".join(text), "ttft": first, "wall": time.perf_counter() - tic, "timings": last["timings"],
            "usage": usage}


def serve_phase(args, port: int) -> dict:
    cmd = [sys.executable, "-m", "mlxspec.cli", "serve", "-t", args.target, "--dtype", args.dtype, "--port", str(port),
           "--num-draft", str(args.num_draft), "--log-level", "warning", "--model-name", "bench"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {proc.stderr.read()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("the server did not start in 10 minutes")
            time.sleep(0.5)
        out = {"completions": [], "chats": []}
        with httpx.Client(base_url=url, timeout=900) as c:
            stream(c, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 8})  # warm-up
            for p in PROMPTS:
                r = stream(c, "/v1/completions", {"prompt": p, "max_tokens": args.max_tokens, "cache_prompt": False})
                out["completions"].append(r)
                print(f"api  {r['usage']['completion_tokens']} tokens, wall {r['wall']:.2f} s, server "
                      f"{(r['timings']['prompt_ms'] + r['timings']['predicted_ms']) / 1000:.2f} s", file=sys.stderr)
            for i, (first, second) in enumerate(CHATS):
                msgs = [{"role": "user", "content": first}]
                t1 = stream(c, "/v1/chat/completions", {"messages": msgs, "max_tokens": args.max_tokens})
                msgs += [{"role": "assistant", "content": t1["text"]}, {"role": "user", "content": second}]
                body = {"messages": msgs, "max_tokens": args.ttft_tokens}
                runs = {}
                for cached in ([True, False] if i % 2 == 0 else [False, True]):
                    runs["cached" if cached else "uncached"] = stream(
                        c, "/v1/chat/completions", {**body, "cache_prompt": cached})
                out["chats"].append({"first": t1, **runs})
                print(f"chat {i}: second turn ttft {runs['cached']['ttft']:.2f} s cached, "
                      f"{runs['uncached']['ttft']:.2f} s uncached", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def generate(args, prompt: str, chat: bool) -> dict:
    cmd = [sys.executable, "-m", "mlxspec.cli", "generate", "-t", args.target, "--dtype", args.dtype, "--prompt", prompt,
           "-n", str(args.max_tokens), "--num-draft", str(args.num_draft), "--json"] + (["--chat"] if chat else [])
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/offline/qwen2.5-coder", help="a pair folder (or target)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ttft-tokens", type=int, default=2, help="tokens per second-turn request (only its TTFT counts)")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    maybe_reexec_with_openblas()  # for the machine description; the mlxspec processes preload it themselves
    api = serve_phase(args, free_port())
    local = [generate(args, p, chat=False) for p in PROMPTS] + [generate(args, CHATS[0][0], chat=True)]

    rows = []
    for p, a, g in zip(PROMPTS + [CHATS[0][0]], api["completions"] + [api["chats"][0]["first"]], local):
        st, t = g["stats"], a["timings"]
        n = a["usage"]["completion_tokens"]
        rows.append({
            "prompt": p[:40], "tokens": n, "same_text": a["text"] == g["text"],
            "api_tok_s": n / a["wall"],  # request sent -> last chunk, as the client sees it
            "server_tok_s": n / ((t["prompt_ms"] + t["predicted_ms"]) / 1000),  # the same generation, in the server
            "inprocess_tok_s": st["generation_tokens"] / (st["prefill_time"] + st["decode_time"]),
            "decode_tok_s_api": t["predicted_per_second"], "decode_tok_s_inprocess": st["tokens_per_second"],
            "tokens_per_pass": t["tokens_per_pass"], "accepted": f"{t['draft_n_accepted']}/{t['draft_n']}",
        })
    chats = [{"cached_ttft": c["cached"]["ttft"], "uncached_ttft": c["uncached"]["ttft"],
              "prompt_tokens": c["cached"]["usage"]["prompt_tokens"],
              "cached_tokens": c["cached"]["usage"]["prompt_tokens_details"]["cached_tokens"]} for c in api["chats"]]

    print("\n| prompt | tokens | same text as `generate` | API tok/s | server tok/s (same run) | in-process tok/s "
          "| API / server | API / in-process | tokens/pass |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']!r} | {r['tokens']} | {r['same_text']} | {r['api_tok_s']:.2f} | {r['server_tok_s']:.2f} "
              f"| {r['inprocess_tok_s']:.2f} | {r['api_tok_s'] / r['server_tok_s']:.3f} "
              f"| {r['api_tok_s'] / r['inprocess_tok_s']:.3f} | {r['tokens_per_pass']:.2f} |")
    print("\n| second turn | prompt tokens | cached | TTFT cached (s) | TTFT uncached (s) | speed-up |")
    print("|---|---|---|---|---|---|")
    for i, c in enumerate(chats):
        print(f"| chat {i} | {c['prompt_tokens']} | {c['cached_tokens']} | {c['cached_ttft']:.2f} "
              f"| {c['uncached_ttft']:.2f} | {c['uncached_ttft'] / c['cached_ttft']:.1f}x |")
    print(f"\n{json.dumps(machine_description())}, load average {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "chats": chats, "api": api, "generate": local,
                                         "machine": machine_description()}, indent=1))
    if not all(r["same_text"] for r in rows):
        raise SystemExit("the API's greedy text differs from `mlxspec generate`")


if __name__ == "__main__":
    main()
