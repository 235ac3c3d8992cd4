"""What every drafter shares: the Draft it returns, the protocol the engine calls, and the
helper that fits a draft's logits to the target's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import mlx.core as mx

from ..sampling import SamplingParams


@dataclass
class Draft:
    tokens: mx.array  # (k,) uint32, may be lazy
    q: mx.array | None  # (k, V_target) processed draft distribution; None: one-hot proposal
    source: str  # which drafter proposed them ("model", "lookup", ...)
    # a token tree (tree.py): parents[i] is node i's parent (-1: the last committed token);
    # None: the chain x_1..x_k. A tree's q, when given, is the distribution each node was
    # sampled from (tree_accept.py); None: deterministic children
    parents: list[int] | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    name: str

    def prefill(self, seq: Sequence[int]) -> None:
        """Catch up with the sequence (prompt plus text so far) before the first round."""

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        """Propose up to k tokens to follow seq (None or an empty draft: nothing to propose)."""

    def commit(self, draft_tokens: list[int]) -> None:
        """The round's draft tokens as ints, once the engine has evaluated them."""

    # Optional: `attach(target: CachedLM) -> None`, called once when a Session is made, with that
    # session's target (its KV cache and the tokens it holds). Drafters that draft from the
    # target's own state (trained heads: drafters/features.py) define it; others need not.


def fit_vocab(logits: mx.array, vocab: int) -> mx.array:
    """Make draft logits (..., V_d) cover exactly the target's V entries: entries the target has
    but the draft lacks get -inf (q = 0 there), entries past the target's size are dropped (the
    draft's distribution is whatever it samples from; exactness only needs q to be that)."""
    d = logits.shape[-1]
    if d == vocab:
        return logits
    if d > vocab:
        return logits[..., :vocab]
    pad = mx.full((*logits.shape[:-1], vocab - d), -float("inf"), dtype=logits.dtype)
    return mx.concatenate([logits, pad], axis=-1)
