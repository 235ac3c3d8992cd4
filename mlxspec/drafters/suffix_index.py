"""A suffix index for SuffixDecoding (Oliaro et al., arXiv 2411.04975): what followed the
current context elsewhere in a text, as a frequency-weighted tree of continuations.

SuffixDecoding keeps suffix trees (depth-limited, path-compressed) over the prompt and output
of a request and over earlier outputs. A query walks the tree to the node of the context's
last m tokens, for each match length m; that node's subtree holds every earlier occurrence
of those m tokens with its continuations, each node counting the occurrences through it.

This module answers the same query without building the tree: it keeps, for anchor n-grams
(1, 2 and 4 tokens), the positions where each occurred (one list append per n-gram and token),
finds the occurrences of the context's longest indexed anchor, extends each match backwards
(at most `max_depth` token comparisons each) and builds the continuation trie of the matching
occurrences only: a few dozen occurrences times the speculation budget, not the text. Only
the `max_occurrences` most recent occurrences of an anchor are read, so a query costs
O(max_occurrences * (max_depth + budget)) however long the text is.

Several documents share one index (a chat's earlier outputs): they are concatenated with a
separator that matches nothing, so no match or continuation crosses a document boundary.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

SEP = -1  # between documents: equal to no token
ANCHORS = (4, 2, 1)  # n-gram sizes indexed, longest first


@dataclass
class Proposal:
    tokens: list[int]
    parents: list[int]  # -1: the root; a chain is [-1, 0, 1, ...]
    probs: list[float]  # estimated probability of reaching each node (counts along the path)
    match: int  # tokens of context matched
    score: float = 0.0  # expected accepted tokens: sum of probs

    @property
    def size(self) -> int:
        return len(self.tokens)


@dataclass
class _Trie:
    count: int = 0
    kids: dict[int, "_Trie"] = field(default_factory=dict)


class SuffixIndex:
    def __init__(self, max_depth: int = 24, max_occurrences: int = 32):
        self.max_depth = max_depth
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self._post: dict[int, dict[tuple, list[int]]] = {n: {} for n in ANCHORS}
        self._next_end = 0  # n-grams ending before this position (with a token after) are indexed

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens = []
        for d in self._post.values():
            d.clear()
        self._next_end = 0

    def extend(self, toks: Sequence[int]) -> None:
        """Append tokens (SEP starts a new document) and index the n-grams that now have a
        following token."""
        self.tokens.extend(int(t) for t in toks)
        t = self.tokens
        for e in range(self._next_end, len(t) - 1):
            if t[e + 1] == SEP:
                continue
            for n, post in self._post.items():
                if e + 1 >= n:
                    key = tuple(t[e + 1 - n : e + 1])
                    if SEP not in key:
                        post.setdefault(key, []).append(e)
        self._next_end = max(self._next_end, len(t) - 1)

    def occurrences(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(match length, end position) of the most recent earlier occurrences of the context's
        last tokens, matched over the longest anchor that occurs and extended backwards."""
        if not context:
            return []
        for n in ANCHORS:
            if len(context) < n:
                continue
            ends = self._post[n].get(tuple(context[-n:]))
            if ends:
                break
        else:
            return []
        t, depth = self.tokens, min(self.max_depth, len(context))
        out = []
        for e in ends[-self.max_occurrences :]:
            m = n
            while m < depth and e - m >= 0 and t[e - m] == context[-1 - m]:
                m += 1
            out.append((m, e))
        return out

    def propose(
        self,
        context: Sequence[int],
        budget: int,
        tree: bool,
        spec_factor: float = 1.0,
        spec_offset: float = 0.0,
        min_prob: float = 0.1,
        min_match: int = 1,
    ) -> Proposal | None:
        """The best proposal for what follows context: for the longest few match lengths m,
        at most min(budget, floor(m * spec_factor + spec_offset)) tokens (a chain following
        the most frequent child, or a tree of the most probable nodes), each reached with
        estimated probability >= min_prob; the highest score wins, ties to the longer match."""
        occ = self.occurrences(context)
        if not occ:
            return None
        best: Proposal | None = None
        for m in sorted({m for m, _ in occ if m >= min_match}, reverse=True)[:3]:
            k = min(budget, int(m * spec_factor + spec_offset))
            if k <= 0:
                continue
            trie = self._trie([e for mm, e in occ if mm >= m], k)
            prop = _best_tree(trie, k, min_prob) if tree else _best_path(trie, k, min_prob)
            if prop is not None and (best is None or prop.score > best.score):
                prop.match = m
                best = prop
        return best

    def _trie(self, ends: list[int], depth: int) -> _Trie:
        """Counts of the continuations (up to depth tokens) after each end position."""
        t, n = self.tokens, len(self.tokens)
        root = _Trie(count=len(ends))
        for e in ends:
            node = root
            for pos in range(e + 1, min(e + 1 + depth, n)):
                x = t[pos]
                if x == SEP:
                    break
                nxt = node.kids.get(x)
                if nxt is None:
                    nxt = node.kids[x] = _Trie()
                nxt.count += 1
                node = nxt
        return root


def _best_path(root: _Trie, k: int, min_prob: float) -> Proposal | None:
    toks, probs, prob, node = [], [], 1.0, root
    while len(toks) < k and node.kids:
        x, nxt = max(node.kids.items(), key=lambda kv: kv[1].count)
        prob *= nxt.count / node.count
        if prob < min_prob:
            break
        toks.append(x)
        probs.append(prob)
        node = nxt
    if not toks:
        return None
    return Proposal(toks, list(range(-1, len(toks) - 1)), probs, 0, sum(probs))


def _best_tree(root: _Trie, k: int, min_prob: float) -> Proposal | None:
    """The k most probable nodes (a max-heap on probability; children are no more probable
    than their parent, so the chosen set is a tree). Children follow parents in the output."""
    toks, parents, probs = [], [], []
    heap: list[tuple[float, int, int, int, _Trie]] = []  # (-prob, tie, parent index, token, node)
    tie = 0

    def push(node: _Trie, prob: float, index: int) -> None:
        nonlocal tie
        for x, kid in node.kids.items():
            p = prob * kid.count / node.count
            if p >= min_prob:
                heapq.heappush(heap, (-p, tie, index, x, kid))
                tie += 1

    push(root, 1.0, -1)
    while heap and len(toks) < k:
        neg, _, parent, x, node = heapq.heappop(heap)
        toks.append(x)
        parents.append(parent)
        probs.append(-neg)
        push(node, -neg, len(toks) - 1)
    if not toks:
        return None
    return Proposal(toks, parents, probs, 0, sum(probs))
