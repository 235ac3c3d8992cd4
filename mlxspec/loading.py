"""Load a target (and a draft) with mlx-lm, check that they can work together, and build a Pair."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx

from .engine import Pair
from .errors import ModelNotFoundError, ModelTooLargeError, PairMismatchError
from .heads import is_head, load_trained_head
from .platform import physical_memory

PAIR_MANIFEST = "mlxspec-pair.json"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def read_pair_manifest(folder: Path) -> tuple[Path, Path | None] | None:
    """(target, draft) folders of a pair folder written by `mlxspec convert --draft`."""
    manifest = folder / PAIR_MANIFEST
    if not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    if data.get("format") != "mlxspec-pair":
        raise ModelNotFoundError(f"{manifest} is not an mlxspec pair manifest")
    target = folder / data["target"]
    draft = folder / data["draft"] if data.get("draft") else None
    return target, draft


def resolve_model(spec: str | Path) -> Path:
    """A local MLX folder, or a Hugging Face repo id fetched through the hub cache."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{spec} is a file, not a model folder (convert it with `mlxspec convert {spec}`)")
        if not (path / "config.json").is_file() and read_pair_manifest(path) is None:
            raise ModelNotFoundError(f"{spec} has no config.json: not an MLX model folder")
        return path
    if not _REPO_ID.match(str(spec)) or str(spec).startswith((".", "/", "~")):
        raise ModelNotFoundError(f"no such model folder: {spec}")
    from mlx_lm.utils import _download

    try:
        return Path(_download(str(spec)))
    except Exception as e:
        raise ModelNotFoundError(
            f"could not get {spec} from the Hugging Face hub ({type(e).__name__}); "
            "give a local folder instead (see `mlxspec convert`)"
        ) from e


def _weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def check_memory(folders: list[Path], dtype: str | None) -> None:
    """Refuse before loading when the weights cannot fit in memory."""
    total = 0
    for folder in folders:
        size = _weights_bytes(folder)
        cfg = json.loads((folder / "config.json").read_text())
        stored = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
        if dtype == "float32" and "32" not in stored and "quantization" not in cfg:
            size *= 2
        total += size
    mem = physical_memory()
    if mem and total > 0.9 * mem:
        raise ModelTooLargeError(
            f"the weights need about {total / 2**30:.1f} GiB but this machine has "
            f"{mem / 2**30:.1f} GiB of memory; use a smaller or quantized model, or a smaller --dtype"
        )


def _load_one(folder: Path, dtype: str | None):
    from mlx_lm.utils import load

    model, tokenizer = load(str(folder), lazy=True)
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model, tokenizer


def check_pair(target_tok, draft_tok) -> None:
    """Vocabularies and special tokens must agree, or the draft proposes the wrong ids."""
    problems = []
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))
        only_d = sorted(set(dv) - set(tv))
        moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])
        detail = f"target has {len(tv)} tokens, draft has {len(dv)}"
        if only_t:
            detail += f"; only in target: {only_t[:3]}"
        if only_d:
            detail += f"; only in draft: {only_d[:3]}"
        if moved:
            detail += f"; {len(moved)} tokens have different ids, e.g. {moved[0]!r}: {tv[moved[0]]} vs {dv[moved[0]]}"
        problems.append(f"vocabularies differ ({detail})")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b and a is not None and b is not None:
            problems.append(f"{attr} differs (target {a}, draft {b})")
    a, b = set(getattr(target_tok, "eos_token_ids", []) or []), set(getattr(draft_tok, "eos_token_ids", []) or [])
    if a and b and not (a & b):
        problems.append(f"end-of-sequence tokens differ (target {sorted(a)}, draft {sorted(b)})")
    if problems:
        raise PairMismatchError(
            "the draft does not match the target (the draft's tokenizer differs from the "
            "target's): " + "; ".join(problems)
            + "; speculative decoding needs the same vocabulary and special tokens"
        )


def load(target: str | Path, draft: str | Path | None = None, dtype: str | None = None) -> Pair:
    """Load a target and an optional draft (local folders, pair folders or hub repo ids). The
    draft may be a trained head folder (EAGLE-3: heads/): it becomes `pair.head`, checked
    against the target, and drafter="auto" drafts with it."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if str(target).startswith("synthetic:"):  # random weights of a named shape, for timing (synthetic.py)
        from .synthetic import load_pair

        return load_pair(str(target), None if draft is None else str(draft), dtype)
    target_path = resolve_model(target)
    pair_folders = read_pair_manifest(target_path)
    if pair_folders is not None:
        target_path, pair_draft = pair_folders
        if draft is None:
            draft = pair_draft
    draft_path = resolve_model(draft) if draft is not None else None
    check_memory([p for p in (target_path, draft_path) if p is not None], dtype)

    target_model, tokenizer = _load_one(target_path, dtype)
    draft_model = head = None
    if draft_path is not None and is_head(draft_path):
        # a trained head (EAGLE-3, ...): checked against the target, which gets its taps
        head = load_trained_head(draft_path, target_model, DTYPES[dtype] if dtype else None)
    elif draft_path is not None:
        draft_model, draft_tok = _load_one(draft_path, dtype)
        check_pair(tokenizer, draft_tok)
    pair = Pair(target_model, draft_model, tokenizer, head=head)
    pair.target_path, pair.draft_path = target_path, draft_path
    return pair
