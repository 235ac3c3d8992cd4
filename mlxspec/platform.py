"""Where MLX runs and how fast its matrix multiplies can be.

The Linux `mlx[cpu]` wheel bundles the reference (netlib) BLAS, which makes a matmul of 8 rows
cost about 11x one row: speculative verification cannot pay on it. Preloading the system
OpenBLAS fixes that (same results within float32 rounding). The CLI re-executes itself once with
OpenBLAS preloaded when it is installed and MLX runs on the CPU; set MLXSPEC_NO_OPENBLAS=1 to
keep the bundled BLAS.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)
OPENBLAS_FIX = (
    "sudo apt-get install libopenblas0-pthread && export "
    "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
)


def find_openblas() -> str | None:
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def loaded_blas() -> str:
    """Which BLAS this process uses (Linux: read from the loaded shared objects)."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    if "openblas" in maps:
        return "OpenBLAS"
    if "mkl" in maps:
        return "MKL"
    if "blas" in maps:
        return "reference BLAS (bundled with the mlx-cpu wheel; slow)"
    return "unknown"


def maybe_reexec_with_openblas() -> None:
    """On Linux, restart this process once with OpenBLAS preloaded, when it is installed."""
    if not sys.platform.startswith("linux") or os.environ.get("MLXSPEC_NO_OPENBLAS"):
        return
    if "openblas" in os.environ.get("LD_PRELOAD", "") or os.environ.get("_MLXSPEC_REEXEC"):
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = (lib + " " + env.get("LD_PRELOAD", "")).strip()
    env["_MLXSPEC_REEXEC"] = "1"
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return


def machine_description() -> dict:
    """OS, chip, memory, MLX version and device, and BLAS: what a benchmark result depends on."""
    import mlx.core as mx

    desc = {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx_version": mx.__version__,
        "mlx_device": str(mx.default_device()),
        "cpu_count": os.cpu_count(),
    }
    try:
        import mlx_lm

        desc["mlx_lm_version"] = mlx_lm.__version__
    except Exception:
        pass
    if sys.platform == "darwin":
        for key, name in (("chip", "machdep.cpu.brand_string"), ("memory_bytes", "hw.memsize")):
            try:
                desc[key] = subprocess.run(
                    ["sysctl", "-n", name], capture_output=True, text=True, check=True
                ).stdout.strip()
            except Exception:
                pass
    else:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        desc["chip"] = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        desc["memory_bytes"] = physical_memory()
        blas = loaded_blas()
        desc["blas"] = blas
        if blas.startswith("reference"):
            desc["blas_fix"] = OPENBLAS_FIX
    return desc


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
