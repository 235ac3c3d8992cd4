"""A cheap copier (lookup) when it has a match, the draft model otherwise."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..sampling import SamplingParams
from .base import Draft
from .lookup import LookupDrafter
from .model import ModelDrafter


class ModelLookupDrafter:
    """Lookup when its match is at least `min_match` tokens long (a copy in progress), the
    draft model otherwise. The model's cache skips the lookup rounds and catches up by common
    prefix the next time it drafts: one forward over the tokens it missed."""

    name = "model+lookup"

    def __init__(self, model: ModelDrafter, lookup: LookupDrafter, min_match: int = 2):
        self.model, self.lookup, self.min_match = model, lookup, min_match
        self.costs = {**model.costs, **lookup.costs}
        self._used: ModelDrafter | LookupDrafter | None = None

    @property
    def p_min(self) -> float | None:
        return self.model.p_min

    @p_min.setter
    def p_min(self, value: float | None) -> None:
        self.model.p_min = value

    @property
    def min_tokens(self) -> int:
        return self.model.min_tokens

    @min_tokens.setter
    def min_tokens(self, value: int) -> None:
        self.model.min_tokens = value

    def prefill(self, seq: Sequence[int]) -> None:
        self.model.prefill(seq)
        self.lookup.prefill(seq)

    def next_source(self, seq: Sequence[int]) -> str:
        """Who drafts the next round, as the length policy's key: "model" or "lookup/<n>"."""
        self.lookup.index.update(seq)
        m = self.lookup.index.match()
        if m is not None and m.size >= self.min_match:
            return f"{self.lookup.name}/{m.size}"
        return self.model.name

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        self._used = self.lookup if self.next_source(seq) != self.model.name else self.model
        return self._used.propose(seq, k, sp, key, vocab)

    def commit(self, draft_tokens: list[int]) -> None:
        if self._used is not None:
            self._used.commit(draft_tokens)
        self._used = None
