"""What the head learns from, computed once by prefilling the target in chunks and kept on disk.

Per token t of a sample (float16 .npy shards, read back memory-mapped, so memory stays bounded
by one chunk while extracting and by one batch while training):
    taps    (n_taps * H,)  the tapped layers' outputs (heads/taps.py), the head's step-0 input
    hidden  (H,)           the target's final normed hidden state: the target's distribution at t
                           is softmax(hidden @ W.T) with W its output matrix; training recomputes
                           it on the draft vocabulary only (W's rows of the draft ids)
    argmax  int32          the target's top token over the FULL vocabulary (positions whose top
                           token lies outside the draft vocabulary are left out of the loss)
    tokens  int32          the token itself

    feats = extract(target, samples, folder, tap_layers, key={...})   # resumable, reused
    feats.sample(i) -> dict of arrays for sample i

A folder holds one manifest.json (its key: target, data hash, taps, sample lengths) and
shard-NNNNN/ folders, each written to a temporary folder and renamed, so a killed extraction
resumes after its last complete shard and never reads a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import MlxspecError, UnsupportedModelError
from ..heads.taps import install_taps

MANIFEST = "manifest.json"
FP16_MAX = 65504.0


# -- the target's output layer, split from its body --------------------------------------------


def _inner(target: nn.Module) -> nn.Module:
    inner = getattr(target, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise UnsupportedModelError(f"{type(target).__name__} has no .model with embed_tokens (an mlx-lm LM)")
    return inner


def embed(target: nn.Module, ids: mx.array) -> mx.array:
    """The target's input embedding (the head's, frozen)."""
    return _inner(target).embed_tokens(ids)


def final_hidden(target: nn.Module, ids: mx.array, cache=None) -> mx.array:
    """(B, T, H): the target body's output, before the output matrix."""
    return _inner(target)(ids, cache=cache)


def _dense(layer: nn.Module, rows: mx.array | None) -> mx.array:
    """(rows, H) float32 weights of a Linear, QuantizedLinear or (tied) Embedding."""
    w = layer.weight
    scales = getattr(layer, "scales", None)
    if scales is not None:
        biases = getattr(layer, "biases", None)
        if rows is not None:
            w, scales = w[rows], scales[rows]
            biases = biases[rows] if biases is not None else None
        return mx.dequantize(w, scales, biases, layer.group_size, layer.bits).astype(mx.float32)
    return (w[rows] if rows is not None else w).astype(mx.float32)


def output_rows(target: nn.Module, ids: np.ndarray | Sequence[int]) -> mx.array:
    """(len(ids), H) float32: the rows of the target's output matrix for these token ids."""
    rows = mx.array(np.asarray(ids, dtype=np.int64)).astype(mx.uint32)
    head = getattr(target, "lm_head", None)
    if head is not None:
        return _dense(head, rows)
    return _dense(_inner(target).embed_tokens, rows)


def full_logits(target: nn.Module, hidden: mx.array) -> mx.array:
    head = getattr(target, "lm_head", None)
    if head is not None:
        return head(hidden)
    return _inner(target).embed_tokens.as_linear(hidden)


def check_split(target: nn.Module) -> None:
    """The logits rebuilt from the final hidden state and output rows must be the target's own
    (models with logit scaling or soft-capping after the output matrix are refused)."""
    probe = mx.array([[1, 2, 3, 4]], mx.uint32)
    want = target(probe).astype(mx.float32)
    h = final_hidden(target, probe).astype(mx.float32)
    rows = np.unique(np.r_[np.arange(min(16, want.shape[-1])), np.array(mx.argmax(want, -1)).ravel()])
    got = h @ output_rows(target, rows).T
    ref = want[..., mx.array(rows)]
    if not mx.allclose(got, ref, rtol=1e-2, atol=1e-2 * (1 + float(mx.abs(ref).max()))).item():
        raise UnsupportedModelError(
            f"{type(target).__name__}'s logits are not its output matrix applied to the final hidden state "
            "(logit scaling or soft-capping); training a head for it is not supported"
        )


# -- the on-disk features ---------------------------------------------------------------------


@dataclass
class Features:
    folder: Path
    key: dict
    lengths: list[int]  # tokens per sample
    index: list[tuple[str, int]]  # per sample: (shard name, first row)
    _open: dict | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def _shard(self, name: str) -> dict[str, np.ndarray]:
        if self._open is None:
            self._open = {}
        if name not in self._open:
            d = self.folder / name
            self._open[name] = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ("taps", "hidden", "argmax", "tokens")}
        return self._open[name]

    def sample(self, i: int) -> dict[str, np.ndarray]:
        name, start = self.index[i]
        n = self.lengths[i]
        shard = self._shard(name)
        return {k: np.asarray(v[start:start + n]) for k, v in shard.items()}


def _read_manifest(folder: Path) -> dict | None:
    f = folder / MANIFEST
    return json.loads(f.read_text()) if f.is_file() else None


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, folder / MANIFEST)


def load_features(folder: str | Path, key: dict | None = None) -> Features | None:
    """The complete features in folder (None when absent or unfinished); with key, they must be
    the features of that key (target, data, taps)."""
    folder = Path(folder)
    m = _read_manifest(folder)
    if m is None or not m.get("complete"):
        return None
    if key is not None and m["key"] != key:
        raise MlxspecError(f"{folder} holds features of another target, data or taps; delete it or use another folder")
    index, lengths = [], []
    for shard in m["shards"]:
        for start, n in shard["samples"]:
            index.append((shard["name"], start))
            lengths.append(n)
    return Features(folder, m["key"], lengths, index)


def _write_shard(folder: Path, name: str, parts: list[dict[str, np.ndarray]]) -> None:
    tmp = folder / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k in ("taps", "hidden", "argmax", "tokens"):
        np.save(tmp / f"{k}.npy", np.concatenate([p[k] for p in parts]))
    shutil.rmtree(folder / name, ignore_errors=True)
    os.rename(tmp, folder / name)


def _to_fp16(x: mx.array, what: str) -> np.ndarray:
    a = np.array(x.astype(mx.float32))
    big = float(np.abs(a).max()) if a.size else 0.0
    if not np.isfinite(big) or big > FP16_MAX:
        raise UnsupportedModelError(f"the target's {what} reach {big:g}, beyond float16; its features cannot be stored")
    return a.astype(np.float16)


def prefill_features(target: nn.Module, recorder, ids: Sequence[int], chunk: int) -> dict[str, np.ndarray]:
    """One sample's features, prefilled chunk by chunk into a fresh KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(target)
    out: dict[str, list[np.ndarray]] = {"taps": [], "hidden": [], "argmax": []}
    for s in range(0, len(ids), chunk):
        x = mx.array([list(ids[s:s + chunk])], mx.uint32)
        h = final_hidden(target, x, cache)
        taps = recorder.hidden()
        top = mx.argmax(full_logits(target, h), axis=-1)
        mx.eval(h, taps, top)
        out["taps"].append(_to_fp16(taps[0], "tapped hidden states"))
        out["hidden"].append(_to_fp16(h[0], "final hidden states"))
        out["argmax"].append(np.array(top[0]).astype(np.int32))
    res = {k: np.concatenate(v) for k, v in out.items()}
    res["tokens"] = np.asarray(ids, dtype=np.int32)
    return res


def greedy_features(target: nn.Module, recorder, prompt: Sequence[int], new_tokens: int, chunk: int,
                    stop: set[int] = frozenset()) -> dict[str, np.ndarray]:
    """Features along the target's own greedy continuation of prompt: held-out trajectories on
    which a greedy draft's accepted length is exactly what speculative decoding would accept."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(target)
    tokens = list(prompt)
    out: dict[str, list[np.ndarray]] = {"taps": [], "hidden": [], "argmax": []}
    pending = list(prompt)
    produced = 0
    while pending:
        for s in range(0, len(pending), chunk):
            x = mx.array([pending[s:s + chunk]], mx.uint32)
            h = final_hidden(target, x, cache)
            taps = recorder.hidden()
            top = mx.argmax(full_logits(target, h), axis=-1)
            mx.eval(h, taps, top)
            out["taps"].append(_to_fp16(taps[0], "tapped hidden states"))
            out["hidden"].append(_to_fp16(h[0], "final hidden states"))
            out["argmax"].append(np.array(top[0]).astype(np.int32))
        nxt = int(out["argmax"][-1][-1])
        if produced >= new_tokens:
            break
        tokens.append(nxt)
        produced += 1
        pending = [nxt]
        if nxt in stop:
            new_tokens = produced  # feed the stop token once, then end
    res = {k: np.concatenate(v) for k, v in out.items()}
    res["tokens"] = np.asarray(tokens, dtype=np.int32)
    return res


def extract(target: nn.Module, samples: list[list[int]], folder: str | Path, tap_layers: Sequence[int], key: dict, *,
            chunk: int = 256, shard_tokens: int = 2048, progress: bool = True, desc: str = "features",
            make: Callable | None = None) -> Features:
    """Compute (or reuse, or finish) the features of samples in folder. `make(target, recorder,
    sample)` builds one sample's features (default: prefill_features)."""
    from tqdm import tqdm

    folder = Path(folder)
    done = load_features(folder, key)
    if done is not None:
        return done
    folder.mkdir(parents=True, exist_ok=True)
    m = _read_manifest(folder)
    if m is not None and m["key"] != key:
        raise MlxspecError(f"{folder} holds features of another target, data or taps; delete it or use another folder")
    if m is None:
        m = {"format": "mlxspec-features", "version": 1, "key": key, "complete": False, "shards": [], "samples_done": 0}
        _write_manifest(folder, m)
    if make is None:
        make = lambda t, r, s: prefill_features(t, r, s, chunk)  # noqa: E731
    check_split(target)
    recorder = install_taps(target, tap_layers)
    try:
        first = m["samples_done"]
        total = sum(len(s) for s in samples)
        bar = tqdm(total=total, initial=sum(len(s) for s in samples[:first]), unit="tok", unit_scale=True,
                   desc=desc, disable=not progress, dynamic_ncols=True, smoothing=0.1)
        parts: list[dict] = []
        spans: list[list[int]] = []
        rows = 0
        t0 = time.time()
        for i in range(first, len(samples)):
            f = make(target, recorder, samples[i])
            parts.append(f)
            spans.append([rows, len(f["tokens"])])
            rows += len(f["tokens"])
            bar.update(len(samples[i]))
            if rows >= shard_tokens or i == len(samples) - 1:
                name = f"shard-{len(m['shards']):05d}"
                _write_shard(folder, name, parts)
                m["shards"].append({"name": name, "samples": spans})
                m["samples_done"] = i + 1
                m["seconds"] = m.get("seconds", 0.0) + time.time() - t0
                t0 = time.time()
                _write_manifest(folder, m)
                parts, spans, rows = [], [], 0
        bar.close()
    finally:
        recorder.remove()
    m["complete"] = True
    _write_manifest(folder, m)
    return load_features(folder, key)
