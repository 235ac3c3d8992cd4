"""Cheaper draft steps (issue 13): a reduced draft vocabulary keeps decoding exact.

The kept sets are small enough (24-32 of 64 tokens) that the target's own tokens are often
outside them: those can only come from the target's correction after a rejection.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import check_marginals, exact_marginals, tiny_llama
from mlx_lm.models import llama

import mlxspec
from mlxspec.drafters import ModelDrafter
from mlxspec.drafters.model import ReducedHead, draft_vocab_ids, draft_vocab_from_text
from mlxspec.errors import UnsupportedModelError
from mlxspec.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 40, 33, 12, 8, 8, 8, 21, 60, 3, 17]]
SCATTERED = sorted(np.random.default_rng(0).choice(64, size=32, replace=False).tolist())  # not a prefix


def alone(model, prompt, n=40):
    return mlxspec.Pair(model).generate(prompt, max_tokens=n).tokens


def _session(pair, ids, **opts):
    session = pair.new_session(**opts)
    session.drafter = ModelDrafter(pair.draft, vocab_ids=ids)
    return session


def test_draft_vocab_ids():
    assert draft_vocab_ids(5, 100) == [0, 1, 2, 3, 4]
    assert draft_vocab_ids(5, 100, keep={98, 99}) == [0, 1, 2, 98, 99]  # end-of-generation ids kept
    assert draft_vocab_ids(500, 100) == list(range(100))
    with pytest.raises(ValueError):
        draft_vocab_ids(0, 100)


def test_draft_vocab_from_text(tiny_pair_dir):
    from mlx_lm.utils import load

    _, tok = load(str(tiny_pair_dir / "target"))
    ids = draft_vocab_from_text(tok, ["w40 w41 w40", "w40 w50"], 4, keep=[2])
    vocab = tok.get_vocab()
    assert ids == sorted({2, vocab["w40"], vocab["w41"], vocab["w50"]})
    assert draft_vocab_from_text(tok, ["w40"], 3) == sorted({vocab["w40"], 0, 1})  # topped up by id order


@pytest.mark.parametrize("ids", [list(range(24)), SCATTERED], ids=["prefix", "scattered"])
@pytest.mark.parametrize("draft_name", ["target", "near", "unrelated"])
def test_greedy_identity_reduced_vocabulary(request, target, draft_name, ids):
    """Drafts always (target as its own draft, where its argmax is kept), partly and never
    accepted; the output is the target's, including tokens the draft cannot propose."""
    pair = mlxspec.Pair(target, request.getfixturevalue(draft_name))
    drafted = accepted = outside = 0
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=40, num_draft=4, session=_session(pair, ids))
        assert res.tokens == alone(target, p)
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
        outside += sum(t not in ids for t in res.tokens)
    assert outside > 0  # the target emitted tokens outside the draft's vocabulary
    if draft_name == "target":
        assert accepted > 0.2 * drafted
    if draft_name == "near":
        assert 0 < accepted < drafted


def test_greedy_identity_through_the_option(target, near):
    pair = mlxspec.Pair(target, near)
    d = pair.make_drafter(draft_vocab=20)
    assert d.head.ids == list(range(20)) and d.costs["model"] < pair.make_drafter().costs["model"]
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=40, num_draft=3, draft_vocab=20, adaptive=True)
        assert res.tokens == alone(target, p)
    with pytest.raises(ValueError, match="draft_vocab must be >= 0"):
        pair.generate([1], max_tokens=2, draft_vocab=-1)


def test_sampled_output_follows_target_with_reduced_vocabulary(target, near):
    ids = sorted(set(range(12)) | set(SCATTERED[::2]))  # a run 0..11 (a view) and others (gathered)
    sp = SamplingParams(temperature=1.0, top_k=6)
    prompt = [9, 40, 33]
    exact = exact_marginals(target, prompt, sp, steps=3)
    support = set().union(*(np.nonzero(e > 0)[0].tolist() for e in exact))
    assert support - set(ids) and support & set(ids)  # the target's tokens are partly outside
    pair = mlxspec.Pair(target, near)
    session = _session(pair, ids)
    n, samples, drafted, accepted = 1000, [], 0, 0
    for s in range(n):
        res = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=6, num_draft=3, seed=s, session=session)
        samples.append(res.tokens)
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    check_marginals(np.array(samples), exact)
    assert 0 < accepted < drafted


def test_draft_q_is_zero_outside_the_kept_ids(target, near):
    pair = mlxspec.Pair(target, near)
    d = ModelDrafter(near, vocab_ids=SCATTERED)
    d.prefill([1, 2, 3])
    draft = d.propose([1, 2, 3], 4, SamplingParams(temperature=0.8, top_p=0.9), mx.random.key(0), pair.vocab_size)
    q = np.array(draft.q)
    assert q.shape == (4, 64)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    outside = np.setdiff1d(np.arange(64), SCATTERED)
    assert np.all(q[:, outside] == 0)
    toks = np.array(draft.tokens).tolist()
    assert all(t in SCATTERED for t in toks) and all(q[i, t] > 0 for i, t in enumerate(toks))


@pytest.mark.parametrize("quantized", [False, True])
def test_reduced_head_equals_the_models_logits(quantized):
    draft = tiny_llama(4)
    if quantized:
        nn.quantize(draft, group_size=32, bits=8)
    x = mx.array([[5, 6, 7, 8]])
    full = np.array(draft(x)[0])
    for ids in (list(range(20)), [3, 9, 40, 63], list(range(10)) + [30, 50], SCATTERED):
        head = ReducedHead(draft, ids)  # also checked against the model's own logits on construction
        np.testing.assert_allclose(np.array(head(head.inner(x)[0])), full[:, ids], rtol=1e-5, atol=1e-5)


def test_quantized_draft_head(target):
    draft = tiny_llama(4)
    nn.quantize(draft, group_size=32, bits=8)
    pair = mlxspec.Pair(target, draft)
    for p in PROMPTS[:2]:
        res = pair.generate(p, max_tokens=24, num_draft=3, session=_session(pair, SCATTERED))
        assert res.tokens == alone(target, p, 24)


class _ScaledLogits(llama.Model):
    """Logits that are not the output layer of the final hidden states."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return 2.0 * super().__call__(inputs, cache, input_embeddings)


def test_unsupported_model_is_refused(target):
    m = tiny_llama(5)
    odd = _ScaledLogits(m.args)
    odd.update(m.parameters())
    with pytest.raises(UnsupportedModelError, match="draft_vocab is not supported"):
        ModelDrafter(odd, vocab_ids=list(range(10)))
    with pytest.raises(ValueError, match="past the draft"):
        ModelDrafter(m, vocab_ids=[1, 64])


def test_cli_draft_vocab_keeps_the_text(tiny_pair_dir):
    import json

    from click.testing import CliRunner

    from mlxspec.cli import cli

    base = ["generate", "-t", str(tiny_pair_dir), "--prompt", "w10 w11 w12 w13", "-n", "20", "--json"]
    runs = [CliRunner().invoke(cli, base + extra) for extra in (["--no-draft"], ["--draft-vocab", "24"])]
    assert all(r.exit_code == 0 for r in runs), runs[1].output
    ref, doc = (json.loads(r.stdout) for r in runs)
    assert doc["tokens"] == ref["tokens"] and doc["stats"]["drafted"] > 0
    r = CliRunner().invoke(cli, base + ["--draft-vocab", "-3"])
    assert r.exit_code == 2


def test_bench_times_the_reduced_draft_head(target, near, monkeypatch):
    from mlxspec.bench import measure_costs

    calls = []
    plain = ReducedHead.__call__
    monkeypatch.setattr(ReducedHead, "__call__", lambda self, h: calls.append(h.shape) or plain(self, h))
    pair = mlxspec.Pair(target, near)
    measure_costs(pair, [1, 2, 3, 4], 3, repeats=1)
    assert calls == []
    reduced = measure_costs(pair, [1, 2, 3, 4], 3, repeats=1, draft_vocab=16)
    assert len(reduced.v) == 3 and reduced.draft_step > 0
    assert calls.count((1, 32)) == 2  # the timed draft steps (warm-up + 1 repeat) ran the 16-id head
