"""Tests for `mlxspec convert`: tiny models written inside the tests, no network.

The reference is always mlx-lm itself: a Hugging Face folder written here is loaded by
`mlx_lm.load` as is, and the converted folder must give the same logits. GGUF files are written
with `gguf.GGUFWriter` from the same known weights (llama's q/k permuted the way llama.cpp does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from click.testing import CliRunner  # noqa: E402
from conftest import importable_env  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from mlxspec import convert as conv  # noqa: E402
from mlxspec.gguf_reader import permute_for_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 12345 héllo"

# hidden 256 so that every GGUF block size (32, and 256 for K-quants) divides every row
HIDDEN, INTER, HEADS, KV, LAYERS = 256, 512, 4, 2, 2


# ----------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------
def _tokenizer(extra_word: str = "") -> Tokenizer:
    """A real byte-level BPE tokenizer (gpt2 style), trained here on a few lines."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [TEXT, "hello world, the quick brown fox jumps over the lazy dog " * 3,
              "for i in range(10): print(i)\nimport numpy as np\n" + extra_word]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def _weights(arch: str, vocab: int, seed: int, tied: bool) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 weights, scaled up so greedy output is not degenerate."""
    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS

    def lin(o, i):
        return (rng.standard_normal((o, i)) * 4 / np.sqrt(i)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    if not tied:
        w["lm_head.weight"] = lin(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "self_attn.q_proj.weight"] = lin(HEADS * hd, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = lin(KV * hd, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = lin(KV * hd, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * hd)
        w[p + "mlp.gate_proj.weight"] = lin(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = lin(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTER)
        if arch == "qwen2":
            for n, d in (("q", HEADS * hd), ("k", KV * hd), ("v", KV * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = rng.standard_normal(d).astype(np.float32)
    return w


def _config(arch: str, vocab: int, tied: bool) -> dict:
    return {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HIDDEN // HEADS,
        "rms_norm_eps": 1e-6, "rope_theta": 100000.0, "vocab_size": vocab,
        "max_position_embeddings": 512, "tie_word_embeddings": tied,
        "bos_token_id": 0, "eos_token_id": 2,
    }


def write_hf(folder: Path, arch: str = "llama", seed: int = 0, tied: bool = False,
             tok: Tokenizer | None = None, shards: int = 1) -> dict[str, np.ndarray]:
    """A Hugging Face folder: config.json, safetensors (optionally sharded), tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tok or _tokenizer()
    vocab = tok.get_vocab_size()
    w = _weights(arch, vocab, seed, tied)
    (folder / "config.json").write_text(json.dumps(_config(arch, vocab, tied)))
    names = sorted(w)
    for i in range(shards):
        part = {k: mx.array(w[k]) for k in names[i::shards]}
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(folder / fname), part, metadata={"format": "pt"})
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE,
        "add_bos_token": False}))
    return w


def write_gguf(path: Path, arch: str = "llama", seed: int = 0, tied: bool = False,
               qtype: str = "F32", tok: Tokenizer | None = None,
               w: dict[str, np.ndarray] | None = None, raw: dict | None = None,
               raw_type=None, arch_name: str | None = None,
               spm: list[tuple[str, float, int]] | None = None) -> dict[str, np.ndarray]:
    """A GGUF file as llama.cpp writes it, from known Hugging Face-named weights.

    `raw` maps some names to already-quantized blocks of `raw_type`, written as they are.
    `spm` (token, score, type) rows give a SentencePiece vocabulary instead of `tok`'s."""
    tok = tok or _tokenizer()
    vocab = len(spm) if spm else tok.get_vocab_size()
    w = w if w is not None else _weights(arch, vocab, seed, tied)
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(0)
    if spm:  # llama.cpp's SentencePiece layout: scores, no merges, BOS added by default
        writer.add_tokenizer_model("llama")
        writer.add_token_list([t for t, _, _ in spm])
        writer.add_token_scores([sc for _, sc, _ in spm])
        writer.add_token_types([ty for _, _, ty in spm])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        inv = {i: t for t, i in tok.get_vocab().items()}
        tokens = [inv[i] for i in range(vocab)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        merges = json.loads(tok.to_str())["model"]["merges"]
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        writer.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
        writer.add_eos_token_id(tok.token_to_id("<|im_end|>"))
        writer.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
        writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    q = gguf.GGMLQuantizationType[qtype]
    for name, x in w.items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{layer[rest]}.{kind}"
        else:
            gname = f"{names[base]}.{kind}"
        if raw and name in raw:
            writer.add_tensor(gname, raw[name], raw_dtype=raw_type)
            continue
        if arch == "llama" and rest_is(name, "q_proj"):
            x = permute_for_gguf(x, HEADS)
        elif arch == "llama" and rest_is(name, "k_proj"):
            x = permute_for_gguf(x, KV)
        if x.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(gname, x.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(gname, x.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(x, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w


def rest_is(name: str, proj: str) -> bool:
    return f".self_attn.{proj}." in name


# The split regex of Qwen2's own tokenizer.json, written out here so that the reference does
# not come from the code under test (nor from transformers' internals).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _as_qwen2(tok: Tokenizer) -> Tokenizer:
    """The same vocabulary with Qwen2's split regex, which a qwen2 GGUF (pre "qwen2") asks for."""
    from tokenizers import Regex

    t = Tokenizer.from_str(tok.to_str())
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return t


def _logits(folder: Path, tokens: list[int]) -> np.ndarray:
    from mlx_lm import load

    model, _ = load(str(folder))
    return np.array(model(mx.array([tokens])).astype(mx.float32))


def _loaded(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in folder.glob("model*.safetensors"):
        out.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return _tokenizer()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, tok) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    write_hf(folder, "llama", tok=tok, shards=2)
    return folder


# ----------------------------------------------------------------------------------------
# Hugging Face folders
# ----------------------------------------------------------------------------------------
def test_hf_folder_same_logits_as_mlx_lm(hf_llama, tok, tmp_path):
    out = conv.convert(hf_llama, tmp_path / "out", progress=False)
    ids = tok.encode(TEXT).ids
    np.testing.assert_array_equal(_logits(out, ids), _logits(hf_llama, ids))
    prov = json.loads((out / "mlxspec-provenance.json").read_text())
    assert prov["source_kind"] == "hf-folder"
    assert set(prov["sha256"]) == {"config.json", "model-00001-of-00002.safetensors",
                                   "model-00002-of-00002.safetensors"}
    assert prov["options"]["dtype"] is None and "mlxspec_version" in prov
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    # the tokenizer and its chat template came along
    from mlx_lm import load

    _, t = load(str(out))
    assert t.encode(TEXT) == ids
    assert "<|im_start|>assistant" in t.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)


def test_hf_dtype_quantize_and_shards(hf_llama, tok, tmp_path, monkeypatch):
    ids = tok.encode(TEXT).ids
    ref = _logits(hf_llama, ids)
    monkeypatch.setattr(conv, "SHARD_BYTES", 400_000)
    out = conv.convert(hf_llama, tmp_path / "q8", dtype="float32", quantize=8, group_size=32,
                       progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    got = _logits(out, ids)
    # the same quantization mlx-lm applies: compare with mlx-lm's own quantize_model
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(hf_llama)
    model, _ = quantize_model(model, config, 32, 8)
    want = np.array(model(mx.array([ids])))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the x4-scaled tiny model amplifies rounding; a loose sanity bound only
    assert np.abs(got - ref).max() < 0.25 * np.abs(ref).max()

    out16 = conv.convert(hf_llama, tmp_path / "f16", dtype="bfloat16", progress=False)
    w = mx.load(str(next(out16.glob("model*.safetensors"))))
    assert all(v.dtype == mx.bfloat16 for v in w.values())
    np.testing.assert_allclose(_logits(out16, ids), ref, atol=0.25 * np.abs(ref).max())


# ----------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_gguf_f32_round_trip_exact(arch, tied, tok, tmp_path):
    w = write_gguf(tmp_path / "m.gguf", arch, seed=1, tied=tied, tok=tok)
    out = conv.convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    got = _loaded(out)
    assert set(got) == set(w)
    for k in w:
        np.testing.assert_array_equal(got[k], w[k], err_msg=k)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["model_type"] == arch
    assert cfg["tie_word_embeddings"] is tied
    # and mlx-lm gives the same logits from it as from a Hugging Face folder of the weights
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(_config(arch, tok.get_vocab_size(), tied)))
    mx.save_safetensors(str(hf / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    tok.save(str(hf / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    np.testing.assert_allclose(_logits(out, ids), _logits(hf, ids), rtol=1e-5, atol=1e-5)
    # the tokenizer rebuilt from the metadata tokenizes like the original
    from mlx_lm import load

    _, t = load(str(out))
    assert t.encode(TEXT) == _as_qwen2(tok).encode(TEXT).ids if arch == "qwen2" else ids
    assert t.eos_token == "<|im_end|>"
    assert t.chat_template == TEMPLATE


SPM_TEXTS = [TEXT, "the quick brown fox jumps over the lazy dog", "import numpy as np"]


def _sentencepiece() -> tuple[Tokenizer, list[tuple[str, float, int]]]:
    """A SentencePiece-style BPE (Metaspace) trained here, and the (token, score, type) rows a
    llama.cpp GGUF stores for it: <unk> <s> </s>, 256 byte tokens, the pieces in merge order
    scored -rank, then a user-defined <think>; no merges (llama.cpp derives them from scores)."""
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(SPM_TEXTS * 3 + ["hello world, " * 3], vocab_size=400, show_progress=False)
    base = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1]) if t not in base]
    rows = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    rows += [(t, 0.0, 6) for t in base[3:]]
    rows += [(t, -float(r), 1) for r, t in enumerate(pieces)]
    rows.append(("<think>", 0.0, 4))
    return sp._tokenizer, rows


def test_gguf_sentencepiece_tokenizer(tmp_path):
    """A llama-style (SentencePiece) vocabulary, rebuilt from its scores alone, tokenizes like
    the original; gemma3's flavour (no prefix space, spaces kept as U+2581) too."""
    from mlx_lm import load

    from mlxspec.gguf_reader import GGUFModel, build_gguf_tokenizer

    ref, rows = _sentencepiece()
    write_gguf(tmp_path / "m.gguf", "llama", seed=4, spm=rows)
    out = conv.convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    _, t = load(str(out))
    for text in SPM_TEXTS + ["ase brn ell ern"]:  # the last depends on the merge order
        ids = t.encode(text, add_special_tokens=False)
        assert t.convert_ids_to_tokens(ids) == ref.encode(text).tokens, text
        assert t.decode(ids) == text
    assert t.encode("hi")[0] == 1  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    ids = t.encode("a <think> b<0x41>", add_special_tokens=False)
    assert "<think>" in t.convert_ids_to_tokens(ids)  # user-defined tokens stay whole
    assert t.decode(t.encode("snow ☃ man", add_special_tokens=False)) == "snow ☃ man"  # bytes
    spec = GGUFModel(tmp_path / "m.gguf")
    gemma = build_gguf_tokenizer("gemma3", spec._tokenizer_spec())
    for text in SPM_TEXTS[1:]:  # no double spaces: Gemma merges spaces, SentencePieceBPE splits
        assert gemma.encode(" " + text).tokens == ref.encode(text).tokens
        assert gemma.decode(gemma.encode(text).ids) == text


# error bound relative to the largest |w| in the tensor
_QUANT_TOL = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.01, "Q5_0": 0.07, "Q4_0": 0.15, "Q4_1": 0.1}


@pytest.mark.parametrize("qtype", sorted(_QUANT_TOL))
def test_gguf_quantized_within_error(qtype, tok, tmp_path):
    from mlxspec.gguf_reader import _unpermute

    w = write_gguf(tmp_path / "m.gguf", "llama", seed=2, qtype=qtype, tok=tok)
    out = conv.convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    got = _loaded(out)
    q = gguf.GGMLQuantizationType[qtype]
    for k, x in w.items():
        err = np.abs(got[k] - x).max()
        assert err <= _QUANT_TOL[qtype] * np.abs(x).max() + 1e-6, (k, err)
        if x.ndim == 2 and qtype not in ("F16",):
            # and exactly what gguf's own dequantizer gives for the bytes in the file
            heads = HEADS if ".q_proj." in k else KV if ".k_proj." in k else 0
            stored = permute_for_gguf(x, heads) if heads else x
            want = gguf.quants.dequantize(gguf.quants.quantize(stored, q), q)
            np.testing.assert_array_equal(got[k], _unpermute(want, heads) if heads else want)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_gguf_block_types_match_reference_dequantizer(qtype, tmp_path, tok):
    """K-quants: gguf-py cannot quantize them, so the file holds valid random blocks, and each
    converted tensor must equal gguf's own dequantization of those bytes, un-permuted."""
    from mlxspec.gguf_reader import _unpermute

    w = _weights("llama", tok.get_vocab_size(), 3, False)
    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    # byte offsets of the fp16 scales in each block: keep them small and finite
    scale_at = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [size - 2], "Q8_0": [0]}[qtype]
    rng = np.random.default_rng(0)
    raw = {}
    for k, x in w.items():
        if x.ndim == 2:
            b = rng.integers(0, 256, (x.size // block, size), dtype=np.uint8)
            for o in scale_at:
                b[:, o:o + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            raw[k] = b.reshape(x.shape[0], -1)
    write_gguf(tmp_path / "m.gguf", "llama", tok=tok, w=w, raw=raw, raw_type=q)
    out = conv.convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    got = _loaded(out)
    for k, x in w.items():
        want = gguf.quants.dequantize(raw[k], q) if k in raw else x
        if ".q_proj." in k:
            want = _unpermute(want, HEADS)
        elif ".k_proj." in k:
            want = _unpermute(want, KV)
        np.testing.assert_array_equal(got[k], want, err_msg=k)


# ----------------------------------------------------------------------------------------
# The hub path, through a Hugging Face cache laid out here (real huggingface-hub, offline)
# ----------------------------------------------------------------------------------------
def _hub_cache(home: Path, repo: str, src: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo_dir / "blobs" / f"{f.name}.blob"
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "import sys; from mlxspec.convert import convert_command; convert_command(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=importable_env(**env), timeout=120)


def test_hub_repo_from_offline_cache(hf_llama, tok, tmp_path):
    _hub_cache(tmp_path / "hf-home", "tiny-org/tiny-llama", hf_llama)
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    r = _run_cli(["tiny-org/tiny-llama", "-o", str(tmp_path / "out"), "--quiet"], env)
    assert r.returncode == 0, r.stderr
    prov = json.loads((tmp_path / "out" / "mlxspec-provenance.json").read_text())
    assert prov["source"] == "tiny-org/tiny-llama" and prov["source_kind"] == "hf-hub"
    assert prov["revision"] == "0123456789abcdef0123456789abcdef01234567"
    ids = tok.encode(TEXT).ids
    np.testing.assert_array_equal(_logits(tmp_path / "out", ids), _logits(hf_llama, ids))
    # not in the cache, offline: one clear line that suggests a local path, no traceback
    r = _run_cli(["tiny-org/absent", "-o", str(tmp_path / "absent")], env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: cannot get tiny-org/absent") and "local" in last
    assert "HF_HUB_OFFLINE" in last
    assert "Traceback" not in r.stderr and not (tmp_path / "absent").exists()


# ----------------------------------------------------------------------------------------
# Atomicity, --force, errors
# ----------------------------------------------------------------------------------------
def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failure_half_way_leaves_nothing(hf_llama, tmp_path, monkeypatch, exc):
    calls = {"n": 0}
    real = conv._transform

    def failing(block, job):
        calls["n"] += 1
        if calls["n"] == 5:
            raise exc
        return real(block, job)

    monkeypatch.setattr(conv, "_transform", failing)
    with pytest.raises(type(exc)):
        conv.convert(hf_llama, tmp_path / "out", progress=False)
    assert calls["n"] == 5
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_existing_output_needs_force(hf_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(conv.ConvertError, match="--force"):
        conv.convert(hf_llama, out, progress=False)
    assert (out / "keep.txt").exists()
    runner = CliRunner()
    r = runner.invoke(conv.convert_command, [str(hf_llama), "-o", str(out), "--quiet"])
    assert r.exit_code == 1 and "already exists" in r.output
    r = runner.invoke(conv.convert_command, [str(hf_llama), "-o", str(out), "--quiet", "--force"])
    assert r.exit_code == 0, r.output
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert _leftovers(tmp_path) == []


def test_clear_errors(tok, tmp_path):
    def err(src, **kw):
        with pytest.raises(conv.ConvertError) as e:
            conv.convert(src, tmp_path / "never", progress=False, **kw)
        assert not (tmp_path / "never").exists()
        return str(e.value.message)

    write_gguf(tmp_path / "ok.gguf", "llama", tok=tok)
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    assert "truncated" in err(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"NOPE" + data[4:1000])
    assert "GGUF magic" in err(tmp_path / "junk.gguf")
    write_gguf(tmp_path / "phi.gguf", "llama", tok=tok, arch_name="phi2")
    msg = err(tmp_path / "phi.gguf")
    assert "'phi2'" in msg and "llama, qwen2, qwen3, gemma3" in msg

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(_config("llama", 320, False)))
    assert "no weights" in err(empty)
    notok = tmp_path / "notok"
    write_hf(notok, tok=tok)
    (notok / "tokenizer.json").unlink()
    assert "no tokenizer" in err(notok)
    assert "no such file" in err(tmp_path / "missing.gguf")
    assert "dtype" in err(tmp_path / "ok.gguf", dtype="int8")


def test_unsupported_tensor_type_is_named(tok, tmp_path, monkeypatch):
    import mlxspec.gguf_reader as gr

    write_gguf(tmp_path / "m.gguf", "llama", tok=tok, qtype="Q8_0")
    monkeypatch.setattr(gr, "SUPPORTED_TENSOR_TYPES", ("F32", "F16"))
    with pytest.raises(conv.ConvertError, match=r"Q8_0.*supported: F32, F16"):
        conv.convert(tmp_path / "m.gguf", tmp_path / "out", progress=False)


def test_disk_full_is_reported(hf_llama, tmp_path, monkeypatch):
    import errno as errno_

    def full(*a, **k):
        raise OSError(errno_.ENOSPC, "No space left on device")

    monkeypatch.setattr(conv, "_as_bytes", full)
    with pytest.raises(conv.ConvertError, match="disk filled up"):
        conv.convert(hf_llama, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------
# Pairs
# ----------------------------------------------------------------------------------------
def test_pair_gguf_target_hf_draft(tok, hf_llama, tmp_path):
    write_gguf(tmp_path / "target.gguf", "llama", seed=5, tok=tok, qtype="Q8_0")
    out = conv.convert(tmp_path / "target.gguf", tmp_path / "pair", draft=hf_llama,
                       dtype="float32", progress=False)
    manifest = json.loads((out / "mlxspec-pair.json").read_text())
    assert manifest["format"] == "mlxspec-pair" and manifest["version"] == 1
    assert (manifest["target"], manifest["draft"]) == ("target", "draft")
    assert manifest["provenance"]["tokenizer_check"]["vocab_size"] == tok.get_vocab_size()
    assert conv.is_pair(out)
    from mlx_lm import load

    for sub in ("target", "draft"):
        model, t = load(str(out / sub))
        assert t.encode(TEXT) == tok.encode(TEXT).ids
        assert (out / sub / "mlxspec-provenance.json").exists()


def test_pair_with_different_tokenizers_is_refused(tok, tmp_path):
    write_hf(tmp_path / "a", tok=tok)
    write_hf(tmp_path / "b", tok=_tokenizer(extra_word="zebra zebra zebra quokka " * 5))
    with pytest.raises(conv.ConvertError, match="tokenizer differs"):
        conv.convert(tmp_path / "a", tmp_path / "pair", draft=tmp_path / "b", progress=False)
    assert not (tmp_path / "pair").exists() and _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------
# A real model (deselected by default: pytest -m realmodel)
# ----------------------------------------------------------------------------------------
SMOL_GGUF = ROOT / "models" / "offline" / "gguf" / "smollm2-135m-instruct-q4_1.gguf"
SMOL_MLX = ROOT / "models" / "offline" / "smollm2-135m"


@pytest.mark.realmodel
def test_real_smollm2_converts_and_generates(tmp_path):
    from mlx_lm import generate, load

    if SMOL_GGUF.exists():
        folder = conv.convert(SMOL_GGUF, tmp_path / "smol", progress=False)
    elif SMOL_MLX.exists():
        folder = SMOL_MLX
    else:
        pytest.skip("run scripts/get_offline_models.py --only smollm2-135m first")
    model, tokenizer = load(str(folder))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    text = generate(model, tokenizer, prompt=prompt, max_tokens=24)
    assert "Paris" in text, text
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_cli_ctrl_c_exits_130_and_cleans_up(hf_llama, tmp_path, monkeypatch):
    def interrupted(block, job):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_transform", interrupted)
    r = CliRunner().invoke(conv.convert_command, [str(hf_llama), "-o", str(tmp_path / "out"),
                                                  "--quiet"])
    assert r.exit_code == 130 and "nothing was written" in r.output
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
