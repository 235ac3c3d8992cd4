"""`mlxspec convert`: a Hugging Face repo or folder, or a GGUF file, to an MLX model folder.

The output is what mlx-lm's own converter writes (config.json, model*.safetensors plus
model.safetensors.index.json, tokenizer files; MLX affine quantization), so both `mlxspec.load`
and `mlx_lm.load` open it. Two sources given together (`--draft`) become a pair folder:

    OUT/target/  OUT/draft/  OUT/mlxspec-pair.json

How it works, and why it does not simply call `mlx_lm.convert`:

- Every source becomes a config dict plus a list of tensors, each of which can produce itself
  as row blocks on demand (`_Tensor`). A Hugging Face folder goes through mlx-lm's
  `load_model(lazy=True)` (its config handling and `sanitize()`; `mx.load` is lazy); a GGUF file
  goes through `gguf_reader` (dequantized with the `gguf` package, a few thousand rows at a time).
- The safetensors shards are planned up front (names, shapes, dtypes, sizes are known before
  any data is read) and written tensor by tensor, block by block. Peak memory is one block
  plus one tensor's worth of MLX temporaries, not the model: mlx-lm's `save_model` needs a
  whole shard (up to 5 GB) materialised at once.
- Everything is written to a hidden temporary folder beside the output, checked by loading it
  with mlx-lm (strict names and shapes, and the tokenizer), then renamed into place.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import click
import numpy as np

DTYPES = ("float16", "bfloat16", "float32")
QUANT_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
PAIR_MANIFEST = "mlxspec-pair.json"
PROVENANCE = "mlxspec-provenance.json"

# mlx-lm's MAX_FILE_SIZE_GB; a module variable so tests can force several shards
SHARD_BYTES = 5 << 30

# Files copied from a Hugging Face folder besides the weights
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.json", "chat_template.jinja",
    "generation_config.json",
)
_HUB_PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class ConvertError(click.ClickException):
    """A conversion that cannot proceed. The message says what is wrong and what to do."""


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------
def convert(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    draft: str | os.PathLike | None = None,
    dtype: str | None = None,
    quantize: int | None = None,
    group_size: int = 64,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert `source` (hub repo id, Hugging Face folder, or GGUF file) to an MLX folder `out`.

    With `draft`, `out` becomes a pair folder (`target/`, `draft/`, `mlxspec-pair.json`) and the
    two tokenizers must agree. `dtype=None` keeps a Hugging Face folder's dtypes and writes
    float16 for GGUF. `quantize` (4 or 8) applies MLX affine quantization with `group_size`.
    Nothing appears at `out` unless everything succeeded; an existing `out` is replaced only
    with `force=True`. Returns the output path.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quantize is not None and quantize not in QUANT_BITS:
        raise ConvertError(f"unsupported --quantize {quantize}; choose 4 or 8")
    if quantize is not None and group_size not in GROUP_SIZES:
        raise ConvertError(f"unsupported --group-size {group_size}; choose one of {GROUP_SIZES}")
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise ConvertError(f"{out} already exists; pass --force to replace it")
    options = {"dtype": dtype, "quantize": quantize,
               "group_size": group_size if quantize else None}
    log = _Log(progress)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output should not be
    try:
        target = _prepare(source, log, options)
        if draft is None:
            target.convert_into(tmp, log)
        else:
            drafted = _prepare(draft, log, options)
            if isinstance(target, _PreparedHead) or isinstance(drafted, _PreparedHead):
                raise ConvertError("a trained draft head is converted on its own (`mlxspec convert HEAD -o OUT`) "
                                   "and loaded with `--draft OUT`; it cannot go into a pair folder")
            (tmp / "target").mkdir()
            (tmp / "draft").mkdir()
            # tokenizers first: a mismatched pair fails in seconds, before any weights are written
            target.write_tokenizer(tmp / "target", log)
            drafted.write_tokenizer(tmp / "draft", log)
            check = check_pair(tmp / "target", tmp / "draft")
            target.convert_into(tmp / "target", log, tokenizer_done=True)
            drafted.convert_into(tmp / "draft", log, tokenizer_done=True)
            manifest = {
                "format": "mlxspec-pair",
                "version": 1,
                "target": "target",
                "draft": "draft",
                "provenance": {
                    "target": target.provenance,
                    "draft": drafted.provenance,
                    "tokenizer_check": check,
                    "mlxspec_version": _version(),
                },
            }
            _write_json(tmp / PAIR_MANIFEST, manifest)
        _publish(tmp, out, force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise ConvertError(
                f"the disk filled up while writing {out.name}; free space on "
                f"{out.parent} (or choose another -o) and run again -- nothing was written"
            ) from None
        raise
    log(f"Wrote {out}")
    return out


def check_pair(target_dir: str | os.PathLike, draft_dir: str | os.PathLike) -> dict[str, Any]:
    """Check that two converted folders share a vocabulary and special tokens.

    Raises ConvertError if not; returns what was compared, for the pair manifest.
    """
    from mlx_lm.utils import load_tokenizer

    from .errors import PairMismatchError
    from .loading import check_pair as check_tokenizers

    t = load_tokenizer(Path(target_dir))
    d = load_tokenizer(Path(draft_dir))
    try:
        check_tokenizers(t, d)  # the same rule mlxspec.load applies
    except PairMismatchError as e:
        raise ConvertError(str(e)) from e
    tv = t.get_vocab()
    return {
        "vocab_size": len(tv),
        "vocab_sha256": hashlib.sha256(
            json.dumps(sorted(tv.items()), ensure_ascii=False).encode()).hexdigest(),
        "bos_token": t.bos_token,
        "eos_token": t.eos_token,
        "eos_token_ids": sorted(t.eos_token_ids),
    }


def is_pair(path: str | os.PathLike) -> bool:
    """True if `path` is a pair folder written by `convert(..., draft=...)`."""
    return (Path(path) / PAIR_MANIFEST).is_file()


def default_output(source: str, draft: str | None = None, quantize: int | None = None) -> Path:
    """`./<name>-mlx` (with `-<n>bit` when quantized), named after the source."""
    p = Path(source)
    name = p.stem if p.suffix.lower() == ".gguf" else p.name or "model"
    if draft is not None:
        name += "-pair"
    if quantize:
        name += f"-{quantize}bit"
    return Path.cwd() / f"{name}-mlx"


# ----------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """One tensor to write, under its mlx-lm name, produced on demand as row blocks."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # mx.Dtype of the source values (float32 for dequantized GGUF)
    chunks: Callable[[], Iterator[Any]] = field(repr=False)


@dataclass
class _Prepared:
    """A source opened and checked, ready to write."""

    label: str
    config: dict[str, Any]
    tensors: list[_Tensor]
    model: Any  # mlx-lm model skeleton (lazy, never evaluated): module tree for quantization
    options: dict[str, Any]
    default_dtype: str | None
    provenance: dict[str, Any]
    write_tokenizer_files: Callable[[Path], None]
    extra_files: list[Path] = field(default_factory=list)

    def write_tokenizer(self, out_dir: Path, log: "_Log") -> None:
        log(f"{self.label}: writing tokenizer")
        self.write_tokenizer_files(out_dir)

    def convert_into(self, out_dir: Path, log: "_Log", tokenizer_done: bool = False) -> None:
        if not tokenizer_done:
            self.write_tokenizer(out_dir, log)
        for f in self.extra_files:
            shutil.copy(f, out_dir / f.name)
        dtype = self.options["dtype"] or self.default_dtype
        config = dict(self.config)
        stats = _write_weights(
            out_dir, self.tensors, self.model, config, dtype=dtype,
            bits=self.options["quantize"], group_size=self.options["group_size"],
            log=log, label=self.label,
        )
        from mlx_lm.utils import save_config

        save_config(config, out_dir / "config.json")
        self.provenance["options"] = {**self.options, "dtype": dtype}
        self.provenance["mlxspec_version"] = _version()
        self.provenance["versions"] = _versions()
        self.provenance["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.provenance["output"] = stats
        _write_json(out_dir / PROVENANCE, self.provenance)
        _verify(out_dir, log, self.label)


def _prepare(source: str | os.PathLike, log: "_Log", options: dict[str, Any]) -> _Prepared:
    src = str(source)
    path = Path(src).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return _prepare_gguf(path, log, options)
        if path.suffix.lower() == ".gguf":
            raise ConvertError(f"{path} does not start with the GGUF magic bytes; "
                               "it is corrupt or not a GGUF file")
        raise ConvertError(f"{path} is neither a GGUF file nor a Hugging Face folder")
    if path.is_dir():
        prov = {"source": str(path.absolute()), "source_kind": "hf-folder"}
        if _is_head(path):
            return _PreparedHead(path, options, prov)
        return _prepare_hf(path, log, options, provenance=prov)
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", src) and not src.startswith((".", "/")):
        folder, revision = _download(src, log)
        prov = {"source": src, "source_kind": "hf-hub", "revision": revision}
        if _is_head(folder):
            return _PreparedHead(folder, options, prov)
        return _prepare_hf(folder, log, options, provenance=prov)
    raise ConvertError(f"{src}: no such file or folder (and not a Hugging Face repo id)")


def _is_head(folder: Path) -> bool:
    from .heads import is_head

    return is_head(folder)


class _PreparedHead:
    """A trained draft head (EAGLE-3, DFlash, DSpark: mlxspec.heads): its config.json is copied
    as it is and its safetensors tensors are written under their published names into one
    model.safetensors, floating-point tensors in the asked dtype (d2t/t2d and other integer or
    boolean maps kept), with provenance. Checked by reading it back as a head of its family."""

    def __init__(self, folder: Path, options: dict[str, Any], provenance: dict[str, Any]):
        self.folder = folder
        self.options = options
        self.label = provenance["source"].rstrip("/").split("/")[-1]
        self.provenance = {**provenance, "converter": "mlxspec.convert", "kind": "draft-head"}
        if options["quantize"]:
            raise ConvertError(f"{self.label} is a trained draft head: convert it without --quantize")
        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            others = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
            hint = f" (found {', '.join(others[:3])}: re-save it with safetensors)" if others else ""
            raise ConvertError(f"{folder} is a draft head without .safetensors weights{hint}")

    def convert_into(self, out_dir: Path, log: "_Log", tokenizer_done: bool = False) -> None:
        import mlx.core as mx

        from .heads import head_family

        dtype = self.options["dtype"]
        weights: dict[str, Any] = {}
        for f in self.files:
            weights.update(mx.load(str(f)))
        if dtype is not None:
            want = getattr(mx, dtype)
            weights = {k: v.astype(want) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        log(f"{self.label}: writing {len(weights)} tensors of a {head_family(self.folder)} head")
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        config = json.loads((self.folder / "config.json").read_text())
        if dtype is not None:
            config["torch_dtype"] = dtype
        _write_json(out_dir / "config.json", config)
        self.provenance["sha256"] = {p.name: _sha256(p, log) for p in sorted(self.files + [self.folder / "config.json"])}
        self.provenance["options"] = {**self.options, "dtype": dtype or "as stored"}
        self.provenance["mlxspec_version"] = _version()
        self.provenance["versions"] = _versions()
        self.provenance["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.provenance["output"] = {"tensors": len(weights),
                                     "bytes": (out_dir / "model.safetensors").stat().st_size}
        _write_json(out_dir / PROVENANCE, self.provenance)
        self._verify(out_dir, config)

    def _verify(self, out_dir: Path, config: dict) -> None:
        from .heads import head_family

        if head_family(out_dir) == "LlamaForCausalLMEagle3":
            from .heads.eagle3 import load_head

            layers = config.get("num_target_layers") or 64  # only for default taps; not checked here
            try:
                load_head(out_dir, target_layers=layers)
            except Exception as e:
                raise ConvertError(f"{self.label}: the written head does not load: {type(e).__name__}: {e}") from None


def _download(repo_id: str, log: "_Log") -> tuple[Path, str | None]:
    """Download (or find in the normal cache) the safetensors, JSON and tokenizer files."""
    from huggingface_hub import constants, snapshot_download

    log(f"{repo_id}: fetching from the Hugging Face hub (or its local cache)")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:
        offline = constants.HF_HUB_OFFLINE
        why = ("HF_HUB_OFFLINE is set and it is not in the local cache" if offline
               else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise ConvertError(
            f"cannot get {repo_id} from the Hugging Face hub ({why}). Without the hub, pass a "
            "local Hugging Face folder or a GGUF file instead (for real models without the "
            "hub see scripts/get_offline_models.py)"
        ) from None
    revision = folder.name if re.fullmatch(r"[0-9a-f]{40}", folder.name) else None
    return folder, revision


def _prepare_hf(folder: Path, log: "_Log", options: dict[str, Any],
                provenance: dict[str, Any]) -> _Prepared:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    label = provenance["source"].rstrip("/").split("/")[-1]
    if not (folder / "config.json").is_file():
        raise ConvertError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    weights = sorted(folder.glob("model*.safetensors"))
    if not weights:
        others = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors")]
        hint = (f" (found {', '.join(others[:3])}: only model*.safetensors is read; re-save it "
                "with safetensors)") if others else ""
        raise ConvertError(f"{folder} has no weights: no model*.safetensors file{hint}")
    tok_files = [n for n in ("tokenizer.json", "tokenizer.model", "vocab.json")
                 if (folder / n).is_file()] + [p.name for p in folder.glob("*.tiktoken")]
    if not tok_files:
        raise ConvertError(f"{folder} has no tokenizer (tokenizer.json, tokenizer.model or "
                           "vocab.json); copy the tokenizer files into it")
    try:
        model, config = load_model(folder, lazy=True, strict=True)
    except Exception as e:
        raise ConvertError(f"mlx-lm cannot load {folder}: {type(e).__name__}: {e}") from None
    if options["quantize"] and config.get("quantization"):
        raise ConvertError(f"{folder} is already quantized; convert it without --quantize")

    tensors = []
    for name, arr in tree_flatten(model.parameters()):
        tensors.append(_Tensor(name, tuple(arr.shape), arr.dtype,
                               chunks=lambda a=arr: iter((a,))))
    provenance["sha256"] = {p.name: _sha256(p, log) for p in
                            sorted(weights + [folder / "config.json"])}

    def write_tok(out_dir: Path) -> None:
        for n in _TOKENIZER_FILES:
            if (folder / n).is_file():
                shutil.copy(folder / n, out_dir / n)
        for p in folder.glob("*.tiktoken"):
            shutil.copy(p, out_dir / p.name)

    return _Prepared(label, config, tensors, model, options, None,
                     {**provenance, "converter": "mlxspec.convert"}, write_tok)


def _prepare_gguf(path: Path, log: "_Log", options: dict[str, Any]) -> _Prepared:
    import mlx.core as mx

    from .gguf_reader import GGUFError, GGUFModel

    log(f"{path.name}: reading GGUF metadata")
    try:
        g = GGUFModel(path)
        config = dict(g.config)
        gts = g.tensors()
    except GGUFError as e:
        raise ConvertError(str(e)) from None
    tensors = [_Tensor(t.name, t.shape, mx.float32, t.chunks) for t in gts]
    model = _skeleton(config, tensors, str(path.name))
    keep = {n for n, _ in _flat_shapes(model)}
    tensors = [t for t in tensors if t.name in keep]
    meta = g.metadata()
    provenance = {
        "source": str(path.absolute()),
        "source_kind": "gguf",
        "sha256": {path.name: _sha256(path, log)},
        "gguf": {
            "architecture": g.arch,
            "name": meta.get("general.name"),
            "file_type": meta.get("general.file_type"),
            "tensor_types": _counts(t.ggml_type for t in gts),
        },
        "converter": "mlxspec.convert",
    }

    def write_tok(out_dir: Path) -> None:
        try:
            g.write_tokenizer(out_dir)
        except GGUFError as e:
            raise ConvertError(str(e)) from None

    return _Prepared(path.stem, config, tensors, model, options, "float16", provenance, write_tok)


def _skeleton(config: dict[str, Any], tensors: Sequence[_Tensor], label: str):
    """The mlx-lm model for `config` (parameters lazy, never computed), checked against tensors."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
    except Exception as e:
        raise ConvertError(f"{label}: mlx-lm cannot build {config.get('model_type')!r}: {e}") from None
    given = {t.name: t.shape for t in tensors}
    if hasattr(model, "sanitize"):
        # lazy zeros: sanitize only renames/drops here (tied lm_head); nothing is computed
        given = {k: tuple(v.shape) for k, v in
                 model.sanitize({k: mx.zeros(s, dtype=mx.float16) for k, s in given.items()}).items()}
    want = dict(_flat_shapes(model))
    missing = sorted(set(want) - set(given))
    extra = sorted(set(given) - set(want))
    wrong = sorted(k for k in set(want) & set(given) if want[k] != given[k])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}")
        if extra:
            parts.append(f"unexpected {extra[:3]}")
        if wrong:
            parts.append(f"wrong shape {[(k, given[k], want[k]) for k in wrong[:2]]}")
        raise ConvertError(f"{label}: tensors do not match mlx-lm's {config['model_type']} "
                           f"model: {'; '.join(parts)}")
    return model


def _flat_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    from mlx.utils import tree_flatten

    return [(k, tuple(v.shape)) for k, v in tree_flatten(model.parameters())]


# ----------------------------------------------------------------------------------------
# Streaming safetensors writer
# ----------------------------------------------------------------------------------------
_ST_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32", "int32": "I32",
    "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16", "int64": "I64",
    "uint64": "U64", "bool": "BOOL", "float64": "F64",
}


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: Any  # mx.Dtype
    offset: int = 0  # within the shard's data section
    written: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.size


@dataclass
class _Job:
    tensor: _Tensor
    out_dtype: Any
    quant: dict[str, int] | None  # {"bits", "group_size"} or None
    entries: list[_Entry]


def _dtype_name(d) -> str:
    return str(d).split(".")[-1]


def _plan(tensors, model, config, dtype, bits, group_size) -> list[_Job]:
    import mlx.core as mx

    out_dtype = getattr(mx, dtype) if dtype else None
    cast_ok = getattr(model, "cast_predicate", lambda _: True)
    quantizable: dict[str, dict[str, int]] = {}
    if bits:
        predicate = getattr(model, "quant_predicate", None)
        qconf: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        for path, module in model.named_modules():
            if not hasattr(module, "to_quantized") or "weight" not in module:
                continue
            params: Any = True
            if predicate is not None:
                params = predicate(path, module)
            if not params:
                continue
            gs = params.get("group_size", group_size) if isinstance(params, dict) else group_size
            if module.weight.shape[-1] % gs:
                continue
            if isinstance(params, dict):
                qconf[path] = {"group_size": gs, "bits": params.get("bits", bits), "mode": "affine"}
                quantizable[path] = {"group_size": gs, "bits": params.get("bits", bits)}
            else:
                quantizable[path] = {"group_size": group_size, "bits": bits}
        config["quantization"] = qconf

    jobs = []
    for t in tensors:
        floating = mx.issubdtype(t.dtype, mx.floating)
        od = out_dtype if (out_dtype is not None and floating and cast_ok(t.name)) else t.dtype
        module_path, _, leaf = t.name.rpartition(".")
        q = quantizable.get(module_path) if leaf == "weight" and floating else None
        if q:
            cols, lead = t.shape[-1], t.shape[:-1]
            entries = [
                _Entry(f"{module_path}.weight", (*lead, cols * q["bits"] // 32), mx.uint32),
                _Entry(f"{module_path}.scales", (*lead, cols // q["group_size"]), od),
                _Entry(f"{module_path}.biases", (*lead, cols // q["group_size"]), od),
            ]
        else:
            entries = [_Entry(t.name, t.shape, od)]
        jobs.append(_Job(t, od, q, entries))
    return jobs


def _shards(jobs: list[_Job], limit: int) -> list[list[_Job]]:
    """Split like mlx-lm's make_shards: a new shard when the next tensor would pass the limit."""
    shards: list[list[_Job]] = []
    size = 0
    for job in jobs:
        n = sum(e.nbytes for e in job.entries)
        if not shards or size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += n
    return shards


def _write_weights(out_dir: Path, tensors, model, config, *, dtype, bits, group_size,
                   log: "_Log", label: str) -> dict[str, Any]:
    jobs = _plan(tensors, model, config, dtype, bits, group_size)
    shards = _shards(jobs, SHARD_BYTES)
    total = sum(e.nbytes for j in jobs for e in j.entries)
    free = shutil.disk_usage(out_dir).free
    if total > free:
        raise ConvertError(f"not enough disk space for {label}: it needs {total / 1e9:.2f} GB "
                           f"and {out_dir.parent} has {free / 1e9:.2f} GB free")
    fmt = ("model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors")
    weight_map: dict[str, str] = {}
    files = []
    t0 = time.perf_counter()
    with log.bar(total, f"{label}: convert+write", unit="B") as bar:
        for i, shard in enumerate(shards):
            fname = fmt.format(i + 1, len(shards))
            _write_shard(out_dir / fname, shard, bar)
            for job in shard:
                for e in job.entries:
                    weight_map[e.name] = fname
            files.append(fname)
    n_params = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    _write_json(out_dir / "model.safetensors.index.json", {
        "metadata": {"total_size": total, "total_parameters": n_params},
        "weight_map": dict(sorted(weight_map.items())),
    })
    return {"files": files, "bytes": total, "parameters": n_params,
            "seconds": round(time.perf_counter() - t0, 1)}


def _write_shard(path: Path, jobs: list[_Job], bar) -> None:
    entries = [e for j in jobs for e in j.entries]
    offset = 0
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    for e in entries:
        e.offset, e.written = offset, 0
        header[e.name] = {"dtype": _ST_DTYPES[_dtype_name(e.dtype)], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors does
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(start + offset)  # reserve the file; regions are filled block by block
        for job in jobs:
            for block in job.tensor.chunks():
                for e, arr in zip(job.entries, _transform(block, job)):
                    data = _as_bytes(arr)
                    if e.written + len(data) > e.nbytes:
                        raise ConvertError(f"{e.name}: more data than its shape {e.shape}")
                    f.seek(start + e.offset + e.written)
                    f.write(data)
                    e.written += len(data)
                    bar.update(len(data))
            for e in job.entries:
                if e.written != e.nbytes:
                    raise ConvertError(f"{e.name}: wrote {e.written} of {e.nbytes} bytes")


def _transform(block, job: _Job) -> list[Any]:
    """Cast a row block to the output dtype and, for quantized layers, quantize it."""
    import mlx.core as mx

    x = block if isinstance(block, mx.array) else mx.array(block)
    if x.dtype != job.out_dtype:
        x = x.astype(job.out_dtype)
    if job.quant is None:
        return [x]
    wq, scales, biases = mx.quantize(x, group_size=job.quant["group_size"], bits=job.quant["bits"])
    return [wq, scales, biases]


def _as_bytes(arr) -> memoryview:
    import mlx.core as mx

    if arr.dtype == mx.bfloat16:  # numpy has no bfloat16: write its bits
        arr = arr.view(mx.uint16)
    mx.eval(arr)
    return memoryview(np.ascontiguousarray(np.asarray(arr))).cast("B")


# ----------------------------------------------------------------------------------------
# Checks, publishing, provenance
# ----------------------------------------------------------------------------------------
def _verify(folder: Path, log: "_Log", label: str) -> None:
    """Open the written folder the way mlx_lm.load does: strict names/shapes, and the tokenizer."""
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        load_model(folder, lazy=True, strict=True)
        load_tokenizer(folder)
    except Exception as e:
        raise ConvertError(f"{label}: the written model does not load with mlx-lm: "
                           f"{type(e).__name__}: {e}") from None


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished temporary folder to `out`, replacing an old one only with force."""
    if out.exists() or out.is_symlink():
        if not force:
            raise ConvertError(f"{out} already exists; pass --force to replace it")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            old.rename(out)
            raise
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        tmp.rename(out)


def _sha256(path: Path, log: "_Log") -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, log.bar(size, f"sha256 {path.name}", unit="B",
                                        min_size=256 << 20) as bar:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return dict(sorted(out.items()))


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, ensure_ascii=False, default=str)
        f.write("\n")


def _version() -> str:
    try:
        from . import __version__

        return __version__
    except ImportError:
        return "unknown"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"mlxspec": _version()}
    for pkg in ("mlx", "mlx-lm", "gguf"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


class _Log:
    """Progress on stderr: one-line messages, and tqdm bars for steps longer than a moment."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=sys.stderr, flush=True)

    def bar(self, total: int, desc: str, unit: str = "it", min_size: int = 0):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024,
                    disable=not self.enabled or total < min_size, leave=False,
                    file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------
@click.command("convert")
@click.argument("source")
@click.option("-o", "--out", "out", type=click.Path(path_type=Path),
              help="Output folder (default: ./<name>-mlx).")
@click.option("--draft", help="A draft model to convert with SOURCE into a pair folder.")
@click.option("--dtype", type=click.Choice(DTYPES),
              help="Float dtype to write (default: the source's; float16 for GGUF).")
@click.option("--quantize", "-q", type=click.Choice(["4", "8"]),
              help="Quantize linear and embedding layers to 4 or 8 bits (MLX affine).")
@click.option("--group-size", type=click.Choice([str(g) for g in GROUP_SIZES]), default="64",
              show_default=True, help="Quantization group size.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def convert_command(source, out, draft, dtype, quantize, group_size, force, quiet):
    """Convert SOURCE to an MLX model folder that mlxspec and mlx-lm load.

    SOURCE is a Hugging Face repo id, a local Hugging Face folder (safetensors) or a GGUF
    file (llama.cpp, Ollama). With --draft, both are converted into OUT/target and OUT/draft
    and checked to share a tokenizer.
    """
    bits = int(quantize) if quantize else None
    if out is None:
        out = default_output(source, draft, bits)
        click.echo(f"Output: {out}", err=True)
    try:
        path = convert(source, out, draft=draft, dtype=dtype, quantize=bits,
                       group_size=int(group_size), force=force, progress=not quiet)
    except KeyboardInterrupt:
        click.echo("\nInterrupted; nothing was written.", err=True)
        sys.exit(130)
    except ConvertError:
        raise
    except Exception as e:  # unexpected: still one line, no traceback
        raise click.ClickException(f"{type(e).__name__}: {e}") from None
    click.echo(str(path))
