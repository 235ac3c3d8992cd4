"""A DFlash or DSpark head drafts a whole block in one forward (heads/dflash.py).

One round, with seq the sequence so far and start = len(seq) - 1 the position of its last token
(the anchor, which the target has not cached yet):
    context  the target's features of positions ctx .. start - 1 that the head has not seen
             (drafters/features.py; the previous verify computed them) enter the head's K/V cache
    block    [anchor, mask x (block_size - 1)] at positions start .. start + block_size - 1,
             one forward, non-causal inside the block
    slots    DFlash: slots 1 .. k propose positions start + 1 .. start + k (each its own position);
             DSpark: slots 0 .. k - 1 propose positions start + 1 .. start + k (shifted by one),
             each slot's logits corrected by the Markov head from the token drafted at the slot
             before, so DSpark samples slot after slot (lazily: still one host wait per round)
    q        each slot's own processed distribution, as it was sampled, for exact acceptance
The block's own K/V never enter the head's cache, so nothing is rewound after verification:
the next round's context is the target's features of the accepted tokens.

Draft length: at most the block's drafts (block_size - 1 for DFlash, block_size for DSpark) and
the engine's k (fixed, or adaptive; a block costs the same whatever k, so the marginal cost of a
longer draft is only its verification: cost 0 per drafted token). With draft_p_min the block is
cut at the first slot (past draft_min) whose score is below it: DSpark's confidence head
(sigmoid, the head's estimate that the slot is accepted if the ones before it were, DeepSpec's
--confidence-threshold) when the head has one, else the slot's top probability. Either score
depends only on the draft's own earlier tokens, so the cut keeps acceptance exact; it costs
one more host wait per round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import mlx.core as mx

from ..sampling import SamplingParams, log_probs
from .base import Draft, fit_vocab

if TYPE_CHECKING:
    from ..cached_lm import CachedLM
    from ..heads.dflash import BlockHead
    from ..heads.taps import TapRecorder
    from .features import TargetFeatures


class BlockHeadDrafter:
    name = "head"

    def __init__(self, head: "BlockHead", recorder: "TapRecorder", source: str):
        self.head = head
        self.recorder = recorder
        self.source = source  # "dflash" or "dspark": who proposed, in stats
        cfg = head.config
        self.block_size = cfg.block_size
        self.max_drafts = cfg.drafts_per_block
        self.cache = head.make_cache()
        self.tokens: list[int] = []  # the sequence positions whose context the head's cache holds
        self.features: "TargetFeatures | None" = None
        self.costs = {self.name: 0.0}  # a block costs the same for any k (see the docstring)
        self.p_min: float | None = None  # set by the engine per generation (draft_p_min)
        self.min_tokens = 1
        self._mask = mx.array([cfg.mask_token_id] * (self.block_size - 1), mx.uint32)

    # -- keeping in step with the target ---------------------------------------------------
    def attach(self, target: "CachedLM") -> None:
        """The session's target: its forwards' tapped features are this drafter's context."""
        from .features import TargetFeatures

        self.features = TargetFeatures(self.recorder, target)

    def _context(self, seq: Sequence[int]) -> mx.array | None:
        """Rewind the head's cache to its common prefix with seq[:start] and return the target
        features (1, S, F) of the positions from there to start - 1; None when the target has
        not computed them (the next verify will: features.recompute_from)."""
        from ..cached_lm import common_prefix

        if self.features is None:
            raise RuntimeError("a block-head drafter needs attach(target) before drafting")
        start = len(seq) - 1
        keep = min(common_prefix(self.tokens, seq), start)
        if keep < len(self.tokens):
            for c in self.cache:
                c.trim(len(self.tokens) - keep)
            del self.tokens[keep:]
        feats = self.features
        if feats.valid(seq) < start:
            return None
        if keep < feats.floor:  # rows we need again were dropped: have the target recompute them
            feats.recompute_from(keep)
            return None
        rows = feats.rows(keep, start)
        self.tokens.extend(seq[keep:start])
        feats.forget_before(start)  # rows below start are in the head's cache now
        return rows[None]

    def prefill(self, seq: Sequence[int]) -> None:
        """Feed the prompt's context (the target's prefill computed its features), in chunks."""
        if self.features is None:
            return
        start = len(seq) - 1
        step = 512
        while len(self.tokens) < start:
            stop = min(len(self.tokens) + step, start)
            taps = self._context(list(seq[:stop]) + [seq[stop]])
            if taps is None:
                return  # not computed yet: the first propose feeds what is there
            self.head.add_context(taps.astype(self.head.fc.weight.dtype), self.cache)
            mx.eval([c.keys for c in self.cache])

    # -- drafting --------------------------------------------------------------------------
    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        k = min(k, self.max_drafts)
        if k <= 0:
            return None
        taps = self._context(seq)
        if taps is None:
            return None
        head = self.head
        block = mx.concatenate([mx.array([seq[-1]], mx.uint32), self._mask])[None]
        h = head(block, taps.astype(head.fc.weight.dtype), self.cache)[0]  # (block_size, H)
        if head.config.dspark:
            tokens, qs, scores = self._dspark_slots(h[:k], seq[-1], k, sp, key, vocab)
        else:
            tokens, qs, scores = self._dflash_slots(h[1 : 1 + k], sp, key, vocab)
        if self.p_min is not None:
            k = self._cut(scores, k)
            if k == 0:
                return None
            tokens, qs = tokens[:k], (qs[:k] if qs is not None else None)
        return Draft(tokens, qs, self.source)

    def _dflash_slots(self, h: mx.array, sp: SamplingParams, key: mx.array, vocab: int):
        """DFlash: slot j predicts its own position; the slots are independent given the block."""
        logits = fit_vocab(self.head.logits(h), vocab)  # (k, V)
        if sp.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.uint32), None, _top_prob(logits)
        lp = log_probs(logits, sp)
        tokens = mx.random.categorical(lp, key=key).astype(mx.uint32)
        return tokens, mx.exp(lp), mx.exp(mx.max(lp, axis=-1))

    def _dspark_slots(self, h: mx.array, anchor: int, k: int, sp: SamplingParams, key: mx.array, vocab: int):
        """DSpark: slot j predicts position start + j + 1; its logits get the Markov correction
        from x_{j-1} (x_{-1} = the anchor), so the slots are sampled in order."""
        head = self.head
        base = head.logits(h)  # (k, V)
        keys = mx.random.split(key, k) if not sp.greedy else [key] * k
        prev = mx.array([anchor], mx.uint32)[0]
        tokens, qs, scores = [], [], []
        for j in range(k):
            logits = base[j]
            bias = head.markov_bias(prev, h[j])
            if bias is not None:
                logits = logits + bias.astype(logits.dtype)
            logits = fit_vocab(logits, vocab)
            conf = head.confidence(prev, h[j])
            if sp.greedy:
                x = mx.argmax(logits, axis=-1).astype(mx.uint32)
                score = _top_prob(logits)
            else:
                lp = log_probs(logits, sp)
                x = mx.random.categorical(lp, key=keys[j]).astype(mx.uint32)
                qs.append(mx.exp(lp))
                score = mx.exp(mx.max(lp))
            scores.append(conf if conf is not None else score)
            tokens.append(x)
            prev = x
        return mx.stack(tokens), (mx.stack(qs) if qs else None), mx.stack(scores)

    def _cut(self, scores: mx.array, k: int) -> int:
        """The draft length under p_min: the first slot (at or past min_tokens) scoring below it.
        A host wait."""
        vals = scores.tolist()
        for j in range(min(self.min_tokens, k), k):
            if vals[j] < self.p_min:
                return j
        return k

    def commit(self, draft_tokens: list[int]) -> None:
        pass  # the block's K/V were never cached; the accepted tokens arrive as context next round


def _top_prob(logits: mx.array) -> mx.array:
    """The plain softmax's top probability (greedy drafts have no sampling distribution)."""
    x = logits.astype(mx.float32)
    return mx.exp(mx.max(x, axis=-1) - mx.logsumexp(x, axis=-1))


def step_timer(head, target_model, context: int):
    """(step, cache) for bench's cost of drafting (TrainedHead.step_timer): `step(x, cache)` runs
    one block round over a head cache of `context` positions: one new context row (bench trims
    it after each call), the block forward, the slots' logits and greedy tokens. Bench divides
    its time by the block's drafts (info["drafts_per_step"]), so its c is per drafted token and
    k * c is the block's cost at k = the block's drafts."""
    from ..heads import target_dims

    module = head.module
    cfg = module.config
    drafter = BlockHeadDrafter(module, head.recorder, head.family)
    width = len(cfg.tap_layers) * cfg.hidden_size
    dtype = module.fc.weight.dtype
    cache = module.make_cache()
    if context:
        module.add_context(mx.zeros((1, context, width), dtype), cache)
        mx.eval([c.keys for c in cache])
    row = mx.zeros((1, 1, width), dtype)
    mask = mx.array([cfg.mask_token_id] * (cfg.block_size - 1), mx.uint32)
    vocab = target_dims(target_model)["vocab_size"]
    sp, key, k = SamplingParams(), mx.random.key(0), cfg.drafts_per_block

    def step(x: mx.array, cache: list) -> mx.array:
        block = mx.concatenate([x[0, -1:].astype(mx.uint32), mask])[None]
        h = module(block, row, cache)[0]
        if cfg.dspark:
            return drafter._dspark_slots(h[:k], 0, k, sp, key, vocab)[0]
        return drafter._dflash_slots(h[1 : 1 + k], sp, key, vocab)[0]

    return step, cache
