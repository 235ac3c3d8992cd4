"""Exact acceptance of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

Pure functions over arrays with no host synchronisation: the engine evaluates their results
once per round, and the statistical tests vmap them over many random keys.

Shapes: k drafted tokens, vocabulary V.
    draft  (k,)       uint32   the proposed tokens x_1..x_k
    q      (k, V)     float32  the draft's processed distribution at each position
                               (None: a deterministic proposal, i.e. one-hot q)
    p      (k+1, V)   float32  the target's processed distribution at each position
Returns (n, token): n in [0, k] drafts accepted, then `token`, sampled from the residual
norm(max(0, p_n - q_n)) when n < k, or from p_{k+1} (the bonus) when every draft was accepted.
"""

from __future__ import annotations

import mlx.core as mx


def _leading_true(mask: mx.array) -> mx.array:
    """Number of leading True values of a (k,) boolean array."""
    return mx.cumprod(mask.astype(mx.int32)).sum()


def accept_sampled(
    draft: mx.array, q: mx.array | None, p: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    k = draft.shape[0]
    u_key, r_key = mx.random.split(key)
    idx = draft.astype(mx.int32)[:, None]
    p_x = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]  # (k,)
    if q is None:
        q_x = mx.ones_like(p_x)
        q_full = mx.zeros_like(p[:k])
        q_full = mx.put_along_axis(q_full, idx, mx.array(1.0, p.dtype), axis=-1)
    else:
        q_x = mx.take_along_axis(q, idx, axis=-1)[:, 0]
        q_full = q
    # accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); written without a division
    u = mx.random.uniform(shape=(k,), key=u_key)
    n = _leading_true(u * q_x < p_x)
    # residual distributions at every position; position k (all accepted) is the bonus p_{k+1}
    resid = mx.maximum(p[:k] - q_full, 0.0)
    resid = mx.concatenate([resid, p[k:]], axis=0)  # (k+1, V)
    r = mx.take(resid, n, axis=0)  # (V,)
    # p == q exactly gives a zero residual, but then rejection has probability 0: fall back to p
    r = mx.where(r.sum() > 0, r, mx.take(p, n, axis=0))
    token = mx.random.categorical(mx.log(r), key=r_key).astype(mx.uint32)
    return n, token


def accept_greedy(draft: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Temperature 0: accept while the draft equals the target's argmax; the next token is the
    target's argmax at the first disagreement (or after the last draft)."""
    k = draft.shape[0]
    best = mx.argmax(target_logits, axis=-1).astype(mx.uint32)  # (k+1,)
    n = _leading_true(best[:k] == draft)
    return n, mx.take(best, n, axis=0)
