"""The acceptance step alone, on synthetic distributions, vectorised over many random keys."""

import math

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as sstats

from mlxspec.accept import accept_greedy, accept_sampled

N = 200_000
V, K = 6, 3
P_MIN = 1e-4  # a chi-square p-value below this fails (seeded: the outcome is deterministic)


def synthetic(seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V) * 0.7, size=K + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(V) * 0.7, size=K).astype(np.float32)
    p[0, 5] = 0.0  # a token the target never emits but the draft may propose
    p[0] /= p[0].sum()
    return p, q


def run(p, q, one_hot_tokens=None):
    """Draft from q (or propose fixed tokens with a one-hot q), accept, for N random keys."""
    P, Q = mx.array(p), mx.array(q)

    def one(key):
        kd, ka = mx.random.split(key)
        if one_hot_tokens is None:
            draft = mx.random.categorical(mx.log(Q), key=kd).astype(mx.uint32)
            return (draft, *accept_sampled(draft, Q, P, ka))
        draft = mx.array(one_hot_tokens, mx.uint32)
        return (draft, *accept_sampled(draft, None, P, ka))

    d, n, t = mx.vmap(one)(mx.random.split(mx.random.key(1234), N))
    return np.array(d), np.array(n), np.array(t)


def emitted(d, n, t, j):
    """The j-th emitted token of the rounds that reached position j (all drafts before accepted)."""
    reach = n >= j
    tok = np.where(n[reach] > j, d[reach, min(j, K - 1)], t[reach]) if j < K else t[reach]
    return tok


def chi2_pvalue(tokens, expected_probs):
    counts = np.bincount(tokens, minlength=V).astype(float)
    expected = np.asarray(expected_probs, dtype=np.float64)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    expected = expected[keep] / expected[keep].sum() * counts.sum()
    return sstats.chisquare(counts[keep], expected).pvalue


def binom_ok(successes, trials, prob):
    """Within 5 standard deviations of the binomial mean: a tolerance from the sample size."""
    sd = math.sqrt(trials * prob * (1 - prob))
    return abs(successes - trials * prob) <= 5 * sd + 1


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_acceptance_keeps_target_distribution(seed):
    p, q = synthetic(seed)
    d, n, t = run(p, q)
    for j in range(K + 1):  # each emitted position, including the bonus after k accepts
        tok = emitted(d, n, t, j)
        assert len(tok) > 1000
        assert chi2_pvalue(tok, p[j]) > P_MIN, f"position {j} does not follow p"


@pytest.mark.parametrize("seed", [0, 1])
def test_acceptance_probability_is_sum_min_p_q(seed):
    p, q = synthetic(seed)
    d, n, t = run(p, q)
    for j in range(K):
        trials = int((n >= j).sum())
        accepted = int((n >= j + 1).sum())
        alpha = float(np.minimum(p[j], q[j]).sum())
        assert binom_ok(accepted, trials, alpha), (j, accepted / trials, alpha)
        # mlx-lm's rule (keep a draft only when the target's own sample equals it) accepts
        # with sum(p*q): the test tells the two apart
        assert not binom_ok(accepted, trials, float((p[j] * q[j]).sum()))


def test_one_hot_proposals_keep_target_distribution():
    p, q = synthetic(2)
    p[1, 5] = 0.0
    p[1] /= p[1].sum()
    fixed = [int(np.argmax(p[0])), 5, 1]  # likely, impossible (p=0), arbitrary
    d, n, t = run(p, q, one_hot_tokens=fixed)
    assert binom_ok(int((n >= 1).sum()), N, float(p[0, fixed[0]]))
    for j in range(K):
        tok = emitted(d, n, t, j)
        if len(tok) > 1000:
            assert chi2_pvalue(tok, p[j]) > P_MIN, j
    # position 1 proposes a token the target never emits: never accepted
    assert (n >= 2).sum() == 0


def test_identical_p_and_q_accepts_everything():
    p, _ = synthetic(3)
    d, n, t = run(p, p[:K])
    assert (n == K).all()
    assert chi2_pvalue(t, p[K]) > P_MIN


def test_greedy_acceptance_matches_argmax():
    logits = mx.array(np.eye(V, dtype=np.float32)[[2, 4, 1, 0]] * 5)  # argmax 2, 4, 1, 0
    for draft, n_exp, tok in [([2, 4, 1], 3, 0), ([2, 4, 3], 2, 1), ([2, 0, 1], 1, 4), ([5, 4, 1], 0, 2)]:
        n, t = accept_greedy(mx.array(draft, mx.uint32), logits)
        assert (n.item(), t.item()) == (n_exp, tok)
