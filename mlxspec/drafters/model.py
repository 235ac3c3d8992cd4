"""A small model of the target's family drafts autoregressively."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cached_lm import CachedLM
from ..sampling import SamplingParams, log_probs
from .base import Draft, fit_vocab


class ModelDrafter:
    """A small model of the same family proposes k tokens autoregressively, keeping its full
    processed distribution q at each position for exact acceptance."""

    name = "model"

    def __init__(self, model: nn.Module, cost: float = 0.0):
        self.lm = CachedLM(model, "draft")
        self._pending = 0  # drafted tokens fed to the cache whose values are not known yet
        self.costs = {self.name: cost}  # one draft step, in target steps (for adaptive length)
        # Early stop (the engine sets these per generation): stop drafting once the draft's top
        # probability for the next token falls below p_min, after at least min_tokens tokens.
        # Reading that probability is a host wait per drafted token, so None (the default)
        # keeps the single wait per round.
        self.p_min: float | None = None
        self.min_tokens = 1

    def prefill(self, seq: Sequence[int]) -> None:
        self.lm.prefill(seq)

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        if k <= 0:
            return None
        feed = self.lm.sync(seq)
        y = mx.array(feed, mx.uint32)
        keys = mx.random.split(key, k)
        tokens, qs = [], []
        for i in range(k):
            logits = fit_vocab(self.lm.forward(y, known=feed if i == 0 else None)[-1], vocab)
            if self.p_min is not None and i >= self.min_tokens and self._unsure(logits, sp):
                # x_1..x_i are proposed and all of them were fed: the cache holds them
                self._pending = i
                if i == 0:
                    return None
                return Draft(mx.stack(tokens), mx.stack(qs) if qs else None, self.name)
            if sp.greedy:
                x = mx.argmax(logits, axis=-1).astype(mx.uint32)
            else:
                lp = log_probs(logits, sp)
                x = mx.random.categorical(lp, key=keys[i]).astype(mx.uint32)
                qs.append(mx.exp(lp))
            tokens.append(x)
            y = x[None]
        self._pending = k - 1  # x_k is sampled but not fed
        return Draft(mx.stack(tokens), mx.stack(qs) if qs else None, self.name)

    def _unsure(self, logits: mx.array, sp: SamplingParams) -> bool:
        """The draft's top probability for the next token is below p_min: the distribution it
        samples from, or its plain softmax when greedy (argmax has no spread). A host wait."""
        if sp.greedy:
            x = logits.astype(mx.float32)
            lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        else:
            lp = log_probs(logits, sp)
        return mx.exp(mx.max(lp)).item() < self.p_min

    def commit(self, draft_tokens: list[int]) -> None:
        self.lm.tokens.extend(draft_tokens[: self._pending])
        self._pending = 0
