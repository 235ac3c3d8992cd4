"""A small model of the target's family drafts autoregressively.

Reduced draft vocabulary (FR-Spec, Zhao et al. 2025): the draft's output layer can be cut to the
N tokens most likely to be needed (`draft_vocab=N`). The draft then samples only among those, q is
its distribution over them (zero elsewhere) and the drawn index maps back to its full-vocabulary
id. Acceptance stays exact, since exactness only needs q to be what the draft sampled from; a
target token outside the N can still be emitted (by the target, after a rejection), it just cannot
be proposed. What is saved: the output projection is (V x hidden), for Qwen2.5-0.5B 136M of its
494M weights, read in full at every draft step.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cached_lm import CachedLM
from ..errors import UnsupportedModelError
from ..sampling import SamplingParams, log_probs
from .base import Draft, fit_vocab


def draft_vocab_ids(n: int, vocab: int, keep: Iterable[int] = ()) -> list[int]:
    """The N ids a reduced draft keeps, by the token-id-order proxy: byte-level BPE vocabularies
    (Qwen, Llama 3, GPT-2) number tokens by merge rank, so lower ids are the more frequent. `keep`
    (the end-of-generation ids, which sit at the end of the vocabulary) is always included."""
    if n <= 0:
        raise ValueError(f"draft_vocab must be positive, got {n}")
    kept = {int(t) for t in keep if 0 <= int(t) < vocab}
    rest = [i for i in range(min(n, vocab)) if i not in kept][: max(0, n - len(kept))]
    return sorted(kept.union(rest))


def draft_vocab_from_text(tokenizer, texts: Iterable[str], n: int, keep: Iterable[int] = ()) -> list[int]:
    """The N ids most frequent in `texts` (your own prompts and replies), topped up by id order
    when the text uses fewer than N distinct tokens; `keep` always included."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    vocab = len(tokenizer.get_vocab())
    chosen = {int(t) for t in keep if 0 <= int(t) < vocab}
    for t, _ in counts.most_common():
        if len(chosen) >= n:
            break
        chosen.add(t)
    for t in range(vocab):
        if len(chosen) >= n:
            break
        chosen.add(t)
    return sorted(chosen)


class ReducedHead:
    """The draft's output layer restricted to `ids`: hidden states (T, H) -> logits (T, N).

    Supports models whose logits are `model.model(x)` followed by `lm_head` or the tied embedding
    (and Gemma's final soft-capping); checked on construction against the model's own logits."""

    def __init__(self, model: nn.Module, ids: Sequence[int]):
        self.ids = sorted({int(i) for i in ids})
        if not self.ids:
            raise ValueError("a reduced draft vocabulary needs at least one token")
        inner = getattr(model, "model", None)
        lm_head = getattr(model, "lm_head", None)
        proj = lm_head if lm_head is not None else getattr(inner, "embed_tokens", None)
        name = getattr(model, "model_type", type(model).__name__)
        if inner is None or proj is None:
            raise UnsupportedModelError(f"draft_vocab: cannot find the output layer of the draft model ({name})")
        width = proj.weight.shape[0]
        if self.ids[-1] >= width:
            raise ValueError(f"draft_vocab: token id {self.ids[-1]} is past the draft's {width} outputs")
        self.inner, self.width = inner, width
        self.prefix = self.ids == list(range(len(self.ids)))
        self.index = mx.array(self.ids, mx.uint32)
        # the kept ids are a run 0..m-1 (a view of the weights, no copy) and a few others (copied)
        m = next((i for i, t in enumerate(self.ids) if t != i), len(self.ids))
        tail = mx.array(self.ids[m:], mx.uint32) if m < len(self.ids) else None

        def rows(a: mx.array) -> list[mx.array]:
            parts = [a[:m]] if m else []
            if tail is not None:
                parts.append(a[tail])
            mx.eval(parts)
            return parts

        if isinstance(proj, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            b = rows(proj["biases"]) if "biases" in proj else [None] * ((m > 0) + (tail is not None))
            gs, bits, mode = proj.group_size, proj.bits, getattr(proj, "mode", "affine")
            blocks = list(zip(rows(proj["weight"]), rows(proj["scales"]), b))
            self._blocks = [
                lambda h, w=w, s=sc, b=bi: mx.quantized_matmul(
                    h, w, scales=s, biases=b, transpose=True, group_size=gs, bits=bits, mode=mode)
                for w, sc, bi in blocks
            ]
        else:
            self._blocks = [lambda h, w=w: h @ w.T for w in rows(proj.weight)]
        bias = getattr(lm_head, "bias", None) if lm_head is not None else None
        self.bias = mx.concatenate(rows(bias)) if bias is not None else None
        cap = getattr(model, "final_logit_softcapping", None) or getattr(
            getattr(model, "args", None), "final_logit_softcapping", None)
        self.softcap = float(cap) if cap else None
        self.head_fraction = _param_bytes(proj) / max(1, _param_bytes(model))  # of the draft's weights
        self._check(model, name)

    @property
    def size(self) -> int:
        return len(self.ids)

    def __call__(self, h: mx.array) -> mx.array:
        outs = [f(h) for f in self._blocks]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)
        if self.bias is not None:
            out = out + self.bias
        if self.softcap is not None:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out

    def hidden(self, tokens: mx.array, cache) -> mx.array:
        """(T,) tokens -> (T, H) final hidden states, through the model's own trunk and cache."""
        return self.inner(tokens[None], cache=cache)[0]

    def to_full(self, q: mx.array, vocab: int) -> mx.array:
        """(N,) distribution over the kept ids -> (vocab,) over the full vocabulary (zeros elsewhere)."""
        if self.prefix:
            return mx.concatenate([q, mx.zeros((vocab - q.shape[-1],), q.dtype)]) if vocab > q.shape[-1] else q
        return mx.zeros((vocab,), q.dtype).at[self.index].add(q)

    def _check(self, model: nn.Module, name: str) -> None:
        x = mx.array([[1, 2, 3]], mx.uint32)
        full = model(x)[0]
        mine = self(self.inner(x)[0])
        ref = full[..., : self.size] if self.prefix else full[..., self.index]
        tol = 1e-3 if full.dtype == mx.float32 else 3e-2
        if full.shape[-1] != self.width or not mx.allclose(mine, ref, rtol=tol, atol=tol).item():
            raise UnsupportedModelError(
                f"draft_vocab is not supported for this draft model ({name}): its logits are not its "
                "output layer applied to its final hidden states; use the full vocabulary")


def _param_bytes(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


class ModelDrafter:
    """A small model of the same family proposes k tokens autoregressively, keeping its full
    processed distribution q at each position for exact acceptance.

    vocab_ids: draft only among these token ids (a reduced vocabulary: see the module docstring);
    q still has the target's full width, zero outside them."""

    name = "model"

    def __init__(self, model: nn.Module, cost: float = 0.0, vocab_ids: Sequence[int] | None = None):
        self.lm = CachedLM(model, "draft")
        self.head = ReducedHead(model, vocab_ids) if vocab_ids is not None else None
        if self.head is not None:  # a memory-bound step reads the kept rows of the output layer only
            cost *= 1.0 - self.head.head_fraction * (1.0 - self.head.size / self.head.width)
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

    def _logits(self, y: mx.array, known: list[int] | None, vocab: int) -> mx.array:
        """The last position's logits: over the target's vocabulary, or over the kept ids."""
        if self.head is None:
            return fit_vocab(self.lm.forward(y, known=known)[-1], vocab)
        if self.head.ids[-1] >= vocab:
            raise ValueError(f"draft_vocab keeps token id {self.head.ids[-1]}, past the target's {vocab} tokens")
        logits = self.head(self.head.hidden(y, self.lm.cache)[-1:])[0]
        if known is not None:
            self.lm.tokens.extend(known)
        return logits

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
            logits = self._logits(y, feed if i == 0 else None, vocab)
            if self.p_min is not None and i >= self.min_tokens and self._unsure(logits, sp):
                # x_1..x_i are proposed and all of them were fed: the cache holds them
                self._pending = i
                if i == 0:
                    return None
                return Draft(mx.stack(tokens), mx.stack(qs) if qs else None, self.name)
            if sp.greedy:
                j = mx.argmax(logits, axis=-1)
            else:
                lp = log_probs(logits, sp)
                j = mx.random.categorical(lp, key=keys[i])
                q = mx.exp(lp)
                qs.append(q if self.head is None else self.head.to_full(q, vocab))
            x = (j if self.head is None else self.head.index[j]).astype(mx.uint32)
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
