"""Prompt lookup decoding: the sequence so far is its own draft model (see ngram.py)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..sampling import SamplingParams
from .base import Draft
from .ngram import NGramIndex


class LookupDrafter:
    """Prompt lookup decoding: propose what followed the most recent earlier occurrence of the
    sequence's longest suffix n-gram (see lookup.py). A deterministic proposal is a one-hot q,
    so exact acceptance keeps the target's distribution at any temperature; proposing reads
    host-side ints only (no device work)."""

    name = "lookup"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.index = NGramIndex(ngram_min, ngram_max)
        self.costs = {self.name: 0.0}

    def prefill(self, seq: Sequence[int]) -> None:
        self.index.update(seq)

    def next_source(self, seq: Sequence[int]) -> str:
        """The length policy's key for the next round: "lookup/<n>" for an n-token match (0:
        none), so that adaptive length learns how far a 4-token match copies, and a 1-token one."""
        self.index.update(seq)
        m = self.index.match()
        return f"{self.name}/{m.size if m is not None else 0}"

    def match_length(self, seq: Sequence[int]) -> int:
        """Tokens of seq's end matched by the next proposal (0: none)."""
        self.index.update(seq)
        m = self.index.match()
        return m.size if m is not None else 0

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        toks, _ = self.index.propose(seq, k)
        if not toks:
            return None
        return Draft(mx.array(toks, mx.uint32), None, self.name)

    def commit(self, draft_tokens: list[int]) -> None:
        pass
