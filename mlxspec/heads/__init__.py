"""Trained draft heads: small networks that draft from the target's own hidden states.

    taps.py     record chosen target layers' outputs in the verifying forward (no fork of mlx-lm)
    eagle3.py   the EAGLE-3 head: format (config.json + safetensors, d2t/t2d) and forward pass,
                shared by loading and by training (`mlxspec train-drafter`)
    dflash.py   the DFlash and DSpark block heads: formats, block forward, Markov and confidence heads

This file is the registry: a head folder's config.json `architectures` names its family, and
LOADERS maps that name to a function (folder, target model, dtype) -> TrainedHead, which reads
the head, checks it against the target (PairMismatchError naming the mismatch) and says which
target layers it taps (OUTPUT of layer i, 0-based: heads/taps.py) and how to build its drafter.
`mlxspec.load(target, draft=HEAD)` calls `load_trained_head`, installs the taps and keeps the
TrainedHead as `pair.head`; drafter "head" (and "auto") builds `head.make_drafter(pair, options)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxspecError, PairMismatchError, UnsupportedModelError

if TYPE_CHECKING:
    from ..drafters.base import Drafter
    from ..engine import Pair
    from ..options import GenerateOptions
    from .taps import TapRecorder


@dataclass
class TrainedHead:
    """A loaded head, checked against its target."""

    family: str  # "eagle3", "dflash", "dspark": the drafter's source name in stats
    module: nn.Module
    tap_layers: tuple[int, ...]  # outputs of these target layers (0-based), in the order the head concatenates
    path: Path | None
    make_drafter: Callable[["Pair", "GenerateOptions"], "Drafter"]
    recorder: "TapRecorder | None" = None  # set by install (mlxspec.load)
    info: dict[str, Any] = field(default_factory=dict)  # shown by bench/chat (draft vocabulary, block size...)
    # (head, target model, context length) -> (step, cache): one draft step as a model-like callable
    # `step(x, cache=cache)` over a head cache of that context, for bench's draft-step cost c
    step_timer: Callable[["TrainedHead", nn.Module, int], tuple[Callable, Any]] | None = None

    def install(self, target: nn.Module, check: bool = True) -> "TapRecorder":
        """Tap the target's layers this head reads (checked against a plain forward)."""
        from .taps import install_taps

        if self.recorder is None:
            self.recorder = install_taps(target, self.tap_layers, check=check)
        return self.recorder


def read_config(folder: str | Path) -> dict | None:
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except ValueError:
        return None


def head_family(folder: str | Path) -> str | None:
    """The registry key of a head folder (its config.json architecture), or None when the
    folder is not a head we know (an ordinary model, for instance)."""
    cfg = read_config(folder)
    if cfg is None:
        return None
    for arch in cfg.get("architectures") or []:
        if arch in LOADERS:
            return arch
    return None


def is_head(folder: str | Path) -> bool:
    return head_family(folder) is not None


def target_dims(target: nn.Module) -> dict[str, int]:
    """hidden_size, vocab_size (the embedding's rows) and num_layers of an mlx-lm target."""
    from .taps import decoder_layers

    args = getattr(target, "args", None)
    hidden = getattr(args, "hidden_size", None)
    vocab = getattr(args, "vocab_size", None)
    emb = target_embedding(target)
    if emb is not None:
        w = emb.weight
        vocab = vocab or w.shape[0]
        if hidden is None and not hasattr(emb, "scales"):
            hidden = w.shape[1]
    return {"hidden_size": int(hidden), "vocab_size": int(vocab), "num_layers": len(decoder_layers(target))}


def target_embedding(target: nn.Module) -> nn.Module | None:
    inner = getattr(target, "model", None) or getattr(target, "language_model", None)
    emb = getattr(inner, "embed_tokens", None) if inner is not None else None
    return emb if emb is not None else getattr(target, "embed_tokens", None)


def float_dtype(target: nn.Module) -> mx.Dtype:
    """The dtype a head runs in next to this target: its embedding's (a quantized embedding's
    scales' dtype)."""
    emb = target_embedding(target)
    if emb is None:
        return mx.float32
    return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype


def check_fits(name: str, target: nn.Module, *, hidden: int | None = None, target_hidden: int | None = None,
               vocab: int | None = None, taps: tuple[int, ...] = ()) -> None:
    """Refuse a head that does not fit the target, naming each mismatch: `hidden` is a width the
    head shares with the target's embedding, `target_hidden` the width of each tapped feature,
    `vocab` the target vocabulary the head's ids refer to, `taps` the tapped layer ids."""
    dims = target_dims(target)
    problems = []
    if target_hidden is not None and target_hidden != dims["hidden_size"]:
        problems.append(f"it reads features of width {target_hidden}, the target's hidden size is {dims['hidden_size']}")
    if hidden is not None and hidden != dims["hidden_size"]:
        problems.append(f"its hidden size is {hidden}, the target's embedding has {dims['hidden_size']}")
    if vocab is not None and vocab != dims["vocab_size"]:
        problems.append(f"its vocabulary has {vocab} tokens, the target's has {dims['vocab_size']}")
    bad = [i for i in taps if not 0 <= i < dims["num_layers"]]
    if bad:
        problems.append(f"it taps layers {list(taps)}, the target has {dims['num_layers']} (0..{dims['num_layers'] - 1})")
    if problems:
        raise PairMismatchError(f"the {name} head does not fit this target: " + "; ".join(problems))


# -- EAGLE-3 --------------------------------------------------------------------------------


def _load_eagle3(folder: Path, target: nn.Module, dtype: mx.Dtype | None) -> TrainedHead:
    from .eagle3 import Eagle3Config, draft_to_target, load_head

    dims = target_dims(target)
    cfg = Eagle3Config.from_dict(read_config(folder) or {}, target_layers=dims["num_layers"])
    check_fits("EAGLE-3", target, hidden=cfg.hidden_size, target_hidden=cfg.target_hidden_size,
               vocab=cfg.vocab_size, taps=cfg.tap_layers)
    head = load_head(folder, target_layers=dims["num_layers"])
    ids = draft_to_target(head.d2t)
    if ids.size and (mx.min(ids).item() < 0 or mx.max(ids).item() >= cfg.vocab_size):
        raise MlxspecError(f"{folder}: d2t maps draft ids outside the vocabulary of {cfg.vocab_size} tokens")
    head.set_dtype(dtype if dtype is not None else float_dtype(target))
    mx.eval(head.parameters())

    def make_drafter(pair: "Pair", opts: "GenerateOptions") -> "Drafter":
        from ..drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(pair.head, pair.target)

    from ..drafters.eagle3 import step_timer

    return TrainedHead("eagle3", head, cfg.tap_layers, folder, make_drafter,
                       info={"draft_vocab": cfg.draft_vocab_size, "taps": list(cfg.tap_layers)}, step_timer=step_timer)


# config.json `architectures` -> loader(folder, target model, dtype or None) -> TrainedHead
LOADERS: dict[str, Callable[[Path, nn.Module, Any], TrainedHead]] = {
    "LlamaForCausalLMEagle3": _load_eagle3,
    "DFlashDraftModel": lambda folder, target, dtype: _block_heads().load_trained(folder, target, dtype),
    "Qwen3DSparkModel": lambda folder, target, dtype: _block_heads().load_trained(folder, target, dtype),
}


def _block_heads():
    from . import dflash  # DFlash and DSpark: one module (the same backbone)

    return dflash


def load_trained_head(folder: str | Path, target: nn.Module, dtype: mx.Dtype | None = None,
                      install: bool = True) -> TrainedHead:
    """Read a head folder for this target, check it, and (install) tap the target's layers."""
    folder = Path(folder)
    arch = head_family(folder)
    if arch is None:
        cfg = read_config(folder) or {}
        raise UnsupportedModelError(
            f"{folder} is not a draft head mlxspec knows (architectures {cfg.get('architectures')}; "
            f"known: {', '.join(LOADERS)})"
        )
    head = LOADERS[arch](folder, target, dtype)
    if install:
        head.install(target)
    return head
