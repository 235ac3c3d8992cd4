"""The EAGLE-3 draft head: its on-disk format and its forward pass, shared by loading
(`mlxspec.load(target, draft=HEAD)`) and training (`mlxspec train-drafter`).

On disk (the published layout SpecForge, SGLang and vLLM read):
    config.json        architectures ["LlamaForCausalLMEagle3"], model_type "llama",
                       num_hidden_layers 1, hidden_size / vocab_size of the target,
                       draft_vocab_size, target_hidden_size, rope_theta,
                       eagle_config.eagle_aux_hidden_state_layer_ids
    model.safetensors  fc.weight                 (H, n_taps * Ht)
                       midlayer.input_layernorm.weight, midlayer.hidden_norm.weight,
                       midlayer.post_attention_layernorm.weight          (H,)
                       midlayer.self_attn.{q,k,v}_proj.weight            (out, 2H)
                       midlayer.self_attn.o_proj.weight                  (H, n_heads * D)
                       midlayer.mlp.{gate,up}_proj.weight (I, H), down_proj.weight (H, I)
                       norm.weight (H,), lm_head.weight (draft_vocab, H)
                       d2t int64 (draft_vocab,): target id = draft id + d2t[draft id]
                       t2d bool (vocab,): whether a target id is in the draft vocabulary
    Variants read too: `layers.0.*` for `midlayer.*` (speculators), an `embed_tokens.weight`
    (unused: the target's embedding is the head's input embedding).

Tapped layers: `eagle_aux_hidden_state_layer_ids` are layer ids whose OUTPUT is tapped (SGLang and
SpecForge; the official EAGLE code taps the inputs of layers 2, L//2, L-3, the same states). Absent,
the default is [1, L//2 - 1, L - 4] of the target's L layers. heads/taps.py uses the same
output-of-layer convention, so the ids pass through unchanged.

The forward of one draft step (B batch, T positions, H hidden):
    x   = fc(taps)                    (B, T, H)   step 0: fused target features of position t
    e   = embed(token at t + 1)       (B, T, H)   the target's own embedding
    a   = attn([input_layernorm(e); hidden_norm(x)])   causal, the head's own KV cache
    h   = x + a;  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))         (B, T, draft_vocab)
and the next step feeds the pre-norm h back as x, with the embedding of the token just drafted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import MlxspecError

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
DEFAULT_ROPE_THETA = 10000.0  # what the official EAGLE-3 trainer used whatever the config said


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (outputs), for a target of num_layers layers
    (clamped into range for the tiny targets of tests)."""
    return (min(1, num_layers - 1), max(0, num_layers // 2 - 1), max(0, num_layers - 4))


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    tap_layers: tuple[int, ...]  # outputs of these target layers (0-based)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, kept on save

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, cfg: dict, target_layers: int | None = None) -> "Eagle3Config":
        """From a config.json dict. target_layers fills in the default taps when the config has none."""
        arch = cfg.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise MlxspecError(f"not an EAGLE-3 head: architectures is {arch}, expected [{ARCHITECTURE!r}]")
        eagle = cfg.get("eagle_config") or {}
        taps = eagle.get("eagle_aux_hidden_state_layer_ids")
        if taps is None:
            if target_layers is None:
                raise MlxspecError("the head does not say which target layers it taps; give target_layers")
            taps = default_taps(target_layers)
        known = {
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "draft_vocab_size", "target_hidden_size", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
            "max_position_embeddings", "eagle_config",
        }
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            tap_layers=tuple(int(i) for i in taps),
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or DEFAULT_ROPE_THETA),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_dict(self) -> dict:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=[ARCHITECTURE],
            model_type="llama",
            num_hidden_layers=1,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.dim,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            tie_word_embeddings=False,
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.tap_layers), "use_aux_hidden_state": True},
        )
        return d


# -- vocabulary maps -------------------------------------------------------------------------


def vocab_maps(used: np.ndarray | list[int], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) for a draft vocabulary of the target ids `used` (sorted ascending here):
    d2t[i] = used[i] - i (an offset, as SpecForge and EAGLE write it), t2d[t] = t in used."""
    used = np.unique(np.asarray(used, dtype=np.int64))
    if used.size == 0 or used[0] < 0 or used[-1] >= vocab_size:
        raise MlxspecError(f"draft vocabulary ids must lie in [0, {vocab_size})")
    d2t = used - np.arange(used.size, dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[used] = True
    return d2t, t2d


def draft_to_target(d2t: mx.array) -> mx.array:
    """(draft_vocab,) target ids of the draft vocabulary entries."""
    return mx.arange(d2t.shape[0], dtype=mx.int64) + d2t.astype(mx.int64)


# -- the module ------------------------------------------------------------------------------


class Attention(nn.Module):
    """Llama attention whose input is [embedding; hidden] (2H wide), with its own rope."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        h, d = cfg.hidden_size, cfg.dim
        self.n_heads, self.n_kv, self.scale = cfg.num_attention_heads, cfg.num_key_value_heads, d**-0.5
        self.q_proj = nn.Linear(2 * h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.rope = initialize_rope(d, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)

    def project(self, x: mx.array, offset: int | mx.array = 0) -> tuple[mx.array, mx.array, mx.array]:
        """x (B, T, 2H) -> q (B, n_heads, T, D), k and v (B, n_kv, T, D), rotated at positions
        offset.. (training builds its own attention pattern from these)."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self.rope(q, offset=offset), self.rope(k, offset=offset), v

    def output(self, o: mx.array) -> mx.array:
        """o (B, n_heads, T, D) -> (B, T, H)."""
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, -1))

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        q, k, v = self.project(x, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.output(o)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The head's one decoder layer over [embedding; hidden]."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def attn_input(self, emb: mx.array, x: mx.array) -> mx.array:
        return mx.concatenate([self.input_layernorm(emb), self.hidden_norm(x)], axis=-1)

    def finish(self, x: mx.array, a: mx.array) -> mx.array:
        """Residual, then the MLP block: the pre-norm hidden state fed to the next step."""
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h))

    def __call__(self, emb: mx.array, x: mx.array, mask=None, cache=None) -> mx.array:
        return self.finish(x, self.self_attn(self.attn_input(emb, x), mask, cache))


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.tap_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # vocabulary maps: data, not parameters (a leading underscore keeps them out of training)
        d2t, t2d = vocab_maps(np.arange(cfg.draft_vocab_size), cfg.vocab_size)
        self._d2t = mx.array(d2t)
        self._t2d = mx.array(t2d)

    @property
    def d2t(self) -> mx.array:
        return self._d2t

    @property
    def t2d(self) -> mx.array:
        return self._t2d

    def set_vocab(self, d2t: mx.array, t2d: mx.array) -> None:
        cfg = self.config
        if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
            raise MlxspecError(
                f"d2t/t2d have shapes {d2t.shape}/{t2d.shape}, expected ({cfg.draft_vocab_size},)/({cfg.vocab_size},)"
            )
        self._d2t, self._t2d = d2t.astype(mx.int64), t2d.astype(mx.bool_)

    def fuse(self, taps: mx.array) -> mx.array:
        """(..., n_taps * Ht) target features -> (..., H)."""
        return self.fc(taps)

    def logits(self, h: mx.array) -> mx.array:
        """Pre-norm hidden (..., H) -> draft-vocabulary logits (..., draft_vocab)."""
        return self.lm_head(self.norm(h))

    def __call__(self, emb: mx.array, x: mx.array, mask=None, cache=None) -> tuple[mx.array, mx.array]:
        """One step over T positions: (draft-vocabulary logits, pre-norm hidden state)."""
        h = self.midlayer(emb, x, mask, cache)
        return self.logits(h), h


# -- reading and writing ---------------------------------------------------------------------


def is_eagle3(folder: str | Path) -> bool:
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    return ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or [])


def _sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for k, v in weights.items():
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        if k.startswith("model."):  # some exports prefix the module
            k = k[len("model."):]
        out[k] = v
    return out


def load_head(folder: str | Path, target_layers: int | None = None) -> Eagle3Head:
    """Read an EAGLE-3 head folder (config.json + safetensors) into an Eagle3Head."""
    folder = Path(folder)
    cfg = Eagle3Config.from_dict(json.loads((folder / "config.json").read_text()), target_layers)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MlxspecError(f"{folder} has no .safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights = _sanitize(weights)
    weights.pop("embed_tokens.weight", None)  # the target's embedding is used
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    head = Eagle3Head(cfg)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise MlxspecError(f"{folder}: the weights do not fit an EAGLE-3 head of its config: {e}") from e
    if d2t is not None and t2d is not None:
        head.set_vocab(d2t, t2d)
    elif cfg.draft_vocab_size != cfg.vocab_size:
        raise MlxspecError(f"{folder}: a reduced draft vocabulary needs d2t and t2d tensors")
    mx.eval(head.parameters())
    return head


def save_head(head: Eagle3Head, folder: str | Path, extra_config: dict | None = None) -> None:
    """Write config.json and model.safetensors into folder (the caller makes it atomic)."""
    from mlx.utils import tree_flatten

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_dict()
    cfg.update(extra_config or {})
    weights = dict(tree_flatten(head.parameters()))
    weights["d2t"] = head.d2t
    weights["t2d"] = head.t2d
    mx.save_safetensors(str(folder / WEIGHTS), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def head_config_for(target: nn.Module, draft_vocab_size: int, tap_layers: tuple[int, ...] | None = None,
                    intermediate_size: int | None = None) -> Eagle3Config:
    """An EAGLE-3 config sized for an mlx-lm target (what training starts from)."""
    args = target.args
    layers = args.num_hidden_layers
    n_heads = args.num_attention_heads
    return Eagle3Config(
        hidden_size=args.hidden_size,
        intermediate_size=intermediate_size or args.intermediate_size,
        num_attention_heads=n_heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or n_heads,
        vocab_size=args.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=args.hidden_size,
        tap_layers=tuple(tap_layers or default_taps(layers)),
        head_dim=getattr(args, "head_dim", None) or args.hidden_size // n_heads,
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(args, "rope_theta", DEFAULT_ROPE_THETA) or DEFAULT_ROPE_THETA),
        rope_scaling=getattr(args, "rope_scaling", None),
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or 32768,
    )

