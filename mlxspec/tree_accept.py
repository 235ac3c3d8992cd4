"""Exact acceptance over a token tree (tree.py has its layout).

The target scored the root (the last committed token) and every node in one pass: row 0 of
`p` is its processed distribution (sampling.probs: temperature, top-k, top-p, min-p) of the
token after the root, row 1 + i the one after node i. Acceptance walks down from the root;
at each node it either moves to one of its children (a drafted token is emitted) or stops and
emits one token of its own. Every rule below emits, at each step, a token distributed exactly
as the target's distribution at that point, which is all exactness needs: by induction over
the steps the output has the target's distribution, whatever the tree.

Greedy (temperature 0), for every drafter:
    follow the child whose token is the target's argmax; at the first node without one,
    emit the argmax. Each emitted token is the argmax: the output is the target's own.

Deterministic children (the draft model's top-b tokens in a model tree, lookup and suffix
proposals): a node's children are distinct tokens chosen before the target's randomness
is drawn. With p' the node's distribution, try the children in order: accept child x with
probability p'(x); on rejection set p'(x) = 0 and renormalise, and try the next; when all are
rejected, sample from p'. Why exact: accepting x with probability p'(x) and otherwise going on
with p' conditioned on "not x" is the chain rule of p' = p'(x) [x] + (1 - p'(x)) p'(. | not x),
so the emitted token has distribution p (EAGLE-2's evaluate_posterior; SGLang's
tree_speculative_sampling_target_only with both thresholds 1).

Children sampled i.i.d. from the draft's distribution q at their parent (SpecInfer's
multi-step speculative sampling): accept x with probability min(1, p'(x)/q(x)); on rejection
p' <- norm(max(0, p' - q)) and go on with the next sibling; when all are rejected, sample from
p'. Why exact: for one child this is the standard rejection step, whose output is p'; a
rejected child leaves the residual as the distribution still to be produced, and the next
child, independent of the first, is one more standard step against that residual.

A chain (one child per node) is the special case: with deterministic children the rule is
accept.py's one-hot q, with sampled children its min(1, p/q) and residual.

Host-side numpy: the engine evaluates the target's pass once, then walks the tree here (a
walk visits at most depth + siblings nodes; the device holds no loop over a data-dependent tree).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """kids[0]: the root's children; kids[1 + i]: node i's, in the order they were proposed."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids


def _sample(dist: np.ndarray, u: float) -> int:
    """Inverse-CDF sample of dist (V,) with a uniform u in [0, 1)."""
    c = np.cumsum(dist, dtype=np.float64)
    i = int(np.searchsorted(c, u * c[-1], side="right"))  # dist[i] > 0 unless u * c[-1] rounds to c[-1]
    return i if i < len(dist) else int(np.flatnonzero(dist)[-1])


def accept_tree_greedy(tokens: Sequence[int], parents: Sequence[int], best: Sequence[int]) -> tuple[list[int], int]:
    """best: (N + 1,) the target's argmax at the root and at each node.
    Returns (accepted path as node indices, the target's token after it)."""
    kids = children_of(parents)
    path, row = [], 0
    while True:
        nxt = next((c for c in kids[row] if tokens[c] == best[row]), None)
        if nxt is None:
            return path, int(best[row])
        path.append(nxt)
        row = nxt + 1


def accept_tree_deterministic(
    tokens: Sequence[int], parents: Sequence[int], p: np.ndarray, u: np.ndarray
) -> tuple[list[int], int]:
    """p: (N + 1, V) target distributions; u: (N + 1,) uniforms (u[c] tests node c, u[N] the
    final sample). Deterministic children: the rule in the module docstring."""
    kids = children_of(parents)
    n = len(parents)
    path, row = [], 0
    while True:
        dist = np.asarray(p[row], dtype=np.float64).copy()
        dist /= dist.sum()
        nxt = None
        for c in kids[row]:
            x = tokens[c]
            if u[c] < dist[x]:
                nxt = c
                break
            dist[x] = 0.0
            total = dist.sum()
            if total <= 0.0:  # the target puts all its mass on rejected tokens: cannot happen
                break  # (a rejected x had p'(x) < 1), but guard the division
            dist /= total
        if nxt is None:
            return path, _sample(dist, float(u[n]))
        path.append(nxt)
        row = nxt + 1


def accept_tree_sampled(
    tokens: Sequence[int], parents: Sequence[int], q: np.ndarray, p: np.ndarray, u: np.ndarray
) -> tuple[list[int], int]:
    """q: (N, V) the draft distribution each node was sampled from (the same row for the
    i.i.d. siblings of one parent); p, u as in accept_tree_deterministic. SpecInfer's rule."""
    kids = children_of(parents)
    n = len(parents)
    path, row = [], 0
    while True:
        dist = np.asarray(p[row], dtype=np.float64).copy()
        dist /= dist.sum()
        nxt = None
        for c in kids[row]:
            x = tokens[c]
            qc = np.asarray(q[c], dtype=np.float64)
            if u[c] * qc[x] < dist[x]:  # u < p'(x) / q(x), without the division
                nxt = c
                break
            resid = np.maximum(dist - qc, 0.0)
            total = resid.sum()
            if total > 0.0:  # p' == q leaves nothing, but then rejection had probability 0
                dist = resid / total
        if nxt is None:
            return path, _sample(dist, float(u[n]))
        path.append(nxt)
        row = nxt + 1
