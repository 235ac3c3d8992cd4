"""Hidden states of chosen target layers, recorded in the same forward pass that verifies.

Trained heads (EAGLE-3, DFlash, DSpark) draft from the target's own residual stream. mlx-lm's
models have no hidden-state API, so instead of forking their files we give each tapped decoder
layer a subclass of its own class whose `__call__` also records the layer's output. The
parameter tree, the weights and the logits are untouched (checked on install), and `remove()`
restores the original classes.

Convention (one for all of mlxspec): tap `i` is the OUTPUT of decoder layer i (0-based), the
pre-final-norm residual stream, i.e. Hugging Face's `hidden_states[i + 1]`. Each head format
converts its own numbering to this one when it is loaded (heads/eagle3.py).

    rec = install_taps(model, [1, 13, 24])
    logits = model(ids, cache=cache)        # as before
    rec.hidden()                            # (B, T, 3 * H): the taps, concatenated in order
    rec.offset                              # the cache offset of the first of those T positions
    rec.cache                               # the first tapped layer's cache object in that forward
    rec.subscribe(fn)                       # fn(rec) after every forward, once all taps are recorded
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an mlx-lm model (model.model.layers for the usual families)."""
    inner = getattr(model, "model", None) or getattr(model, "language_model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        layers = getattr(model, "layers", None)
    if not layers:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


def _model_args(model: nn.Module) -> dict:
    args = getattr(model, "args", None)
    return vars(args) if args is not None and hasattr(args, "__dict__") else {}


def check_tappable(model: nn.Module) -> None:
    """Refuse models whose layers are not all plain full attention: a sliding window or a
    recurrent (hybrid) layer changes what a tapped state means between training and drafting,
    and their caches cannot be rewound exactly."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    name = getattr(model, "model_type", type(model).__name__)
    args = _model_args(model)
    types = set(args.get("layer_types") or [])
    if types - {"full_attention"}:
        raise UnsupportedModelError(
            f"{name} has {', '.join(sorted(types - {'full_attention'}))} layers; trained heads need a "
            "target whose layers are all full attention"
        )
    bad = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    if bad:
        raise UnsupportedModelError(
            f"{name} uses {', '.join(bad)} caches (sliding-window or recurrent layers); trained heads need "
            "a target with plain attention caches"
        )


class TapRecorder:
    """Holds what the tapped layers produced in the last forward pass."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.outputs: dict[int, mx.array] = {}
        self.offset: int | None = None  # cache offset before the last forward (its first position)
        self.cache = None  # the first tapped layer's cache in the last forward (None: no cache)
        self._listeners: list[Callable[[], Callable | None]] = []  # weak references
        self._originals: list[tuple[nn.Module, type]] = []

    def subscribe(self, fn: Callable[["TapRecorder"], None]) -> None:
        """Call fn(self) after every forward of the model, once its last tapped layer has run
        (drafters/features.py keeps each session's features this way). Held weakly: a bound
        method stops being called once its object is gone."""
        ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda f=fn: f)
        self._listeners.append(ref)

    def _notify(self) -> None:
        alive = []
        for ref in self._listeners:
            fn = ref()
            if fn is not None:
                alive.append(ref)
                fn(self)
        self._listeners = alive

    def hidden(self) -> mx.array:
        """(B, T, n_taps * H): the taps of the last forward, concatenated in layer order."""
        missing = [i for i in self.layer_ids if i not in self.outputs]
        if missing:
            raise RuntimeError(f"layers {missing} were not run since the taps were installed")
        return mx.concatenate([self.outputs[i] for i in self.layer_ids], axis=-1)

    def remove(self) -> None:
        for layer, cls in self._originals:
            layer.__class__ = cls
            for name in ("_mlxspec_tap", "_mlxspec_tap_id", "_mlxspec_tap_first", "_mlxspec_tap_last"):
                object.__delattr__(layer, name)
        self._originals.clear()


def _tapped_class(cls: type) -> type:
    def __call__(self, x, *args, **kwargs):
        rec: TapRecorder = self._mlxspec_tap
        if self._mlxspec_tap_first:
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            rec.offset = int(cache.offset) if cache is not None else 0
            rec.cache = cache
        out = cls.__call__(self, x, *args, **kwargs)
        rec.outputs[self._mlxspec_tap_id] = out
        if self._mlxspec_tap_last:
            rec._notify()
        return out

    return type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})


def install_taps(model: nn.Module, layer_ids: Sequence[int], check: bool = True) -> TapRecorder:
    """Record the outputs of decoder layers `layer_ids` (0-based) at every forward of `model`.
    With `check`, refuse unsuitable models and verify on a 4-token probe that the taps fire and
    leave the logits unchanged."""
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise UnsupportedModelError(
            f"the head taps layers {list(layer_ids)}, but the target has {len(layers)} layers (0..{len(layers) - 1})"
        )
    if check:
        check_tappable(model)
        probe = mx.array([[1, 2, 3, 4]], mx.uint32)
        before = model(probe)
    rec = TapRecorder(model, layer_ids)
    first, last = min(layer_ids), max(layer_ids)
    for i in sorted(set(layer_ids)):
        layer = layers[i]
        if hasattr(layer, "_mlxspec_tap"):
            raise UnsupportedModelError(f"layer {i} of this model is already tapped")
        rec._originals.append((layer, type(layer)))
        object.__setattr__(layer, "_mlxspec_tap", rec)
        object.__setattr__(layer, "_mlxspec_tap_id", i)
        object.__setattr__(layer, "_mlxspec_tap_first", i == first)
        object.__setattr__(layer, "_mlxspec_tap_last", i == last)
        layer.__class__ = _tapped_class(type(layer))
    if check:
        rec.outputs.clear()
        after = model(probe)
        ok = mx.array_equal(before, after).item()
        fired = set(rec.outputs) == set(layer_ids)
        if not (ok and fired):
            rec.remove()
            raise UnsupportedModelError(
                f"{type(model).__name__}'s forward does not go through its decoder layers as expected "
                "(the hidden-state taps did not fire, or changed the logits)"
            )
        rec.outputs.clear()
    return rec
