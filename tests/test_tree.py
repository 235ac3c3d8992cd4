"""Token trees (issue 11): the tree-masked forward, cache compaction, exact tree acceptance and
model tree drafts through the engine, on tiny random models."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import check_marginals, exact_marginals
from scipy import stats as sstats

import mlxspec
from mlxspec.cached_lm import CachedLM
from mlxspec.drafters import Draft
from mlxspec.errors import UnsupportedModelError
from mlxspec.sampling import SamplingParams, probs
from mlxspec.tree import forward_tree, is_chain, keep_path, path_to
from mlxspec.tree_accept import accept_tree_deterministic, accept_tree_greedy, accept_tree_sampled

PREFIX = [3, 9, 11, 20, 5, 17]
TOKENS = [7, 8, 9, 10, 11, 12, 13, 7]
PARENTS = [-1, -1, 0, 0, 1, 2, 5, 5]
PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 40, 33, 12, 8, 8, 8, 21, 60, 3, 17]]


def path_logits(model, seq):
    return model(mx.array([seq]))[0, -1]


@pytest.mark.parametrize("n_feed", [1, 3])
def test_tree_forward_equals_each_path_and_compaction_equals_causal(target, n_feed):
    lm = CachedLM(target, "target")
    lm.prefill(PREFIX[: len(PREFIX) - n_feed + 1])
    feed = PREFIX[len(PREFIX) - n_feed :]
    logits = forward_tree(lm, feed, mx.array(TOKENS), PARENTS)
    assert logits.shape[0] == n_feed + len(TOKENS)
    np.testing.assert_allclose(np.array(logits[n_feed - 1]), np.array(path_logits(target, PREFIX)), atol=1e-4)
    for i in range(len(TOKENS)):
        seq = PREFIX + [TOKENS[j] for j in path_to(PARENTS, i)]
        np.testing.assert_allclose(np.array(logits[n_feed + i]), np.array(path_logits(target, seq)), atol=1e-4)
    keep = path_to(PARENTS, 6)  # nodes 0, 2, 5, 6: a gather, not a prefix
    keep_path(lm, len(TOKENS), keep, [TOKENS[j] for j in keep])
    seq = PREFIX + [TOKENS[j] for j in keep]
    assert lm.tokens == seq and all(c.offset == len(seq) for c in lm.cache)
    nxt = lm.forward(mx.array([33]), known=[33])[-1]
    np.testing.assert_allclose(np.array(nxt), np.array(path_logits(target, seq + [33])), atol=1e-4)


def test_tree_in_two_calls_equals_one(target):
    """A tree fed depth by depth (as the tree drafter does) scores what one call does."""
    lm = CachedLM(target, "target")
    lm.prefill(PREFIX)
    first = forward_tree(lm, PREFIX[-1:], mx.array(TOKENS[:4]), PARENTS[:4])
    rest = forward_tree(lm, [], mx.array(TOKENS[4:]), PARENTS, first=4)
    for i in range(len(TOKENS)):
        got = first[1 + i] if i < 4 else rest[i - 4]
        seq = PREFIX + [TOKENS[j] for j in path_to(PARENTS, i)]
        np.testing.assert_allclose(np.array(got), np.array(path_logits(target, seq)), atol=1e-4)
    keep_path(lm, len(TOKENS), [1, 4], [TOKENS[1], TOKENS[4]])
    nxt = lm.forward(mx.array([5]), known=[5])[-1]
    np.testing.assert_allclose(np.array(nxt), np.array(path_logits(target, PREFIX + [8, 11, 5])), atol=1e-4)


class OffsetOnlyRope(nn.Module):
    """A rope that only understands an int offset: tree mode must refuse it."""

    def __call__(self, x, offset=0):
        return x + (offset if isinstance(offset, int) else 0) * 0.01


def test_unsupported_rope_and_bad_parents_are_refused():
    from conftest import tiny_llama

    m = tiny_llama(7)
    for layer in m.model.layers:
        layer.self_attn.rope = OffsetOnlyRope()
    lm = CachedLM(m, "target")
    lm.prefill([1, 2, 3])
    with pytest.raises(UnsupportedModelError, match="per-token positions"):
        forward_tree(lm, [3], mx.array([4, 5]), [-1, -1])
    from mlxspec.tree import check_parents

    with pytest.raises(ValueError, match="parents must come before"):
        check_parents([-1, 2, 0])
    assert is_chain([-1, 0, 1]) and not is_chain([-1, -1])


# -- acceptance rules, exact by chi-square ---------------------------------------------------
# A two-token target: p_root over the first token, p_next[t] over the second after t. The
# tree's rows: row 0 = p_root, row 1 + i = p_next[token of node i] for depth-1 nodes (deeper
# rows are only the bonus). Whatever the rule emits, completed to two tokens with the target,
# must follow p_root[t1] * p_next[t1][t2].

V = 6


def _target(seed):
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(V) * 0.7), rng.dirichlet(np.ones(V) * 0.7, size=V)


def _rows(tokens, parents, p_root, p_next):
    rows = [p_root]
    for t, par in zip(tokens, parents):
        rows.append(p_next[t] if par < 0 else np.full(V, 1.0 / V))
    return np.array(rows)


def _joint_test(draw, p_root, p_next, n=12000, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.zeros(V * V)
    for _ in range(n):
        out = draw(rng)
        if len(out) < 2:
            out.append(int(rng.choice(V, p=p_next[out[0]])))
        counts[out[0] * V + out[1]] += 1
    exp = (p_root[:, None] * p_next).ravel() * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    return sstats.chisquare(obs, ex).pvalue


@pytest.mark.parametrize("order", ["likely first", "likely third"])
def test_deterministic_children_rule_is_exact(order):
    p_root, p_next = _target(1)
    ranked = list(np.argsort(-p_root))
    # the target's most likely token as the first or the third sibling; a second level under it
    roots = ranked[:3] if order == "likely first" else [ranked[2], ranked[1], ranked[0]]
    best = ranked[0]
    tokens = roots + [int(np.argmax(p_next[best])), int(np.argsort(-p_next[best])[1])]
    parents = [-1, -1, -1, roots.index(best), roots.index(best)]
    rows = _rows(tokens, parents, p_root, p_next)

    def draw(rng):
        path, t = accept_tree_deterministic(tokens, parents, rows, rng.random(len(tokens) + 1))
        return [tokens[i] for i in path] + [t]

    assert _joint_test(draw, p_root, p_next) > 1e-4


def test_sampled_children_rule_is_exact():
    p_root, p_next = _target(2)
    rng0 = np.random.default_rng(5)
    q_root, q_next = rng0.dirichlet(np.ones(V), size=1)[0], rng0.dirichlet(np.ones(V), size=V)

    def draw(rng):
        roots = [int(x) for x in rng.choice(V, size=3, p=q_root)]  # i.i.d.: duplicates allowed
        kids = [int(x) for x in rng.choice(V, size=2, p=q_next[roots[0]])]
        tokens, parents = roots + kids, [-1, -1, -1, 0, 0]
        q = np.array([q_root] * 3 + [q_next[roots[0]]] * 2)
        path, t = accept_tree_sampled(tokens, parents, q, _rows(tokens, parents, p_root, p_next),
                                      rng.random(len(tokens) + 1))
        return [tokens[i] for i in path] + [t]

    assert _joint_test(draw, p_root, p_next) > 1e-4


def test_the_chi_square_check_catches_a_wrong_rule():
    """Accepting siblings with p(x) without renormalising after a rejection is not exact: the
    same check must fail on it (so the tests above can fail)."""
    p_root, p_next = _target(1)
    tokens, parents = [int(t) for t in np.argsort(-p_root)[:3]], [-1, -1, -1]

    def wrong(rng):
        u = rng.random(4)
        for c, x in enumerate(tokens):
            if u[c] < p_root[x]:
                return [x]
        return [int(rng.choice(V, p=p_root))]

    assert _joint_test(wrong, p_root, p_next) < 1e-6


def test_greedy_tree_rule_follows_the_argmax():
    tokens, parents = [4, 2, 9, 1, 7], [-1, -1, 1, 1, 2]
    # root's argmax 2 (node 1), node 1's 9 (node 2), node 2's 7 (node 4), node 4's 3: no such child
    assert accept_tree_greedy(tokens, parents, [2, 0, 9, 7, 3, 3]) == ([1, 2, 4], 3)
    assert accept_tree_greedy(tokens, parents, [5, 0, 0, 0, 0, 0]) == ([], 5)


# -- model tree drafts through the engine ------------------------------------------------------


@pytest.fixture(scope="module")
def references(target):
    return {tuple(p): mlxspec.Pair(target).generate(p, max_tokens=40).tokens for p in PROMPTS}


@pytest.mark.parametrize("draft_name", ["target", "unrelated", "near"])
@pytest.mark.parametrize("tree_nodes", [3, 12])
def test_greedy_identity_model_trees(request, target, references, draft_name, tree_nodes):
    pair = mlxspec.Pair(target, request.getfixturevalue(draft_name))
    session = pair.new_session()
    rounds = accepted = branched = 0
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=40, tree_nodes=tree_nodes, session=session)
        assert res.tokens == references[tuple(p)]
        s = res.stats
        assert s.accepted + s.rounds == s.generation_tokens == 40
        assert s.drafted <= s.rounds * tree_nodes
        rounds, accepted = rounds + s.rounds, accepted + s.accepted
        branched += s.drafted > sum(s.drafted_per_position)  # some rounds drafted siblings
    assert branched  # trees, not only chains
    per_round = accepted / rounds
    if draft_name == "target":  # always accepted: at least the top child, every round
        assert per_round >= 0.95
    elif draft_name == "unrelated":  # (almost) never accepted
        assert per_round < 0.3
    else:  # partly accepted
        assert 0.2 < per_round < 3


def test_tree_beats_its_own_first_branch(target, near):
    """Siblings rescue rounds whose first choice is wrong: a tree of 12 accepts more per
    pass than the chain of its depth."""
    pair = mlxspec.Pair(target, near)
    chain = np.mean([pair.generate(p, max_tokens=40, num_draft=3).stats.tokens_per_round for p in PROMPTS])
    tree = np.mean([pair.generate(p, max_tokens=40, tree_nodes=12).stats.tokens_per_round for p in PROMPTS])
    assert tree > chain


def test_session_turns_with_trees_keep_the_caches_right(target, near):
    pair = mlxspec.Pair(target, near)
    session = pair.new_session()
    p = PROMPTS[2]
    for _ in range(2):
        res = pair.generate(p, max_tokens=20, tree_nodes=6, session=session)
        assert res.tokens == mlxspec.Pair(target).generate(p, max_tokens=20).tokens
        seq = session.tokens
        lm = session.drafter.lm  # the draft's cache, after tree compaction, equals a fresh run
        feed = lm.sync(seq)
        cached = lm.forward(mx.array(feed, mx.uint32), known=feed)[-1]
        np.testing.assert_allclose(np.array(cached), np.array(near(mx.array([seq]))[0, -1]), atol=1e-4)
        p = seq + [9, 10]


def test_sampled_model_trees_follow_the_target(target, near):
    sp = SamplingParams(temperature=1.0, top_k=5)
    prompt = PROMPTS[0]
    exact = exact_marginals(target, prompt, sp, steps=3)
    pair = mlxspec.Pair(target, near)
    session = pair.new_session()
    samples, accepted = [], 0
    for s in range(400):
        res = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=5, tree_nodes=6, seed=s, session=session)
        samples.append(res.tokens)
        accepted += res.stats.accepted
    check_marginals(np.array(samples), exact)
    assert accepted > 120


class IidTreeDrafter:
    """A test drafter whose children are sampled i.i.d. from the draft model (q given): three
    at the root, two under the first. Exercises the engine's sampled-children path."""

    name = "iid"

    def __init__(self, model):
        self.model = model
        self.tree_nodes = 5

    def prefill(self, seq):
        pass

    def propose(self, seq, k, sp, key, vocab):
        k1, k2 = mx.random.split(key)
        q_root = probs(self.model(mx.array([seq]))[0, -1], sp)
        roots = mx.random.categorical(mx.log(q_root), num_samples=3, key=k1).astype(mx.uint32)
        x0 = int(roots[0].item())
        q_kid = probs(self.model(mx.array([list(seq) + [x0]]))[0, -1], sp)
        kids = mx.random.categorical(mx.log(q_kid), num_samples=2, key=k2).astype(mx.uint32)
        q = mx.stack([q_root] * 3 + [q_kid] * 2)
        return Draft(mx.concatenate([roots, kids]), q, self.name, parents=[-1, -1, -1, 0, 0])

    def commit(self, tokens):
        pass

    def commit_tree(self, path, tokens):
        pass


def test_sampled_children_through_the_engine_follow_the_target(target, near):
    sp = SamplingParams(temperature=1.0, top_k=5)
    prompt = PROMPTS[2]
    exact = exact_marginals(target, prompt, sp, steps=3)
    pair = mlxspec.Pair(target)
    session = pair.new_session(drafter="none")
    session.drafter = IidTreeDrafter(near)
    samples, accepted = [], 0
    for s in range(400):
        res = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=5, tree_nodes=5, num_draft=2,
                            seed=s, session=session)
        samples.append(res.tokens)
        accepted += res.stats.accepted
    check_marginals(np.array(samples), exact)
    assert accepted > 120
