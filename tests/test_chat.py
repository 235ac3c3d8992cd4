"""`mlxspec chat` and `mlxspec generate`, end to end on tiny random pairs saved to disk.

Click's runner drives `generate` and the piped chat; a real pseudo-terminal (pexpect) drives
the interactive loop, Ctrl-C and Ctrl-D included.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

import mlxspec
from mlxspec.chat import Conversation, StopFlag
from mlxspec.options import GenerateOptions
from mlxspec.cli import cli
from mlxspec import resolve

from conftest import importable_env, perturbed, save_tiny, tiny_llama

PROMPT = "w10 w11 w12 w13"


def run(args, input=None):
    return CliRunner().invoke(cli, args, input=input)


def pair_json(folder, *extra):
    r = run(["generate", "-t", str(folder), "--prompt", PROMPT, "-n", "24", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# -- generate ---------------------------------------------------------------------------------


def test_generate_json_is_the_targets_greedy_text(tiny_pair_dir):
    spec = pair_json(tiny_pair_dir)
    alone = pair_json(tiny_pair_dir, "--no-draft")
    assert spec["tokens"] == alone["tokens"]  # exact: the draft changes the speed, not the text
    assert spec["text"] == alone["text"] and spec["text"]
    st = spec["stats"]
    assert st["generation_tokens"] == len(spec["tokens"]) <= 24
    assert st["drafted"] > 0 and 0 <= st["accepted"] <= st["drafted"]
    assert spec["draft"] is not None and alone["draft"] is None and alone["stats"]["drafted"] == 0
    assert Path(spec["target"]).name == "target"
    assert spec["prompt_tokens"] == 4 and spec["time_to_first_token"] > 0


def test_generate_streams_text_and_one_stats_line(tiny_pair_dir):
    want = pair_json(tiny_pair_dir)["text"]
    r = run(["generate", "-t", str(tiny_pair_dir), "--prompt", "-", "-n", "24"], input=PROMPT + "\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == want + "\n"  # the streamed pieces add up to the whole text
    stats = [ln for ln in r.stderr.splitlines() if ln.startswith("[")]
    assert len(stats) == 1 and "tokens/pass" in stats[0] and "accepted" in stats[0]


def test_generate_chat_applies_the_template(tiny_pair_dir):
    pair = mlxspec.load(tiny_pair_dir)
    ids = pair.encode([{"role": "system", "content": "w7"}, {"role": "user", "content": PROMPT}])
    want = pair.generate(ids, max_tokens=16, num_draft=0)
    r = run(["generate", "-t", str(tiny_pair_dir), "--prompt", PROMPT, "--chat", "--system", "w7",
             "-n", "16", "--json", "--seed", "1"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["prompt_tokens"] == len(ids) and doc["tokens"] == want.tokens


# -- the conversation: cache reuse, Ctrl-C, context window -------------------------------------


def test_turns_prefill_only_the_new_message_and_match_a_fresh_session(tiny_pair_dir):
    pair = mlxspec.load(tiny_pair_dir)
    conv = Conversation(pair, "w7", GenerateOptions(max_tokens=12))
    r1 = conv.turn("w10 w11")
    ids2, _, reused = conv.prompt_ids("w20 w21 w22")
    assert reused and ids2[: conv.reply_end] == conv.tokens[: conv.reply_end]
    assert ids2 == pair.encode(conv.messages + [{"role": "user", "content": "w20 w21 w22"}])
    cached = conv.session.cached_tokens
    r2 = conv.turn("w20 w21 w22")
    # only the tokens after the cached prefix were computed (the engine keeps the last prompt
    # token to feed with the first round)
    assert r2.stats.prefill_tokens == len(ids2) - 1 - cached
    assert r2.stats.prefill_tokens < len(ids2) // 2
    fresh = pair.generate(ids2, max_tokens=12)  # no cache: everything recomputed
    assert r2.tokens == fresh.tokens
    assert len(conv.messages) == 5 and conv.messages[-1]["content"] == r2.text == fresh.text
    assert r1.stats.generation_tokens == len(r1.tokens)


def test_stopping_a_reply_keeps_the_conversation_and_the_caches_consistent(tiny_pair_dir):
    pair = mlxspec.load(tiny_pair_dir)
    conv = Conversation(pair, None, GenerateOptions(max_tokens=40))
    stop = StopFlag()
    stop.hits = 1  # Ctrl-C already pressed: the reply stops after its first step
    r1 = conv.turn("w10 w11", stop=stop)
    assert r1.interrupted and not r1.aborted and 1 <= len(r1.tokens) <= 5
    assert conv.messages[-1] == {"role": "assistant", "content": r1.text}
    ids2, _, reused = conv.prompt_ids("w30")
    r2 = conv.turn("w30")
    assert reused and r2.stats.prefill_tokens < len(ids2) - 1
    assert r2.tokens == pair.generate(ids2, max_tokens=40).tokens


def test_reset_starts_over(tiny_pair_dir):
    pair = mlxspec.load(tiny_pair_dir)
    conv = Conversation(pair, "w7", GenerateOptions(max_tokens=8))
    first = conv.turn("w10 w11").tokens
    conv.turn("w12")
    conv.reset()
    assert conv.messages == [{"role": "system", "content": "w7"}] and conv.session.cached_tokens == 0
    again = conv.turn("w10 w11")
    assert again.tokens == first and again.stats.prefill_tokens == again.stats.prompt_tokens - 1


def test_piped_chat_one_reply_line_per_message(tiny_pair_dir):
    pair = mlxspec.load(tiny_pair_dir)
    conv = Conversation(pair, None, GenerateOptions(max_tokens=10))
    want = [conv.turn(m).text for m in ("w10 w11", "w20", "w30 w31")]
    r = run(["chat", "-t", str(tiny_pair_dir), "-n", "10"], input="w10 w11\n\nw20\n/stats\nw30 w31\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == want  # nothing but the replies on standard output
    assert len(re.findall(r"tokens/pass, first token [\d.]+ s\]", r.stderr)) == 3
    m = re.search(r"prompt tokens: (\d+), computed: (\d+)", r.stderr)
    assert m and int(m.group(2)) < int(m.group(1))  # the second turn came mostly from the cache
    assert "turns: 2" in r.stderr  # /stats came after two turns


def test_piped_chat_past_the_context_window_says_so_and_goes_on(tiny_pair_dir):
    long = " ".join(f"w{6 + i % 50}" for i in range(100))  # 100 tokens; the window is 256
    r = run(["chat", "-t", str(tiny_pair_dir), "-n", "8"], input=f"{long}\n{long}\n{long}\n/reset\nw10\n")
    assert r.exit_code == 0, r.output
    assert "context window of 256 tokens" in r.stderr and "/reset" in r.stderr
    assert "Traceback" not in r.output
    lines = r.stdout.split("\n")
    assert len(lines) == 5 and lines[2] == "" and lines[4] == ""  # one line per message, the refused one empty
    assert lines[0] and lines[1] and lines[3]
    assert "New conversation." in r.stderr


def test_a_reply_is_capped_by_the_room_left_in_the_context(tiny_pair_dir):
    pair = mlxspec.load(tiny_pair_dir)
    conv = Conversation(pair, None, GenerateOptions(max_tokens=200))
    notes = []
    conv.turn(" ".join(f"w{6 + i % 50}" for i in range(180)), on_limit=notes.append)
    assert notes and "nearly full" in notes[0]
    assert len(conv.tokens) <= 256 + 1


# -- bad input: one line, non-zero exit, no traceback -----------------------------------------


def _one_line_error(r, *words):
    assert r.exit_code != 0
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1, r.output
    for w in words:
        assert w in errors[0], errors[0]


def test_missing_target_folder(tmp_path):
    r = run(["generate", "-t", str(tmp_path / "nope"), "--prompt", "hi"])
    _one_line_error(r, "nope")
    r = run(["chat", "-t", str(tmp_path / "nope")], input="hi\n")
    _one_line_error(r, "nope")


def test_draft_that_does_not_match_the_target(tiny_pair_dir, mismatched_draft_dir):
    r = run(["generate", "-t", str(tiny_pair_dir / "target"), "-d", str(mismatched_draft_dir), "--prompt", PROMPT])
    _one_line_error(r, "does not match")


@pytest.mark.parametrize("args", [["--dtype", "float8"], ["--temperature", "-1"], ["--top-p", "2"],
                                  ["--num-draft", "x"]])
def test_unknown_option_values(tiny_pair_dir, args):
    r = run(["generate", "-t", str(tiny_pair_dir), "--prompt", PROMPT, *args])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("Error")]) == 1


def test_a_file_is_not_a_model(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    _one_line_error(run(["generate", "-t", str(f), "--prompt", "hi"]), "mlxspec convert")


# -- finding models ---------------------------------------------------------------------------


@pytest.fixture
def recipe_root(tmp_path, monkeypatch):
    """A repo root with models/tiny.json (the default) pointing at models/offline/tiny."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.json").write_text(json.dumps({
        "name": "tiny", "default": True,
        "hub": {"target": "mlx-community/Tiny-4bit", "draft": "mlx-community/Tiny-draft-4bit"},
        "offline": {"pair": "models/offline/tiny", "get": "python scripts/get_offline_models.py"},
    }))
    (tmp_path / "models" / "results.json").write_text("[1, 2]")  # not a recipe: ignored
    monkeypatch.setattr(resolve, "REPO_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLXSPEC_USE_HUB", "0")
    return tmp_path


def test_no_target_and_no_default_pair_names_the_command(recipe_root):
    r = run(["generate", "--prompt", PROMPT])
    _one_line_error(r, "python scripts/get_offline_models.py", "tiny")


def test_default_recipe_uses_its_offline_pair(recipe_root, tiny_pair_dir):
    (recipe_root / "models" / "offline").mkdir()
    (recipe_root / "models" / "offline" / "tiny").symlink_to(tiny_pair_dir)
    want = pair_json(tiny_pair_dir)
    r = run(["generate", "--prompt", PROMPT, "-n", "24", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["tokens"] == want["tokens"] and doc["draft"] is not None
    r = run(["generate", "-t", "tiny", "--no-draft", "--prompt", PROMPT, "-n", "24", "--json"])
    assert json.loads(r.stdout)["draft"] is None
    assert resolve.resolve_one("tiny", "draft").target.endswith("draft")


def test_hub_recipe_and_repos(recipe_root, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXSPEC_USE_HUB", "1")
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    res = resolve.resolve_pair(None, None)
    assert (res.target, res.draft) == ("mlx-community/Tiny-4bit", "mlx-community/Tiny-draft-4bit")

    configs = {"acme/mlx-q": {"quantization": {"bits": 4}}, "acme/plain": {"model_type": "llama"}}
    converted = []

    def convert(repo, out):
        converted.append(repo)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    kw = dict(fetch_config=configs.__getitem__, convert=convert)
    assert resolve.resolve_one("acme/mlx-q", **kw).target == "acme/mlx-q"  # already MLX: as it is
    first = resolve.resolve_one("acme/plain", **kw).target
    again = resolve.resolve_one("acme/plain", **kw).target  # converted once, then from the cache
    assert first == again == str(tmp_path / "cache" / "acme--plain") and converted == ["acme/plain"]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(mlxspec.ModelNotFoundError, match="hub"):
        resolve.resolve_one("acme/other", **kw)


# -- the interactive loop in a real terminal ----------------------------------------------------


@pytest.fixture(scope="module")
def endless_pair_dir(tmp_path_factory):
    """A target that never ends a reply (its end-of-sequence logit is 0, below the maximum) and
    a partly accepted draft, with a huge context window: replies run to --max-tokens, long
    enough to interrupt."""
    target = tiny_llama(5)
    w = mx.array(target.lm_head.weight)
    w[2] = 0.0
    target.lm_head.weight = w
    root = tmp_path_factory.mktemp("endless")
    save_tiny(root / "target", target)
    save_tiny(root / "draft", perturbed(target, seed=7, noise=0.05))
    for sub in ("target", "draft"):
        cfg = json.loads((root / sub / "config.json").read_text())
        cfg["max_position_embeddings"] = 1_000_000
        (root / sub / "config.json").write_text(json.dumps(cfg))
    (root / "mlxspec-pair.json").write_text(
        json.dumps({"format": "mlxspec-pair", "version": 1, "target": "target", "draft": "draft"})
    )
    return root


def test_interactive_chat_in_a_terminal(endless_pair_dir):
    pexpect = pytest.importorskip("pexpect")
    env = importable_env(MLXSPEC_NO_OPENBLAS="1", TERM="xterm", NO_COLOR="")
    child = pexpect.spawn(
        sys.executable, ["-m", "mlxspec.cli", "chat", "-t", str(endless_pair_dir), "-n", "400", "-k", "4",
                         "--show-draft"],
        env=env, encoding="utf-8", timeout=60, dimensions=(40, 200),
    )
    transcript = []
    try:
        child.expect("/help for commands")
        child.expect(">>> ")
        # one whole turn: the reply runs to --max-tokens, then the stats line
        child.sendline("hello there")
        child.expect(r"\[400 tokens, [\d.]+ tok/s, \d+% accepted, [\d.]+ tokens/pass, first token [\d.]+ s\]")
        transcript.append(child.before + child.after)
        assert "\x1b[32m" in child.before  # --show-draft colours the draft's tokens on a terminal
        child.expect(">>> ")
        child.sendline("/stats")
        child.expect(r"turns: 1, tokens generated: 400")
        child.expect(r"context: \d+ of 1000000 tokens")
        child.expect(">>> ")
        transcript.append(child.before)
        # Ctrl-C while the reply streams: the reply stops, the chat goes on
        child.sendline("and again")
        child.expect(r"w\d+")
        child.sendintr()
        child.expect(r"\[stopped\]")
        child.expect(r"\[(\d+) tokens")
        assert int(child.match.group(1)) < 400
        child.expect(">>> ")
        transcript.append(child.before)
        child.sendline("/stats")
        child.expect(r"turns: 2")
        child.expect(">>> ")
        child.sendline("/reset")
        child.expect("New conversation.")
        child.expect(">>> ")
        child.sendline("/stats")
        child.expect(r"turns: 2.*context: 0 of 1000000 tokens")  # totals stay, the history goes
        child.expect(">>> ")
        child.sendeof()  # Ctrl-D at an empty prompt
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, "".join(transcript)


def test_ctrl_c_at_the_prompt_exits_zero(tiny_pair_dir):
    pexpect = pytest.importorskip("pexpect")
    env = importable_env(MLXSPEC_NO_OPENBLAS="1")
    child = pexpect.spawn(sys.executable, ["-m", "mlxspec.cli", "chat", "-t", str(tiny_pair_dir)],
                          env=env, encoding="utf-8", timeout=60)
    child.expect(">>> ")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before
