"""How good a head is, measured as speculative decoding would see it, not by the loss.

- held_out_acceptance: greedy draft chains on the target's own greedy continuations of held-out
  prompts (features/held-out): per draft position k, the fraction of rounds whose first k drafts
  all equal what the target produced, and tokens per target pass (1 + mean accepted), with
  the round starting at every position of the continuations. Cheap (the head only), so it runs
  at every checkpoint.
- engine_acceptance: the real engine, `mlxspec.load(target, draft=HEAD).generate(...)`, when
  this installation's loader knows EAGLE-3 heads (it reports why not otherwise).
- plot_curve: the loss curve and the held-out acceptance per position, as a PNG.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .loop import chain_acceptance


def held_out_acceptance(head, embed, held_out, firsts: Sequence[int], draft_length: int) -> dict:
    samples = [held_out.sample(i) for i in range(len(held_out))]
    return chain_acceptance(head, embed, samples, draft_length, list(firsts))


def engine_acceptance(target: str | Path, head_dir: str | Path, prompts: Sequence[Sequence[int]], max_tokens: int,
                      draft_length: int, dtype: str | None = None) -> dict:
    """Greedy generation with the head as the drafter through the engine: acceptance per
    position and tokens per pass, plus whether the output equals the target alone's."""
    import mlxspec

    try:
        pair = mlxspec.load(target, draft=head_dir, dtype=dtype)
    except Exception as e:  # the loader of another issue may not know heads yet
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    drafted, accepted, passes, tokens = None, None, 0, 0
    identical = True
    for p in prompts:
        res = pair.generate(list(p), max_tokens=max_tokens, temperature=0.0, num_draft=draft_length)
        plain = pair.generate(list(p), max_tokens=max_tokens, temperature=0.0, drafter="none")
        identical &= list(res.tokens) == list(plain.tokens)
        st = res.stats
        d, a = list(st.drafted_per_position), list(st.accepted_per_position)
        drafted = d if drafted is None else [x + y for x, y in zip(drafted, d)]
        accepted = a if accepted is None else [x + y for x, y in zip(accepted, a)]
        passes += st.rounds
        tokens += st.generation_tokens
    return {
        "available": True,
        "acceptance_per_position": [round(a / d, 4) if d else None for a, d in zip(accepted or [], drafted or [])],
        "tokens_per_pass": round(tokens / passes, 4) if passes else None,
        "greedy_identical": identical,
    }


def plot_curve(log: Sequence[dict], png: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in log if r.get("kind") == "train"]
    evals = [r for r in log if r.get("kind") == "eval" and r.get("acceptance_per_position")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r["loss"] for r in train], label="weighted TTT loss", color="black")
        n = len(train[0]["loss_per_step"])
        for j in range(n):
            ax.plot(steps, [r["loss_per_step"][j] for r in train], lw=0.8, alpha=0.7, label=f"step {j}")
    ax.set_xlabel("training step")
    ax.set_ylabel("soft cross-entropy")
    ax.set_title("loss")
    if train:
        ax.legend(fontsize=7)
    ax = axes[1]
    for r in evals:
        acc = r["acceptance_per_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"step {r['step']} ({r['tokens_per_pass']:.2f} tok/pass)")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(first k drafts accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("held-out greedy acceptance")
    if evals:
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tmp = Path(png).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(png)


def read_log(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
