"""The suffix drafter (SuffixDecoding, issue 11): its index (matches, frequencies, eviction,
memory bound, cost on a long history) and exactness through the engine, chains and trees."""

import random
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import check_marginals, exact_marginals, perturbed, tiny_llama

import mlxspec
from mlxspec.drafters import ModelCopierDrafter, SuffixDrafter
from mlxspec.drafters.suffix_index import SEP, SuffixIndex
from mlxspec.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 40, 33, 12, 8, 8, 8, 21, 60, 3, 17]]
SP = SamplingParams()


# -- the index -------------------------------------------------------------------------------


def test_longest_match_and_frequencies():
    ix = SuffixIndex()
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17
    ix.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 9, 7, 2, 3, 4, 5, 9])
    occ = ix.occurrences([1, 2, 3])
    assert sorted(occ) == [(2, 14), (3, 2), (3, 8)]  # "1 2 3" twice; "7 2 3" matches 2 tokens
    occ = ix.occurrences([8, 2, 3])  # only "2 3" matches: three occurrences
    assert sorted(e for _, e in occ) == [2, 8, 14] and {m for m, _ in occ} == {2}
    # after "2 3": "4" three times, then "5" twice and "6" once: the chain takes the majority
    p = ix.propose([8, 2, 3], budget=8, tree=False, spec_offset=8)
    assert p.tokens[:3] == [4, 5, 9] and p.probs[:2] == [1.0, pytest.approx(2 / 3)]
    assert p.parents == list(range(-1, p.size - 1))
    # the tree takes the most probable nodes: "4 5 9" (1, 2/3, 2/3), then the sibling "6" (1/3)
    t = ix.propose([8, 2, 3], budget=4, tree=True, spec_offset=8)
    assert t.tokens == [4, 5, 9, 6] and t.parents == [-1, 0, 1, 0]
    assert t.score == pytest.approx(1 + 2 / 3 + 2 / 3 + 1 / 3)


def test_speculation_grows_with_the_match_and_low_probabilities_are_cut():
    ix = SuffixIndex()
    ix.extend(list(range(10, 40)) + [0] + list(range(10, 40)))
    short = ix.propose([99, 10], budget=16, tree=False)  # a 1-token match: floor(1 * 1.0) = 1 token
    long = ix.propose(list(range(10, 16)), budget=16, tree=False)  # 6 tokens: 6 proposed
    assert short.size == 1 and long.size == 6 and long.tokens == list(range(16, 22))
    ix2 = SuffixIndex()
    ix2.extend([1, 2] + [1, 3] * 1 + [1, 4] * 1 + [1, 5] * 1 + [1, 6] + [1, 7] + [1, 8] + [1, 9] + [1, 10] + [1, 11] + [1, 12])
    assert ix2.propose([1], budget=4, tree=True, spec_offset=4, min_prob=0.2) is None  # every branch < 0.2


def test_documents_do_not_leak_into_each_other():
    ix = SuffixIndex()
    ix.extend([SEP, 1, 2, 3, SEP, 1, 2, 9])
    p = ix.propose([5, 1, 2], budget=4, tree=True, spec_offset=4)
    assert SEP not in p.tokens and set(p.tokens) <= {3, 9}


def test_history_is_bounded_and_evicts_the_oldest_first():
    d = SuffixDrafter(max_cached_tokens=1000)
    first_output = None
    for g in range(60):  # 60 unrelated generations of 100 output tokens each
        prompt = [1000 + g, 1, 2]
        out = [2000 + g * 100 + i for i in range(100)]
        first_output = first_output or out
        d.prefill(prompt)
        d.propose(prompt + out, 4, SP, None, 10_000)  # the engine hands it the growing sequence
    d.prefill([7, 7])  # a new request: the last generation's output goes to the history
    assert d.cached_tokens <= 1000
    posting = sum(len(v) for post in d.history._post.values() for v in post.values())
    assert posting <= 3 * 1000  # the index is bounded with the text
    last = 2000 + 59 * 100  # the last output's first token
    recent = d.history.propose([last + 10], budget=3, tree=False, spec_offset=3)
    assert recent is not None and recent.tokens == [last + 11, last + 12, last + 13]
    assert d.history.propose([first_output[10]], budget=3, tree=False, spec_offset=3) is None


def test_a_chat_turn_extends_the_index_and_earlier_outputs_are_searched():
    d = SuffixDrafter(spec_factor=1.0, spec_offset=0.0)  # vLLM's rule: an m-token match proposes m
    d.prefill([5, 6, 7])
    d.propose([5, 6, 7, 20, 21, 22, 23, 24], 4, SP, None, 100)
    d.prefill([5, 6, 7, 20, 21, 22, 23, 24, 8, 9])  # the next turn: no new document
    assert d.cached_tokens == 0 and len(d.local) == 10
    d.prefill([1, 2, 20, 21])  # another request: the old output is remembered
    assert d.cached_tokens > 0
    draft = d.propose([1, 2, 20, 21], 3, SP, None, 100)
    assert draft.tokens.tolist() == [22, 23]  # a 2-token match proposes 2 (from the history)


def test_proposing_on_a_50k_history_is_cheap():
    random.seed(0)
    chunks = [[random.randrange(5000) for _ in range(random.randrange(5, 60))] for _ in range(300)]
    hist: list[int] = []
    while len(hist) < 50_000:
        hist += random.choice(chunks) if random.random() < 0.5 else [random.randrange(5000) for _ in range(20)]
    d = SuffixDrafter()
    d.prefill(hist)
    seq = list(hist)
    for tree_nodes in (0, 16):
        d.tree_nodes = tree_nodes
        t0 = time.perf_counter()
        for i in range(100):
            seq.append(hist[(i * 37) % len(hist)])
            d.match_length(seq)
            p = d._proposal(seq, 16)
            assert len(d.local.occurrences(seq)) <= d.local.max_occurrences  # the bound on a query's work
        per_round = (time.perf_counter() - t0) / 100
        assert per_round < 0.05, f"{per_round * 1e3:.1f} ms per round"  # typically ~0.2 ms
    assert p is not None


# -- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def copier():
    m = tiny_llama(1)
    for layer in m.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.02
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def copier_draft(copier):
    return perturbed(copier, seed=5, noise=0.3)


def alone(model, prompt, n=40):
    return mlxspec.Pair(model).generate(prompt, max_tokens=n).tokens


@pytest.mark.parametrize("drafter, opts", [
    ("suffix", dict(adaptive=True)),
    ("suffix", dict(tree_nodes=8)),
    ("model+suffix", dict(tree_nodes=8)),
])
def test_greedy_identity_suffix(copier, copier_draft, drafter, opts):
    pair = mlxspec.Pair(copier, copier_draft)
    session = pair.new_session(drafter=drafter)
    by_source, drafted, accepted, branched = {}, 0, 0, 0
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=50, drafter=drafter, session=session, **opts)
        assert res.tokens == alone(copier, p, 50)
        branched += res.stats.drafted > sum(res.stats.drafted_per_position)
        for k, v in res.stats.tokens_by_source.items():
            by_source[k] = by_source.get(k, 0) + v
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    assert by_source.get("suffix", 0) > 10 and 0 < accepted < drafted
    assert bool(branched) == ("tree_nodes" in opts)
    if drafter == "model+suffix":
        assert by_source.get("model", 0) > 0


def test_greedy_identity_suffix_on_a_target_that_does_not_copy(target):
    pair = mlxspec.Pair(target)
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=30, drafter="suffix", tree_nodes=6)
        assert res.tokens == alone(target, p, 30)


def test_sampled_suffix_trees_follow_the_target(copier):
    sp = SamplingParams(temperature=1.0, top_k=5)
    a = alone(copier, [3, 4, 5], 6)
    # "3 4 5" seen twice, followed by two different runs: the tree branches at its first token
    prompt = [3, 4, 5] + a + [3, 4, 5] + a[::-1] + [3, 4, 5]
    exact = exact_marginals(copier, prompt, sp, steps=3)
    pair = mlxspec.Pair(copier)
    session = pair.new_session(drafter="suffix")
    samples, accepted, drafted, branched = [], 0, 0, 0
    for s in range(400):
        res = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=5, tree_nodes=6, seed=s,
                            session=session, drafter="suffix")
        samples.append(res.tokens)
        accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
        branched += res.stats.drafted > sum(res.stats.drafted_per_position)  # a round drafted siblings
    check_marginals(np.array(samples), exact)
    assert 0 < accepted < drafted and branched > 100


def test_model_plus_suffix_is_the_combined_class(copier, copier_draft):
    d = mlxspec.Pair(copier, copier_draft).make_drafter(drafter="model+suffix")
    assert isinstance(d, ModelCopierDrafter) and d.name == "model+suffix"
    assert d.next_source([1, 2, 3]) == "model"


@pytest.mark.parametrize("extra", [
    ["--drafter", "suffix", "--tree-nodes", "6"],
    ["--drafter", "model+suffix", "--tree-nodes", "6"],
    ["--drafter", "model", "--tree-nodes", "6"],
])
def test_cli_trees_and_suffix_keep_the_text(tiny_pair_dir, extra):
    import json

    from click.testing import CliRunner

    from mlxspec.cli import cli

    base = ["generate", "-t", str(tiny_pair_dir), "--prompt", "w10 w11 w12 w13 w10 w11 w12 w13 w10 w11",
            "-n", "24", "--json"]
    r0 = CliRunner().invoke(cli, base + ["--no-draft"])
    r = CliRunner().invoke(cli, base + extra)
    assert r0.exit_code == 0 and r.exit_code == 0, r.output
    doc, ref = json.loads(r.stdout), json.loads(r0.stdout)
    assert doc["tokens"] == ref["tokens"] and doc["drafter"] == extra[1] and doc["stats"]["drafted"] > 0
    bad = CliRunner().invoke(cli, base + ["--tree-nodes", "-1"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output


def test_piped_chat_with_suffix_trees_matches_the_target(tiny_pair_dir):
    from click.testing import CliRunner

    from mlxspec.cli import cli

    lines = "w10 w11 w12 w10 w11\nw12 w10 w11 w12\n"
    args = ["chat", "-t", str(tiny_pair_dir), "-n", "12"]
    r0 = CliRunner().invoke(cli, args + ["--no-draft"], input=lines)
    r = CliRunner().invoke(cli, args + ["--drafter", "model+suffix", "--tree-nodes", "5"], input=lines)
    assert r0.exit_code == 0 and r.exit_code == 0, r.output
    assert r.stdout == r0.stdout and len(r.stdout.strip().splitlines()) == 2
