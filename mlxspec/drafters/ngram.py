"""An incremental n-gram index for prompt lookup decoding (Saxena 2023).

The sequence so far (prompt + generated text) is its own draft model: find an earlier
occurrence of the sequence's last n tokens and propose the tokens that followed it. Code
editing, extraction and summarisation repeat long runs of their input, and on those runs the
proposals are accepted wholesale, at no model cost.

The index maps every n-gram (for n in [ngram_min, ngram_max]) that has at least one token after
it to the position of its most recent occurrence. Appending t tokens costs O(t * sizes) dict
writes, so a 16k-token prompt is indexed once (about 64k writes, tens of milliseconds) and
every later round indexes only its few new tokens; a lookup is `sizes` dict reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Match:
    size: int  # n: how many trailing tokens matched
    start: int  # position of the first token that followed the earlier occurrence


class NGramIndex:
    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self._next_end = 0  # n-grams ending at positions < _next_end are indexed

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []
        for m in self._maps.values():
            m.clear()
        self._next_end = 0

    def update(self, seq: Sequence[int]) -> None:
        """Bring the index in step with seq. Within a generation seq only grows, so only its new
        tail is indexed; a sequence that diverges from what was indexed (a new chat turn that
        rewrites history) rebuilds the index."""
        n_old = len(self.tokens)
        if len(seq) < n_old or list(seq[:n_old]) != self.tokens:
            self.reset()
            n_old = 0
        self.tokens.extend(int(t) for t in seq[n_old:])
        toks = self.tokens
        # index n-grams ending at e for e in [_next_end, len - 2]: each has a following token
        for e in range(self._next_end, len(toks) - 1):
            for n, m in self._maps.items():
                if e + 1 >= n:
                    m[tuple(toks[e + 1 - n : e + 1])] = e  # later occurrences overwrite: most recent
        self._next_end = max(self._next_end, len(toks) - 1)

    def match(self) -> Match | None:
        """The longest suffix n-gram of the indexed tokens that occurred earlier (its most recent
        earlier occurrence), or None."""
        toks = self.tokens
        for n in range(min(self.ngram_max, len(toks) - 1), self.ngram_min - 1, -1):
            e = self._maps[n].get(tuple(toks[len(toks) - n :]))
            if e is not None:
                return Match(n, e + 1)
        return None

    def continuation(self, match: Match, k: int) -> list[int]:
        """k tokens copied from match.start on. A copy that reaches the end of the sequence
        continues from its own output (as in LZ77), so a periodic run such as `a b a b` keeps
        proposing its period instead of stopping at the end of the text."""
        toks, n = self.tokens, len(self.tokens)
        out: list[int] = []
        for j in range(k):
            pos = match.start + j
            out.append(toks[pos] if pos < n else out[pos - n])
        return out

    def propose(self, seq: Sequence[int], k: int) -> tuple[list[int], Match | None]:
        """Update with seq, then propose up to k tokens (empty when nothing matched)."""
        self.update(seq)
        m = self.match()
        if m is None or k <= 0:
            return [], m
        return self.continuation(m, k), m
