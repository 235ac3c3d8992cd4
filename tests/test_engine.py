"""The engine end to end on tiny random models: exactness, rewind, stats, bad input."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import check_marginals, exact_marginals, tiny_llama
from mlx_lm.models.cache import ArraysCache

import mlxspec
from mlxspec.drafters import CachedLM
from mlxspec.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 40, 33, 12, 8, 8, 8, 21, 60, 3, 17]]


def reference_greedy(model, prompt, n):
    """Greedy decoding the slow, obvious way: a full forward over the whole sequence each step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def references(target):
    return {tuple(p): reference_greedy(target, p, 40) for p in PROMPTS}


def test_target_alone_equals_reference(target, references):
    pair = mlxspec.Pair(target)
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=40)
        assert res.tokens == references[tuple(p)]
        assert res.stats.rounds == 40 and res.stats.drafted == 0
        assert not any(res.from_draft)


@pytest.mark.parametrize("draft_name, lo, hi", [
    ("target", 1.0, 1.0),      # always accepted
    ("unrelated", 0.0, 0.15),  # (almost) never accepted
    ("near", 0.1, 0.95),       # partly accepted
])
@pytest.mark.parametrize("num_draft", [1, 3, 6])
def test_greedy_is_token_identical(request, target, references, draft_name, lo, hi, num_draft):
    draft = request.getfixturevalue(draft_name)
    pair = mlxspec.Pair(target, draft)
    rates = []
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=40, num_draft=num_draft)
        assert res.tokens == references[tuple(p)]
        assert len(res.from_draft) == 40
        rates.append(res.stats.acceptance_rate)
    assert lo <= float(np.mean(rates)) <= hi


def test_near_draft_exercises_both_paths(target, near):
    res = mlxspec.Pair(target, near).generate(PROMPTS[0], max_tokens=60, num_draft=4)
    s = res.stats
    assert 0 < s.accepted < s.drafted
    assert any(res.from_draft) and not all(res.from_draft)


def test_stats_add_up(target, near):
    res = mlxspec.Pair(target, near).generate(PROMPTS[2], max_tokens=50, num_draft=3)
    s = res.stats
    assert s.generation_tokens == len(res.tokens) == 50
    assert s.accepted + s.rounds == s.generation_tokens  # each round: n accepted + 1 from the target
    assert sum(s.tokens_by_source.values()) == 50
    assert s.tokens_by_source.get("model", 0) == sum(res.from_draft) == s.accepted
    assert s.drafted == sum(s.drafted_per_position)
    assert s.accepted == sum(s.accepted_per_position)
    assert all(a <= d for a, d in zip(s.accepted_per_position, s.drafted_per_position))
    assert s.accepted_per_position == sorted(s.accepted_per_position, reverse=True)
    assert s.tokens_per_round == pytest.approx(50 / s.rounds)
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert s.finish_reason == "length" and s.prefill_tokens == len(PROMPTS[2]) - 1
    assert s.decode_time > 0 and s.tokens_per_second > 0


def test_profile_splits_draft_and_verify_time(target, near):
    res = mlxspec.Pair(target, near).generate(PROMPTS[0], max_tokens=10, profile=True)
    assert res.stats.draft_time > 0 and res.stats.verify_time > 0
    assert mlxspec.Pair(target, near).generate(PROMPTS[0], max_tokens=10).stats.draft_time is None


def test_seeded_runs_are_reproducible(target, near):
    pair = mlxspec.Pair(target, near)
    runs = [pair.generate(PROMPTS[0], max_tokens=30, temperature=1.0, seed=s).tokens for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stops_at_end_of_sequence(target, near, references):
    ref = references[tuple(PROMPTS[0])]
    eos = ref[7]
    stop = ref.index(eos)
    pair = mlxspec.Pair(target, near)
    pair.eos_token_ids = {eos}
    session = pair.new_session()
    res = pair.generate(PROMPTS[0], max_tokens=40, num_draft=4, session=session)
    assert res.tokens == ref[:stop]
    assert res.stats.finish_reason == "stop"
    assert session.tokens == PROMPTS[0] + ref[: stop + 1]  # the stop token stays in the sequence


def test_session_reuses_the_cache(target, near):
    pair = mlxspec.Pair(target, near)
    session = pair.new_session()
    first = pair.generate(PROMPTS[2], max_tokens=12, session=session)
    follow = PROMPTS[2] + first.tokens + [5, 6, 7]
    again = pair.generate(follow, max_tokens=20, session=session)
    assert again.stats.prefill_tokens == 3  # only the new tokens were computed
    fresh = pair.generate(follow, max_tokens=20)
    assert again.tokens == fresh.tokens
    # a diverging prompt rewinds to the common prefix
    other = pair.generate(PROMPTS[2][:4] + [50, 51], max_tokens=20, session=session)
    assert other.tokens == pair.generate(PROMPTS[2][:4] + [50, 51], max_tokens=20).tokens
    assert other.stats.prefill_tokens == 1


def test_logits_after_rewind_equal_fresh_recompute(target):
    lm = CachedLM(target, "target")
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    lm.forward(mx.array(seq, mx.uint32), known=seq)
    lm.forward(mx.array([8, 9, 7, 9], mx.uint32), known=[8, 9, 7, 9])
    lm.rewind(len(seq) + 1)  # keep 8, drop 9 7 9
    after = lm.forward(mx.array([2, 3], mx.uint32), known=[2, 3])
    fresh = target(mx.array([seq + [8, 2, 3]]))[0, -2:]
    assert lm.tokens == seq + [8, 2, 3]
    np.testing.assert_allclose(np.array(after), np.array(fresh), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_draft", [2])
def test_sampled_output_follows_target_distribution(target, near, num_draft):
    sp = SamplingParams(temperature=1.0, top_k=6)
    prompt = [1, 2, 3]
    exact = exact_marginals(target, prompt, sp, steps=3)
    pair = mlxspec.Pair(target, near)
    session = pair.new_session()
    n = 1500
    samples = np.array([
        pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=6, num_draft=num_draft,
                      seed=s, session=session).tokens
        for s in range(n)
    ])
    check_marginals(samples, exact)


def test_padded_draft_vocabulary_is_fine(target, references):
    padded = tiny_llama(7, vocab=80)
    res = mlxspec.Pair(target, padded).generate(PROMPTS[0], max_tokens=40, num_draft=3)
    assert res.tokens == references[tuple(PROMPTS[0])]
    res = mlxspec.Pair(target, padded).generate(PROMPTS[0], max_tokens=20, num_draft=3, temperature=1.0, seed=0)
    assert all(t < 64 for t in res.tokens)


# -- bad input -----------------------------------------------------------------------------

def test_bad_arguments(target, near):
    pair = mlxspec.Pair(target, near)
    with pytest.raises(ValueError, match="empty"):
        pair.generate([], max_tokens=5)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_tokens"):
            pair.generate([1, 2], max_tokens=bad)
    with pytest.raises(ValueError, match="temperature"):
        pair.generate([1, 2], temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        pair.generate([1, 2], top_p=0)
    with pytest.raises(ValueError, match="tokenizer"):
        pair.generate("text without a tokenizer")


def test_missing_path():
    with pytest.raises(mlxspec.ModelNotFoundError, match="no such model folder"):
        mlxspec.load("/no/such/folder")
    with pytest.raises(mlxspec.ModelNotFoundError, match="no such model folder"):
        mlxspec.load("./relative/missing")


def test_mismatched_vocabularies(tiny_pair_dir, mismatched_draft_dir):
    with pytest.raises(mlxspec.PairMismatchError, match="vocabularies differ.*zzz"):
        mlxspec.load(tiny_pair_dir / "target", draft=mismatched_draft_dir)


def test_load_pair_folder_and_text_prompts(tiny_pair_dir):
    pair = mlxspec.load(tiny_pair_dir)
    assert pair.draft is not None
    res = pair.generate("w6 w7 w8", max_tokens=8)
    alone = mlxspec.load(tiny_pair_dir / "target").generate("w6 w7 w8", max_tokens=8)
    assert res.tokens == alone.tokens and res.text == alone.text
    assert res.text.split()[0].startswith("w") or res.stats.finish_reason == "stop"
    chat = pair.generate([{"role": "user", "content": "w9 w10"}], max_tokens=8)
    assert chat.stats.prompt_tokens == len(pair.encode("<|user|> w9 w10 </s> <|assistant|>"))
    chunks = list(pair.stream("w6 w7 w8", max_tokens=8))
    assert "".join(c.text for c in chunks) == res.text
    assert [t for c in chunks for t in c.tokens] == res.tokens
    assert chunks[-1].finish_reason in ("stop", "length")


def test_uncached_model_is_refused(target):
    class Recurrent:
        model_type = "recurrent-test"

        def make_cache(self):
            return [ArraysCache(2)]

    with pytest.raises(mlxspec.UnsupportedModelError, match="recurrent-test.*ArraysCache"):
        CachedLM(Recurrent(), "draft")
