"""The EAGLE-3 head format (heads/eagle3.py) and the hidden-state taps (heads/taps.py) that
loading and training share."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from conftest import tiny_llama
from mlxspec.errors import MlxspecError, UnsupportedModelError
from mlxspec.heads.eagle3 import (
    Eagle3Config, Eagle3Head, default_taps, draft_to_target, head_config_for, is_eagle3, load_head, save_head,
    vocab_maps,
)
from mlxspec.heads.taps import install_taps


@pytest.fixture(scope="module")
def deep_target():
    return tiny_llama(3, layers=6)


def _hidden_states(model, ids):
    """Hugging Face's hidden_states: the embedding, then every layer's output, by a plain loop."""
    inner = model.model
    h = inner.embed_tokens(ids)
    out = [h]
    for layer in inner.layers:
        h = layer(h, "causal" if ids.shape[1] > 1 else None, None)
        out.append(h)
    return out


def test_tap_i_is_the_output_of_layer_i(deep_target):
    ids = mx.array([[3, 14, 15, 9, 26, 5]], mx.uint32)
    hs = _hidden_states(deep_target, ids)
    rec = install_taps(deep_target, [1, 2, 4])
    try:
        cache = make_prompt_cache(deep_target)
        deep_target(ids[:, :2], cache=cache)
        logits = deep_target(ids[:, 2:], cache=cache)
        assert rec.offset == 2
        got = rec.hidden()
        want = mx.concatenate([hs[i + 1][:, 2:] for i in (1, 2, 4)], axis=-1)  # hidden_states[i + 1]
        assert mx.allclose(got, want, atol=1e-4).item()
        off_by_one = mx.concatenate([hs[i][:, 2:] for i in (1, 2, 4)], axis=-1)
        assert not mx.allclose(got, off_by_one, atol=1e-2).item()
    finally:
        rec.remove()
    plain = deep_target(ids, cache=None)[:, 2:]
    assert mx.allclose(logits, plain, atol=1e-4).item()
    assert type(deep_target.model.layers[1]).__name__ == "TransformerBlock"  # removed cleanly
    install_taps(deep_target, [0]).remove()  # and can be installed again


def test_taps_refuse_bad_layers_and_rotating_caches(deep_target):
    with pytest.raises(UnsupportedModelError, match="6 layers"):
        install_taps(deep_target, [6])
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                 sliding_window=4, sliding_window_pattern=2)
    with pytest.raises(UnsupportedModelError, match="RotatingKVCache"):
        install_taps(gemma3_text.Model(args), [0])


def test_vocab_maps_are_offsets():
    d2t, t2d = vocab_maps([7, 2, 9, 2], 12)
    assert d2t.tolist() == [2 - 0, 7 - 1, 9 - 2]
    assert np.flatnonzero(t2d).tolist() == [2, 7, 9]
    assert draft_to_target(mx.array(d2t)).tolist() == [2, 7, 9]
    with pytest.raises(MlxspecError):
        vocab_maps([12], 12)


def test_save_load_round_trip_and_speculators_names(tmp_path, deep_target):
    cfg = head_config_for(deep_target, draft_vocab_size=16)
    assert cfg.tap_layers == default_taps(6) == (1, 2, 2)
    head = Eagle3Head(cfg)
    d2t, t2d = vocab_maps(np.arange(0, 64, 4), 64)
    head.set_vocab(mx.array(d2t), mx.array(t2d))
    save_head(head, tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 16
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    stored = mx.load(str(tmp_path / "h" / "model.safetensors"))
    assert stored["fc.weight"].shape == (32, 3 * 32)
    assert stored["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # input [embedding; hidden]
    assert stored["d2t"].dtype == mx.int64 and stored["t2d"].dtype == mx.bool_
    assert is_eagle3(tmp_path / "h")

    back = load_head(tmp_path / "h")
    assert back.config == cfg
    assert draft_to_target(back.d2t).tolist() == list(range(0, 64, 4))
    for (k, a), (k2, b) in zip(tree_flatten(head.parameters()), tree_flatten(back.parameters())):
        assert k == k2 and mx.array_equal(a, b).item()

    # the speculators/SGLang variant names its layer layers.0.*
    renamed = {(k.replace("midlayer.", "layers.0.") if k.startswith("midlayer.") else k): v for k, v in stored.items()}
    (tmp_path / "s").mkdir()
    mx.save_safetensors(str(tmp_path / "s" / "model.safetensors"), renamed)
    (tmp_path / "s" / "config.json").write_text(json.dumps(raw))
    again = load_head(tmp_path / "s")
    x = mx.random.normal((1, 3, 32))
    a, _ = head(x, x)
    b, _ = again(x, x)
    assert mx.array_equal(a, b).item()


def test_config_defaults_and_refusals(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32, "intermediate_size": 64,
           "num_attention_heads": 4, "vocab_size": 64}
    c = Eagle3Config.from_dict(cfg, target_layers=32)
    assert c.tap_layers == (1, 15, 28) and c.rope_theta == 10000.0 and c.draft_vocab_size == 64
    with pytest.raises(MlxspecError, match="which target layers"):
        Eagle3Config.from_dict(cfg)
    with pytest.raises(MlxspecError, match="not an EAGLE-3 head"):
        Eagle3Config.from_dict({**cfg, "architectures": ["LlamaForCausalLM"]}, 32)
