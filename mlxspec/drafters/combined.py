"""A cheap copier (lookup or suffix) when it has a match, the draft model otherwise."""

from __future__ import annotations

from typing import Protocol, Sequence

import mlx.core as mx

from ..sampling import SamplingParams
from .base import Draft, Drafter
from .model import ModelDrafter


class Copier(Drafter, Protocol):
    """A drafter that copies from text seen before (lookup.py, suffix.py)."""

    def match_length(self, seq: Sequence[int]) -> int:
        """Tokens of seq's end matched by its next proposal (0: none)."""


class ModelCopierDrafter:
    """The copier when its match is at least `min_match` tokens long (a copy in progress), the
    draft model otherwise: "model+lookup", "model+suffix". The model's cache skips the
    copier's rounds and catches up by common prefix the next time it drafts: one forward over
    the tokens it missed."""

    def __init__(self, model: ModelDrafter, copier: Copier, min_match: int = 2):
        self.model, self.copier, self.min_match = model, copier, min_match
        self.name = f"{model.name}+{copier.name}"
        self.costs = {**model.costs, **copier.costs}
        self._used: Drafter | None = None

    @property
    def lookup(self) -> Copier:  # the name before suffix joined
        return self.copier

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

    @property
    def tree_nodes(self) -> int:
        return getattr(self.model, "tree_nodes", 0)

    @tree_nodes.setter
    def tree_nodes(self, value: int) -> None:
        for d in (self.model, self.copier):
            if hasattr(d, "tree_nodes"):
                d.tree_nodes = value

    def prefill(self, seq: Sequence[int]) -> None:
        self.model.prefill(seq)
        self.copier.prefill(seq)

    def next_source(self, seq: Sequence[int]) -> str:
        """Who drafts the next round, as the length policy's key: "model" or "<copier>/<n>"."""
        m = self.copier.match_length(seq)
        if m >= self.min_match:
            return f"{self.copier.name}/{m}"
        return self.model.name

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        self._used = self.copier if self.next_source(seq) != self.model.name else self.model
        return self._used.propose(seq, k, sp, key, vocab)

    def commit(self, draft_tokens: list[int]) -> None:
        if self._used is not None:
            self._used.commit(draft_tokens)
        self._used = None

    def commit_tree(self, path: list[int], tokens: list[int]) -> None:
        if self._used is not None:
            self._used.commit_tree(path, tokens)
        self._used = None


ModelLookupDrafter = ModelCopierDrafter  # the name it had when lookup was the only copier
