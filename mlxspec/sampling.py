"""One function turns logits into the sampling distribution; the drafter's sampler, the
verifier and the acceptance step all call it, so they can never disagree about temperature,
top-k, top-p or min-p."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_probs(logits: mx.array, sp: SamplingParams) -> mx.array:
    """logits (..., V) -> log of the processed distribution (..., V), -inf where filtered.

    Order as in vLLM and llama.cpp: temperature, then top-k, top-p, min-p on the tempered
    distribution. Only meaningful for temperature > 0 (greedy uses argmax).
    """
    x = logits.astype(mx.float32) * (1.0 / sp.temperature)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    vocab = x.shape[-1]
    if 0 < sp.top_k < vocab:
        x = apply_top_k(x, sp.top_k)
    if sp.top_p < 1.0:
        x = apply_top_p(x, sp.top_p)
    if sp.min_p > 0.0:
        x = apply_min_p(x, sp.min_p)
    if sp.top_k or sp.top_p < 1.0 or sp.min_p > 0.0:
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    return x


def probs(logits: mx.array, sp: SamplingParams) -> mx.array:
    """The processed distribution (..., V) that both the draft and the target sample from."""
    return mx.exp(log_probs(logits, sp))


def sample(logits: mx.array, sp: SamplingParams, key: mx.array) -> mx.array:
    """Sample one token per row of logits (..., V) -> (...) uint32."""
    if sp.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    return mx.random.categorical(log_probs(logits, sp), key=key).astype(mx.uint32)
