#!/usr/bin/env python
"""Train an EAGLE-3 head for the offline Qwen2.5-Coder-1.5B target on Python code available on
every machine: the top-level modules of this Python's standard library.

    python scripts/train_qwen_head.py                      # data -> train -> models/qwen2.5-coder-head
    python scripts/train_qwen_head.py --data-only          # only write the data and the recipe

The data: each top-level `def`/`class` block of the standard library's top-level .py modules
(sorted by module name, blocks of 200..6000 characters) becomes one chat record
    user:      Write the Python function `name` of the standard-library module `mod`.
    assistant: ```python\n<the block>\n```
so the head learns code inside the target's chat format (what `mlxspec bench` asks for).
The recipe (Python version, modules, records, sha256) is written to
models/qwen2.5-coder-head-recipe.json; the training settings and measured tokens go to the
output folder's mlxspec-train.json. The weights stay out of git.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "models" / "qwen2.5-coder-head-recipe.json"
BLOCK = re.compile(r"^(def|class|async def) (\w+)", re.M)

# the settings of the committed run (sized for ~40 minutes of a shared 2-core machine)
TRAIN_ARGS = [
    "--draft-vocab", "8192", "--ttt-steps", "5", "--max-tokens", "8192", "--max-tokens-per-sample", "512",
    "--intermediate-size", "2048", "--epochs", "3", "--batch-size", "2", "--lr", "5e-4",
    "--checkpoint-every", "20", "--eval-prompts", "4", "--eval-new-tokens", "40", "--dtype", "float32",
]


def blocks(source: str) -> list[tuple[str, str, str]]:
    """(kind, name, text) of each top-level def/class block."""
    starts = [m for m in BLOCK.finditer(source)]
    out = []
    for m, nxt in zip(starts, starts[1:] + [None]):
        end = nxt.start() if nxt is not None else len(source)
        text = source[m.start():end].rstrip()
        # a decorator line belongs to the next block, not this one's tail
        text = re.sub(r"(\n@[^\n]*)+$", "", text)
        out.append(("class" if m.group(1) == "class" else "function", m.group(2), text))
    return out


def make_data(folder: Path) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder.mkdir(parents=True, exist_ok=True)
    records, modules = [], []
    for f in sorted(stdlib.glob("*.py")):
        mod = f.stem
        n = 0
        for kind, name, text in blocks(f.read_text(encoding="utf-8", errors="replace")):
            if not 200 <= len(text) <= 6000:
                continue
            records.append({"messages": [
                {"role": "user", "content": f"Write the Python {kind} `{name}` of the standard-library module `{mod}`."},
                {"role": "assistant", "content": f"```python\n{text}\n```"},
            ]})
            n += 1
        if n:
            modules.append({"module": mod, "records": n})
    out = folder / "stdlib-chat.jsonl"
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    out.write_bytes(raw)
    return {
        "what": "chat records of the top-level def/class blocks (200..6000 characters) of the standard "
                "library's top-level .py modules; mlxspec train-drafter then holds out 5% of the records "
                "and takes a seeded random sample of the rest up to --max-tokens",
        "python": sys.version.split()[0],
        "stdlib": str(stdlib),
        "file": out.name,
        "records": len(records),
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "modules": modules,
        "train_args": TRAIN_ARGS,
    }


@click.command()
@click.option("--target", default=str(ROOT / "models/offline/qwen2.5-coder/target"), show_default=True)
@click.option("--work", default=str(ROOT / "models/offline/qwen2.5-coder-head-data"), show_default=True,
              help="Where the data JSONL is written.")
@click.option("--out", default=str(ROOT / "models/offline/qwen2.5-coder-head"), show_default=True)
@click.option("--data-only", is_flag=True)
@click.option("--resume", is_flag=True)
def main(target: str, work: str, out: str, data_only: bool, resume: bool) -> None:
    recipe = make_data(Path(work))
    RECIPE.write_text(json.dumps(recipe, indent=1) + "\n")
    click.echo(f"{recipe['records']} records, {recipe['bytes']} bytes -> {work}; recipe in {RECIPE}")
    if data_only:
        return
    cmd = [sys.executable, "-m", "mlxspec.cli", "train-drafter", "--target", target,
           "--data", str(Path(work) / recipe["file"]), "--out", out, *TRAIN_ARGS, *(["--resume"] if resume else [])]
    click.echo(" ".join(cmd))
    sys.exit(subprocess.call(cmd, cwd=ROOT))


if __name__ == "__main__":
    main()
