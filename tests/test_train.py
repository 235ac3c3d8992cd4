"""`mlxspec train-drafter` (mlxspec/train/): data, features, vocabulary, the TTT unroll, the
resumable loop, evaluation, and the command, on tiny random targets."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache, make_prompt_cache

from conftest import save_tiny, tiny_llama
from mlxspec.heads.eagle3 import Eagle3Head, head_config_for, load_head
from mlxspec.train import data as data_mod
from mlxspec.train.data import DataError
from mlxspec.train.features import extract, final_hidden, load_features, output_rows, prefill_features
from mlxspec.train.loop import chain_acceptance, last_checkpoint, unroll
from mlxspec.train.pipeline import TrainSettings, train_drafter
from mlxspec.train.vocab import count_tokens, draft_vocab


def bigram_llama(seed: int):
    """A tiny llama whose decoder layers barely matter (their matrices scaled down), so its next
    token depends mostly on the current one: a target a small head can learn in seconds."""
    model = tiny_llama(seed, layers=4)
    layers = model.model.layers
    for layer in layers:
        layer.update(tree_map(lambda p: p * 0.05 if p.ndim > 1 else p, layer.parameters()))
    model.lm_head.weight = model.lm_head.weight.at[:6].multiply(0.0)  # special tokens rarely win
    mx.eval(model.parameters())
    return model


def sampled_texts(model, n: int, length: int, seed: int) -> list[str]:
    """Texts sampled from the model itself (word ids 6.., no special tokens)."""
    key = mx.random.key(seed)
    out = []
    for _ in range(n):
        key, sub = mx.random.split(key)
        ids = [int(mx.random.randint(6, 64, (1,), key=sub).item())]
        cache = make_prompt_cache(model)
        x = mx.array([ids])
        for _ in range(length - 1):
            key, sub = mx.random.split(key)
            lg = model(x, cache=cache)[0, -1].at[:6].add(-1e9)
            ids.append(int(mx.random.categorical(lg, key=sub).item()))
            x = mx.array([[ids[-1]]])
        out.append(" ".join(f"w{i}" for i in ids))
    return out


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory):
    from mlx_lm.utils import load

    root = tmp_path_factory.mktemp("train")
    model = bigram_llama(5)
    save_tiny(root / "target", model)
    texts = sampled_texts(model, 36, 48, seed=0)
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    m, tok = load(str(root / "target"))
    return root, (m, tok, root / "target")


SETTINGS = TrainSettings(draft_vocab=64, ttt_steps=3, steps=60, batch_size=4, max_tokens_per_sample=48, lr=1e-2,
                         held_out_fraction=0.15, checkpoint_every=20, log_every=10, eval_prompts=4,
                         eval_prompt_tokens=8, eval_new_tokens=24)


# -- the unroll is what the head computes when it drafts with its KV cache --------------------


def _sequential(head, embed, taps, tokens, t, steps, feed_own):
    """The head drafting after position t as a drafter would: step 0 over positions 0..t into a
    KV cache, then one position per step, each fed its own hidden state."""
    cache = KVCache()
    x = head.fuse(taps[:, : t + 1])
    logits, h = head(embed(tokens[:, 1: t + 2]), x, mask="causal", cache=cache)
    out = [logits[:, -1]]
    h = h[:, -1:]
    for j in range(1, steps):
        if feed_own:
            tok = (mx.argmax(out[-1], -1) + head.d2t[mx.argmax(out[-1], -1)])[:, None]
        else:
            tok = tokens[:, t + j + 1: t + j + 2]
        logits, h = head(embed(tok), h, mask=None, cache=cache)
        out.append(logits[:, -1])
    return out


@pytest.mark.parametrize("feed_own", [False, True])
def test_unroll_equals_drafting_with_a_kv_cache(feed_own):
    target = tiny_llama(7, layers=4)
    cfg = head_config_for(target, 40, intermediate_size=48)
    mx.random.seed(3)
    head = Eagle3Head(cfg)
    from mlxspec.heads.eagle3 import vocab_maps

    d2t, t2d = vocab_maps(np.arange(10, 50), 64)
    head.set_vocab(mx.array(d2t), mx.array(t2d))
    head.update(tree_map(lambda p: p * 3 if p.ndim > 1 else p, head.parameters()))  # sharper attention
    emb = target.model.embed_tokens
    tokens = mx.array([[12, 40, 33, 17, 25, 48, 11, 30, 22, 19, 44, 13, 29, 36]], mx.int32)
    taps = mx.random.normal((1, tokens.shape[1], 3 * 32))
    steps = 4
    un = unroll(head, emb, taps, tokens, steps, feed_own=feed_own)
    for t in (0, 3, 8):
        seq = _sequential(head, emb, taps, tokens, t, steps, feed_own)
        for j in range(steps):
            assert mx.allclose(un[j][0, t], seq[j][0], atol=1e-4).item(), (t, j)


# -- training end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(bigram_dir, tmp_path_factory):
    root, loaded = bigram_dir
    out = tmp_path_factory.mktemp("run") / "head"
    prov = train_drafter(root / "target", [root / "data.jsonl"], out, SETTINGS, progress=False, echo=lambda s: None,
                         loaded=loaded)
    return out, prov


def test_training_lowers_the_loss_and_raises_acceptance(trained, bigram_dir):
    out, prov = trained
    log = [json.loads(line) for line in (out / "train-log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert losses[-1] < 0.8 * losses[0]
    before, after = prov["eval_untrained"], prov["eval"]
    assert before["step"] == 0 and after["step"] == SETTINGS.steps
    assert after["positions"] >= 40
    assert after["acceptance_per_position"][0] >= before["acceptance_per_position"][0] + 0.4
    assert after["tokens_per_pass"] >= before["tokens_per_pass"] + 1.0
    # the output folder: a loadable head, provenance, log, plot, checkpoints
    head = load_head(out)
    assert head.config.draft_vocab_size == prov["draft_vocab"]["size"]
    assert prov["complete"] and prov["step"] == SETTINGS.steps
    assert prov["data"]["sha256"] and prov["data"]["train_tokens"] > 1000
    assert (out / "loss.png").stat().st_size > 1000
    assert last_checkpoint(out).name == f"step-{SETTINGS.steps:06d}"
    # the saved head drafts what the trained one measured
    root, (model, _, _) = bigram_dir
    feats = load_features(out / "features" / "held-out")
    samples = [feats.sample(i) for i in range(len(feats))]
    firsts = [SETTINGS.eval_prompt_tokens] * len(samples)
    again = chain_acceptance(head, model.model.embed_tokens, samples, SETTINGS.eval_draft_length, firsts)
    assert again["acceptance_per_position"] == after["acceptance_per_position"]


def _weights(folder):
    return {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}


def test_resume_gives_the_uninterrupted_result(trained, bigram_dir, tmp_path):
    root, loaded = bigram_dir
    full, _ = trained
    out = tmp_path / "head"
    # killed after step 30 (checkpoints at 20), then resumed: it redoes 21..30 from the step-20 state
    train_drafter(root / "target", [root / "data.jsonl"], out, SETTINGS, progress=False, echo=lambda s: None,
                  loaded=loaded, stop_after=30)
    shutil.rmtree(out / "checkpoints" / "step-000030", ignore_errors=True)
    assert last_checkpoint(out).name == "step-000020"
    with pytest.raises(Exception, match="--resume"):
        train_drafter(root / "target", [root / "data.jsonl"], out, SETTINGS, progress=False, echo=lambda s: None,
                      loaded=loaded)
    prov = train_drafter(root / "target", [root / "data.jsonl"], out, SETTINGS, progress=False, echo=lambda s: None,
                         loaded=loaded, resume=True)
    assert prov["step"] == SETTINGS.steps
    a, b = _weights(full), _weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    log_a = (full / "train-log.jsonl").read_text().splitlines()
    log_b = (out / "train-log.jsonl").read_text().splitlines()
    strip = lambda lines: [{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"} for x in lines]  # noqa: E731
    assert strip(log_a) == strip(log_b)


def test_an_interrupted_run_leaves_a_loadable_checkpoint(bigram_dir, tmp_path):
    root, loaded = bigram_dir
    out = tmp_path / "head"
    train_drafter(root / "target", [root / "data.jsonl"], out, SETTINGS, progress=False, echo=lambda s: None,
                  loaded=loaded, stop_after=25)
    # a kill during the next checkpoint leaves a temporary folder, which nothing reads
    (out / "checkpoints" / ".step-000040.tmp").mkdir()
    (out / "checkpoints" / ".step-000040.tmp" / "model.safetensors").write_bytes(b"partial")
    ckpt = last_checkpoint(out)
    assert ckpt.name == "step-000020"
    head = load_head(out)
    assert _weights(out).keys() == _weights(ckpt).keys()
    for k, v in _weights(ckpt).items():
        assert np.array_equal(v, _weights(out)[k])
    assert head.config.draft_vocab_size > 0
    prov = json.loads((out / "mlxspec-train.json").read_text())
    assert prov["step"] == 20 and not prov["complete"]


# -- data -------------------------------------------------------------------------------------


def test_bad_data_gets_a_clear_error(tmp_path, bigram_dir):
    root, (model, tok, _) = bigram_dir
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        data_mod.read_documents([empty])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w6 w7"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        data_mod.read_documents([bad])
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"prompt": "w6"}\n')
    with pytest.raises(DataError, match=r"wrong.jsonl:1: .*\"text\" or a \"messages\""):
        data_mod.read_documents([wrong])
    with pytest.raises(DataError, match="no such file"):
        data_mod.read_documents([tmp_path / "missing"])
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.bin").write_bytes(b"\0\1")
    with pytest.raises(DataError, match="no text, code"):
        data_mod.read_documents([tmp_path / "folder"])
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "w6 w7 w8"}\n{"text": "w9 w10"}\n')
    docs, files, h = data_mod.read_documents([short])
    with pytest.raises(DataError, match="at least 5 tokens"):
        data_mod.build_corpus(docs, tok, max_tokens_per_sample=16, min_tokens=5)
    with pytest.raises(Exception, match="empty"):
        train_drafter(root / "target", [empty], tmp_path / "out", SETTINGS, progress=False, echo=lambda s: None,
                      loaded=(model, tok, root / "target"))


def test_chat_records_use_the_chat_template_and_documents_are_held_out_whole(tmp_path, bigram_dir):
    _, (model, tok, _) = bigram_dir
    f = tmp_path / "chat.jsonl"
    recs = [{"messages": [{"role": "user", "content": f"w{6 + i} w7"}, {"role": "assistant", "content": "w8 w9 w10"}]}
            for i in range(20)]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    docs, files, digest = data_mod.read_documents([f])
    corpus = data_mod.build_corpus(docs, tok, max_tokens_per_sample=64, min_tokens=4, held_out_fraction=0.1)
    want = tok.apply_chat_template([{"role": "user", "content": "w6 w7"}, {"role": "assistant", "content": "w8 w9 w10"}],
                                   tokenize=True)
    assert list(want) in corpus.train + corpus.held_out
    assert len(corpus.held_out) == 2 and len(corpus.train) == 18
    assert not set(map(tuple, corpus.held_out)) & set(map(tuple, corpus.train))
    capped = data_mod.build_corpus(docs, tok, max_tokens_per_sample=64, min_tokens=4, max_tokens=30)
    assert capped.train_tokens == 27  # three 9-token samples; a 3-token remainder is below min_tokens


# -- features and vocabulary ------------------------------------------------------------------


def test_features_are_the_targets_and_extraction_resumes(tmp_path):
    from mlxspec.heads.taps import install_taps

    model = tiny_llama(8, layers=4)
    samples = [list(range(6, 6 + n)) for n in (20, 13, 31)]
    key = {"k": 1}
    calls = []

    def make(t, r, s):
        calls.append(len(s))
        if len(calls) == 3 and not getattr(make, "resumed", False):
            raise KeyboardInterrupt  # killed during the third sample
        return prefill_features(t, r, s, chunk=8)

    with pytest.raises(KeyboardInterrupt):
        extract(model, samples, tmp_path / "f", (0, 1, 3), key, shard_tokens=1, progress=False, make=make)
    assert load_features(tmp_path / "f") is None  # unfinished: not used
    make.resumed = True
    feats = extract(model, samples, tmp_path / "f", (0, 1, 3), key, shard_tokens=1, progress=False, make=make)
    assert calls == [20, 13, 31, 31]  # the first two were not recomputed
    s = feats.sample(2)
    ids = mx.array([samples[2]])
    rec = install_taps(model, (0, 1, 3))
    try:
        h = final_hidden(model, ids)
        taps = rec.hidden()
    finally:
        rec.remove()
    assert np.allclose(s["taps"], np.array(taps[0]), atol=2e-2 * float(mx.abs(taps).max()))
    logits = model(ids)[0]
    rebuilt = mx.array(s["hidden"].astype(np.float32)) @ output_rows(model, np.arange(64)).T
    assert mx.allclose(rebuilt, logits, atol=5e-2 * float(mx.abs(logits).max())).item()
    assert s["argmax"].tolist() == np.array(mx.argmax(logits, -1)).tolist()
    with pytest.raises(Exception, match="another target"):
        extract(model, samples, tmp_path / "f", (0, 1, 3), {"k": 2}, progress=False)


def test_draft_vocab_is_the_most_frequent_tokens_plus_eos():
    counts = count_tokens([[5, 5, 5, 9, 9, 3], [9, 7]], 12)
    assert draft_vocab(counts, 2, always=[11]).ids.tolist() == [5, 11]  # the size includes the forced ids
    v = draft_vocab(counts, 3, always=[11])
    assert v.ids.tolist() == [5, 9, 11]
    assert v.coverage == pytest.approx(6 / 8)
    assert v.d2t.tolist() == [5, 8, 9] and v.t2d.sum() == 3
    small = draft_vocab(counts, 100)
    assert small.ids.tolist() == [3, 5, 7, 9]  # never-seen tokens are not drafted


def test_the_command_trains_and_reports_bad_data_in_one_line(bigram_dir, tmp_path):
    from click.testing import CliRunner

    from mlxspec.cli import cli

    root, _ = bigram_dir
    out = tmp_path / "head"
    args = ["train-drafter", "--target", str(root / "target"), "--data", str(root / "data.jsonl"), "--out", str(out),
            "--steps", "4", "--ttt-steps", "2", "--max-tokens-per-sample", "32", "--eval-prompts", "1",
            "--eval-new-tokens", "8", "--checkpoint-every", "2", "--quiet"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "done: 4 steps" in res.output
    prov = json.loads((out / "mlxspec-train.json").read_text())
    assert prov["settings"]["ttt_steps"] == 2 and prov["complete"]
    assert len((out / "train-log.jsonl").read_text().splitlines()) >= 3
    again = CliRunner().invoke(cli, args)
    assert again.exit_code != 0 and "--resume" in again.output
    (tmp_path / "bad.jsonl").write_text("not json\n")
    bad = CliRunner().invoke(cli, [*args[:4], str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o2")])
    assert bad.exit_code != 0
    assert "bad.jsonl:1: not valid JSON" in bad.output and "Traceback" not in bad.output


# -- the trained head in the engine: it loads as a draft and decoding stays exact ---------------


def test_the_trained_head_loads_as_a_draft_and_keeps_the_output_exact(trained, bigram_dir):
    import mlxspec
    from conftest import check_marginals, exact_marginals
    from mlxspec.sampling import SamplingParams

    root, _ = bigram_dir
    out, prov = trained
    e = prov["engine_eval"]  # the engine's own count, from the held-out prompts
    assert e["tokens_per_pass"] > 2.0 and e["acceptance_per_position"][0] > 0.5
    pair = mlxspec.load(root / "target", draft=out, dtype="float32")
    try:
        assert pair.head is not None and pair.draft is None
        accepted = drafted = 0
        for prompt in ([9, 30, 41], [12, 7, 55, 20, 33], [50, 51, 52, 53]):
            res = pair.generate(prompt, max_tokens=40, num_draft=3, adaptive=False)
            assert res.tokens == pair.generate(prompt, max_tokens=40, drafter="none").tokens
            accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
        assert 0 < accepted < drafted
        sp = SamplingParams(temperature=1.0, top_k=4)
        prompt = [9, 30, 41]
        exact = exact_marginals(pair.target, prompt, sp, steps=3)
        session = pair.new_session()
        samples, drafted, accepted = [], 0, 0
        for s in range(600):
            res = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=4, num_draft=2, adaptive=False, seed=s,
                                session=session)
            samples.append(res.tokens)
            drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
        check_marginals(np.array(samples), exact)
        assert 0 < accepted < drafted  # drafts both accepted and rejected
    finally:
        pair.head.recorder.remove()
