"""The draft model proposes a token tree: a dynamic tree in the spirit of EAGLE-2.

With `tree_nodes` = 0 this is the plain ModelDrafter (a chain, unchanged). Otherwise, per round:

    depth 1   one forward over the tokens the draft's cache misses; the root's top-`width`
              tokens become candidates, scored by their draft log-probability
    depth d   the `width` candidates of depth d - 1 with the highest cumulative log-probability
              (the product of the draft's probabilities along their path) are fed in one
              batched forward, under the tree mask and per-node positions (tree.py); each
              gets its top-`width` tokens as candidates of depth d
    the tree  the `tree_nodes` candidates with the highest cumulative log-probability: a
              node's cumulative score is at most its parent's, so the set is a tree
              (ties go to the earlier candidate, the parent)

so a round costs one draft forward per depth (`width` tokens each) and one host wait per
depth (to pick what to expand), and the target verifies the tree in one pass.

The children of a node are the draft's top tokens: deterministic given the draft, distinct,
and chosen before the target's randomness, so the engine verifies them with the
deterministic-children rule (tree_accept.py), exact at any temperature. Ranking uses the
distribution the draft would sample from (sampling.log_probs: temperature, top-k, top-p,
min-p; tokens it filters out are never proposed), or its plain softmax when greedy.

The draft's cache keeps the expanded nodes of the accepted path after the round (the same
gather as the target's, tree.keep_path); the tokens after them are fed at the next round.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..sampling import SamplingParams
from ..tree import forward_tree, keep_path
from .base import Draft, fit_vocab
from .model import ModelDrafter
from .tree_search import grow_tree, top_children


class TreeModelDrafter(ModelDrafter):
    """ModelDrafter (chains, unchanged) that drafts trees when `tree_nodes` > 0 (the module
    docstring). Trees rank the draft's full output layer: a reduced draft vocabulary
    (`vocab_ids`) applies to its chains only."""

    def __init__(
        self, model: nn.Module, cost: float = 0.0, vocab_ids: Sequence[int] | None = None,
        width: int = 4, max_depth: int = 16,
    ):
        super().__init__(model, cost, vocab_ids)
        if width < 1 or max_depth < 1:
            raise ValueError("need width >= 1 and max_depth >= 1")
        self.width, self.max_depth = width, max_depth
        self.tree_nodes = 0  # the engine sets it per generation; 0 drafts chains
        self._slots: list[int] | None = None  # candidate id of each tree node in the draft cache
        self._node_of: dict[int, int] = {}  # candidate id -> node index in the proposed tree
        self._cands: list[tuple[int, int, float, int]] = []
        self._n_slots = 0

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        self._slots = None
        if self.tree_nodes <= 0:
            return super().propose(seq, k, sp, key, vocab)
        if k <= 0:
            return None
        return self._propose_tree(seq, min(k, self.max_depth), sp, vocab)

    def _propose_tree(self, seq: Sequence[int], depth_max: int, sp: SamplingParams, vocab: int) -> Draft | None:
        lm = self.lm
        feed = lm.sync(seq)
        logits = lm.forward(mx.array(feed, mx.uint32), known=feed)[-1:]

        def score(rows: mx.array) -> tuple[list, list]:
            idx, vals = top_children(fit_vocab(rows, vocab), sp, self.width)
            return idx.tolist(), vals.tolist()  # a host wait: which nodes to expand next

        def expand(frontier, cands, slot_parents, first, depth) -> mx.array:
            nodes = mx.array([cands[c][0] for c in frontier], mx.uint32)
            return forward_tree(lm, [], nodes, slot_parents, first=first)

        t = grow_tree(score, expand, logits, depth_max, self.tree_nodes, self.width)
        self._slots = sorted(t.slot_of, key=t.slot_of.get)
        self._n_slots = len(t.slot_parents)
        if not t.cands:
            self._keep([])
            return None
        self._node_of = {c: i for i, c in enumerate(t.chosen)}
        self._cands = t.cands
        return Draft(mx.array(t.tokens, mx.uint32), None, self.name, parents=t.parents)

    def _keep(self, path_cands: list[int]) -> None:
        """Keep the expanded candidates of an accepted path (a prefix of it) in the draft cache."""
        if self._slots is None:
            return
        slot_of = {c: s for s, c in enumerate(self._slots)}
        keep = []
        for c in path_cands:
            if c not in slot_of:
                break
            keep.append(c)
        keep_path(self.lm, self._n_slots, [slot_of[c] for c in keep], [self._cands[c][0] for c in keep] if keep else [])
        self._slots = None

    def commit(self, draft_tokens: list[int]) -> None:
        if self._slots is None:
            return super().commit(draft_tokens)
        # a tree that came out as a chain, verified as one: its nodes in order are the path
        by_node = {i: c for c, i in self._node_of.items()}
        self._keep([by_node[i] for i in range(len(by_node))])

    def commit_tree(self, path: list[int], tokens: list[int]) -> None:
        by_node = {i: c for c, i in self._node_of.items()}
        self._keep([by_node[i] for i in path])
