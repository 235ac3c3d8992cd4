"""Token trees on stock mlx-lm models: one forward over many candidate continuations.

A tree of N drafted nodes hangs below the last committed token (the root). Node i has a token
and a parent `parents[i]` (-1: the root), with parents listed before their children. One
forward over [feed..., node_0..node_{N-1}] scores every node, if

- each node attends to the cached prefix, the fed tokens, its ancestors and itself (the tree
  mask): mlx-lm's models take no mask argument but ask their first cache for one
  (`cache.make_mask`), so the cache answers with the tree mask for that one call;
- each node is rotated at its depth (siblings share a RoPE position): attention calls
  `self.rope(x, offset=cache.offset)`, so each layer's rope is wrapped for that one call by one
  that rotates token j of x at `positions[j]` (mx.fast.rope takes one offset per batch row:
  the wrapper makes each token a row).

Afterwards only the accepted root-to-node path stays in the cache (`keep_path`): its keys and
values are gathered into place behind the fed tokens and the offset is set after them. No
model file is forked; models whose caches or rope this cannot drive are refused with a clear
error (sliding-window and rotating caches, ropes that fail the one-time check).

Shapes: N nodes, F fed tokens (usually 1, the last token), prefix P cached tokens.
    mask       (F + N, P + F + N)  bool, True = attend
    positions  (F + N,)            int32: P + i for fed token i, P + F - 1 + depth for a node
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .errors import UnsupportedModelError


def check_parents(parents: Sequence[int]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come before their children (-1: the root)")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for the root's children."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def is_chain(parents: Sequence[int]) -> bool:
    """A tree with one child per node: the plain chain x_1..x_N."""
    return all(p == i - 1 for i, p in enumerate(parents))


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root, -1)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def ancestors(parents: Sequence[int]) -> np.ndarray:
    """(N, N) bool: [i, j] is True when node j is node i or one of its ancestors."""
    n = len(parents)
    a = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            a[i] = a[p]
        a[i, i] = True
    return a


def tree_mask(parents: Sequence[int], prefix: int, n_feed: int, first: int = 0) -> mx.array:
    """The attention mask of one forward over [feed..., nodes first..N-1], the cache holding
    prefix committed tokens then nodes 0..first-1: (F + N - first, P + F + N)."""
    n, f = len(parents), n_feed
    m = np.zeros((f + n - first, prefix + f + n), dtype=bool)
    m[:, :prefix] = True
    m[:f, prefix : prefix + f] = np.tril(np.ones((f, f), dtype=bool))
    m[f:, prefix : prefix + f] = True
    m[f:, prefix + f :] = ancestors(parents)[first:]
    return mx.array(m)


def tree_positions(parents: Sequence[int], prefix: int, n_feed: int, first: int = 0) -> mx.array:
    d = depths(parents)[first:]
    pos = list(range(prefix, prefix + n_feed)) + [prefix + n_feed - 1 + x for x in d]
    return mx.array(pos, mx.int32)


# -- driving a stock mlx-lm model ------------------------------------------------------------


class PositionedRope(nn.Module):
    """Rotates token j of x (1, H, L, D) at positions[j] with the wrapped rope, by making each
    token a batch row: (L, H, 1, D) with one offset per row."""

    def __init__(self, inner: nn.Module, positions: mx.array):
        super().__init__()
        self.inner = inner
        self.positions = positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        rows = x.transpose(2, 1, 0, 3)  # (L, H, B=1, D)
        return self.inner(rows, offset=self.positions).transpose(2, 1, 0, 3)


_ROPE_OK: dict[type, bool] = {}


def _check_rope(rope: nn.Module, head_dim: int) -> bool:
    """Once per rope class: per-token positions p, p+1, ... must equal the plain rope at offset p."""
    cls = type(rope)
    if cls not in _ROPE_OK:
        try:
            x = mx.random.normal((1, 2, 5, head_dim), key=mx.random.key(0))
            want = rope(x, offset=7)
            got = PositionedRope(rope, mx.arange(7, 12, dtype=mx.int32))(x)
            _ROPE_OK[cls] = bool(mx.allclose(want, got, atol=1e-4).item())
        except Exception:
            _ROPE_OK[cls] = False
    return _ROPE_OK[cls]


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = model.model.layers
    out = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "rope"):
            raise UnsupportedModelError(
                f"{type(model).__name__}: a layer without self_attn.rope; token trees need "
                f"rotary attention in every layer (use a chain: tree_nodes=0)"
            )
        out.append(attn)
    return out


def _head_dim(attn: nn.Module) -> int:
    for name in ("head_dim", "hd"):
        if hasattr(attn, name):
            return int(getattr(attn, name))
    return int(attn.k_proj.weight.shape[0] // attn.n_kv_heads)


def check_tree_model(model: nn.Module, cache: list) -> None:
    """Refuse, with what to do instead, a model whose caches or rope a tree cannot drive."""
    bad = sorted({type(c).__name__ for c in cache if type(c) not in (KVCache, QuantizedKVCache)})
    name = getattr(model, "model_type", type(model).__name__)
    if bad:
        raise UnsupportedModelError(
            f"{name} uses {', '.join(bad)} caches; token trees need plain KV caches "
            f"(use a chain: tree_nodes=0)"
        )
    for attn in _attention_layers(model):
        if not _check_rope(attn.rope, _head_dim(attn)):
            raise UnsupportedModelError(
                f"{name}: its rope ({type(attn.rope).__name__}) does not take per-token positions; "
                f"use a chain (tree_nodes=0)"
            )


@contextmanager
def tree_attention(model: nn.Module, cache: list, mask: mx.array, positions: mx.array) -> Iterator[None]:
    """Within the block, model(ids, cache=cache) attends with `mask` and rotates at `positions`."""
    attns = _attention_layers(model)
    ropes = [a.rope for a in attns]
    for a, r in zip(attns, ropes):
        a.rope = PositionedRope(r, positions)
    for c in cache:
        c.make_mask = lambda *args, **kw: mask  # an instance attribute hides the method
    try:
        yield
    finally:
        for a, r in zip(attns, ropes):
            a.rope = r
        for c in cache:
            c.__dict__.pop("make_mask", None)


def forward_tree(
    lm, feed: Sequence[int], nodes: mx.array, parents: Sequence[int], first: int = 0
) -> mx.array:
    """Feed `feed` (ints) then tree nodes first..N-1 (`nodes`, their N - first tokens) to a
    CachedLM in one pass; logits (F + N - first, V). `parents` covers nodes 0..N-1; nodes
    0..first-1 must already be in the cache (an earlier call; then feed is empty). The cache
    then holds the fed tokens (in lm.tokens) and the nodes after them (not in lm.tokens):
    call keep_path when the tree is decided."""
    check_tree_model(lm.model, lm.cache)
    prefix, f = lm.offset, len(feed)
    if first and f:
        raise ValueError("feed the committed tokens with the first nodes, not later")
    for c in lm.cache:
        if c.offset != prefix + first:
            raise RuntimeError(f"cache holds {c.offset} tokens, expected {prefix + first}")
    mask = tree_mask(parents, prefix, f, first)
    pos = tree_positions(parents, prefix, f, first)
    inp = mx.concatenate([mx.array(list(feed), mx.uint32), nodes.astype(mx.uint32)]) if f else nodes
    with tree_attention(lm.model, lm.cache, mask, pos):
        logits = lm.model(inp[None], cache=lm.cache)[0]
    lm.tokens.extend(int(t) for t in feed)
    return logits


def keep_path(lm, n_nodes: int, keep: Sequence[int], tokens: Sequence[int]) -> None:
    """After forward_tree: keep only nodes `keep` (ascending node indices, a root-to-node path)
    of the n_nodes in the cache, in order, behind lm.tokens; `tokens` are their values."""
    base, m = lm.offset, len(keep)
    for c in lm.cache:
        if c.offset != base + n_nodes:
            raise RuntimeError(f"cache holds {c.offset} tokens, expected {base + n_nodes}")
    if list(keep) != list(range(m)):  # the chain's prefix needs no copy, only the offset
        idx = mx.array([base + i for i in keep], mx.int32)
        for c in lm.cache:
            for arrays in (c.keys, c.values):
                for a in arrays if isinstance(arrays, (tuple, list)) else (arrays,):
                    a[..., base : base + m, :] = a[..., idx, :]
    for c in lm.cache:
        c.offset = base + m
    lm.tokens.extend(int(t) for t in tokens)
