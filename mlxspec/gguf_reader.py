"""Read a GGUF file (llama.cpp, Ollama) as a Hugging Face-style model: config, tensors, tokenizer.

The tensors are dequantized with the `gguf` package and numpy, one tensor and a few thousand
rows at a time, so that a caller can stream them to disk: `mlx.core.load` cannot be used
because it fails on K-quants. Names are mapped to the Hugging Face names mlx-lm's model
classes use, and llama.cpp's changes to the weights are undone:

- llama: `attn_q` / `attn_k` rows are permuted for llama.cpp's rotary layout;
- gemma3: RMSNorm weights are stored as `1 + w`.

The tokenizer is rebuilt from the metadata with transformers' own GGUF tokenizer builders
(byte-level BPE for gpt2-style vocabularies such as Qwen2 and SmolLM, SentencePiece-BPE for
llama/gemma ones), which work without torch.
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

    def build_tokenizer(self):
        """A `tokenizers.Tokenizer` and a tokenizer_config dict rebuilt from the metadata."""
        tokens = self._get("tokenizer.ggml.tokens")
        model = self._get("tokenizer.ggml.model")
        if not tokens or not model:
            raise GGUFError(
                f"{self.path.name} has no tokenizer in its metadata "
                "(tokenizer.ggml.model / tokenizer.ggml.tokens); cannot write a tokenizer"
            )
        import logging

        logging.getLogger("transformers").setLevel(logging.ERROR)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        tok_dict: dict[str, Any] = {}
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
            v = self._get(f"tokenizer.{key}")
            if v is not None:
                tok_dict[name] = v
        try:
            tokenizer, _ = convert_gguf_tokenizer(self.arch, tok_dict)
        except Exception as e:
            raise GGUFError(
                f"cannot build a tokenizer from {self.path.name} "
                f"(tokenizer.ggml.model={model!r}): {e}"
            ) from None
        pre = tok_dict.get("pre_tokenizer_type")
        if pre == "smollm":
            # SmolLM's own tokenizer.json splits digits one by one before the byte-level step
            from tokenizers import pre_tokenizers

            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])

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
