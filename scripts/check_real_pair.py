#!/usr/bin/env python
"""Check the core engine on a real draft/target pair, side by side with mlx-lm, in one run.

(a) greedy output of mlxspec with the draft is token-identical to the target alone (mlxspec's
    plain path and mlx-lm's generate_step);
(b) at temperatures 0.7 and 1.0, mean tokens per target pass of mlxspec's exact rejection
    sampling against mlx-lm's speculative_generate_step (same prompts, settings, seeds);
(c) decode tokens/s of mlxspec and mlx-lm, each with and without the draft, measured
    alternately (A B C D A B C D ...), reported as medians and ratios.

    python scripts/check_real_pair.py                    # the offline Qwen2.5-Coder pair
    python scripts/check_real_pair.py --target T --draft D --max-tokens 64

On Linux run it with OpenBLAS preloaded (the script re-executes itself with it when installed).
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

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a C function that reverses a singly linked list in place.",
    "Explain what a Python decorator is, with a short example.",
    "Write a Python class for a stack with push, pop and peek.",
]


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def timed_mlxspec(pair, ids, max_tokens, num_draft, temperature=0.0, seed=0):
    """Run mlxspec; decode tokens/s counted from the first chunk to the last, like mlx-lm below."""
    t_first, n_first, tokens, flags, stats = None, 0, [], [], None
    for chunk in pair.stream(ids, max_tokens=max_tokens, num_draft=num_draft,
                             temperature=temperature, seed=seed):
        if t_first is None:
            t_first, n_first = time.perf_counter(), len(chunk.tokens)
        tokens += chunk.tokens
        flags += chunk.from_draft
        stats = chunk.stats
    t_end = time.perf_counter()
    tps = (len(tokens) - n_first) / (t_end - t_first) if t_end > t_first else 0.0
    return tokens, flags, stats, tps


def timed_mlx_lm(pair, ids, max_tokens, num_draft, temperature=0.0, seed=0):
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    prompt = mx.array(ids, mx.uint32)
    if num_draft:
        gen = speculative_generate_step(prompt, pair.target, pair.draft, sampler=sampler,
                                        num_draft_tokens=num_draft, max_tokens=max_tokens)
    else:
        gen = generate_step(prompt, pair.target, sampler=sampler, max_tokens=max_tokens)
    eos = pair.eos_token_ids
    t_first, tokens, flags = None, [], []
    for item in gen:
        tok = int(item[0])
        if t_first is None:
            t_first = time.perf_counter()
        if tok in eos:
            break
        tokens.append(tok)
        flags.append(bool(item[2]) if num_draft else False)
    t_end = time.perf_counter()
    tps = (len(tokens) - 1) / (t_end - t_first) if t_end > t_first else 0.0
    return tokens, flags, tps


def mlx_lm_tokens_per_pass(flags: list[bool]) -> float:
    """mlx-lm yields each round's accepted drafts (True) then one target token (False)."""
    rounds = sum(1 for f in flags if not f) or 1
    return len(flags) / rounds


@click.command()
@click.option("--target", default=None, help="target model (default: the offline Qwen2.5-Coder pair)")
@click.option("--draft", default=None)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--num-draft", default=3, show_default=True)
@click.option("--repeats", default=2, show_default=True, help="alternating repeats for (c)")
@click.option("--seeds", default=3, show_default=True, help="seeds per prompt for (b)")
@click.option("--prompts", "n_prompts", default=4, show_default=True)
@click.option("--skip-sampled", is_flag=True, help="only (a) and (c)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def main(target, draft, dtype, max_tokens, num_draft, repeats, seeds, n_prompts, skip_sampled, json_out):
    from mlxspec.platform import loaded_blas, maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    import mlxspec

    if target is None:
        target = str(ROOT / "models/offline/qwen2.5-coder")
    click.echo(f"loading {target} (+ {draft or 'pair draft'}) as {dtype}; BLAS: {loaded_blas()}")
    pair = mlxspec.load(target, draft=draft, dtype=dtype)
    if pair.draft is None:
        raise click.ClickException("this check needs a draft model")
    prompts = [pair.encode(messages(p)) for p in PROMPTS[:n_prompts]]
    report: dict = {"max_tokens": max_tokens, "num_draft": num_draft, "dtype": dtype}

    # warm-up (compiles kernels, faults in weights)
    timed_mlxspec(pair, prompts[0], 8, num_draft)
    timed_mlx_lm(pair, prompts[0], 8, num_draft)

    # (a) + (c): greedy, alternating configurations
    click.echo(f"\n(a)+(c) greedy, {max_tokens} tokens, k={num_draft}, {repeats} alternating repeats")
    configs = ["mlxspec target", "mlxspec spec", "mlx-lm target", "mlx-lm spec"]
    tps = {c: [] for c in configs}
    identical, outputs = True, {}
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            res = {}
            for c in configs:
                if c.startswith("mlxspec"):
                    toks, _, st, v = timed_mlxspec(pair, ids, max_tokens, num_draft if "spec" in c else 0)
                else:
                    toks, _, v = timed_mlx_lm(pair, ids, max_tokens, num_draft if "spec" in c else 0)
                res[c] = toks
                tps[c].append(v)
            same = res["mlxspec spec"] == res["mlxspec target"] == res["mlx-lm target"]
            identical &= same
            if r == 0:
                outputs[i] = pair.tokenizer.decode(res["mlxspec spec"])
                click.echo(f"  prompt {i}: identical={same} ({len(res['mlxspec spec'])} tokens) "
                           f"{outputs[i][:70]!r}")
    med = {c: statistics.median(v) for c, v in tps.items()}
    click.echo(f"  greedy token-identical on every prompt: {identical}")
    for c in configs:
        click.echo(f"  {c:15s} median {med[c]:6.2f} tok/s  (min {min(tps[c]):.2f}, max {max(tps[c]):.2f})")
    ratios = {
        "mlxspec_target_over_mlx_lm_target": med["mlxspec target"] / med["mlx-lm target"],
        "mlxspec_speedup": med["mlxspec spec"] / med["mlxspec target"],
        "mlx_lm_speedup": med["mlx-lm spec"] / med["mlx-lm target"],
        "mlxspec_spec_over_mlx_lm_spec": med["mlxspec spec"] / med["mlx-lm spec"],
    }
    for k, v in ratios.items():
        click.echo(f"  {k:36s} {v:5.3f}")
    report.update(greedy_identical=identical, tokens_per_second=tps, medians=med, ratios=ratios)

    # (b) sampled acceptance
    click.echo(f"\n(b) sampled, tokens per target pass, {len(prompts)} prompts x {seeds} seeds")
    report["sampled"] = {}
    for temp in () if skip_sampled else (0.7, 1.0):
        ours, theirs, acc = [], [], []
        for ids in prompts:
            for s in range(seeds):
                _, _, st, _ = timed_mlxspec(pair, ids, max_tokens, num_draft, temp, seed=s)
                ours.append(st.tokens_per_round)
                acc.append(st.acceptance_rate)
                _, flags, _ = timed_mlx_lm(pair, ids, max_tokens, num_draft, temp, seed=s)
                theirs.append(mlx_lm_tokens_per_pass(flags))
        m_ours, m_theirs = statistics.mean(ours), statistics.mean(theirs)
        click.echo(f"  T={temp}: mlxspec {m_ours:.2f} tokens/pass (acceptance {statistics.mean(acc):.2f}), "
                   f"mlx-lm {m_theirs:.2f} tokens/pass")
        report["sampled"][str(temp)] = {"mlxspec_tokens_per_pass": ours, "mlx_lm_tokens_per_pass": theirs,
                                        "mlxspec_acceptance": acc}
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2))
        click.echo(f"\nwrote {json_out}")


if __name__ == "__main__":
    main()
