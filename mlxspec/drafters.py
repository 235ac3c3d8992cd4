"""Drafters propose tokens; the engine verifies them with exact acceptance.

A drafter keeps whatever state it needs (a KV cache, an n-gram index) in step with the
sequence the engine hands it, and returns lazy arrays: proposing builds an MLX graph that the
engine evaluates together with verification, once per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .errors import UnsupportedModelError
from .sampling import SamplingParams, log_probs


@dataclass
class Draft:
    tokens: mx.array  # (k,) uint32, may be lazy
    q: mx.array | None  # (k, V_target) processed draft distribution; None: one-hot proposal
    source: str  # which drafter proposed them ("model", "lookup", ...)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    name: str

    def prefill(self, seq: Sequence[int]) -> None:
        """Catch up with the sequence (prompt plus text so far) before the first round."""

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        """Propose up to k tokens to follow seq (None or an empty draft: nothing to propose)."""

    def commit(self, draft_tokens: list[int]) -> None:
        """The round's draft tokens as ints, once the engine has evaluated them."""


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


def fit_vocab(logits: mx.array, vocab: int) -> mx.array:
    """Make draft logits (..., V_d) cover exactly the target's V entries: entries the target has
    but the draft lacks get -inf (q = 0 there), entries past the target's size are dropped (the
    draft's distribution is whatever it samples from; exactness only needs q to be that)."""
    d = logits.shape[-1]
    if d == vocab:
        return logits
    if d > vocab:
        return logits[..., :vocab]
    pad = mx.full((*logits.shape[:-1], vocab - d), -float("inf"), dtype=logits.dtype)
    return mx.concatenate([logits, pad], axis=-1)


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


class ModelDrafter:
    """A small model of the same family proposes k tokens autoregressively, keeping its full
    processed distribution q at each position for exact acceptance."""

    name = "model"

    def __init__(self, model: nn.Module, cost: float = 0.0):
        self.lm = CachedLM(model, "draft")
        self._pending = 0  # drafted tokens fed to the cache whose values are not known yet
        self.costs = {self.name: cost}  # one draft step, in target steps (for adaptive length)
        # Early stop (the engine sets these per generation): stop drafting once the draft's top
        # probability for the next token falls below p_min, after at least min_tokens tokens.
        # Reading that probability is a host wait per drafted token, so None (the default)
        # keeps the single wait per round.
        self.p_min: float | None = None
        self.min_tokens = 1

    def prefill(self, seq: Sequence[int]) -> None:
        self.lm.prefill(seq)

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        if k <= 0:
            return None
        feed = self.lm.sync(seq)
        y = mx.array(feed, mx.uint32)
        keys = mx.random.split(key, k)
        tokens, qs = [], []
        for i in range(k):
            logits = fit_vocab(self.lm.forward(y, known=feed if i == 0 else None)[-1], vocab)
            if self.p_min is not None and i >= self.min_tokens and self._unsure(logits, sp):
                # x_1..x_i are proposed and all of them were fed: the cache holds them
                self._pending = i
                if i == 0:
                    return None
                return Draft(mx.stack(tokens), mx.stack(qs) if qs else None, self.name)
            if sp.greedy:
                x = mx.argmax(logits, axis=-1).astype(mx.uint32)
            else:
                lp = log_probs(logits, sp)
                x = mx.random.categorical(lp, key=keys[i]).astype(mx.uint32)
                qs.append(mx.exp(lp))
            tokens.append(x)
            y = x[None]
        self._pending = k - 1  # x_k is sampled but not fed
        return Draft(mx.stack(tokens), mx.stack(qs) if qs else None, self.name)

    def _unsure(self, logits: mx.array, sp: SamplingParams) -> bool:
        """The draft's top probability for the next token is below p_min: the distribution it
        samples from, or its plain softmax when greedy (argmax has no spread). A host wait."""
        if sp.greedy:
            x = logits.astype(mx.float32)
            lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        else:
            lp = log_probs(logits, sp)
        return mx.exp(mx.max(lp)).item() < self.p_min

    def commit(self, draft_tokens: list[int]) -> None:
        self.lm.tokens.extend(draft_tokens[: self._pending])
        self._pending = 0


class LookupDrafter:
    """Prompt lookup decoding: propose what followed the most recent earlier occurrence of the
    sequence's longest suffix n-gram (see lookup.py). A deterministic proposal is a one-hot q,
    so exact acceptance keeps the target's distribution at any temperature; proposing reads
    host-side ints only (no device work)."""

    name = "lookup"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        from .lookup import NGramIndex

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

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        toks, _ = self.index.propose(seq, k)
        if not toks:
            return None
        return Draft(mx.array(toks, mx.uint32), None, self.name)

    def commit(self, draft_tokens: list[int]) -> None:
        pass


class ModelLookupDrafter:
    """Lookup when its match is at least `min_match` tokens long (a copy in progress), the
    draft model otherwise. The model's cache skips the lookup rounds and catches up by common
    prefix the next time it drafts: one forward over the tokens it missed."""

    name = "model+lookup"

    def __init__(self, model: ModelDrafter, lookup: LookupDrafter, min_match: int = 2):
        self.model, self.lookup, self.min_match = model, lookup, min_match
        self.costs = {**model.costs, **lookup.costs}
        self._used: ModelDrafter | LookupDrafter | None = None

    @property
    def p_min(self) -> float | None:
        return self.model.p_min

    @p_min.setter
    def p_min(self, value: float | None) -> None:
        self.model.p_min = value

    @property
    def min_tokens(self) -> int:
        return self.model.min_tokens

    @min_tokens.setter
    def min_tokens(self, value: int) -> None:
        self.model.min_tokens = value

    def prefill(self, seq: Sequence[int]) -> None:
        self.model.prefill(seq)
        self.lookup.prefill(seq)

    def next_source(self, seq: Sequence[int]) -> str:
        """Who drafts the next round, as the length policy's key: "model" or "lookup/<n>"."""
        self.lookup.index.update(seq)
        m = self.lookup.index.match()
        if m is not None and m.size >= self.min_match:
            return f"{self.lookup.name}/{m.size}"
        return self.model.name

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        self._used = self.lookup if self.next_source(seq) != self.model.name else self.model
        return self._used.propose(seq, k, sp, key, vocab)

    def commit(self, draft_tokens: list[int]) -> None:
        if self._used is not None:
            self._used.commit(draft_tokens)
        self._used = None


DRAFTERS = ("auto", "model", "lookup", "model+lookup", "none")
