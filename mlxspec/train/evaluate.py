"""How good a head is, measured as speculative decoding would see it, not by the loss.

- held_out_acceptance: greedy draft chains on the target's own greedy continuations of held-out
  prompts (features/held-out): per draft position k, the fraction of rounds whose first k drafts
  all equal what the target produced, and tokens per target pass (1 + mean accepted), with
  the round starting at every position of the continuations. Cheap (the head only), so it runs
  at every checkpoint.
- engine_acceptance: the real engine (the head folder loaded as `mlxspec.load(target, draft=HEAD)`
  does) generating greedily from the held-out prompts: acceptance per position as the rounds
  saw it, and tokens per target pass. It decodes with the target, so it runs once, at the end.
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


def engine_acceptance(target, tokenizer, head_dir: str | Path, prompts: Sequence[Sequence[int]], max_tokens: int,
                      draft_length: int) -> dict:
    """Greedy generation through the real engine with the head folder as the drafter
    (`Pair(target, head=...)`, what `mlxspec.load(target, draft=HEAD)` builds): acceptance per
    draft position and tokens per target pass over the prompts."""
    from ..engine import Pair
    from ..heads import load_trained_head

    head = load_trained_head(head_dir, target)
    try:
        pair = Pair(target, None, tokenizer, head=head)
        drafted, accepted, rounds, tokens, total = [0] * draft_length, [0] * draft_length, 0, 0, 0
        for p in prompts:
            st = pair.generate(list(p), max_tokens=max_tokens, temperature=0.0, num_draft=draft_length,
                               adaptive=False).stats
            for i, (d, a) in enumerate(zip(st.drafted_per_position, st.accepted_per_position)):
                if i < draft_length:
                    drafted[i] += d
                    accepted[i] += a
            rounds += st.rounds
            tokens += st.generation_tokens
            total += st.accepted
    finally:
        head.recorder.remove()
    return {
        "prompts": len(prompts), "tokens": tokens, "passes": rounds,
        "acceptance_per_position": [round(a / d, 4) if d else None for a, d in zip(accepted, drafted)],
        "tokens_per_pass": round(1.0 + total / rounds, 4) if rounds else None,  # the engine's tokens_per_round
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
