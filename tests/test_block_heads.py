"""DFlash and DSpark block heads (heads/dflash.py, drafters/block_head.py) on tiny random
targets: the published layouts, refusals, the block forward against a direct re-implementation
of the reference code (slot conventions), greedy identity and sampled exactness."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import check_marginals, exact_marginals, tiny_llama
from mlx.utils import tree_map
from mlx_lm.models import qwen3

import mlxspec
from mlxspec.errors import MlxspecError, PairMismatchError, UnsupportedModelError
from mlxspec.heads import load_trained_head
from mlxspec.heads.dflash import BlockHeadConfig, default_taps, load_head
from mlxspec.sampling import SamplingParams, log_probs

LAYERS = 5
TAPS = (0, 2, 3)  # outputs of these target layers (the last, 4, cannot be tapped)


def tiny_qwen3(seed: int, vocab: int = 64, layers: int = LAYERS, scale: float = 4.0):
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=32, num_hidden_layers=layers, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, vocab_size=vocab,
        max_position_embeddings=512, tie_word_embeddings=False, rope_theta=1e6,
    )
    mx.random.seed(seed)
    model = qwen3.Model(args)
    model.update(tree_map(lambda p: p * scale if p.ndim > 1 else p, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


# -- heads written in the published layouts ----------------------------------------------------


def published_config(arch: str, target, block_size: int, taps=TAPS, markov_rank: int = 0,
                     confidence: bool = False, mask: int | None = None) -> dict:
    """config.json as z-lab (DFlash) and DeepSpec (DSpark) write it, for a 2-layer head."""
    a = target.args
    base = {
        "architectures": [arch], "model_type": "qwen3", "hidden_size": a.hidden_size,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": a.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 512, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "num_target_layers": a.num_hidden_layers, "layer_types": ["full_attention"] * 2,
    }
    mask = a.vocab_size - 1 if mask is None else mask
    if arch == "DFlashDraftModel":
        return {**base, "block_size": block_size, "tie_word_embeddings": False,
                "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(taps)}}
    cfg = {**base, "block_size": block_size, "mask_token_id": mask, "target_layer_ids": list(taps),
           "num_anchors": 512, "markov_rank": markov_rank, "enable_confidence_head": confidence,
           "tie_word_embeddings": False}
    if markov_rank:
        cfg["markov_head_type"] = "vanilla"
    if confidence:
        cfg["confidence_head_with_markov"] = markov_rank > 0
    return cfg


def published_weights(cfg: dict, target, seed: int, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Random tensors under the reference checkpoints' names and shapes (torch Linear: (out, in))."""
    rng = np.random.default_rng(seed)
    h, i_, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    taps = cfg.get("target_layer_ids") or cfg["dflash_config"]["target_layer_ids"]

    def mat(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1]) * 4).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": mat(h, len(taps) * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        w.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": mat(nh * d, h), p + "self_attn.k_proj.weight": mat(nkv * d, h),
            p + "self_attn.v_proj.weight": mat(nkv * d, h), p + "self_attn.o_proj.weight": mat(h, nh * d),
            p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": mat(i_, h), p + "mlp.up_proj.weight": mat(i_, h),
            p + "mlp.down_proj.weight": mat(h, i_),
        })
    if cfg["architectures"] == ["Qwen3DSparkModel"]:
        # frozen copies of the target's embedding and lm_head
        w["embed_tokens.weight"] = np.array(target.model.embed_tokens.weight)
        w["lm_head.weight"] = np.array(target.lm_head.weight)
        r = cfg["markov_rank"]
        if r:
            w["markov_head.markov_w1.weight"] = mat(v, r)
            w["markov_head.markov_w2.weight"] = mat(v, r)
        if cfg["enable_confidence_head"]:
            w["confidence_head.proj.weight"] = mat(1, h + (r if cfg.get("confidence_head_with_markov") else 0))
            w["confidence_head.proj.bias"] = np.array([1.5], np.float32)
    return w


def write_head(folder, cfg: dict, weights: dict[str, np.ndarray], dtype=mx.bfloat16):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v).astype(dtype) for k, v in weights.items()},
                        metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def qtarget():
    return tiny_qwen3(11)


@pytest.fixture(scope="module")
def ltarget():
    return tiny_llama(12, layers=LAYERS)


def make_pair(target, tmp_path, arch, name="head", seed=0, **kw):
    cfg = published_config(arch, target, **kw)
    folder = write_head(tmp_path / name, cfg, published_weights(cfg, target, seed))
    head = load_trained_head(folder, target)
    return mlxspec.Pair(target, head=head), head


def _untap(target):
    from mlxspec.heads.taps import decoder_layers

    for layer in decoder_layers(target):
        rec = getattr(layer, "_mlxspec_tap", None)
        if rec is not None:
            rec.remove()


@pytest.fixture(autouse=True)
def clean_taps(qtarget, ltarget):
    yield
    _untap(qtarget)
    _untap(ltarget)


# -- format, loading, refusal ---------------------------------------------------------------


def test_configs_parse_both_layouts(qtarget):
    d = BlockHeadConfig.from_dict(published_config("DFlashDraftModel", qtarget, block_size=16))
    assert (d.block_size, d.mask_token_id, d.tap_layers, d.dspark, d.drafts_per_block) == (16, 63, TAPS, False, 15)
    nested = published_config("DFlashDraftModel", qtarget, block_size=16)
    nested["dflash_config"]["block_size"] = nested.pop("block_size")  # block_size inside dflash_config
    assert BlockHeadConfig.from_dict(nested).block_size == 16
    del nested["dflash_config"]["target_layer_ids"]  # default: spread from layer 1 to L - 3
    del nested["num_target_layers"]
    assert BlockHeadConfig.from_dict(nested, target_layers=36).tap_layers == (1, 33)
    assert default_taps(36, 5) == (1, 9, 17, 25, 33)  # the Qwen3-8B heads' published taps
    s = BlockHeadConfig.from_dict(published_config("Qwen3DSparkModel", qtarget, block_size=7, markov_rank=16,
                                                   confidence=True))
    assert (s.block_size, s.drafts_per_block, s.markov_rank, s.confidence_head, s.confidence_with_markov) == (
        7, 7, 16, True, True)
    round_trip = BlockHeadConfig.from_dict(s.to_dict())
    assert round_trip == s


@pytest.mark.parametrize("arch, kw", [
    ("DFlashDraftModel", {}),
    ("Qwen3DSparkModel", {"markov_rank": 8, "confidence": True}),
    ("Qwen3DSparkModel", {}),  # DeepSpec's "dflash_*" checkpoints: DSpark without Markov
])
def test_published_layouts_load(qtarget, tmp_path, arch, kw):
    cfg = published_config(arch, qtarget, block_size=4, **kw)
    weights = published_weights(cfg, qtarget, seed=1)
    head = load_head(write_head(tmp_path / "h", cfg, weights))
    from mlx.utils import tree_flatten

    ours = dict(tree_flatten(head.parameters()))
    assert set(ours) == set(weights)  # every published tensor has a home, and nothing else
    for k, v in weights.items():
        assert ours[k].shape == v.shape, k
        np.testing.assert_allclose(np.array(ours[k].astype(mx.float32)),
                                   np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32)))


def test_mismatches_are_refused(qtarget, ltarget, tmp_path):
    good = published_config("DFlashDraftModel", qtarget, block_size=4)
    weights = published_weights(good, qtarget, seed=2)
    # a head trained for a wider target
    wide = {**good, "hidden_size": 48}
    wide_w = published_weights(wide, qtarget, seed=2)
    with pytest.raises(PairMismatchError, match="hidden size is 48"):
        load_trained_head(write_head(tmp_path / "wide", wide, wide_w), qtarget)
    # a tapped layer the target does not have, or its last layer
    for taps, msg in (((0, 2, 7), "taps layers"), ((0, 2, 4), "last layer")):
        bad = {**good, "dflash_config": {**good["dflash_config"], "target_layer_ids": list(taps)}}
        with pytest.raises(PairMismatchError, match=msg):
            load_trained_head(write_head(tmp_path / f"taps{taps[-1]}", bad, weights), qtarget)
    # trained on a deeper target
    with pytest.raises(PairMismatchError, match="36 layers"):
        load_trained_head(write_head(tmp_path / "deep", {**good, "num_target_layers": 36}, weights), qtarget)
    # a mask token past the target's embedding
    bad = {**good, "dflash_config": {**good["dflash_config"], "mask_token_id": 64}}
    with pytest.raises(PairMismatchError, match="mask token 64"):
        load_trained_head(write_head(tmp_path / "mask", bad, weights), qtarget)
    # a DFlash checkpoint with its own lm_head is not the z-lab format
    with pytest.raises(UnsupportedModelError, match="lm_head.weight"):
        load_trained_head(write_head(tmp_path / "lm", good, {**weights, "lm_head.weight": np.zeros((64, 32), np.float32)}),
                          qtarget)
    # DSpark's own vocabulary must be the target's
    ds = published_config("Qwen3DSparkModel", qtarget, block_size=4)
    ds_w = published_weights(ds, qtarget, seed=2)
    ds_w["embed_tokens.weight"] = ds_w["embed_tokens.weight"][:60]
    ds_w["lm_head.weight"] = ds_w["lm_head.weight"][:60]
    with pytest.raises(PairMismatchError, match="vocabulary has 60"):
        load_trained_head(write_head(tmp_path / "vocab", {**ds, "vocab_size": 60}, ds_w), qtarget)
    # missing tensors, unsupported variants
    with pytest.raises(MlxspecError, match="do not fit"):
        load_trained_head(write_head(tmp_path / "short", good, {k: v for k, v in weights.items() if k != "fc.weight"}),
                          qtarget)
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        BlockHeadConfig.from_dict({**good, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(UnsupportedModelError, match="embedding output"):
        BlockHeadConfig.from_dict({**ds, "target_layer_ids": [-1, 2]})
    with pytest.raises(UnsupportedModelError, match="rnn"):
        BlockHeadConfig.from_dict({**ds, "markov_rank": 4, "markov_head_type": "rnn"})
    with pytest.raises(MlxspecError, match="no mask_token_id"):
        BlockHeadConfig.from_dict({**ds, "mask_token_id": None})


# -- the block forward against the reference code -----------------------------------------------


def _rope(x, positions, theta):
    """Hugging Face's rotate_half RoPE, (T, n, D) at absolute positions (T,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None]  # (T, D/2)
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_block(w: dict, cfg: dict, taps: np.ndarray, block_emb: np.ndarray) -> np.ndarray:
    """z-lab's DFlashDraftModel.forward / DeepSpec's _forward_backbone in numpy, from scratch:
    taps (S, n*H) of positions 0..S-1, the block's embeddings (L, H) at positions S..S+L-1;
    every block row attends to all S + L keys. -> normed hidden (L, H)."""
    nh, nkv, d, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    s, l_ = taps.shape[0], block_emb.shape[0]
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = block_emb
    pos = np.arange(s + l_, dtype=np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731
        hn = _rms(x, p("input_layernorm.weight"))
        q = _rms((hn @ p("self_attn.q_proj.weight").T).reshape(l_, nh, d), p("self_attn.q_norm.weight"))
        kv_in = np.concatenate([ctx, hn], 0)
        k = _rms((kv_in @ p("self_attn.k_proj.weight").T).reshape(s + l_, nkv, d), p("self_attn.k_norm.weight"))
        v = (kv_in @ p("self_attn.v_proj.weight").T).reshape(s + l_, nkv, d)
        q, k = _rope(q, pos[s:], theta), _rope(k, pos, theta)
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
        att = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", att, v).reshape(l_, nh * d)
        x = x + o @ p("self_attn.o_proj.weight").T
        hn = _rms(x, p("post_attention_layernorm.weight"))
        g, u = hn @ p("mlp.gate_proj.weight").T, hn @ p("mlp.up_proj.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ p("mlp.down_proj.weight").T
    return _rms(x, w["norm.weight"])


def _hf_hidden_states(model, ids):
    """Hugging Face's hidden_states by a plain loop: the embedding, then each layer's output."""
    inner = model.model
    h = inner.embed_tokens(ids)
    out = [h]
    for layer in inner.layers:
        h = layer(h, "causal", None)
        out.append(h)
    return out


@pytest.mark.parametrize("arch, markov", [("DFlashDraftModel", None), ("Qwen3DSparkModel", "vanilla"),
                                           ("Qwen3DSparkModel", "gated")])
def test_block_matches_the_reference_forward_and_slot_convention(qtarget, tmp_path, arch, markov):
    """Drafts of rounds in a real generation equal the numpy re-implementation of the reference
    forward, with DFlash's slots 1..k (own position) and DSpark's slots 0..k-1 (shifted by one,
    Markov-corrected from the previous draft, the anchor for slot 0); shifted or swapped slots,
    or taps read at hidden_states[i] instead of [i + 1], fail."""
    bs = 4
    kw = {"markov_rank": 8} if arch == "Qwen3DSparkModel" else {}
    cfg = published_config(arch, qtarget, block_size=bs, **kw)
    w = published_weights(cfg, qtarget, seed=5, scale=1.0)
    if markov == "gated":  # DeepSpec's GatedMarkovHead: gate_proj over [h; W1[prev]]
        cfg["markov_head_type"] = "gated"
        rng = np.random.default_rng(6)
        w["markov_head.gate_proj.weight"] = rng.standard_normal((8, 32 + 8)).astype(np.float32)
        w["markov_head.gate_proj.bias"] = rng.standard_normal(8).astype(np.float32)
    head = load_trained_head(write_head(tmp_path / "h", cfg, w, dtype=mx.float32), qtarget)
    pair = mlxspec.Pair(qtarget, head=head)
    session = pair.new_session(drafter="head")
    drafter = session.drafter
    sp = SamplingParams(temperature=1.0)
    proposals = []
    real_propose = drafter.propose

    def spy(seq, k, sp_, key, vocab):
        d = real_propose(seq, k, sp_, key, vocab)
        proposals.append((list(seq), d))
        return d

    drafter.propose = spy
    pair.generate([5, 9, 2, 33, 7], max_tokens=12, num_draft=bs, temperature=1.0, seed=3, session=session)
    assert len(proposals) >= 3
    lm_head = np.array(qtarget.lm_head.weight)
    emb = np.array(qtarget.model.embed_tokens.weight)
    dspark = arch == "Qwen3DSparkModel"
    for seq, d in proposals:
        if d is None:
            continue
        start = len(seq) - 1
        hs = _hf_hidden_states(qtarget, mx.array([seq]))
        taps = np.concatenate([np.array(hs[i + 1][0, :start]) for i in TAPS], -1)
        block = [seq[-1]] + [cfg["vocab_size"] - 1] * (bs - 1)
        h = reference_block(w, cfg, taps, (w["embed_tokens.weight"] if dspark else emb)[block])
        k = d.size
        toks = np.array(d.tokens).tolist()
        if dspark:
            w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
            prev = [seq[-1]] + toks[:-1]

            def markov_bias(hs, prev_ids):
                e = w1[prev_ids]
                if markov == "gated":
                    z = np.concatenate([hs, e], -1) @ w["markov_head.gate_proj.weight"].T + w["markov_head.gate_proj.bias"]
                    e = e / (1 + np.exp(-z))
                return e @ w2.T

            logits = h[:k] @ w["lm_head.weight"].T + markov_bias(h[:k], prev)  # slot j predicts start + j + 1
        else:
            logits = h[1 : 1 + k] @ lm_head.T  # slot j predicts its own position start + j
        want = np.array(log_probs(mx.array(logits), sp))
        got = np.log(np.maximum(np.array(d.q), 1e-30))
        np.testing.assert_allclose(np.exp(got), np.exp(want), atol=2e-4)
        # the other convention (a shift by one) would give other distributions
        if dspark:
            m = min(k, bs - 1)
            wrong = h[1 : 1 + m] @ w["lm_head.weight"].T + markov_bias(h[1 : 1 + m], prev[:m])
        else:
            m, wrong = k, h[:k] @ lm_head.T
        assert np.abs(np.exp(np.array(log_probs(mx.array(wrong), sp))) - np.exp(want[:m])).max() > 1e-2
        # and so would taps read one layer early (hidden_states[i] instead of [i + 1])
        early = np.concatenate([np.array(hs[i][0, :start]) for i in TAPS], -1)
        if start > 0:
            he = reference_block(w, cfg, early, (w["embed_tokens.weight"] if dspark else emb)[block])
            assert np.abs(he - h).max() > 1e-2


# -- exactness ----------------------------------------------------------------------------------


def reference_greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(prompt):]


PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 40, 33, 12, 8, 8, 8, 21, 60, 3, 17]]


@pytest.mark.parametrize("target_name", ["qtarget", "ltarget"])
@pytest.mark.parametrize("arch, kw", [
    ("DFlashDraftModel", {"block_size": 5}),
    ("Qwen3DSparkModel", {"block_size": 4, "markov_rank": 8, "confidence": True}),
])
def test_random_heads_greedy_identity(request, tmp_path, target_name, arch, kw):
    target = request.getfixturevalue(target_name)
    pair, _ = make_pair(target, tmp_path, arch, **kw)
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=24, num_draft=16)
        assert res.tokens == reference_greedy(target, p, 24)
        assert res.stats.drafted > 0
    # with draft_p_min the block is cut (DSpark: by its confidence head): still identical
    full = pair.generate(PROMPTS[2], max_tokens=24, num_draft=16)
    res = pair.generate(PROMPTS[2], max_tokens=24, num_draft=16, draft_p_min=0.95)
    assert res.tokens == reference_greedy(target, PROMPTS[2], 24)
    assert res.stats.drafted / res.stats.rounds < full.stats.drafted / full.stats.rounds


def bigram_target(seed: int, vocab: int = 64, scale: float = 4.0):
    """A qwen3 target whose next token depends only on the current one (attention outputs
    zeroed): a DSpark Markov head can then know its distribution exactly."""
    t = tiny_qwen3(seed, vocab=vocab, scale=scale)
    for layer in t.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    mx.eval(t.parameters())
    return t


def markov_head_for(target, tmp_path, name, noise: float, seed: int = 0, block_size: int = 4):
    """A DSpark head whose backbone contributes nothing (final norm 0) and whose Markov head holds
    the target's bigram logits (noise: how far from them): slot j's logits are the target's given
    x_{j-1}, so its drafts are accepted exactly as far as the Markov chain is right."""
    v = target.args.vocab_size
    cfg = published_config("Qwen3DSparkModel", target, block_size=block_size, markov_rank=v)
    w = published_weights(cfg, target, seed)
    w["norm.weight"] = np.zeros_like(w["norm.weight"])
    bigram = np.array(target(mx.arange(v)[None])[0])  # (V, V): row j = logits after token j
    rng = np.random.default_rng(seed)
    w["markov_head.markov_w1.weight"] = np.eye(v, dtype=np.float32)
    w["markov_head.markov_w2.weight"] = (bigram.T + noise * bigram.std() * rng.standard_normal((v, v))).astype(np.float32)
    return write_head(tmp_path / name, cfg, w, dtype=mx.float32)


def zero_target(seed: int, boost: float | None):
    """A qwen3 target that prefers token 0: always (final norm 0: all logits 0, argmax 0), or
    often (boost: lm_head row 0 along its mean hidden state). A DFlash head with a zero final
    norm (logits 0: proposes 0) is then always or partly accepted."""
    t = tiny_qwen3(seed)
    if boost is None:
        t.model.norm.weight = mx.zeros_like(t.model.norm.weight)
    else:
        hs = t.model(mx.array([list(range(64))]))[0]  # final normed hidden states
        direction = mx.mean(hs, axis=0)
        w = t.lm_head.weight
        t.lm_head.weight = mx.concatenate([(boost * direction / mx.linalg.norm(direction))[None], w[1:]], axis=0)
    mx.eval(t.parameters())
    return t


@pytest.mark.parametrize("boost, lo, hi", [(None, 1.0, 1.0), (12.0, 0.05, 0.95)])
def test_dflash_accepting_head_greedy_identity(tmp_path, boost, lo, hi):
    target = zero_target(21, boost)
    cfg = published_config("DFlashDraftModel", target, block_size=6)
    w = published_weights(cfg, target, 3)
    w["norm.weight"] = np.zeros_like(w["norm.weight"])
    pair = mlxspec.Pair(target, head=load_trained_head(write_head(tmp_path / "d", cfg, w), target))
    rates = []
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=30, num_draft=16)
        assert res.tokens == reference_greedy(target, p, 30)
        rates.append(res.stats.acceptance_rate)
        assert res.stats.drafted_per_position and len(res.stats.drafted_per_position) <= 5
    assert lo <= float(np.mean(rates)) <= hi
    _untap(target)


@pytest.mark.parametrize("noise, lo, hi", [(0.0, 1.0, 1.0), (0.2, 0.3, 0.99)])
def test_dspark_markov_head_greedy_identity(tmp_path, noise, lo, hi):
    target = bigram_target(31)
    head = load_trained_head(markov_head_for(target, tmp_path, "m", noise), target)
    pair = mlxspec.Pair(target, head=head)
    rates = []
    for p in PROMPTS:
        res = pair.generate(p, max_tokens=30, num_draft=16)
        assert res.tokens == reference_greedy(target, p, 30)
        rates.append(res.stats.acceptance_rate)
        assert len(res.stats.drafted_per_position) <= 4  # DSpark: block_size drafts per block
    assert lo <= float(np.mean(rates)) <= hi
    _untap(target)


def _sampled(pair, prompt, n, sp, num_draft=3):
    session = pair.new_session()
    out = [pair.generate(prompt, max_tokens=3, temperature=sp.temperature, num_draft=num_draft, seed=s,
                         session=session) for s in range(n)]
    return np.array([r.tokens for r in out]), sum(r.stats.accepted for r in out), sum(r.stats.drafted for r in out)


SMALL_V = 16  # full distributions (no top-k): the exact marginals enumerate 16^3 continuations


def test_dflash_sampled_output_follows_the_target(tmp_path):
    target = tiny_qwen3(41, vocab=SMALL_V, scale=1.5)
    sp = SamplingParams(temperature=1.0)
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, sp, steps=3)
    cfg = published_config("DFlashDraftModel", target, block_size=4)
    w = published_weights(cfg, target, 7)
    w["norm.weight"] = 0.3 * w["norm.weight"]  # a flatter q: it overlaps p, acceptance is partial
    pair = mlxspec.Pair(target, head=load_trained_head(write_head(tmp_path / "d", cfg, w), target))
    samples, acc, drafted = _sampled(pair, prompt, 500, sp)
    assert 0.1 * drafted < acc < 0.9 * drafted
    check_marginals(samples, exact)
    _untap(target)


def test_dspark_sampled_output_follows_the_target(tmp_path):
    target = bigram_target(51, vocab=SMALL_V, scale=1.5)
    sp = SamplingParams(temperature=1.0)
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, sp, steps=3)
    head = load_trained_head(markov_head_for(target, tmp_path, "m", noise=0.7), target)
    pair = mlxspec.Pair(target, head=head)
    samples, acc, drafted = _sampled(pair, prompt, 500, sp)
    assert 0.2 * drafted < acc < 0.97 * drafted
    check_marginals(samples, exact)
    _untap(target)


def test_load_session_turns_and_long_prompts(ltarget, tmp_path):
    """mlxspec.load(target, draft=HEAD) drafts with the head; a session's next turn that
    diverges inside the earlier one rewinds the head's context; a prompt longer than one
    prefill chunk (512) is fed in chunks; all token-identical to the target alone."""
    from conftest import save_tiny

    save_tiny(tmp_path / "t", ltarget)
    cfg = published_config("Qwen3DSparkModel", ltarget, block_size=4, markov_rank=8, confidence=True)
    head_dir = write_head(tmp_path / "h", cfg, published_weights(cfg, ltarget, 4), dtype=mx.float32)
    pair = mlxspec.load(tmp_path / "t", draft=head_dir)
    assert pair.head.family == "dspark" and pair.head.info["block_size"] == 4
    # its embed_tokens and lm_head are copies of the target's: held once
    assert pair.head.info["shares_target"] == ["embed_tokens", "lm_head"]
    target = pair.target
    session = pair.new_session()
    first = [9, 40, 33, 12, 8, 8]
    res = pair.generate(first, max_tokens=12, num_draft=4, session=session)
    assert res.tokens == reference_greedy(target, first, 12) and res.stats.drafted > 0
    turn = first[:3] + [17, 21]  # diverges at position 3, inside the head's cached context
    res = pair.generate(turn, max_tokens=12, num_draft=4, session=session)
    assert res.tokens == reference_greedy(target, turn, 12)
    longer = session.tokens + [5, 6]  # extends the previous turn: only the new rows are fed
    res = pair.generate(longer, max_tokens=8, num_draft=4, session=session)
    assert res.tokens == reference_greedy(target, longer, 8)
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(6, 64, 600).tolist()
    res = pair.generate(long_prompt, max_tokens=10, num_draft=4)
    assert res.tokens == reference_greedy(target, long_prompt, 10) and res.stats.drafted > 0
    pair.head.recorder.remove()


@pytest.mark.parametrize("arch, kw", [("DFlashDraftModel", {}), ("Qwen3DSparkModel", {"markov_rank": 8})])
def test_bench_times_a_block(qtarget, tmp_path, arch, kw):
    """bench's draft-step cost for a block head: one block round per timed step, over the block's
    drafts (c per drafted token); the timed steps leave the head's cache at the context."""
    from mlxspec.bench import measure_costs
    from mlxspec.drafters.block_head import step_timer

    pair, head = make_pair(qtarget, tmp_path, arch, block_size=4, **kw)
    step, cache = step_timer(head, qtarget, 12)
    out = step(mx.array([[5]], mx.uint32), cache)
    assert out.shape == (head.module.config.drafts_per_block,) and cache[0].offset == 13
    costs = measure_costs(pair, list(range(1, 13)), 3, repeats=1)
    assert costs.draft_step > 0 and costs.c > 0
