"""The DFlash and DSpark block draft heads: their on-disk formats and their block forward.

Both draft a whole block in ONE forward of a few Qwen3-style layers: the block is
[anchor, mask x (block_size - 1)] at absolute positions start .. start + block_size - 1, where
the anchor is the last token of the sequence (not yet in the target's cache, at position start),
and every layer attends, without a causal mask, to the keys and values of
[context; block]. The context is the target's own residual stream at positions 0 .. start - 1,
fused once per position (`ctx = hidden_norm(fc(concat(taps)))`) and cached as K/V in each layer
(only context K/V is cached; the block is recomputed every round).

DFlash (z-lab, architectures ["DFlashDraftModel"]), on disk:
    config.json   Qwen3 sizes (hidden_size = the target's), num_hidden_layers (5),
                  block_size (16) top-level or in dflash_config,
                  dflash_config {mask_token_id, target_layer_ids}, num_target_layers
    *.safetensors fc.weight (H, n_taps * H), hidden_norm.weight, norm.weight (H,),
                  layers.i.self_attn.{q,k,v,o}_proj.weight, layers.i.self_attn.{q,k}_norm.weight (D,),
                  layers.i.{input,post_attention}_layernorm.weight, layers.i.mlp.{gate,up,down}_proj.weight
                  and NO embedding or lm_head: the target's embedding and lm_head are used (a
                  checkpoint with lm_head.* is refused: it is not the format it claims to be).
    Slots: slot k (1 <= k < block_size) predicts the token at ITS OWN position start + k, so a
    block drafts block_size - 1 tokens; slot 0 (the anchor) predicts nothing.

DSpark (DeepSpec, architectures ["Qwen3DSparkModel"]), on disk:
    config.json   the target's Qwen3 config plus num_hidden_layers (5), block_size (7),
                  mask_token_id, target_layer_ids, markov_rank (256, 0: none), markov_head_type
                  ("vanilla" or "gated"), enable_confidence_head, confidence_head_with_markov
    *.safetensors the DFlash tensors, plus its own embed_tokens.weight (V, H) and lm_head.weight
                  (V, H) (frozen copies of the target's), markov_head.markov_w1.weight (V, r)
                  (an embedding), markov_head.markov_w2.weight (V, r) (a Linear r -> V),
                  markov_head.gate_proj.{weight (r, H + r), bias} (gated only),
                  confidence_head.proj.{weight (1, H [+ r]), bias (1,)}
    Slots: slot k (0 <= k < block_size) predicts position start + k + 1 (shifted by one), so a
    block drafts block_size tokens. With h_k the slot's normalised hidden state and x_{k-1} the
    token drafted at the slot before (x_{-1} = the anchor):
        logits_k = lm_head(h_k) + markov_w2 . (g_k * markov_w1[x_{k-1}])      (g_k = 1: vanilla)
        g_k      = sigmoid(gate_proj([h_k; markov_w1[x_{k-1}]]))                 (gated)
        conf_k   = sigmoid(proj([h_k; markov_w1[x_{k-1}]]))   (without _with_markov: proj(h_k))
    so the tokens are sampled one slot after the other, and conf_k (the head's estimate that
    x_k is accepted given x_{<k} were) may cut the block short.
    DeepSpec's "dflash_*" checkpoints are Qwen3DSparkModel with markov_rank 0: DSpark's slots.

Tapped layers: `target_layer_ids` are layers whose OUTPUT is tapped (Hugging Face's
hidden_states[i + 1]), heads/taps.py's convention, so they pass through unchanged. DFlash's
default when a config has none: round(1 + i * (L - 4) / (n - 1)) for the n draft layers of a
target of L layers (z-lab build_target_layer_ids). The embedding output (-1, DeepSpec) and the
last layer are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxspecError, PairMismatchError, UnsupportedModelError
from .eagle3 import MLP  # the same gated SiLU block

DFLASH = "DFlashDraftModel"
DSPARK = "Qwen3DSparkModel"
ARCHITECTURES = (DFLASH, DSPARK)
MARKOV_TYPES = ("vanilla", "gated")


def default_taps(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's build_target_layer_ids: n layers spread evenly from layer 1 to L - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class BlockHeadConfig:
    architecture: str  # DFLASH or DSPARK
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    tap_layers: tuple[int, ...]  # outputs of these target layers (0-based)
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    markov_rank: int = 0  # DSpark only
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, kept on save

    @property
    def dspark(self) -> bool:
        return self.architecture == DSPARK

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block proposes: DSpark's slots all predict, DFlash's anchor slot does not."""
        return self.block_size if self.dspark else self.block_size - 1

    @classmethod
    def from_dict(cls, cfg: dict, target_layers: int | None = None) -> "BlockHeadConfig":
        """From a config.json dict. target_layers (the target's layer count) fills in DFlash's
        default taps when the config names none."""
        arch = [a for a in (cfg.get("architectures") or []) if a in ARCHITECTURES]
        if not arch:
            raise MlxspecError(
                f"not a DFlash or DSpark head: architectures is {cfg.get('architectures')}, "
                f"expected [{DFLASH!r}] or [{DSPARK!r}]"
            )
        arch = arch[0]
        dfl = cfg.get("dflash_config") or {}

        def pick(name: str, default: Any = None) -> Any:
            if arch == DFLASH and dfl.get(name) is not None:
                return dfl[name]
            return cfg.get(name, default)

        for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", None)):
            if pick(name, neutral) != neutral:
                raise UnsupportedModelError(f"{arch} heads with {name}={pick(name)} are not supported")
        types = set(cfg.get("layer_types") or []) - {"full_attention"}
        if types:
            raise UnsupportedModelError(f"{arch} heads with {', '.join(sorted(types))} layers are not supported")
        layers = int(cfg["num_hidden_layers"])
        n_target = cfg.get("num_target_layers") or target_layers
        taps = pick("target_layer_ids")
        if taps is None:
            if arch == DSPARK:
                raise MlxspecError("the DSpark config has no target_layer_ids")
            if n_target is None:
                raise MlxspecError("the head does not say which target layers it taps; give target_layers")
            taps = default_taps(int(n_target), layers)
        taps = tuple(int(i) for i in taps)
        if any(i < 0 for i in taps):
            raise UnsupportedModelError(
                f"the head taps {list(taps)}; tapping the embedding output (-1) is not supported"
            )
        block = pick("block_size")
        mask = pick("mask_token_id")
        if block is None or int(block) < (1 if arch == DSPARK else 2):
            raise MlxspecError(f"the {arch} config has no usable block_size (got {block})")
        if mask is None:
            raise MlxspecError(f"the {arch} config has no mask_token_id")
        rank = int(cfg.get("markov_rank") or 0) if arch == DSPARK else 0
        mtype = str(cfg.get("markov_head_type") or "vanilla").lower()
        if rank and mtype not in MARKOV_TYPES:
            raise UnsupportedModelError(f"markov_head_type {mtype!r} is not supported (only {', '.join(MARKOV_TYPES)})")
        conf = bool(cfg.get("enable_confidence_head")) if arch == DSPARK else False
        conf_markov = conf and bool(cfg.get("confidence_head_with_markov"))
        if conf_markov and not rank:
            raise MlxspecError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        n_heads = int(cfg["num_attention_heads"])
        known = {
            "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "block_size", "mask_token_id", "target_layer_ids",
            "num_target_layers", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
            "attention_bias", "markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov",
        }
        return cls(
            architecture=arch,
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads),
            vocab_size=int(cfg["vocab_size"]),
            block_size=int(block),
            mask_token_id=int(mask),
            tap_layers=taps,
            num_target_layers=int(n_target) if n_target is not None else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or 1e6),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 40960),
            attention_bias=bool(cfg.get("attention_bias", False)),
            markov_rank=rank,
            markov_head_type=mtype,
            confidence_head=conf,
            confidence_with_markov=conf_markov,
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_dict(self) -> dict:
        """The config.json of the published layout of this architecture."""
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=[self.architecture],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            hidden_act="silu",
            block_size=self.block_size,
            layer_types=["full_attention"] * self.num_hidden_layers,
        )
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.dspark:
            d.update(
                mask_token_id=self.mask_token_id,
                target_layer_ids=list(self.tap_layers),
                markov_rank=self.markov_rank,
                enable_confidence_head=self.confidence_head,
                tie_word_embeddings=False,
            )
            if self.markov_rank:
                d["markov_head_type"] = self.markov_head_type
            if self.confidence_head:
                d["confidence_head_with_markov"] = self.confidence_with_markov
        else:
            d["dflash_config"] = {**(d.get("dflash_config") or {}), "mask_token_id": self.mask_token_id,
                                  "target_layer_ids": list(self.tap_layers)}
        return d


# -- the module ------------------------------------------------------------------------------


class Attention(nn.Module):
    """Qwen3 attention (q_norm/k_norm per head) whose keys and values are [context; block]."""

    def __init__(self, cfg: BlockHeadConfig):
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.scale = cfg.num_attention_heads, cfg.num_key_value_heads, d**-0.5
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(d, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)

    def _kv(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (B, T, H) -> k (k_norm'ed) and v, each (B, n_kv, T, D), not rotated."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv, -1).transpose(0, 2, 1, 3)
        return k, v

    def add_context(self, ctx: mx.array, cache) -> tuple[mx.array, mx.array]:
        """Append the K/V of context positions (B, S, H) to the cache (rotated at their
        positions) -> all cached keys and values."""
        kc, vc = self._kv(ctx)
        return cache.update_and_fetch(self.rope(kc, offset=cache.offset), vc)

    def __call__(self, x: mx.array, ctx: mx.array, cache) -> mx.array:
        """x (B, L, H) the normed block, ctx (B, S, H) fused context of the S positions after the
        cache's (S may be 0). The block sits right after the context: positions P + S .. P + S + L - 1
        for P = cache.offset. Only the context's K/V enter the cache."""
        b, l, _ = x.shape
        p, s = cache.offset, ctx.shape[1]
        if s:
            keys, values = self.add_context(ctx, cache)
        else:
            keys, values = cache.keys_and_values() if p else (None, None)
        q = self.q_norm(self.q_proj(x).reshape(b, l, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=p + s)
        kb, vb = self._kv(x)
        kb = self.rope(kb, offset=p + s)
        if keys is not None:
            kb, vb = mx.concatenate([keys, kb], axis=2), mx.concatenate([values, vb], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, kb, vb, scale=self.scale, mask=None)  # non-causal
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, l, -1))


class Layer(nn.Module):
    def __init__(self, cfg: BlockHeadConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x: mx.array, ctx: mx.array, cache) -> mx.array:
        # the context enters every layer as it is (no input_layernorm): z-lab and DeepSpec alike
        h = x + self.self_attn(self.input_layernorm(x), ctx, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """DSpark's low-rank bigram correction: logits += W2 . (g * W1[previous token])."""

    def __init__(self, cfg: BlockHeadConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)  # weight (V, r)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)  # weight (V, r)
        if cfg.markov_head_type == "gated":
            self.gate_proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, cfg.markov_rank)

    def prev(self, tokens: mx.array) -> mx.array:
        """(...,) token ids -> (..., r) W1 rows."""
        return self.markov_w1(tokens)

    def bias(self, tokens: mx.array, h: mx.array) -> mx.array:
        """Previous tokens (...,) and the slots' normed hidden states (..., H) -> (..., V)."""
        e = self.prev(tokens)
        if "gate_proj" in self:
            e = mx.sigmoid(self.gate_proj(mx.concatenate([h, e.astype(h.dtype)], axis=-1))) * e
        return self.markov_w2(e)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return self.proj(features)[..., 0]


class BlockHead(nn.Module):
    """A DFlash or DSpark head. DFlash borrows the target's embedding and lm_head (`bind`);
    DSpark carries its own."""

    def __init__(self, cfg: BlockHeadConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.tap_layers) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        if cfg.dspark:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
            self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
            if cfg.markov_rank:
                self.markov_head = MarkovHead(cfg)
            if cfg.confidence_head:
                self.confidence_head = ConfidenceHead(h + (cfg.markov_rank if cfg.confidence_with_markov else 0))
        # the target's embedding and logits for DFlash (leading underscore: not parameters)
        self._target_embed = None
        self._target_logits = None

    # -- the target's parts ------------------------------------------------------------------
    def bind(self, target: nn.Module) -> "BlockHead":
        """Borrow the target's input embedding and lm_head (DFlash)."""
        self._target_embed, self._target_logits = target_embedding_and_head(target)
        return self

    def embed(self, tokens: mx.array) -> mx.array:
        if self.config.dspark:
            return self.embed_tokens(tokens)
        if self._target_embed is None:
            raise MlxspecError("a DFlash head drafts with its target's embedding: call head.bind(target) first")
        return self._target_embed(tokens)

    def logits(self, h: mx.array) -> mx.array:
        """Normed hidden states (..., H) -> logits (..., V), before any Markov correction."""
        if self.config.dspark:
            return self.lm_head(h)
        if self._target_logits is None:
            raise MlxspecError("a DFlash head drafts with its target's lm_head: call head.bind(target) first")
        return self._target_logits(h)

    # -- the forward -----------------------------------------------------------------------
    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def fuse(self, taps: mx.array) -> mx.array:
        """(..., n_taps * H) target features -> the context (..., H)."""
        return self.hidden_norm(self.fc(taps))

    def add_context(self, taps: mx.array, cache: list) -> None:
        """Only context (a long prompt, in chunks): taps (B, S, n_taps * H) into every layer's cache."""
        ctx = self.fuse(taps)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(ctx, c)

    def __call__(self, block: mx.array, taps: mx.array, cache: list) -> mx.array:
        """block (B, L) token ids [anchor, mask...], taps (B, S, n_taps * H) the target features
        of the S context positions not yet in `cache` (they are added to it), -> the block's
        normed hidden states (B, L, H). Context positions 0 .. P + S - 1, block P + S ...."""
        x = self.embed(block)
        if taps.shape[1]:
            ctx = self.fuse(taps).astype(x.dtype)
        else:  # nothing new since the last round's context (or no context at all)
            ctx = mx.zeros((x.shape[0], 0, x.shape[-1]), x.dtype)
        for layer, c in zip(self.layers, cache):
            x = layer(x, ctx, c)
        return self.norm(x)

    def markov_bias(self, prev: mx.array, h: mx.array) -> mx.array | None:
        return self.markov_head.bias(prev, h) if "markov_head" in self else None

    def confidence(self, prev: mx.array, h: mx.array) -> mx.array | None:
        """sigmoid of the confidence head for slots with hidden states h (..., H) whose previous
        tokens are prev (...,); None without one."""
        if "confidence_head" not in self:
            return None
        feats = h
        if self.config.confidence_with_markov:
            feats = mx.concatenate([h, self.markov_head.prev(prev).astype(h.dtype)], axis=-1)
        return mx.sigmoid(self.confidence_head(feats).astype(mx.float32))


def target_embedding_and_head(target: nn.Module) -> tuple[nn.Module, Any]:
    """An mlx-lm model's input embedding and its lm_head (or the tied embedding as a linear)."""
    inner = getattr(target, "model", None) or getattr(target, "language_model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    if embed is None:
        inner = getattr(inner, "model", None)
        embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    if embed is None:
        raise UnsupportedModelError(f"cannot find the input embedding of {type(target).__name__}")
    head = getattr(target, "lm_head", None)
    return embed, head if head is not None else embed.as_linear


# -- reading, writing, fitting to a target -----------------------------------------------------


def is_block_head(folder: str | Path) -> bool:
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    return any(a in ARCHITECTURES for a in (json.loads(cfg.read_text()).get("architectures") or []))


def _sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in weights.items()}


def load_head(folder: str | Path, target_layers: int | None = None) -> BlockHead:
    """Read a DFlash or DSpark head folder (config.json + safetensors) into a BlockHead."""
    folder = Path(folder)
    cfg = BlockHeadConfig.from_dict(json.loads((folder / "config.json").read_text()), target_layers)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MlxspecError(f"{folder} has no .safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights = _sanitize(weights)
    if not cfg.dspark:
        own = sorted(k for k in weights if k.startswith(("lm_head.", "embed_tokens.")))
        if own:
            raise UnsupportedModelError(
                f"{folder}: a DFlash head uses its target's embedding and lm_head, but this checkpoint "
                f"carries {', '.join(own)}: it is not the z-lab DFlash format"
            )
    head = BlockHead(cfg)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise MlxspecError(f"{folder}: the weights do not fit a {cfg.architecture} head of its config: {e}") from e
    mx.eval(head.parameters())
    return head


def save_head(head: BlockHead, folder: str | Path, extra_config: dict | None = None) -> None:
    """Write config.json and model.safetensors in the published layout (the caller makes it atomic)."""
    from mlx.utils import tree_flatten

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_dict()
    cfg.update(extra_config or {})
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(head.parameters())),
                        metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def check_fits(cfg: BlockHeadConfig, target: nn.Module) -> None:
    """Refuse a head that does not fit this target, naming the mismatch (PairMismatchError): its
    hidden size, its vocabulary (DSpark's own), its tapped layers (the last layer cannot be
    tapped: Hugging Face's last hidden state, which the head was trained on, is the NORMED one),
    the target depth it was trained on, and its mask token."""
    from . import check_fits as check_common, target_dims, target_embedding

    name = "DFlash" if cfg.architecture == DFLASH else "DSpark"
    check_common(name, target, hidden=cfg.hidden_size, target_hidden=cfg.hidden_size,
                 vocab=cfg.vocab_size if cfg.dspark else None, taps=cfg.tap_layers)
    n = target_dims(target)["num_layers"]
    problems = []
    if n - 1 in cfg.tap_layers:
        problems.append(f"it taps the last layer ({n - 1}), whose output Hugging Face gives normed")
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        problems.append(f"it was trained on a target of {cfg.num_target_layers} layers, this one has {n}")
    rows = target_embedding(target).weight.shape[0]
    if not 0 <= cfg.mask_token_id < rows:
        problems.append(f"its mask token {cfg.mask_token_id} is outside the target's embedding (0..{rows - 1})")
    if problems:
        raise PairMismatchError(f"the {name} head does not fit this target: " + "; ".join(problems))


def load_trained(folder: Path, target: nn.Module, dtype: mx.Dtype | None = None):
    """The registry's loader (heads/__init__.py LOADERS): read, check against the target, cast
    to the target's dtype (or `dtype`), bind the target's embedding and lm_head (DFlash)."""
    from . import TrainedHead, read_config, target_dims, target_embedding

    n = target_dims(target)["num_layers"]
    cfg = BlockHeadConfig.from_dict(read_config(folder) or {}, target_layers=n)
    check_fits(cfg, target)
    head = load_head(folder, target_layers=n)
    if dtype is None:
        emb = target_embedding(target)
        dtype = mx.float16 if hasattr(emb, "scales") else emb.weight.dtype
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    shared = []
    if cfg.dspark:
        shared = _share_target_copies(head, target)
    else:
        head.bind(target)
    family = "dspark" if cfg.dspark else "dflash"

    def make_drafter(pair, opts):
        from ..drafters.block_head import BlockHeadDrafter

        return BlockHeadDrafter(pair.head.module, pair.head.recorder, family)

    from ..drafters.block_head import step_timer

    info = {"block_size": cfg.block_size, "taps": list(cfg.tap_layers), "layers": cfg.num_hidden_layers,
            "drafts_per_step": cfg.drafts_per_block}  # bench: one timed step drafts a whole block
    if cfg.dspark:
        info.update(markov_rank=cfg.markov_rank, confidence_head=cfg.confidence_head, shares_target=shared)
    return TrainedHead(family, head, cfg.tap_layers, folder, make_drafter, info=info, step_timer=step_timer)


def _share_target_copies(head: BlockHead, target: nn.Module) -> list[str]:
    """DSpark's embed_tokens and lm_head are frozen copies of the target's: where they are equal
    to the target's (after the cast) use the target's arrays, so they are held once (about 2 x
    V x H: 1.2 GB for a 1.5B target in float32). Returns the names shared."""
    emb, logits = target_embedding_and_head(target)
    pairs = [("embed_tokens", head.embed_tokens, emb)]
    if isinstance(logits, nn.Module):
        pairs.append(("lm_head", head.lm_head, logits))
    elif not hasattr(emb, "scales"):  # tied: the embedding is the lm_head
        pairs.append(("lm_head", head.lm_head, emb))
    shared = []
    for name, mine, theirs in pairs:
        w = getattr(theirs, "weight", None)
        if hasattr(theirs, "scales") or w is None or w.shape != mine.weight.shape or w.dtype != mine.weight.dtype:
            continue
        if mx.array_equal(mine.weight, w).item():
            mine.weight = w
            shared.append(name)
    return shared


def head_config_for(target: nn.Module, architecture: str, block_size: int, num_layers: int = 5,
                    tap_layers: Sequence[int] | None = None, mask_token_id: int | None = None,
                    markov_rank: int = 0, confidence_head: bool = False) -> BlockHeadConfig:
    """A head config of the published shape for an mlx-lm target (tests, cost benchmarks,
    training): target-sized layers, taps spread over the target like DFlash's default."""
    args = target.args
    layers = args.num_hidden_layers
    n_heads = args.num_attention_heads
    embed, _ = target_embedding_and_head(target)
    return BlockHeadConfig(
        architecture=architecture,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(args, "head_dim", None) or args.hidden_size // n_heads,
        vocab_size=embed.weight.shape[0],
        block_size=block_size,
        mask_token_id=embed.weight.shape[0] - 1 if mask_token_id is None else mask_token_id,
        tap_layers=tuple(tap_layers or default_taps(layers, num_layers)),
        num_target_layers=layers,
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(args, "rope_theta", 1e6) or 1e6),
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or 40960,
        markov_rank=markov_rank,
        confidence_head=confidence_head,
        confidence_with_markov=confidence_head and markov_rank > 0,
    )
