"""Trained EAGLE-3 heads as drafters: loading the published layouts, refusing heads that do not
fit the target, exactness (greedy identity, chi-square of sampled output) and the conventions
(which target layer, which position) that would silently lower acceptance if they were wrong.

Two kinds of tiny targets (qwen2, qwen3 and llama classes of mlx-lm, 4+ layers):
- random ones, drafted for by random heads (drafts mostly rejected);
- "bigram" ones whose layers add nothing (o_proj and down_proj zero), so every tapped feature is
  the token's embedding and the next token depends on the current token only. For those a head
  can be written by hand that computes the target's own next-token logits one position ahead
  (see `copying_head`), so its drafts are accepted; with a reduced draft vocabulary, the target's
  tokens outside it are drafted wrong and rejected.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models import llama, qwen2, qwen3

import mlxspec
from conftest import check_marginals, exact_marginals, save_tiny
from mlxspec.drafters.eagle3 import Eagle3Drafter
from mlxspec.errors import MlxspecError, PairMismatchError, UnsupportedModelError
from mlxspec.heads import is_head, load_trained_head
from mlxspec.heads.eagle3 import Eagle3Config, Eagle3Head, vocab_maps
from mlxspec.sampling import SamplingParams

VOCAB, HIDDEN = 64, 32


# -- tiny targets ----------------------------------------------------------------------------


def tiny_target(arch: str, seed: int, layers: int = 4, bigram: bool = False):
    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, intermediate_size=2 * HIDDEN, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=False,
                  rope_theta=10000.0)
    if arch == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", **common))
    elif arch == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **common))
    else:
        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", max_position_embeddings=256, head_dim=8, **common))
    mx.random.seed(seed)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * (0.5 if p.ndim > 1 else 0.1) + (p.ndim == 1),
                          model.parameters()))
    if bigram:
        # embeddings [1, z] with rms 1: dimension 0 is a constant the copying head attends with
        z = mx.random.normal((VOCAB, HIDDEN - 1))
        z = z / mx.sqrt((z * z).sum(-1, keepdims=True)) * (HIDDEN - 1) ** 0.5
        model.model.embed_tokens.weight = mx.concatenate([mx.ones((VOCAB, 1)), z], axis=1)
        model.lm_head.weight = mx.random.normal((VOCAB, HIDDEN)) * 0.4
        for layer in model.model.layers:  # each layer passes its input on unchanged
            layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def head_config(taps=(1, 2, 3), draft_vocab: int = VOCAB, rope_theta: float = 10000.0) -> Eagle3Config:
    return Eagle3Config(hidden_size=HIDDEN, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
                        vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=HIDDEN,
                        tap_layers=tuple(taps), head_dim=8, rms_norm_eps=1e-6, rope_theta=rope_theta)


def random_head(seed: int, used=None, taps=(1, 2, 3)) -> Eagle3Head:
    used = np.arange(VOCAB) if used is None else np.asarray(used)
    mx.random.seed(seed)
    head = Eagle3Head(head_config(taps, len(used)))
    head.update(tree_map(lambda p: mx.random.normal(p.shape) * (0.3 if p.ndim > 1 else 0.1) + (p.ndim == 1),
                         head.parameters()))
    d2t, t2d = vocab_maps(used, VOCAB)
    head.set_vocab(mx.array(d2t), mx.array(t2d))
    return head


def copying_head(target, used=None) -> Eagle3Head:
    """A head whose logits at position j are the bigram target's logits at position j + 1.

    Position j gets x_j = fc(taps of j) = e_j (the token's embedding: the target's layers add
    nothing) and the embedding e_{j+1}. Attention looks at its own position only: q = k = a
    constant read from the embeddings' constant dimension 0, and the head's rope (base 3, four
    incommensurate frequencies) makes q.R(d).k largest at distance 0 by >= 0.13 |q|^2, times
    ~2000 here. Its value is e_{j+1} - hidden_norm(x_j) = e_{j+1} - e_j, so h_j = x_j + a_j = e_{j+1};
    the MLP is off. Draft steps feed h back: hidden_norm(h) = e_{j+1} again, and the same algebra
    holds. Logits = lm_head(norm(h)) with the target's final norm and (the draft vocabulary's
    rows of) its lm_head: exactly the target's next-token logits after token j + 1."""
    used = np.arange(VOCAB) if used is None else np.asarray(used)
    cfg = head_config((1, 2, 3), len(used), rope_theta=3.0)
    head = Eagle3Head(cfg)
    h, n_heads, d = HIDDEN, 4, 8
    eye = mx.eye(h)
    u = mx.ones((d,)) * 45.0 / d**0.5 * 2  # |u|^2 / sqrt(d) ~ 2900: attention to another position is < e^-300
    qk = mx.zeros((n_heads * d, 2 * h))
    qk[:, 0] = mx.tile(u, (n_heads,))
    mid = head.midlayer
    mid.self_attn.q_proj.weight = qk
    mid.self_attn.k_proj.weight = qk
    mid.self_attn.v_proj.weight = mx.concatenate([eye, -eye], axis=1)
    mid.self_attn.o_proj.weight = eye
    mid.mlp.down_proj.weight = mx.zeros_like(mid.mlp.down_proj.weight)
    head.fc.weight = mx.concatenate([eye, mx.zeros((h, 2 * h))], axis=1)
    head.norm.weight = target.model.norm.weight
    head.lm_head.weight = target.lm_head.weight[mx.array(used)]
    d2t, t2d = vocab_maps(used, VOCAB)
    head.set_vocab(mx.array(d2t), mx.array(t2d))
    mx.eval(head.parameters())
    return head


def write_published(folder, head: Eagle3Head, *, layers0: bool = False, dtype=mx.float32, embed=None,
                    taps_in_config: bool = True) -> None:
    """A head folder as SpecForge exports it (midlayer.*) or as speculators writes it (layers.0.*),
    with the reference's config keys; d2t int64 and t2d bool."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    weights = {}
    for k, v in tree_flatten(head.parameters()):
        if layers0 and k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        weights[k] = v.astype(dtype)
    if embed is not None:
        weights["embed_tokens.weight"] = embed.astype(dtype)
    weights["d2t"] = head.d2t.astype(mx.int64)
    weights["t2d"] = head.t2d.astype(mx.bool_)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "pretraining_tp": 1, "bos_token_id": 1, "eos_token_id": 2,
    }
    if taps_in_config:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.tap_layers),
                                  "use_aux_hidden_state": True}
    (folder / "config.json").write_text(json.dumps(config))


def head_pair(target, head: Eagle3Head, tmp_path, name="head", **kw) -> mlxspec.Pair:
    write_published(tmp_path / name, head, **kw)
    return mlxspec.Pair(target, None, None, head=load_trained_head(tmp_path / name, target))


def alone(model, prompt, n):
    return mlxspec.Pair(model).generate(prompt, max_tokens=n, drafter="none").tokens


@pytest.fixture(autouse=True)
def _untap():
    """Each test taps its own targets; remove the taps afterwards (targets are module-scoped)."""
    yield
    for model in list(_TARGETS.values()):
        for layer in model.model.layers:
            rec = getattr(layer, "_mlxspec_tap", None)
            if rec is not None:
                rec.remove()


_TARGETS: dict = {}


def target_of(arch: str, bigram: bool = False, layers: int = 4):
    key = (arch, bigram, layers)
    if key not in _TARGETS:
        seed = 10 * ("llama", "qwen2", "qwen3").index(arch) + layers + 100 * bigram  # not the test order
        _TARGETS[key] = tiny_target(arch, seed=seed, layers=layers, bigram=bigram)
    return _TARGETS[key]


# -- loading and refusals ----------------------------------------------------------------------


@pytest.mark.parametrize("layers0", [False, True])
def test_published_layouts_load_and_the_reduced_vocabulary_maps_back(tmp_path, layers0):
    target = target_of("qwen3")
    used = np.sort(np.random.default_rng(0).choice(VOCAB, 40, replace=False))
    head = random_head(1, used)
    write_published(tmp_path / "h", head, layers0=layers0, dtype=mx.bfloat16, embed=target.model.embed_tokens.weight)
    assert is_head(tmp_path / "h") and not is_head(tmp_path)
    th = load_trained_head(tmp_path / "h", target)
    try:
        assert th.family == "eagle3" and th.tap_layers == (1, 2, 3) and th.recorder is not None
        assert th.module.fc.weight.dtype == mx.float32  # run in the target's dtype
        got = dict(tree_flatten(th.module.parameters()))
        for k, v in tree_flatten(head.parameters()):
            assert mx.array_equal(got[k], v.astype(mx.bfloat16).astype(mx.float32)).item(), k
        d = Eagle3Drafter(th, target)
        assert d._ids.tolist() == used.tolist()
        p = mx.arange(40, dtype=mx.float32) + 1
        q = d._scatter(p, VOCAB)
        assert q[mx.array(used)].tolist() == p.tolist() and float(q.sum()) == float(p.sum())
    finally:
        th.recorder.remove()


def test_default_taps_when_the_config_has_none(tmp_path):
    target = target_of("llama", layers=8)
    head = random_head(2, taps=(1, 3, 4))  # = default_taps(8): [1, L//2 - 1, L - 4]
    write_published(tmp_path / "h", head, taps_in_config=False)
    th = load_trained_head(tmp_path / "h", target)
    assert th.tap_layers == (1, 3, 4)
    th.recorder.remove()


def test_heads_that_do_not_fit_are_refused(tmp_path):
    target = target_of("qwen2")
    good = random_head(3)
    write_published(tmp_path / "h", good)
    base = json.loads((tmp_path / "h" / "config.json").read_text())

    def refused(change, match, error=PairMismatchError):
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        write_published(folder, good)
        cfg = json.loads(json.dumps(base))
        change(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(error, match=match):
            load_trained_head(folder, target)

    refused(lambda c: c.update(target_hidden_size=48), "features of width 48, the target's hidden size is 32")
    refused(lambda c: c.update(vocab_size=128), "vocabulary has 128 tokens, the target's has 64")
    refused(lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 4]),
            r"taps layers \[1, 2, 4\], the target has 4 \(0..3\)")
    refused(lambda c: c.update(intermediate_size=40), "do not fit an EAGLE-3 head", MlxspecError)
    refused(lambda c: c.update(architectures=["SomethingElse"]), "not a draft head mlxspec knows", UnsupportedModelError)
    for layer in target.model.layers:
        assert not hasattr(layer, "_mlxspec_tap")  # a refused head leaves the target untapped

    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                 sliding_window=4, sliding_window_pattern=2)
    with pytest.raises(UnsupportedModelError, match="RotatingKVCache"):
        load_trained_head(tmp_path / "h", gemma3_text.Model(args))


def test_load_a_head_folder_as_the_draft(tmp_path, target):
    """mlxspec.load(target, draft=HEAD): what save_head writes (training) loads too; auto drafts with it."""
    from mlxspec.heads.eagle3 import head_config_for, save_head

    save_tiny(tmp_path / "t", target)
    mx.random.seed(4)
    save_head(Eagle3Head(head_config_for(target, draft_vocab_size=32, tap_layers=(0, 1, 1))), tmp_path / "h")
    pair = mlxspec.load(tmp_path / "t", draft=tmp_path / "h", dtype="float32")
    try:
        assert pair.draft is None and pair.head.family == "eagle3"
        res = pair.generate("w7 w8 w9", max_tokens=12)
        assert res.stats.drafted > 0 and set(res.stats.tokens_by_source) <= {"eagle3", "target"}
        assert res.tokens == pair.generate("w7 w8 w9", max_tokens=12, drafter="none").tokens
        with pytest.raises(MlxspecError, match="needs a draft model"):
            pair.new_session(drafter="model")
    finally:
        pair.head.recorder.remove()
    plain = mlxspec.Pair(target)
    with pytest.raises(MlxspecError, match="needs a trained draft head"):
        plain.new_session(drafter="head")


# -- exactness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_greedy_identity_accepting_and_rejecting(tmp_path, arch):
    prompt = [5, 17, 33, 2, 40, 9]
    # a random target and head: drafts are (almost) all rejected
    target = target_of(arch)
    pair = head_pair(target, random_head(5), tmp_path, "random")
    want = alone(target, prompt, 40)
    res = pair.generate(prompt, max_tokens=40, num_draft=3)
    assert res.tokens == want and res.stats.drafted > 0
    pair.head.recorder.remove()

    # the copying head on a bigram target: every draft accepted, adaptive lengths grow
    big = target_of(arch, bigram=True)
    want = alone(big, prompt, 48)
    pair = head_pair(big, copying_head(big), tmp_path, "copy")
    res = pair.generate(prompt, max_tokens=48)
    assert res.tokens == want
    assert res.stats.accepted == res.stats.drafted > 30 and res.stats.tokens_per_round > 3
    pair.head.recorder.remove()

    # reduced draft vocabulary: the target's tokens outside it cannot be drafted and are rejected
    drop = {want[7]}
    used = [t for t in range(VOCAB) if t not in drop]
    pair = head_pair(big, copying_head(big, used), tmp_path, "reduced")
    res = pair.generate(prompt, max_tokens=48, adaptive=False, num_draft=4)
    assert res.tokens == want
    assert 0 < res.stats.accepted < res.stats.drafted
    pair.head.recorder.remove()


def test_greedy_identity_across_chat_turns_and_early_stop(tmp_path):
    """A session reused for a continuation (the cache diverges mid-way), and draft_p_min."""
    big = target_of("llama", bigram=True)
    pair = head_pair(big, copying_head(big, [t for t in range(VOCAB) if t % 7]), tmp_path)
    session = pair.new_session()
    first = pair.generate([5, 17, 33], max_tokens=20, session=session, num_draft=5, adaptive=False)
    prompt2 = [5, 17, 33] + first.tokens[:11] + [8, 3]
    second = pair.generate(prompt2, max_tokens=20, session=session, num_draft=5, adaptive=False)
    assert first.tokens == alone(big, [5, 17, 33], 20)
    assert second.tokens == alone(big, prompt2, 20)
    assert second.stats.accepted > 0
    third = pair.generate(prompt2, max_tokens=20, session=session, draft_p_min=0.9)
    assert third.tokens == second.tokens
    pair.head.recorder.remove()


def test_sampled_output_follows_the_target(tmp_path):
    """The copying head with the second most likely token of each of the first two steps left out
    of its vocabulary: q is the target's distribution renormalised over the draft vocabulary, so
    drafts are accepted, rejected and resampled."""
    sp = SamplingParams(temperature=1.0, top_k=4)
    target = target_of("qwen3", bigram=True)
    prompt = [7, 21, 40, 3]
    exact = exact_marginals(target, prompt, sp, steps=3)
    drop = {int(np.argsort(exact[0])[-2]), int(np.argsort(exact[1])[-2])}
    head = copying_head(target, [t for t in range(VOCAB) if t not in drop])
    pair = head_pair(target, head, tmp_path)
    session = pair.new_session()
    n, samples, drafted, accepted = 500, [], 0, 0
    for s in range(n):
        res = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=4, num_draft=2, adaptive=False,
                            seed=s, session=session)
        samples.append(res.tokens)
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    check_marginals(np.array(samples), exact)
    assert drafted // 4 < accepted < drafted * 9 // 10
    pair.head.recorder.remove()


# -- conventions: which layer, which position ----------------------------------------------------


def _hidden_states(model, ids):
    """Hugging Face's hidden_states by a plain loop: the embedding, then each layer's output."""
    h = model.model.embed_tokens(ids)
    out = [h]
    for layer in model.model.layers:
        h = layer(h, "causal" if ids.shape[1] > 1 else None, None)
        out.append(h)
    return out


def _reference_drafts(target, head: Eagle3Head, seq, k, shift=1):
    """Greedy drafts by recomputing everything from scratch, without caches: head position j
    reads hidden_states[i + shift] (the output of tapped layer i when shift is 1) at position j
    and token j + 1; each draft step appends the last pre-norm h and the drafted token."""
    ids = mx.array([seq], mx.uint32)
    hs = _hidden_states(target, ids)
    feats = mx.concatenate([hs[i + shift][:, : len(seq) - 1] for i in head.config.tap_layers], axis=-1)
    xs, toks = head.fuse(feats), list(seq[1:])
    ids_map = (mx.arange(head.d2t.shape[0]) + head.d2t).tolist()
    out = []
    for _ in range(k):
        emb = target.model.embed_tokens(mx.array([toks], mx.uint32))
        logits, h = head(emb, xs, mask="causal")
        t = ids_map[mx.argmax(logits[0, -1]).item()]
        out.append(t)
        xs = mx.concatenate([xs, h[:, -1:]], axis=1)
        toks.append(t)
    return out


def test_drafts_equal_a_from_scratch_reference_and_tap_i_is_layer_i_output(tmp_path):
    """Every round's drafts (after prefill, accepted and rejected rounds, a second turn that
    rewinds) equal the uncached reference; the same reference reading the INPUT of each tapped
    layer (an off-by-one tap) disagrees."""
    target = target_of("qwen3", layers=6)
    head = random_head(7, used=np.arange(0, VOCAB, 2), taps=(1, 3, 4))
    pair = head_pair(target, head, tmp_path)
    rounds = []

    class Recording(Eagle3Drafter):
        def propose(self, seq, k, sp, key, vocab):
            d = super().propose(seq, k, sp, key, vocab)
            if d is not None:
                rounds.append((list(seq), d.tokens.tolist()))
            return d

    session = pair.new_session()
    session.drafter.__class__ = Recording
    res = pair.generate([3, 9, 27, 17, 44], max_tokens=24, num_draft=3, adaptive=False, session=session)
    pair.generate([3, 9, 27, 17, 44] + res.tokens[:10] + [6], max_tokens=10, num_draft=3, adaptive=False,
                  session=session)
    assert len(rounds) > 10
    wrong = 0
    loaded = pair.head.module
    for seq, drafts in rounds:
        assert drafts == _reference_drafts(target, loaded, seq, len(drafts)), seq
        wrong += drafts != _reference_drafts(target, loaded, seq, len(drafts), shift=0)
    assert wrong > len(rounds) // 2
    pair.head.recorder.remove()


# -- the command line ----------------------------------------------------------------------------


def test_generate_and_bench_with_draft_head(tmp_path):
    """`--draft HEAD_DIR` in generate and bench: the head drafts, acceptance is reported."""
    from click.testing import CliRunner

    from mlxspec.cli import cli

    big = target_of("llama", bigram=True)
    save_tiny(tmp_path / "t", big)
    write_published(tmp_path / "h", copying_head(big))
    try:
        r = CliRunner().invoke(cli, ["generate", "-t", str(tmp_path / "t"), "-d", str(tmp_path / "h"), "-p", "w7 w8",
                                     "--max-tokens", "12", "--dtype", "float32"])
        assert r.exit_code == 0, r.output
        assert "eagle3 head" in r.output and "100% accepted" in r.output
        out = tmp_path / "b.json"
        r = CliRunner().invoke(cli, ["bench", "-t", str(tmp_path / "t"), "-d", str(tmp_path / "h"), "-k", "2",
                                     "-m", "8", "-r", "1", "--kinds", "code", "--per-kind", "1", "--no-warmup",
                                     "--dtype", "float32", "--json", str(out), "-q"])
        assert r.exit_code == 0, r.output
        report = json.loads(out.read_text())
        assert report["costs"]["c"] > 0
        spec = [g for g in report["results"] if g["num_draft"] == 2]
        assert spec and spec[0]["acceptance_rate"] == 1.0 and spec[0]["identical_to_target"] == 1.0
    finally:
        for layer in big.model.layers:
            rec = getattr(layer, "_mlxspec_tap", None)
            if rec is not None:
                rec.remove()


def test_convert_copies_a_head_with_provenance(tmp_path, target):
    from mlxspec.convert import ConvertError, convert

    used = np.arange(0, VOCAB, 2)
    head = random_head(8, used, taps=(0, 1, 1))
    write_published(tmp_path / "src", head, layers0=True, dtype=mx.bfloat16)
    out = convert(tmp_path / "src", tmp_path / "out", dtype="float16", progress=False)
    stored = mx.load(str(out / "model.safetensors"))
    assert stored["layers.0.self_attn.q_proj.weight"].dtype == mx.float16  # published names kept
    assert stored["d2t"].dtype == mx.int64 and stored["t2d"].dtype == mx.bool_
    prov = json.loads((out / "mlxspec-provenance.json").read_text())
    assert prov["kind"] == "draft-head" and prov["options"]["dtype"] == "float16"
    assert set(prov["sha256"]) == {"model.safetensors", "config.json"}
    save_tiny(tmp_path / "t", target)
    pair = mlxspec.load(tmp_path / "t", draft=out, dtype="float32")
    try:
        assert pair.head.family == "eagle3" and pair.head.info["draft_vocab"] == 32
        assert pair.generate("w7 w8", max_tokens=6).tokens == pair.generate("w7 w8", max_tokens=6, drafter="none").tokens
    finally:
        pair.head.recorder.remove()
    with pytest.raises(ConvertError, match="without --quantize"):
        convert(tmp_path / "src", tmp_path / "q", quantize=4, progress=False)
    assert not (tmp_path / "q").exists()


# -- token trees -----------------------------------------------------------------------------------


def test_trees_greedy_identity_and_features_after_tree_rounds(tmp_path):
    """--tree-nodes: the head drafts dynamic trees; after each tree round the target keeps the
    accepted path and the head's features follow it: every round's first head logits equal the
    uncached reference (which reads the target's plain hidden states of the sequence)."""
    target = target_of("llama", layers=6)
    head = random_head(9, taps=(1, 3, 4))
    pair = head_pair(target, head, tmp_path, "random")
    logged = []

    class Recording(Eagle3Drafter):
        def _catch_up(self, seq, upto):
            out = super()._catch_up(seq, upto)
            if out is not None and upto == len(seq) - 1:
                logged.append((list(seq), out[0]))
            return out

    session = pair.new_session(tree_nodes=6)
    session.drafter.__class__ = Recording
    prompt = [3, 9, 27, 17, 44]
    res = pair.generate(prompt, max_tokens=24, tree_nodes=6, session=session)
    assert res.tokens == alone(target, prompt, 24)
    assert res.stats.accepted > 0 and res.stats.drafted > res.stats.rounds  # trees, some paths accepted
    loaded = pair.head.module
    for seq, got in logged:
        ids = mx.array([seq], mx.uint32)
        hs = _hidden_states(target, ids)
        feats = mx.concatenate([hs[i + 1][:, : len(seq) - 1] for i in loaded.config.tap_layers], axis=-1)
        want, _ = loaded(target.model.embed_tokens(ids[:, 1:]), loaded.fuse(feats), mask="causal")
        assert mx.allclose(got, want[0, -1], atol=1e-4).item(), seq
    pair.head.recorder.remove()

    big = target_of("qwen2", bigram=True)
    pair = head_pair(big, copying_head(big), tmp_path, "copy")
    res = pair.generate(prompt, max_tokens=30, tree_nodes=8)
    assert res.tokens == alone(big, prompt, 30) and res.stats.tokens_per_round > 2
    pair.head.recorder.remove()


def test_trees_sampled_output_follows_the_target(tmp_path):
    sp = SamplingParams(temperature=1.0, top_k=4)
    target = target_of("qwen3", bigram=True)
    prompt = [7, 21, 40, 3]
    exact = exact_marginals(target, prompt, sp, steps=3)
    # the target's likeliest first token is left out of the draft vocabulary: the root's children
    # miss it (and include a token the target's top-k excludes), so some trees are rejected at once
    pair = head_pair(target, copying_head(target, [t for t in range(VOCAB) if t != int(np.argmax(exact[0]))]), tmp_path)
    session = pair.new_session(tree_nodes=5)
    n, samples, accepted = 400, [], 0
    for s in range(n):
        res = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=4, tree_nodes=5, seed=s, session=session)
        samples.append(res.tokens)
        accepted += res.stats.accepted
    check_marginals(np.array(samples), exact)
    assert n // 4 < accepted < 2 * n * 9 // 10
    pair.head.recorder.remove()
