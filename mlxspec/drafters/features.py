"""The target's tapped features, kept in step with the sequence: what a trained-head drafter
(EAGLE-3, DFlash, DSpark) drafts from.

The target computes features in its own forwards: the prefill (in chunks) and each round's
verify pass, which feeds [tokens of seq not yet cached..., drafts]. A `TargetFeatures` listens to
the tap recorder (heads/taps.py) and keeps the rows of the forwards made on ONE session's target
cache, by position: a forward at cache offset o replaces every row from o on, exactly as the
target's cache was rewound to o before it. So row p is the feature of the token the target's
cache holds at p (`target.tokens[p]`), and it is valid for a sequence `seq` when the cached
tokens 0..p agree with seq:

    feats = TargetFeatures(recorder, target)      # target: the session's CachedLM (Drafter.attach)
    n = feats.valid(seq)                          # rows 0..n-1 are features of seq's positions
    x = feats.rows(start, stop)                   # (stop - start, n_taps * H), start >= feats.floor

Rows of positions below `floor` are dropped (`forget_before`) to bound memory on long contexts;
a drafter that needs one again calls `recompute_from(p)`, which rewinds the target's cache so
that the next verify pass computes rows p.. afresh (one round without a draft).

Timing in a round: propose(seq) reads rows of positions the previous verify computed (the engine
has evaluated that pass in its host wait); the verify of this round appends rows for
[seq's uncached tail, drafts] lazily, and they are evaluated with the round.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..cached_lm import CachedLM, common_prefix
from ..heads.taps import TapRecorder


class TargetFeatures:
    def __init__(self, recorder: TapRecorder, target: CachedLM):
        self.recorder = recorder
        self.target = target
        self._cache = target.cache[min(recorder.layer_ids)]  # identifies this session's forwards
        self._chunks: list[tuple[int, mx.array]] = []  # (first position, rows (T, F)), ascending, contiguous
        self.floor = 0  # rows below this position were dropped
        recorder.subscribe(self._on_forward)

    # -- recording -----------------------------------------------------------------------
    def _on_forward(self, rec: TapRecorder) -> None:
        if rec.cache is not self._cache:
            return  # another session's forward (or an uncached one) on the same target model
        h = rec.hidden()
        if h.shape[0] != 1:
            return  # batched forwards are not the engine's
        self._truncate(rec.offset)
        if rec.offset < self.floor:  # rewound below the floor: the rows before offset are gone
            self._chunks.clear()
            self.floor = rec.offset
        elif self._chunks and self.end != rec.offset:  # a gap: earlier rows belong to another history
            self._chunks.clear()
            self.floor = rec.offset
        elif not self._chunks:
            self.floor = rec.offset
        self._chunks.append((rec.offset, h[0]))

    def _truncate(self, pos: int) -> None:
        """Drop the rows of positions >= pos."""
        while self._chunks:
            start, rows = self._chunks[-1]
            if start >= pos:
                self._chunks.pop()
            elif start + rows.shape[0] > pos:
                self._chunks[-1] = (start, rows[: pos - start])
                break
            else:
                break

    # -- reading -------------------------------------------------------------------------
    @property
    def end(self) -> int:
        """One past the last position with a row (rows may be stale past target.offset)."""
        if not self._chunks:
            return self.floor
        start, rows = self._chunks[-1]
        return start + rows.shape[0]

    def valid(self, seq: Sequence[int]) -> int:
        """n such that the rows of positions floor..n-1 are the target's features of seq[0..n-1]
        (n <= floor: none are)."""
        return min(self.end, common_prefix(self.target.tokens, seq))

    def rows(self, start: int, stop: int) -> mx.array:
        """(stop - start, F): rows of positions start..stop-1 (within floor..end)."""
        if not (self.floor <= start <= stop <= self.end):
            raise IndexError(f"feature rows {start}..{stop} asked, {self.floor}..{self.end} held")
        parts = []
        for s, r in self._chunks:
            lo, hi = max(start, s), min(stop, s + r.shape[0])
            if lo < hi:
                parts.append(r[lo - s : hi - s])
        if not parts:
            return mx.zeros((0, self.width), self.dtype)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    @property
    def width(self) -> int:
        return self._chunks[0][1].shape[-1] if self._chunks else 0

    @property
    def dtype(self):
        return self._chunks[0][1].dtype if self._chunks else mx.float32

    # -- memory --------------------------------------------------------------------------
    def forget_before(self, pos: int) -> None:
        """Drop rows of positions < pos (whole chunks; the kept rows are copied out of the
        forward's larger arrays so those can be freed). Merges the rest into one array when
        there are many chunks, so reading stays cheap."""
        if pos <= self.floor or not self._chunks:
            return
        pos = min(pos, self.end)
        kept = self.rows(pos, self.end)
        self._chunks = [(pos, kept)] if kept.shape[0] else []
        self.floor = pos

    def compact(self, max_chunks: int = 32) -> None:
        """Merge the chunks into one array when there are more than max_chunks."""
        if len(self._chunks) > max_chunks:
            start = self._chunks[0][0]
            merged = self.rows(start, self.end)
            mx.eval(merged)
            self._chunks = [(start, merged)]

    def keep_path(self, n_nodes: int, path: list[int]) -> None:
        """After a token-tree verify pass (tree.keep_path on the target): its last n_nodes rows
        are the tree's nodes in node order; keep those of the accepted `path`, in order, as the
        rows of the positions the target's cache now holds them at."""
        if not self._chunks:
            return
        start, rows = self._chunks[-1]
        fed = rows.shape[0] - n_nodes
        if fed < 0:  # not the tree forward: forget it, the drafter recomputes what it lacks
            self._truncate(start)
            return
        idx = mx.array(list(range(fed)) + [fed + i for i in path], mx.int32)
        self._chunks[-1] = (start, rows[idx])

    def recompute_from(self, pos: int) -> None:
        """Make the next target forward compute rows pos.. again, by rewinding the target's
        cache to pos (the engine feeds from there; the tokens of seq are unchanged)."""
        self.target.rewind(min(pos, self.target.offset))
