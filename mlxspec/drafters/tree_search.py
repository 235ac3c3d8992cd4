"""EAGLE-2's dynamic draft tree, shared by every drafter that drafts trees (the draft model in
tree_model.py, the EAGLE-3 head in eagle3.py): they differ only in how a depth's candidates
are scored and expanded, which they pass in.

Candidates are (token, parent candidate or -1, cumulative log-probability, depth). Each depth,
every frontier candidate's top-`width` children join; the `width` best new ones that can still
make the final tree (a child scores at most its parent, so those above the `tree_nodes`-th best
score so far) are expanded by one batched forward, each into a new cache slot. The tree is the
`tree_nodes` best candidates, parents before children.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..sampling import SamplingParams, log_probs


@dataclass
class TreeSearch:
    cands: list[tuple[int, int, float, int]]
    slot_of: dict[int, int]  # expanded candidate -> its slot in the drafter's cache
    slot_parents: list[int]  # per slot: the slot of its parent (-1: the root)
    chosen: list[int]  # the tree's candidates, parents before children
    parents: list[int]  # per tree node: its parent node (-1: the root)

    @property
    def tokens(self) -> list[int]:
        return [self.cands[c][0] for c in self.chosen]


def top_children(logits: mx.array, sp: SamplingParams, width: int) -> tuple[mx.array, mx.array]:
    """Top-`width` ids and log-probabilities of each row of logits (R, V): of the distribution
    the drafter samples from (its plain softmax when greedy)."""
    if sp.greedy:
        x = logits.astype(mx.float32)
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    else:
        lp = log_probs(logits, sp)
    b = min(width, lp.shape[-1])
    idx = mx.argpartition(-lp, kth=b - 1, axis=-1)[:, :b]
    return idx, mx.take_along_axis(lp, idx, axis=-1)


def grow_tree(
    score: Callable[[object], tuple[list, list]],
    expand: Callable[[list[int], list, list[int], int, int], object],
    rows: object,
    depth_max: int,
    tree_nodes: int,
    width: int,
) -> TreeSearch:
    """score(rows) -> (token ids, log-probs) per frontier row, as lists (a host wait);
    expand(frontier, cands, slot_parents, first_new_slot, depth) -> the rows scoring their
    children (one batched forward)."""
    cands: list[tuple[int, int, float, int]] = []
    slot_of: dict[int, int] = {}
    slot_parents: list[int] = []
    frontier = [-1]  # the candidates whose children the rows score
    for depth in range(1, depth_max + 1):
        toks, vals = score(rows)
        new = []
        for parent, row_t, row_v in zip(frontier, toks, vals):
            base = cands[parent][2] if parent >= 0 else 0.0
            for t, v in zip(row_t, row_v):
                if v > -float("inf"):
                    new.append(len(cands))
                    cands.append((int(t), parent, base + float(v), depth))
        if depth == depth_max:
            break
        ranked = sorted((c[2] for c in cands), reverse=True)
        bar = ranked[tree_nodes - 1] if len(ranked) >= tree_nodes else -float("inf")
        frontier = [c for c in sorted(new, key=lambda c: -cands[c][2])[:width] if cands[c][2] > bar]
        if not frontier:
            break
        first = len(slot_parents)
        for c in frontier:
            slot_of[c] = len(slot_parents)
            p = cands[c][1]
            slot_parents.append(slot_of[p] if p >= 0 else -1)
        rows = expand(frontier, cands, slot_parents, first, depth)
    chosen = sorted(range(len(cands)), key=lambda c: (-cands[c][2], c))[:tree_nodes]
    chosen.sort(key=lambda c: (cands[c][3], c))  # parents before children
    node_of = {c: i for i, c in enumerate(chosen)}
    parents = [node_of[cands[c][1]] if cands[c][1] >= 0 else -1 for c in chosen]
    return TreeSearch(cands, slot_of, slot_parents, chosen, parents)
