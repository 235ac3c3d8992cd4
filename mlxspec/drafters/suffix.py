"""SuffixDecoding: draft chains or trees, with no model, from what followed the current
context in the prompt, the output so far and earlier outputs (suffix_index.py).

Two indexes, as in SuffixDecoding: `local` over the current sequence (prompt + output; a
chat's next turn extends it, so earlier turns stay in it), and `history` over the outputs of
earlier generations that the next one did not continue (other requests of a server, or a
chat restarted with a different history), bounded to `max_cached_tokens` tokens: when it
grows past them, the oldest outputs are evicted first. Both are searched; the proposal with
the higher score wins (ties: the current sequence).

Proposals are deterministic (no randomness, q = one-hot), so the engine verifies them with
the deterministic-children rule (tree_accept.py) or, for a chain, accept.py's one-hot rule:
exact at any temperature. The speculation length grows with the match: a match of m tokens
proposes at most floor(m * spec_factor + spec_offset) tokens (and at most the round's budget:
the length policy's k for a chain, `tree_nodes` nodes for a tree). The defaults, 2m + 4, are
more eager than vLLM's m + 0: replaying greedy runs of the Qwen pair (scripts/bench_trees.py
--simulate) gave more tokens per pass on every prompt, since a proposal costs no model here
and the rounds right after a mismatch otherwise propose only a token or two.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import mlx.core as mx

from ..sampling import SamplingParams
from .base import Draft
from .suffix_index import SEP, Proposal, SuffixIndex


class SuffixDrafter:
    name = "suffix"

    def __init__(
        self,
        max_depth: int = 24,
        spec_factor: float = 2.0,
        spec_offset: float = 4.0,
        min_prob: float = 0.1,
        max_cached_tokens: int = 100_000,
        min_match: int = 1,
    ):
        if max_depth < 1 or max_cached_tokens < 0:
            raise ValueError("need max_depth >= 1 and max_cached_tokens >= 0")
        self.spec_factor, self.spec_offset, self.min_prob = spec_factor, spec_offset, min_prob
        self.min_match = min_match
        self.max_cached_tokens = max_cached_tokens
        self.local = SuffixIndex(max_depth)
        self.history = SuffixIndex(max_depth)
        self._outputs: deque[list[int]] = deque()  # what `history` holds, oldest first
        self._prompt_len = 0
        self.tree_nodes = 0  # the engine sets it per generation: > 0 drafts trees of that many nodes
        self.costs = {self.name: 0.0}
        self._last: tuple[int, int, Proposal | None] | None = None  # (len(seq), budget, proposal)

    # -- keeping the indexes in step -------------------------------------------------------
    def prefill(self, seq: Sequence[int]) -> None:
        self._last = None
        self._sync(seq, check_all=True)

    def _sync(self, seq: Sequence[int], check_all: bool = False) -> None:
        """Within a generation seq only grows: check its join with what is indexed, not all of
        it (proposing stays O(1) in the text length). A sequence that does not extend the
        indexed one starts a new document; the old one's output goes to the history."""
        loc = self.local.tokens
        n = len(loc)
        same = len(seq) >= n and (
            list(seq[:n]) == loc if check_all else (n == 0 or (seq[n - 1] == loc[-1] and seq[0] == loc[0]))
        )
        if not same:
            self._remember(loc[self._prompt_len :])
            self.local.clear()
            self._prompt_len = len(seq)
            n = 0
        elif check_all and n == 0:
            self._prompt_len = len(seq)
        if len(seq) > n:
            self.local.extend(seq[n:])

    def _remember(self, output: list[int]) -> None:
        if not output or self.max_cached_tokens == 0:
            return
        output = output[-self.max_cached_tokens :]
        self._outputs.append(output)
        self.history.extend([SEP] + output)
        total = sum(len(o) + 1 for o in self._outputs)
        if total > self.max_cached_tokens:  # evict the oldest, down to 3/4 of the bound, and reindex
            while self._outputs and total > self.max_cached_tokens * 3 // 4:
                total -= len(self._outputs.popleft()) + 1
            self.history.clear()
            for o in self._outputs:
                self.history.extend([SEP] + o)

    @property
    def cached_tokens(self) -> int:
        """Tokens held by the history index (bounded by max_cached_tokens)."""
        return len(self.history)

    # -- proposing -------------------------------------------------------------------------
    def _proposal(self, seq: Sequence[int], budget: int) -> Proposal | None:
        if self._last is not None and self._last[:2] == (len(seq), budget):
            return self._last[2]
        self._sync(seq)
        tree = self.tree_nodes > 0
        best = None
        for index in (self.local, self.history):
            if not len(index):
                continue
            p = index.propose(seq, budget, tree, self.spec_factor, self.spec_offset, self.min_prob, self.min_match)
            if p is not None and (best is None or p.score > best.score):
                best = p
        self._last = (len(seq), budget, best)
        return best

    def match_length(self, seq: Sequence[int]) -> int:
        """Tokens of context matched by the next proposal (0: nothing to propose)."""
        p = self._proposal(seq, max(self.tree_nodes, 16))
        return p.match if p is not None else 0

    def next_source(self, seq: Sequence[int]) -> str:
        """The length policy's key: "suffix/<match length>" (capped at 8: longer matches copy alike)."""
        return f"{self.name}/{min(self.match_length(seq), 8)}"

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        if k <= 0:
            return None
        p = self._proposal(seq, k)
        if p is None or not p.tokens:
            return None
        chain = all(q == i - 1 for i, q in enumerate(p.parents))
        return Draft(mx.array(p.tokens, mx.uint32), None, self.name, parents=None if chain else list(p.parents))

    def commit(self, draft_tokens: list[int]) -> None:
        pass

    def commit_tree(self, path: list[int], tokens: list[int]) -> None:
        pass
