"""Read a GGUF file (llama.cpp, Ollama) as a Hugging Face-style model: config, tensors, tokenizer.

The tensors are dequantized with the `gguf` package and numpy, one tensor and a few thousand
rows at a time, so that a caller can stream them to disk: `mlx.core.load` cannot be used
because it fails on K-quants. Names are mapped to the Hugging Face names mlx-lm's model
classes use, and llama.cpp's changes to the weights are undone:

- llama: `attn_q` / `attn_k` rows are permuted for llama.cpp's rotary layout;
- gemma3: RMSNorm weights are stored as `1 + w`.

The tokenizer is rebuilt from the metadata with the public `tokenizers` API (byte-level BPE for
gpt2-style vocabularies such as Qwen2 and SmolLM, SentencePiece-BPE for llama/gemma ones); it
does not depend on transformers' private GGUF helpers, which change between releases.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# Every type here is dequantized by the `gguf` package with numpy; the first nine are tested.
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K",
    "Q5_0", "Q5_1", "Q2_K", "Q3_K",
)

# Rows dequantized at a time: bounds the float32 working set to about 64 MB per tensor chunk.
_CHUNK_FLOATS = 16 << 20


class GGUFError(ValueError):
    """A GGUF file this converter cannot read; the message says what to do."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor, named and shaped as in the Hugging Face checkpoint (row-major shape)."""

    name: str  # Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
    gguf_name: str
    shape: tuple[int, ...]
    ggml_type: str
    chunks: Callable[[], Iterator[np.ndarray]] = field(repr=False, compare=False)


# blk.N.<gguf> -> model.layers.N.<hf>; gemma3 overrides a few.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

_HF_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}


def _clean_float(x: float) -> float:
    # metadata floats are float32: 9.999999974752427e-07 -> 1e-06
    return float(f"{float(x):.7g}")


class GGUFModel:
    """A GGUF file opened for conversion. Construction reads only the header and metadata."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        try:
            self.reader = gguf.GGUFReader(self.path)
        except GGUFError:
            raise
        except Exception as e:  # numpy raises on reads past the end of a truncated memmap
            raise GGUFError(
                f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                "it may be truncated or corrupt -- download it again and check its SHA-256"
            ) from None
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {t.name} ends at byte "
                    f"{t.data_offset + t.n_bytes:,} but the file has {size:,} bytes"
                )
        self.arch = str(self._get("general.architecture", ""))
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"unsupported GGUF architecture {self.arch!r} in {self.path.name}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self._by_name = {t.name: t for t in self.reader.tensors}
        bad = sorted({t.tensor_type.name for t in self.reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
        if bad:
            raise GGUFError(
                f"unsupported GGUF tensor type(s) {', '.join(bad)} in {self.path.name}; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
        if "rope_freqs.weight" in self._by_name:
            raise GGUFError(
                f"{self.path.name} carries llama3-style `rope_freqs` (RoPE frequency scaling); "
                "converting it from GGUF is not supported -- convert the Hugging Face checkpoint"
            )
        self.config = self._build_config()

    # -- metadata -------------------------------------------------------------------------
    def _get(self, key: str, default: Any = None) -> Any:
        f = self.reader.get_field(key)
        if f is None:
            return default
        v = f.contents()
        return v

    def _arch(self, key: str, default: Any = None) -> Any:
        return self._get(f"{self.arch}.{key}", default)

    def metadata(self) -> dict[str, Any]:
        """Scalar metadata (arrays summarised), for provenance and debugging."""
        out = {}
        for k, f in self.reader.fields.items():
            if k.startswith("GGUF.") or k.startswith("tokenizer.ggml."):
                continue
            if k == "tokenizer.chat_template":
                continue
            try:
                v = f.contents()
            except Exception:
                continue
            if isinstance(v, list) and len(v) > 16:
                v = f"[{len(v)} items]"
            out[k] = v
        return out

    def _build_config(self) -> dict[str, Any]:
        need = {
            "hidden_size": "embedding_length",
            "intermediate_size": "feed_forward_length",
            "num_hidden_layers": "block_count",
            "num_attention_heads": "attention.head_count",
        }
        cfg: dict[str, Any] = {}
        for hf_key, key in need.items():
            v = self._arch(key)
            if v is None:
                raise GGUFError(f"{self.path.name}: metadata {self.arch}.{key} is missing")
            cfg[hf_key] = int(v)
        heads = cfg["num_attention_heads"]
        cfg["num_key_value_heads"] = int(self._arch("attention.head_count_kv", heads))
        cfg["head_dim"] = int(self._arch("attention.key_length", cfg["hidden_size"] // heads))
        cfg["rms_norm_eps"] = _clean_float(self._arch("attention.layer_norm_rms_epsilon", 1e-6))
        # mlx-lm reads only a top-level rope_theta; without it, it silently uses 10000
        cfg["rope_theta"] = _clean_float(self._arch("rope.freq_base", 10000.0))
        cfg["max_position_embeddings"] = int(self._arch("context_length", 4096))
        emb = self._by_name.get("token_embd.weight")
        if emb is None:
            raise GGUFError(f"{self.path.name} has no token_embd.weight tensor")
        n_vocab = int(emb.shape[-1])
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        cfg["vocab_size"] = n_vocab if tokens is None else max(n_vocab, len(tokens.data))
        cfg["tie_word_embeddings"] = "output.weight" not in self._by_name

        scaling = self._arch("rope.scaling.type")
        if scaling and scaling != "none":
            factor = _clean_float(self._arch("rope.scaling.factor", 1.0))
            rs: dict[str, Any] = {"type": scaling, "rope_type": scaling, "factor": factor}
            orig = self._arch("rope.scaling.original_context_length")
            if orig:
                rs["original_max_position_embeddings"] = int(orig)
            cfg["rope_scaling"] = rs

        model_type, hf_class = _HF_CLASSES[self.arch]
        cfg["model_type"] = model_type
        cfg["architectures"] = [hf_class]
        if self.arch == "llama":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in self._by_name
            cfg["mlp_bias"] = "blk.0.ffn_up.bias" in self._by_name
        if self.arch == "gemma3":
            cfg["sliding_window"] = int(self._arch("attention.sliding_window", 512))
            # llama.cpp hard-codes these for gemma3: 5 local layers to 1 global, local base 10000
            cfg["sliding_window_pattern"] = 6
            cfg["rope_local_base_freq"] = 10000.0
            # llama.cpp scales queries by 1/sqrt(head_dim) except on the 27B model
            cfg["query_pre_attn_scalar"] = (
                cfg["hidden_size"] // heads if cfg["num_hidden_layers"] == 62 else cfg["head_dim"]
            )
            cfg["hidden_activation"] = "gelu_pytorch_tanh"
        for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
            v = self._get(f"tokenizer.ggml.{name}_token_id")
            if v is not None:
                cfg[key] = int(v)
        return cfg

    # -- tensors ----------------------------------------------------------------------------
    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name for a GGUF tensor name, or None for tensors to skip."""
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
        m = _BLOCK_RE.match(gguf_name)
        if m:
            names = _GEMMA3_LAYER_NAMES if self.arch == "gemma3" else _LAYER_NAMES
            hf = names.get(m.group(2))
            if hf is not None:
                return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
        return None

    def tensors(self) -> list[GGUFTensor]:
        out = []
        for t in self.reader.tensors:
            name = self.hf_name(t.name)
            if name is None:
                raise GGUFError(
                    f"{self.path.name}: tensor {t.name!r} has no Hugging Face equivalent "
                    f"for architecture {self.arch!r}"
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            out.append(GGUFTensor(name, t.name, shape, t.tensor_type.name,
                                  chunks=lambda t=t, shape=shape: self._chunks(t, shape)))
        return out

    def _chunks(self, t, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        """Yield the tensor as float32 row blocks (axis 0), transformed to Hugging Face layout."""
        qtype = t.tensor_type
        perm_heads = self._permuted_heads(t.name)
        if len(shape) == 1:  # norms and biases: small, one chunk
            x = self._dequantize(np.asarray(t.data), qtype).reshape(shape)
            if perm_heads:
                x = _unpermute(x, perm_heads)
            if self.arch == "gemma3" and t.name.endswith("norm.weight"):
                x = x - 1.0
            yield x
            return
        n_rows = shape[0]
        row_len = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        data = t.data.reshape(n_rows, -1)  # one GGUF row per HF row (rows are whole blocks)

        step = max(1, _CHUNK_FLOATS // max(1, row_len))
        if perm_heads:
            rows_per_head = n_rows // perm_heads
            step = max(rows_per_head, step - step % rows_per_head)
        is_gemma_norm = self.arch == "gemma3" and t.name.endswith("norm.weight")

        for i in range(0, n_rows, step):
            x = self._dequantize(np.asarray(data[i : i + step]), qtype)
            x = x.reshape((x.shape[0],) + tuple(shape[1:]))
            if perm_heads:
                x = _unpermute(x, x.shape[0] // (n_rows // perm_heads))
            if is_gemma_norm:
                x = x - 1.0
            yield x

    @staticmethod
    def _dequantize(block: np.ndarray, qtype) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        if qtype == GGMLQuantizationType.F32:
            return block.view(np.float32).astype(np.float32, copy=True)
        if qtype == GGMLQuantizationType.F16:
            return block.view(np.float16).astype(np.float32)
        return quants.dequantize(block, qtype).astype(np.float32, copy=False)

    def _permuted_heads(self, gguf_name: str) -> int:
        """llama.cpp permutes llama q/k projections per head; return the head count, or 0."""
        if self.arch != "llama":
            return 0
        if re.search(r"\.attn_q\.(weight|bias)$", gguf_name):
            return self.config["num_attention_heads"]
        if re.search(r"\.attn_k\.(weight|bias)$", gguf_name):
            return self.config["num_key_value_heads"]
        return 0

    # -- tokenizer --------------------------------------------------------------------------
    def write_tokenizer(self, out_dir: Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
        tokenizer, tok_config = self.build_tokenizer()
        tokenizer.save(str(out_dir / "tokenizer.json"))
        with open(out_dir / "tokenizer_config.json", "w") as f:
            json.dump(tok_config, f, indent=2, ensure_ascii=False)
        special = {k: tok_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if tok_config.get(k) is not None}
        with open(out_dir / "special_tokens_map.json", "w") as f:
            json.dump(special, f, indent=2, ensure_ascii=False)

    def _tokenizer_spec(self) -> "_TokenizerSpec":
        tokens = [str(t) for t in self._get("tokenizer.ggml.tokens") or ()]
        ids = (self._get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding"))
        return _TokenizerSpec(
            model=str(self._get("tokenizer.ggml.model", "")),
            pre=self._get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=list(self._get("tokenizer.ggml.token_type") or ()),
            scores=self._get("tokenizer.ggml.scores"),
            merges=self._get("tokenizer.ggml.merges"),
            special_ids={int(i) for i in ids if i is not None and 0 <= int(i) < len(tokens)},
            unk_id=self._get("tokenizer.ggml.unknown_token_id"),
            add_space_prefix=self._get("tokenizer.ggml.add_space_prefix"),
        )

    def build_tokenizer(self):
        """A `tokenizers.Tokenizer` and a tokenizer_config dict rebuilt from the metadata."""
        tokens = self._get("tokenizer.ggml.tokens")
        model = self._get("tokenizer.ggml.model")
        if not tokens or not model:
            raise GGUFError(
                f"{self.path.name} has no tokenizer in its metadata "
                "(tokenizer.ggml.model / tokenizer.ggml.tokens); cannot write a tokenizer"
            )
        try:
            tokenizer = build_gguf_tokenizer(self.arch, self._tokenizer_spec())
        except GGUFError as e:
            raise GGUFError(f"{self.path.name}: {e}") from None
        except Exception as e:
            raise GGUFError(
                f"cannot build a tokenizer from {self.path.name} "
                f"(tokenizer.ggml.model={model!r}): {type(e).__name__}: {e}"
            ) from None

        def tok(key: str) -> str | None:
            i = self._get(f"tokenizer.ggml.{key}")
            return None if i is None or int(i) >= len(tokens) else tokens[int(i)]

        add_bos = self._get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = model == "llama"  # llama.cpp's default for SentencePiece vocabularies
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok("bos_token_id"),
            "eos_token": tok("eos_token_id"),
            "unk_token": tok("unknown_token_id"),
            "pad_token": tok("padding_token_id"),
            "add_bos_token": bool(add_bos),
            "add_eos_token": bool(self._get("tokenizer.ggml.add_eos_token", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": self.config["max_position_embeddings"],
        }
        template = self._get("tokenizer.chat_template")
        if template:
            cfg["chat_template"] = template
        _set_bos_post_processor(tokenizer, cfg)
        return tokenizer, cfg


# -- the tokenizer, rebuilt with the public `tokenizers` API only ------------------------------
#
# A GGUF has no tokenizer.json: it stores llama.cpp's vocabulary (`tokenizer.ggml.*`). The two
# kinds the supported architectures use are rebuilt here, the way llama.cpp tokenizes them and
# the way the models' own tokenizer.json files are written:
#
# - "gpt2": byte-level BPE (Qwen2/3, SmolLM, Llama 3). Merges from the file; the split regex
#   named by `tokenizer.ggml.pre`.
# - "llama": SentencePiece BPE with byte fallback (Llama 2, Gemma 3). Merges from the file, or,
#   as SentencePiece files store none, derived from the token scores (Gemma: from the order).
#
# Nothing here imports transformers, whose GGUF helpers are private and change between releases.

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4  # llama.cpp's token types

# Split regexes of byte-level vocabularies, by `tokenizer.ggml.pre` (from llama.cpp / the models'
# own tokenizer.json). A name not listed gets GPT-2's (ByteLevel's built-in regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx",
                     "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# SentencePiece vocabularies that prefix no space and store runs of spaces as spaces
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


@dataclass
class _TokenizerSpec:
    """The `tokenizer.ggml.*` metadata a tokenizer is built from."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special_ids: set[int]  # bos, eos, unk, pad
    unk_id: int | None = None
    add_space_prefix: bool | None = None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are spelled in it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    best-scored merged token first (llama.cpp merges the best-scored pair first)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _file_merges(merges) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        a, sep, b = str(m).partition(" ")
        if not sep:
            raise GGUFError(f"malformed tokenizer.ggml.merges entry {m!r}")
        out.append((a, b))
    return out


def build_gguf_tokenizer(arch: str, spec: _TokenizerSpec):
    """The `tokenizers.Tokenizer` a GGUF vocabulary describes (see the comment above)."""
    if spec.model == "gpt2":
        tokenizer, spelled = _byte_level_bpe(spec)
    elif spec.model == "llama":
        tokenizer, spelled = _sentencepiece_bpe(arch, spec)
    else:
        raise GGUFError(
            f"tokenizer.ggml.model {spec.model!r} is not supported (supported: gpt2, llama)")
    _add_gguf_special_tokens(tokenizer, spec, spelled)
    return tokenizer


def _byte_level_bpe(spec: _TokenizerSpec):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
               for t in spec.tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if not spec.merges:
        raise GGUFError("a byte-level (gpt2) vocabulary without tokenizer.ggml.merges")
    tokenizer = Tokenizer(models.BPE(vocab, _file_merges(spec.merges), dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = _PRE_SPLITS.get(spec.pre or "")
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    elif spec.pre == "smollm":
        # SmolLM's own tokenizer.json splits digits one by one before GPT-2's byte-level regex
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, spelled


def _sentencepiece_bpe(arch: str, spec: _TokenizerSpec):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = arch in _GEMMA_ARCHS
    tokens = spec.tokens
    if gemma:  # a token of 2+ spaces is stored as spaces; Gemma's tokenizer spells it with U+2581
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if spec.merges:
        merges = _file_merges(spec.merges)
    elif gemma:  # Gemma's scores do not follow its merge order; the token order does
        merges = _merges_from_scores(vocab, {t: -i for i, t in enumerate(tokens)})
    elif spec.scores is not None and len(spec.scores) == len(tokens):
        merges = _merges_from_scores(vocab, dict(zip(tokens, map(float, spec.scores))))
    else:
        raise GGUFError("a SentencePiece (llama) vocabulary with neither merges nor scores")
    unk = None
    if spec.unk_id is not None and 0 <= int(spec.unk_id) < len(tokens):
        unk = tokens[int(spec.unk_id)]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                                     byte_fallback=True, dropout=None))
    replace = decoders.Replace("\u2581", " ")
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
        tokenizer.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse()])
    else:
        prefix = spec.add_space_prefix is None or bool(spec.add_space_prefix)
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        steps = [replace, decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, tokens


def _add_gguf_special_tokens(tokenizer, spec: _TokenizerSpec, spelled: list[str]) -> None:
    """Control tokens (and bos/eos/unk/pad) become special added tokens, user-defined ones plain
    added tokens: llama.cpp matches both whole in the text. A byte-level "control" token spelled
    outside the byte alphabet is a llama.cpp mislabel and is left alone."""
    from tokenizers import AddedToken

    types = spec.token_types
    special, user = [], []
    for i, (orig, tok) in enumerate(zip(spec.tokens, spelled)):
        kind = types[i] if i < len(types) else _TOKEN_NORMAL
        if kind == _TOKEN_CONTROL or i in spec.special_ids:
            if spec.model != "gpt2" or tok == orig:
                special.append(AddedToken(tok, normalized=False, special=True))
        elif kind == _TOKEN_USER_DEFINED:
            user.append(AddedToken(tok, normalized=False, special=False))
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def _set_bos_post_processor(tokenizer, cfg: dict[str, Any]) -> None:
    """Make the fast tokenizer add BOS/EOS exactly when the GGUF says llama.cpp would."""
    from tokenizers import processors

    vocab = tokenizer.get_vocab()
    bos, eos = cfg.get("bos_token"), cfg.get("eos_token")
    single, special = ["$A"], []
    if cfg["add_bos_token"] and bos in vocab:
        single = [f"{bos}:0", *single]
        special.append((bos, vocab[bos]))
    if cfg["add_eos_token"] and eos in vocab:
        single = [*single, f"{eos}:0"]
        special.append((eos, vocab[eos]))
    if special:
        pair = single + [s.replace("$A", "$B") for s in single]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=special)
    elif isinstance(tokenizer.post_processor, processors.TemplateProcessing):
        tokenizer.post_processor = None


def _unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows: (n_head, d/2, 2, ...) -> (n_head, 2, d/2, ...)."""
    rows = x.shape[0]
    return (x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:])
             .swapaxes(1, 2)
             .reshape(x.shape))


def permute_for_gguf(x: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (convert_hf_to_gguf.py `LlamaModel.permute`), for tests."""
    rows = x.shape[0]
    return (x.reshape(n_head, 2, rows // n_head // 2, *x.shape[1:])
             .swapaxes(1, 2)
             .reshape(x.shape))
