"""An mlx-lm model with its KV cache and the token list that cache holds: the one object that
feeds, rewinds and resyncs a model, for the target and for model drafters alike."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .errors import UnsupportedModelError


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    m = min(len(a), len(b))
    if list(a[:m]) == list(b[:m]):
        return m
    lo, hi = 0, m  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class CachedLM:
    """An mlx-lm model with its KV cache and the list of tokens that cache holds.

    Rewinding is by common prefix with the true sequence, so rejected drafts, a stop token in
    the middle of a round and a new chat turn are all the same operation: trim, then feed.
    """

    def __init__(self, model: nn.Module, role: str, prefill_step: int = 512):
        self.model = model
        self.role = role
        self.prefill_step = prefill_step
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []
        bad = sorted({type(c).__name__ for c in self.cache if not c.is_trimmable()})
        if bad:
            name = getattr(model, "model_type", type(model).__name__)
            raise UnsupportedModelError(
                f"the {role} model ({name}) uses a KV cache that cannot be rewound "
                f"({', '.join(bad)}); speculative decoding needs to drop rejected drafts. "
                f"Use it without a draft, or pick an attention-only {role} model."
            )

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def rewind(self, n: int) -> None:
        """Keep only the first n cached tokens."""
        drop = len(self.tokens) - n
        if drop > 0:
            for c in self.cache:
                c.trim(drop)
            del self.tokens[n:]

    def sync(self, seq: Sequence[int]) -> list[int]:
        """Trim the cache to its common prefix with seq (keeping at least one token of seq to
        feed) and return the tokens of seq still to feed."""
        keep = min(common_prefix(self.tokens, seq), len(seq) - 1)
        self.rewind(keep)
        return list(seq[keep:])

    def prefill(self, seq: Sequence[int]) -> None:
        """Feed all of seq but its last token, in chunks, evaluating each chunk."""
        todo = self.sync(seq)[:-1]
        for i in range(0, len(todo), self.prefill_step):
            chunk = todo[i : i + self.prefill_step]
            self.model(mx.array(chunk, mx.uint32)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.tokens.extend(chunk)

    def forward(self, tokens: mx.array, known: list[int] | None = None) -> mx.array:
        """Feed tokens (T,) and return logits (T, V). `known` are their values when the caller
        has them as ints; otherwise call `extend` once they are known."""
        logits = self.model(tokens[None], cache=self.cache)[0]
        if known is not None:
            self.tokens.extend(known)
        return logits
