#!/usr/bin/env python
"""Measure `mlxspec convert`: wall time, CPU time and peak memory (max RSS) of one conversion.

Each conversion runs in a fresh child process, so its peak RSS is its own (RUSAGE_CHILDREN).
Timings on shared machines drift by tens of percent; use --repeat and read the median.

    python scripts/bench_convert.py                                 # the 1.5B Qwen GGUF -> float16
    python scripts/bench_convert.py SOURCE [--dtype ...] [--quantize 4] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "models" / "offline" / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
LIMIT_GB = 5.0  # the bound for the 1.5B GGUF -> float16

CHILD = """
import sys, json
from mlxspec.convert import convert
src, out, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
convert(src, out, progress=False, force=True, **opts)
"""


def run_once(source: Path, opts: dict, workdir: Path) -> dict:
    out = workdir / "out"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, str(source), str(out), json.dumps(opts)],
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out)
    return {
        "wall_s": round(wall, 1),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
        # ru_maxrss of the children is the largest any child reached (KiB on Linux)
        "peak_rss_gb": round(after.ru_maxrss * 1024 / 1e9, 2),
        "output_gb": round(size / 1e9, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", default=str(DEFAULT))
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--quantize", type=int, choices=[4, 8])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    source = Path(args.source)
    if not source.exists():
        print(f"{source} not found; run scripts/get_offline_models.py first", file=sys.stderr)
        return 1
    opts = {"dtype": args.dtype, "quantize": args.quantize, "group_size": args.group_size}
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-convert-", dir=ROOT / "models") as tmp:
        for i in range(args.repeat):
            r = run_once(source, opts, Path(tmp))
            runs.append(r)
            print(f"run {i + 1}: {r}", flush=True)
    result = {
        "source": source.name,
        "source_gb": round(source.stat().st_size / 1e9, 2),
        "options": opts,
        "runs": runs,
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "peak_rss_gb": max(r["peak_rss_gb"] for r in runs),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if source == DEFAULT and not args.quantize and result["peak_rss_gb"] >= LIMIT_GB:
        print(f"FAIL: peak memory {result['peak_rss_gb']} GB >= {LIMIT_GB} GB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
