"""The draft vocabulary: the most frequent target tokens of the training data (EAGLE-3 and
SpecForge do the same), as the d2t/t2d maps of heads/eagle3.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..heads.eagle3 import vocab_maps


@dataclass(frozen=True)
class DraftVocab:
    ids: np.ndarray  # (draft_vocab,) target ids, ascending
    d2t: np.ndarray
    t2d: np.ndarray
    coverage: float  # fraction of the counted tokens that lie in the draft vocabulary
    distinct: int  # distinct tokens seen in the data

    @property
    def size(self) -> int:
        return int(self.ids.size)


def count_tokens(samples: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        np.add.at(counts, np.asarray(s, dtype=np.int64), 1)
    return counts


def counts_array(counts: dict[int, int], vocab_size: int) -> np.ndarray:
    out = np.zeros(vocab_size, dtype=np.int64)
    for t, n in counts.items():
        if 0 <= t < vocab_size:
            out[t] = n
    return out


def draft_vocab(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The `size` most frequent tokens (ties broken by lower id), plus the `always` ids (the
    end-of-sequence tokens, so the head can propose stopping). A token never seen gets no
    training signal, so the vocabulary stops at the tokens that occur: it may be smaller than
    `size`."""
    vocab_size = counts.size
    always = sorted({int(t) for t in always if 0 <= int(t) < vocab_size})
    seen = np.flatnonzero(counts)
    keep = max(1, min(size, seen.size + sum(1 for t in always if counts[t] == 0)))
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    chosen = list(dict.fromkeys([*always, *order[:keep].tolist()]))[:max(keep, len(always))]
    ids = np.array(sorted(chosen), dtype=np.int64)
    d2t, t2d = vocab_maps(ids, vocab_size)
    total = counts.sum()
    coverage = float(counts[ids].sum() / total) if total else 0.0
    return DraftVocab(ids, d2t, t2d, coverage, int(seen.size))
