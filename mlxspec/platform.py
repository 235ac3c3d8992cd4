"""Where MLX runs, how fast its matrix multiplies can be, and how exact its float32 is.

BLAS. The Linux `mlx[cpu]` wheel bundles the reference (netlib) BLAS, which makes a matmul of 8
rows cost about 11x one row: speculative verification cannot pay on it. Preloading OpenBLAS fixes
that (same results within float32 rounding). The CLI and the scripts re-execute themselves once
with OpenBLAS preloaded when they find it: installed system-wide (`libopenblas0-pthread`), or
unpacked into the virtual environment without root by `scripts/quickstart.sh` (`apt-get download`
+ `dpkg -x` into `.venv/openblas/`; `MLXSPEC_OPENBLAS_DIR` names another such folder). When none
is found, every command says so in one line on stderr. MLXSPEC_NO_OPENBLAS=1 keeps the bundled
BLAS (and that line quiet).

TF32. MLX runs float32 matrix products of several rows in TF32 (10-bit mantissa) on hardware that
has it (NVIDIA GPUs through the CUDA backend, Apple M5-class GPUs), unless `MLX_ENABLE_TF32=0`.
A verify pass (k+1 rows) and one-token decoding (1 row) then round differently and greedy
near-ties flip. libmlx reads the variable once, at its first matmul-family call (a function-level
static in mlx/utils.h), so importing mlxspec sets it to 0 unless the user set it: float32 stays
float32. float16/bfloat16 and quantized products are not affected by it; the CPU backend ignores it.
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys

TF32_VARIABLE = "MLX_ENABLE_TF32"


def keep_float32_exact(environ=os.environ) -> str:
    """Ask MLX for full-precision float32 matmuls (MLX_ENABLE_TF32=0) unless the user chose.
    Must run before MLX's first matmul; mlxspec/__init__.py calls it before importing mlx."""
    return environ.setdefault(TF32_VARIABLE, "0")


keep_float32_exact()

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)
# inside a folder where a Debian package was unpacked with `dpkg -x` (scripts/quickstart.sh)
UNPACKED_OPENBLAS = "usr/lib/*/openblas-pthread/libblas.so.3"
OPENBLAS_FIX = (
    "scripts/quickstart.sh unpacks OpenBLAS into .venv without root, or "
    "`sudo apt-get install libopenblas0-pthread`; the mlxspec command then preloads it"
)
SLOW_BLAS_LINE = (
    "mlxspec: MLX is using the slow reference BLAS of its Linux CPU wheel (measured: a 1.5B model "
    "decodes about 5x slower, 0.29 against 1.5 tokens/s, and verifying 8 tokens costs 11x one token, "
    "so speculation cannot pay). Fix: {fix}."
)


def unpacked_openblas_dirs() -> list[str]:
    """Folders where OpenBLAS may have been unpacked without root: $MLXSPEC_OPENBLAS_DIR, then
    <virtual environment>/openblas."""
    dirs = []
    if os.environ.get("MLXSPEC_OPENBLAS_DIR"):
        dirs.append(os.environ["MLXSPEC_OPENBLAS_DIR"])
    dirs.append(os.path.join(sys.prefix, "openblas"))
    return dirs


def find_unpacked_openblas(root: str) -> tuple[str, list[str]] | None:
    """(libblas.so.3, library folders to search) in a folder holding unpacked Debian packages
    (libopenblas0-pthread, and libgfortran5 when the system lacks it), or None."""
    hits = sorted(glob.glob(os.path.join(root, UNPACKED_OPENBLAS)))
    if not hits:
        return None
    libdirs = sorted(
        d for d in glob.glob(os.path.join(root, "usr/lib/*")) + glob.glob(os.path.join(root, "lib/*"))
        if os.path.isdir(d) and not d.endswith("openblas-pthread")
    )
    return hits[0], [os.path.dirname(hits[0]), *libdirs]


def find_openblas() -> tuple[str, list[str]] | None:
    """(the OpenBLAS libblas.so.3 to preload, extra library folders it needs), or None: the
    system's first, then one unpacked into the virtual environment."""
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path, []
    for root in unpacked_openblas_dirs():
        found = find_unpacked_openblas(root)
        if found is not None:
            return found
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
    # numpy's own copy (scipy_openblas, with renamed symbols) does not serve MLX
    if any("openblas" in line and "scipy_openblas" not in line for line in maps.splitlines()):
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
    found = find_openblas()
    if found is None:
        warn_if_slow_blas()
        return
    lib, libdirs = found
    env = dict(os.environ)
    env["LD_PRELOAD"] = (lib + " " + env.get("LD_PRELOAD", "")).strip()
    if libdirs:  # an unpacked OpenBLAS: its libgfortran may be unpacked beside it
        env["LD_LIBRARY_PATH"] = ":".join([*libdirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env["_MLXSPEC_REEXEC"] = "1"
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        warn_if_slow_blas()
        return


def slow_blas_warning() -> str | None:
    """The one line to print when MLX computes on the CPU with the reference BLAS, else None."""
    if not sys.platform.startswith("linux") or os.environ.get("MLXSPEC_NO_OPENBLAS"):
        return None
    import mlx.core as mx

    if mx.default_device() != mx.cpu or not loaded_blas().startswith("reference"):
        return None
    return SLOW_BLAS_LINE.format(fix=OPENBLAS_FIX)


def warn_if_slow_blas(stream=None) -> None:
    line = slow_blas_warning()
    if line is not None:
        print(line, file=stream or sys.stderr, flush=True)


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
