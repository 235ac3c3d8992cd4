"""`mlxspec bench`: its arithmetic on known numbers, the prompt suite, and the command end to end
on the tiny pair."""

import json

import pytest
from click.testing import CliRunner

from mlxspec import bench
from mlxspec.bench import (
    BenchConfig,
    Costs,
    Run,
    conditional_acceptance,
    expected_tokens,
    expected_tokens_iid,
    iid_alpha,
    load_prompts,
    median,
    predicted_speedup,
    quantile,
    recommend,
    round_cost,
    summarize,
    summarize_runs,
    survival,
)
from mlxspec.cli import cli

# -- arithmetic ---------------------------------------------------------------------------------


def test_median_and_quantiles():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert quantile([1, 2, 3, 4, 5], 0.25) == 2
    assert quantile([10, 20], 0.75) == 17.5
    s = summarize([5.0, 1.0, 3.0, 2.0])
    assert s == {"median": 2.5, "q1": 1.75, "q3": 3.5, "min": 1.0, "max": 5.0, "n": 4}
    with pytest.raises(ValueError):
        median([])


def test_expected_tokens_iid():
    assert expected_tokens_iid(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_iid(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))
    assert expected_tokens_iid(1.0, 3) == 4.0
    assert expected_tokens_iid(0.0, 5) == 1.0


def test_acceptance_from_position_counts():
    # 10 rounds of k=3: position 1 accepted 8 times, position 2 six times, position 3 three times
    acc, dr = [8, 6, 3], [10, 10, 10]
    assert survival(acc, dr) == [0.8, 0.6, 0.3]
    assert conditional_acceptance(acc, dr) == pytest.approx([0.8, 0.75, 0.5])
    # judged draft tokens: 10 at position 1, 8 at position 2, 6 at position 3
    assert iid_alpha(acc, dr) == pytest.approx(17 / 24)
    assert expected_tokens(survival(acc, dr), 3) == pytest.approx(2.7)
    assert expected_tokens(survival(acc, dr), 2) == pytest.approx(2.4)


def test_predicted_speedup():
    v = [1.0, 1.1, 1.2, 1.4]
    assert round_cost(0, 0.25, v) == 1.0
    assert round_cost(2, 0.25, v) == pytest.approx(0.5 + 1.2)
    assert predicted_speedup(2.4, 2, 0.25, v) == pytest.approx(2.4 / 1.7)
    # all accepted, free drafting and verification: k + 1 tokens for the price of one
    assert predicted_speedup(expected_tokens_iid(1.0, 3), 3, 0.0, [1.0] * 4) == 4.0
    with pytest.raises(ValueError):
        round_cost(4, 0.25, v)  # v covers up to 4 tokens, k + 1 = 5


def test_recommend():
    r = recommend({1: 1.2, 2: 1.4, 3: 1.3}, {1: 1.3, 2: 1.5, 3: 1.45})
    assert r["num_draft"] == 2 and r["speedup"] == 1.4
    assert "draft length of 2" in r["text"] and "1.50x" in r["text"]
    assert recommend({1: 1.1, 3: 1.1})["num_draft"] == 1  # a tie goes to the shorter draft
    r = recommend({1: 0.9, 2: 0.95, 4: 1.0}, {1: 0.8, 2: 1.2, 4: 0.7})
    assert r["num_draft"] is None
    assert r["text"].startswith("speculation does not pay here") and "1.20x, at k=2" in r["text"]


def _run(engine, k, prompt, repeat, tokens, decode, rounds=None, acc=(), dr=()):
    return Run(engine=engine, num_draft=k, prompt_id=prompt, kind="code", repeat=repeat, seed=0,
               prompt_tokens=10, tokens=tokens, prefill_time=0.5, decode_time=decode, ttft=0.5 + decode / tokens,
               rounds=rounds if rounds is not None else tokens, drafted=sum(dr), accepted=sum(acc),
               accepted_per_position=list(acc), drafted_per_position=list(dr), peak_memory=1000 * (k + 1))


def test_summarize_runs_on_known_numbers():
    costs = Costs(context_tokens=10, target_step=0.1, draft_step=0.02, verify=[0.1, 0.11, 0.12])
    assert costs.c == pytest.approx(0.2) and costs.v == pytest.approx([1.0, 1.1, 1.2])
    runs = [
        # repeat 0: target alone 20 tokens in 2 s + 20 in 2 s -> 10 tok/s; k=2: 40 in 2.5 s -> 16 tok/s
        _run("mlxspec", 0, "a", 0, 20, 2.0), _run("mlxspec", 0, "b", 0, 20, 2.0),
        _run("mlxspec", 2, "a", 0, 20, 1.0, rounds=8, acc=[6, 4], dr=[8, 8]),
        _run("mlxspec", 2, "b", 0, 20, 1.5, rounds=10, acc=[6, 4], dr=[10, 10]),
        # repeat 1: target alone 8 tok/s; k=2: 16 tok/s
        _run("mlxspec", 0, "a", 1, 20, 2.5), _run("mlxspec", 0, "b", 1, 20, 2.5),
        _run("mlxspec", 2, "a", 1, 20, 1.25, rounds=8, acc=[6, 4], dr=[8, 8]),
        _run("mlxspec", 2, "b", 1, 20, 1.25, rounds=10, acc=[6, 4], dr=[10, 10]),
    ]
    rep = summarize_runs(runs, costs, BenchConfig(draft_lengths=(2,), repeats=2))
    base, spec = rep["results"]
    assert base["num_draft"] == 0 and base["speedup"]["median"] == 1.0
    assert spec["tokens_per_second"]["min"] == pytest.approx(16.0)
    assert spec["speedup"]["min"] == pytest.approx(1.6) and spec["speedup"]["max"] == pytest.approx(2.0)
    assert spec["speedup"]["median"] == pytest.approx(1.8)
    # per prompt: a 2.0 and b 1.333 in repeat 0, 2.0 and 2.0 in repeat 1
    assert spec["per_prompt_speedup"]["median"] == pytest.approx(2.0)
    assert spec["per_prompt_speedup"]["min"] == pytest.approx(20 / 1.5 / 10)
    # pooled acceptance: position 1 accepted 24 of 36 times, position 2 16 of 36
    assert spec["acceptance_rate"] == pytest.approx(40 / 72)
    assert spec["position_acceptance"] == pytest.approx([24 / 36, 16 / 36])
    assert spec["tokens_per_pass"] == pytest.approx(1 + 40 / 36)
    assert base["tokens_per_pass"] == 1.0
    e = 1 + 24 / 36 + 16 / 36
    assert spec["expected_tokens_per_round"] == pytest.approx(e)
    assert spec["round_cost"] == pytest.approx(2 * 0.2 + 1.2)
    assert spec["predicted_speedup"] == pytest.approx(e / 1.6)
    assert spec["predicted_speedup_from_tokens_per_pass"] == pytest.approx((1 + 40 / 36) / 1.6)
    assert spec["peak_memory_bytes"] == 3000
    assert rep["recommendation"]["num_draft"] == 2


# -- the prompt suite -----------------------------------------------------------------------------


def test_builtin_suite():
    prompts = load_prompts()
    assert len(prompts) >= 12
    kinds = {p.kind for p in prompts}
    assert kinds == set(bench.KINDS)
    assert all(sum(p.kind == k for p in prompts) >= 3 for k in kinds)
    assert len({p.id for p in prompts}) == len(prompts)
    assert [p.kind for p in load_prompts(kinds=["edit"], per_kind=2)] == ["edit", "edit"]
    two = load_prompts(kinds=["code", "edit"], per_kind=2)
    assert sorted(p.kind for p in two) == ["code", "code", "edit", "edit"]


def test_prompt_file_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(bench.PromptFileError, match="no prompts"):
        load_prompts(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "one"}\n\n{"prompt": "two",\n')
    with pytest.raises(bench.PromptFileError, match=r"bad.jsonl, line 3: not valid JSON"):
        load_prompts(bad)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"prompt": "one"}\n{"text": "two"}\n')
    with pytest.raises(bench.PromptFileError, match=r"line 2: give exactly one of"):
        load_prompts(nofield)
    with pytest.raises(bench.PromptFileError, match="no prompt .* has a kind"):
        load_prompts(_write(tmp_path / "ok.jsonl", [{"prompt": "x", "kind": "code"}]), kinds=["chat"])
    with pytest.raises(bench.PromptFileError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- end to end on the tiny pair ------------------------------------------------------------------

# raw word prompts on which the tiny target writes past 16 tokens without its stop token
TINY_SUITE = [
    {"id": "t1", "kind": "code", "prompt": "w15 w6", "raw": True},
    {"id": "t2", "kind": "chat", "prompt": "w60 w48", "raw": True},
    {"id": "t3", "kind": "chat", "messages": [{"role": "user", "content": "w60 w31"}]},
]


def test_bench_end_to_end(tiny_pair_dir, tmp_path):
    suite = _write(tmp_path / "suite.jsonl", TINY_SUITE)
    out, png, md = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "bench.md"
    res = CliRunner().invoke(cli, [
        "bench", "--target", str(tiny_pair_dir), "-k", "1,3", "-m", "16", "-r", "2",
        "--prompts", str(suite), "--compare-mlx-lm", "--json", str(out), "--plot", str(png),
        "--markdown", str(md), "-q",
    ])
    assert res.exit_code == 0, res.output
    assert "recommendation:" in res.output and "predicted" in res.output

    rep = json.loads(out.read_text())
    m = rep["machine"]
    for key in ("os", "mlx_version", "mlx_device", "cpu_count"):
        assert m[key]
    assert rep["settings"]["draft_lengths"] == [1, 3] and rep["settings"]["prompt_file"] == str(suite)
    assert [p["id"] for p in rep["prompts"]] == ["t1", "t2", "t3"]
    c = rep["costs"]
    assert len(c["v"]) == 4 and c["v"][0] == 1.0 and c["c"] > 0 and c["target_step_s"] > 0
    # every setting ran every prompt in every repeat
    assert len(rep["runs"]) == 2 * 3 * 6
    assert {(r["engine"], r["num_draft"]) for r in rep["runs"]} == {
        (e, k) for e in ("mlxspec", "mlx-lm") for k in (0, 1, 3)}

    res_by = {(e["engine"], e["num_draft"]): e for e in rep["results"]}
    for k in (1, 3):
        e = res_by[("mlxspec", k)]
        runs = [r for r in rep["runs"] if r["engine"] == "mlxspec" and r["num_draft"] == k]
        assert e["identical_to_target"] == 1.0  # greedy speculation reproduces the target alone
        assert res_by[("mlx-lm", k)]["identical_to_target"] == 1.0
        assert len(e["position_acceptance"]) == k
        assert e["acceptance_rate"] == pytest.approx(sum(r["accepted"] for r in runs) / sum(r["drafted"] for r in runs))
        assert 1.0 <= e["tokens_per_pass"] <= k + 1
        assert e["predicted_speedup"] == pytest.approx(
            e["expected_tokens_per_round"] / (k * c["c"] + c["v"][k]))
        # the suite speedup of repeat 0, recomputed from the raw runs
        base = [r for r in rep["runs"] if r["engine"] == "mlxspec" and r["num_draft"] == 0 and r["repeat"] == 0]
        spec = [r for r in runs if r["repeat"] == 0]
        ratio = (sum(r["tokens"] for r in spec) / sum(r["decode_time"] for r in spec)) / (
            sum(r["tokens"] for r in base) / sum(r["decode_time"] for r in base))
        assert e["speedup"]["min"] - 1e-9 <= ratio <= e["speedup"]["max"] + 1e-9
        for r in runs:
            assert r["tokens"] == 16 and r["ttft"] >= r["prefill_time"] > 0 and r["peak_memory"] > 0
        assert "speedup_vs_mlxspec_target" in res_by[("mlx-lm", k)]
    assert res_by[("mlxspec", 0)]["speedup"]["median"] == 1.0
    rec = rep["recommendation"]
    assert rec["num_draft"] in (None, 1, 3) and rec["text"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    table = md.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3  # header, target alone, k=1, k=3
    k1 = res_by[("mlxspec", 1)]
    assert rows[2].startswith(f"| 1 | {k1['tokens_per_second']['median']:.2f} | {k1['speedup']['median']:.2f}x")
    assert "Recommendation: " in table


def test_bench_sampled_runs_each_seed(tiny_pair_dir, tmp_path):
    suite = _write(tmp_path / "suite.jsonl", TINY_SUITE[:1])
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(cli, [
        "bench", "-t", str(tiny_pair_dir), "-k", "2", "-m", "8", "-r", "1", "--temperature", "0.8",
        "--seeds", "2", "--prompts", str(suite), "--no-warmup", "--json", str(out), "-q",
    ])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["settings"]["seeds"] == [0, 1]
    assert sorted((r["num_draft"], r["seed"]) for r in rep["runs"]) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert all("identical_to_target" not in e for e in rep["results"])  # only checked when greedy
    assert rep["results"][1]["speedup"]["n"] == 2


@pytest.mark.parametrize("content, message", [
    ("", "has no prompts"),
    ('{"prompt": "w7 w8"}\n{"prompt": "w9" \n', "line 2: not valid JSON"),
])
def test_bench_bad_prompt_file(tiny_pair_dir, tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    res = CliRunner().invoke(cli, ["bench", "-t", str(tiny_pair_dir), "--prompts", str(f)])
    assert res.exit_code != 0
    assert res.output.startswith("Error: ") and message in res.output
    assert "Traceback" not in res.output


def test_bench_needs_a_draft(tiny_pair_dir, tmp_path):
    suite = _write(tmp_path / "suite.jsonl", TINY_SUITE[:1])
    res = CliRunner().invoke(cli, ["bench", "-t", str(tiny_pair_dir / "target"), "--prompts", str(suite)])
    assert res.exit_code != 0 and "needs a draft model" in res.output


def test_bench_rejects_bad_draft_lengths(tiny_pair_dir):
    res = CliRunner().invoke(cli, ["bench", "-t", str(tiny_pair_dir), "-k", "0,2"])
    assert res.exit_code != 0 and ">= 1" in res.output
