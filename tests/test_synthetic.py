"""Synthetic models for timing (issue 13): shapes, memory refusal, the cost-model report and its JSON."""

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

import mlxspec
from mlxspec import synthetic as S
from mlxspec.bench import expected_tokens
from mlxspec.errors import ModelNotFoundError, ModelTooLargeError

SMALL = "synthetic:qwen2.5-0.5b:layers=1:vocab=512"
SMALLER = "synthetic:gemma3-270m:layers=1:vocab=256"


def test_parse_specs():
    s = S.SyntheticSpec.parse("synthetic:qwen2.5-7b:q4")
    assert s.shape == "qwen2.5-7b" and s.bits == 4 and s.config["hidden_size"] == 3584
    s = S.SyntheticSpec.parse("synthetic:llama3-8b:layers=2:vocab=1000")
    assert s.config["num_hidden_layers"] == 2 and s.config["vocab_size"] == 1000 and s.bits is None
    untied = S.SyntheticSpec.parse("synthetic:qwen2.5-0.5b:untied")
    assert untied.config["tie_word_embeddings"] is False
    assert untied.weight_bytes("float32") - S.SyntheticSpec.parse("synthetic:qwen2.5-0.5b").weight_bytes("float32") \
        == 151936 * 896 * 4
    with pytest.raises(ModelNotFoundError, match="no synthetic shape 'qwen9'.*qwen2.5-0.5b"):
        S.SyntheticSpec.parse("synthetic:qwen9")
    with pytest.raises(ModelNotFoundError, match="bad option 'q5x'"):
        S.SyntheticSpec.parse("synthetic:qwen2.5-7b:q5x")
    with pytest.raises(ModelNotFoundError, match="bad option 'layers=0'"):
        S.SyntheticSpec.parse("synthetic:qwen2.5-7b:layers=0")
    # the released sizes, from the shapes alone (nothing allocated)
    gb = {n: S.SyntheticSpec.parse(S.PREFIX + n).weight_bytes("bfloat16") / 1e9 for n in S.SHAPES}
    assert 0.95 < gb["qwen2.5-0.5b"] < 1.0 and 15.0 < gb["qwen2.5-7b"] < 15.5 and 140 < gb["llama3-70b"] < 142
    assert 1.9 < gb["gemma3-1b"] < 2.1 and 16.0 < gb["qwen3-8b"] < 16.5


@pytest.mark.parametrize("spec,dtype", [
    (SMALL, "float32"),
    (SMALL + ":q4", "bfloat16"),
    (SMALL + ":untied", "float32"),
    ("synthetic:qwen3-0.6b:layers=1:vocab=256", "bfloat16"),
    ("synthetic:llama3.2-1b:layers=1:vocab=256:q8", "float32"),
    ("synthetic:llama3.2-1b:layers=1:vocab=256", "float16"),
    (SMALLER, "float32"),
])
def test_built_models_match_their_shapes(spec, dtype):
    model = S.build(spec, dtype)
    params = tree_flatten(model.parameters())
    assert sum(v.nbytes for _, v in params) == S.SyntheticSpec.parse(spec).weight_bytes(dtype)
    floats = [v.dtype for _, v in params if v.dtype != mx.uint32]
    assert set(floats) == {mlxspec.loading.DTYPES[dtype]}
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, S.SyntheticSpec.parse(spec).config["vocab_size"])
    assert bool(mx.all(mx.isfinite(logits)).item())


def test_memory_refusal():
    with pytest.raises(ModelTooLargeError, match="llama3-70b 131.4 GiB of weights do not fit"):
        S.build("synthetic:llama3-70b", "bfloat16", budget=64 * 2**30)
    with pytest.raises(ModelTooLargeError):  # refused from the shape, before anything is allocated
        S.build(SMALL, "float32", budget=1000)
    with pytest.raises(ModelTooLargeError, match="do not fit"):
        mlxspec.load("synthetic:llama3-70b", draft="synthetic:llama3.2-1b", dtype="float32")


def test_load_a_synthetic_pair():
    pair = mlxspec.load(SMALL, draft=SMALLER.replace("vocab=256", "vocab=512"), dtype="float32")
    assert pair.tokenizer is None and pair.vocab_size == 512 and pair.target_path == SMALL
    res = pair.generate([1, 2, 3], max_tokens=8, num_draft=2)
    assert res.tokens == mlxspec.Pair(pair.target).generate([1, 2, 3], max_tokens=8).tokens
    with pytest.raises(ModelNotFoundError, match="synthetic draft"):
        mlxspec.load(SMALL, draft="some/folder")
    from mlxspec.resolve import resolve_one

    with pytest.raises(ModelNotFoundError, match="random weights and no tokenizer.*mlxspec bench"):
        resolve_one(SMALL)  # chat, generate and serve need text
    with pytest.raises(ModelNotFoundError, match="no synthetic shape"):
        resolve_one("synthetic:gpt-9")


def test_acceptance_profiles(tmp_path):
    p = S.acceptance_profile(None, 3)
    assert p["alpha"] == S.DEFAULT_ALPHA and p["survival"] == pytest.approx([0.8, 0.64, 0.512])
    assert "default" in p["source"]
    assert S.acceptance_profile("0.5", 2)["survival"] == [0.5, 0.25]
    with pytest.raises(ValueError):
        S.acceptance_profile("1.5", 2)
    report = {"models": {"target": "t", "draft": "d"}, "results": [
        {"engine": "mlxspec", "num_draft": 0},
        {"engine": "mlxspec", "num_draft": 2, "position_acceptance": [0.9, 0.8], "alpha_iid": 0.85},
        {"engine": "mlxspec", "num_draft": 3, "position_acceptance": [0.9, 0.8, 0.6], "alpha_iid": 0.8},
        {"engine": "mlx-lm", "num_draft": 4},
    ]}
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(report))
    p = S.acceptance_profile(str(f), 5)  # the longest draft's, then geometric with its rate
    assert p["survival"] == pytest.approx([0.9, 0.8, 0.6, 0.48, 0.384]) and "k=3" in p["source"]
    f.write_text("{}")
    with pytest.raises(ModelNotFoundError, match="not a number"):
        S.acceptance_profile(str(f), 2)
    with pytest.raises(ModelNotFoundError, match="not a number"):
        S.acceptance_profile(str(tmp_path / "missing.json"), 2)


@pytest.mark.parametrize("budget_mib", [None, 100])
def test_cost_report(budget_mib):
    """Both models at once when they fit together (interleaved), else one at a time."""
    budget = budget_mib * 2**20 if budget_mib else None  # 100 MiB: each fits alone, not both
    r = S.cost_report(SMALL, SMALL, "float32", (1, 3), "0.9", context=8, repeats=1, budget=budget)
    assert r["timed_together"] == (budget is None)
    c = r["costs"]
    assert len(c["v"]) == 4 and c["v"][0] == 1.0 and c["c"] == pytest.approx(c["draft_step_s"] / c["target_step_s"])
    for p in r["predictions"]:
        k = p["num_draft"]
        e = expected_tokens([0.9, 0.81, 0.729], k)
        assert p["expected_tokens_per_round"] == pytest.approx(e)
        assert p["predicted_speedup"] == pytest.approx(e / (k * c["c"] + c["v"][k]))
    text = S.format_cost_report(r)
    assert "predicted speedup" in text and "given: each draft token accepted with probability 0.9" in text


def test_bench_command_with_synthetic_models(tmp_path):
    from mlxspec.cli import cli

    out = tmp_path / "synthetic.json"
    args = ["bench", "-t", SMALL, "-d", SMALLER.replace("vocab=256", "vocab=512"), "--dtype", "float32",
            "-k", "1,2", "--context", "8", "--acceptance", "0.7", "--json", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["synthetic"] and [p["num_draft"] for p in doc["predictions"]] == [1, 2]
    assert doc["models"]["dtype"] == "float32" and doc["acceptance"]["alpha"] == 0.7
    assert "c = " in r.output and "predicted speedup" in r.output
    r = CliRunner().invoke(cli, ["bench", "-t", SMALL])
    assert r.exit_code == 2 and "needs a synthetic --draft" in r.output
    r = CliRunner().invoke(cli, ["bench", "-t", "synthetic:llama3-70b", "-d", "synthetic:llama3-8b", "--dtype", "float32"])
    assert r.exit_code == 1 and "do not fit" in r.output and "Traceback" not in r.output
