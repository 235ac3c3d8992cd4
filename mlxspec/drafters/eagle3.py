"""An EAGLE-3 head drafts from the target's own features (heads/eagle3.py has the format).

The head keeps its own KV cache. Its position j reads the target's fused features of position j
together with the embedding of token j + 1, and predicts token j + 2. So for a sequence of L
tokens the head must hold positions 0..L-2, computed from the target's features (the catch-up,
drafters/features.py supplies the rows); the output at L-2 gives the first draft token. Each
later draft step feeds back the head's pre-norm hidden state instead of target features, with
the embedding of the token just drafted. Those draft-step entries are trimmed at the next
propose, where the accepted positions are recomputed from the target's verified features.

The head's cache is rewound by common prefix like CachedLM: entry j depends on tokens 0..j+1.

With `tree_nodes` > 0 (`--tree-nodes N`) it drafts a dynamic token tree instead of a chain
(`_propose_tree`), verified by the engine in one target pass; the target's feature rows of the
accepted path are then kept in order (TargetFeatures.keep_path), as the target's cache keeps them.

Its logits cover the draft vocabulary; a draft id d is target id d + d2t[d]. Greedy takes the
argmax in the draft vocabulary; sampling draws from sampling.log_probs of the draft logits, and
q (what acceptance needs) is that distribution scattered into the target's ids, zero elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..adaptive import weight_ratio
from ..cached_lm import CachedLM, common_prefix
from ..sampling import SamplingParams, log_probs
from .base import Draft
from .features import TargetFeatures
from .tree_search import grow_tree, top_children

if TYPE_CHECKING:
    from ..heads import TrainedHead

PREFILL_STEP = 512  # head positions per catch-up forward in prefill
KEEP_ROWS = 64  # target feature rows kept behind the head's position (a new turn may diverge there)


class Eagle3Drafter:
    name = "head"  # the registry name (drafter="head")
    source = "eagle3"  # what stats and the length policy call its tokens

    def __init__(self, head: "TrainedHead", target_model: nn.Module, cost: float | None = None,
                 width: int = 4, max_depth: int = 8):
        from ..heads import target_embedding
        from ..heads.eagle3 import draft_to_target

        if head.recorder is None:
            raise ValueError("the head's taps are not installed on the target (TrainedHead.install)")
        self.head = head.module
        self.recorder = head.recorder
        self.embed = target_embedding(target_model)
        self.cache = KVCache()
        self.tokens: list[int] = []  # seq[:m + 1] for the m head positions computed from target features
        self.features: TargetFeatures | None = None  # set by attach (the session's target)
        ids = draft_to_target(self.head.d2t)
        self._identity = bool(mx.all(ids == mx.arange(ids.shape[0])).item())
        self._ids = ids.astype(mx.uint32)  # draft id -> target id
        self._inverse: dict[int, mx.array] = {}  # target vocabulary width -> gather index
        self.costs = {self.source: weight_ratio(self.head, target_model) if cost is None else cost}
        # early stop, as ModelDrafter (the engine sets these per generation)
        self.p_min: float | None = None
        self.min_tokens = 1
        # token trees (the engine sets tree_nodes per generation; 0 drafts chains): a dynamic
        # tree as TreeModelDrafter builds it, `width` candidates expanded per depth
        self.tree_nodes = 0
        self.width, self.max_depth = width, max_depth
        self._tree_size = 0

    # -- the engine's calls ----------------------------------------------------------------
    def attach(self, target: CachedLM) -> None:
        self.features = TargetFeatures(self.recorder, target)

    def next_source(self, seq: Sequence[int]) -> str:
        return self.source

    def prefill(self, seq: Sequence[int]) -> None:
        n = len(seq) - 1  # the head positions the target's prefill gave features for
        if self.features is None or n < 1:
            return
        for upto in [*range(PREFILL_STEP, n, PREFILL_STEP), n]:
            out = self._catch_up(seq, upto)
            if out is None:
                return
            mx.eval(out[1], self.cache.state)

    def propose(
        self, seq: Sequence[int], k: int, sp: SamplingParams, key: mx.array, vocab: int
    ) -> Draft | None:
        if k <= 0 or self.features is None or len(seq) < 2:
            return None
        out = self._catch_up(seq, len(seq) - 1)
        if out is None:
            return None
        if self.tree_nodes > 0:
            return self._propose_tree(out, len(seq) - 1, min(k, self.max_depth), sp)
        logits, h = out
        keys = mx.random.split(key, k) if not sp.greedy else None
        tokens, qs = [], []
        for i in range(k):
            if self.p_min is not None and i >= self.min_tokens and self._unsure(logits, sp):
                break
            if sp.greedy:
                x = self._to_target(mx.argmax(logits, axis=-1))
            else:
                lp = log_probs(logits, sp)
                x = self._to_target(mx.random.categorical(lp, key=keys[i]))
                qs.append(self._scatter(mx.exp(lp), vocab))
            tokens.append(x)
            if i < k - 1:
                lg, h = self.head(self.embed(x.reshape(1, 1)), h, cache=self.cache)
                logits = lg[0, -1]
        if not tokens:
            return None
        return Draft(mx.stack(tokens), mx.stack(qs) if qs else None, self.source)

    def commit(self, draft_tokens: list[int]) -> None:
        pass  # draft-step entries are trimmed at the next propose, which recomputes from features

    def commit_tree(self, path: list[int], tokens: list[int]) -> None:
        """A tree round: the target kept the accepted path's nodes; so do its feature rows."""
        if self.features is not None:
            self.features.keep_path(self._tree_size, path)

    # -- token trees -----------------------------------------------------------------------
    def _propose_tree(self, out: tuple[mx.array, mx.array], pos: int, depth_max: int,
                      sp: SamplingParams) -> Draft | None:
        """A dynamic tree (as drafters/tree_model.py): the root's top-`width` tokens are the
        depth-1 candidates; at each depth the `width` candidates of highest cumulative
        log-probability are expanded in one head forward (each fed its parent's pre-norm h and
        its own token, at head position pos - 1 + depth, attending to the head's cache and its
        own ancestors); the tree is the `tree_nodes` best candidates. Children are the head's
        top tokens, chosen before the target's randomness: the engine verifies them with the
        deterministic-children rule, exact at any temperature. One host wait per depth."""
        logits, h = out
        base = self.cache.offset  # the head positions computed from target features
        hidden = {-1: h[0, 0]}  # expanded candidate -> its pre-norm h (its children's input)

        def score(rows: mx.array) -> tuple[list, list]:
            idx, vals = top_children(rows, sp, self.width)
            ids = idx.astype(mx.uint32) if self._identity else self._ids[idx]
            return ids.tolist(), vals.tolist()  # a host wait: which candidates to expand next

        def expand(frontier, cands, slot_parents, first, depth) -> mx.array:
            rows, hs = self._expand(frontier, cands, hidden, slot_parents, first, base, pos - 1 + depth)
            for i, c in enumerate(frontier):
                hidden[c] = hs[i]
            return rows

        t = grow_tree(score, expand, logits[None], depth_max, self.tree_nodes, self.width)
        if not t.cands:
            return None
        self._tree_size = len(t.chosen)
        return Draft(mx.array(t.tokens, mx.uint32), None, self.source, parents=t.parents)

    def _expand(self, frontier: list[int], cands: list, hidden: dict, slot_parents: list[int], first: int,
                base: int, position: int) -> tuple[mx.array, mx.array]:
        """One head forward over the candidates `frontier` (new slots first.. of the head's
        cache): draft logits (w, Vd) and pre-norm h (w, H)."""
        import numpy as np

        mid = self.head.midlayer
        attn = mid.self_attn
        w, n = len(frontier), len(slot_parents)
        mask = np.zeros((w, base + n), dtype=bool)
        mask[:, :base] = True
        for r in range(w):
            s = first + r
            while s >= 0:
                mask[r, base + s] = True
                s = slot_parents[s]
        emb = self.embed(mx.array([cands[c][0] for c in frontier], mx.uint32)[None])
        x = mx.stack([hidden[cands[c][1]] for c in frontier])[None]
        q, k, v = attn.project(mid.attn_input(emb, x), offset=position)
        k, v = self.cache.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mx.array(mask))
        h = mid.finish(x, attn.output(o))
        return self.head.logits(h)[0], h[0]

    # -- internals -------------------------------------------------------------------------
    def _catch_up(self, seq: Sequence[int], upto: int) -> tuple[mx.array, mx.array] | None:
        """Make the head's cache hold positions 0..upto-1 computed from target features (at least
        the last one computed now). Returns (draft logits (Vd,), pre-norm h (1, 1, H)) of
        position upto-1, lazily; None when the target's features for them are not there."""
        m = max(len(self.tokens) - 1, 0)
        keep = max(0, min(m, common_prefix(self.tokens, seq) - 1, upto - 1))
        if self.cache.offset > keep:
            self.cache.trim(self.cache.offset - keep)
        del self.tokens[keep + 1:]
        feats = self.features
        if keep < feats.floor:  # rows dropped to bound memory: have the next verify recompute them
            feats.recompute_from(keep)
            return None
        if feats.valid(seq) < upto:
            return None
        x = self.head.fuse(feats.rows(keep, upto)[None])
        emb = self.embed(mx.array(seq[keep + 1 : upto + 1], mx.uint32)[None])
        logits, h = self.head(emb, x, mask="causal" if upto - keep > 1 else None, cache=self.cache)
        self.tokens = list(seq[: upto + 1])
        if upto - feats.floor > 4 * KEEP_ROWS:
            feats.forget_before(upto - KEEP_ROWS)
        return logits[0, -1], h[:, -1:]

    def _to_target(self, d: mx.array) -> mx.array:
        return d.astype(mx.uint32) if self._identity else self._ids[d]

    def _scatter(self, p: mx.array, vocab: int) -> mx.array:
        """(Vd,) draft-vocabulary probabilities -> (vocab,) over target ids, zero outside."""
        vd = p.shape[-1]
        if self._identity and vd == vocab:
            return p
        inv = self._inverse.get(vocab)
        if inv is None:
            import numpy as np

            idx = np.full(vocab, vd, dtype=np.int32)  # vd: the appended zero
            ids = np.array(self._ids.astype(mx.int64))
            ok = ids < vocab
            idx[ids[ok]] = np.arange(vd, dtype=np.int32)[ok]
            inv = self._inverse[vocab] = mx.array(idx)
        return mx.concatenate([p, mx.zeros((1,), p.dtype)])[inv]

    def _unsure(self, logits: mx.array, sp: SamplingParams) -> bool:
        """The head's top probability for the next token is below p_min (a host wait)."""
        if sp.greedy:
            x = logits.astype(mx.float32)
            lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        else:
            lp = log_probs(logits, sp)
        return mx.exp(mx.max(lp)).item() < self.p_min


class HeadStep:
    """One EAGLE-3 draft step as a model-like callable, for timing (bench's draft-step cost c):
    `step(x (1, 1) token ids, cache=[KVCache]) -> draft logits`, the head attending over a cache
    of `context` positions, its hidden input the previous step's h, as in propose."""

    def __init__(self, head: "TrainedHead", target_model: nn.Module):
        from ..heads import target_embedding

        self.head = head.module
        self.embed = target_embedding(target_model)
        self.h = mx.zeros((1, 1, self.head.config.hidden_size), self.head.fc.weight.dtype)

    def make_cache(self, context: int, step: int = PREFILL_STEP) -> list[KVCache]:
        """A head cache holding `context` positions (random target features)."""
        cfg = self.head.config
        cache = KVCache()
        for start in range(0, context, step):
            n = min(step, context - start)
            feats = mx.random.normal((1, n, len(cfg.tap_layers) * cfg.target_hidden_size)).astype(self.h.dtype)
            toks = mx.random.randint(0, cfg.vocab_size, (1, n)).astype(mx.uint32)
            self.head(self.embed(toks), self.head.fuse(feats), mask="causal" if n > 1 else None, cache=cache)
            mx.eval(cache.state)
        return [cache]

    def __call__(self, x: mx.array, cache: list[KVCache]) -> mx.array:
        logits, _ = self.head(self.embed(x), self.h, cache=cache[0])
        return logits


def step_timer(head: "TrainedHead", target_model: nn.Module, context: int):
    """(step, cache) for timing one draft step at this context length (TrainedHead.step_timer)."""
    step = HeadStep(head, target_model)
    return step, step.make_cache(context)
