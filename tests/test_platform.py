"""Exact float32 on every backend (MLX_ENABLE_TF32) and no silent slow BLAS (issue 13)."""

import os
import subprocess
import sys
import textwrap

import pytest

import mlxspec.platform as P


def _run(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k != P.TF32_VARIABLE}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# Records MLX_ENABLE_TF32 at the moment mlx.core is first imported, then imports an entry point.
_WATCH = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core" and not seen:
            seen.append(os.environ.get("MLX_ENABLE_TF32"))
        return None
sys.meta_path.insert(0, Watch())
import {module}
print(seen[0], "mlx.core" in sys.modules)
"""


@pytest.mark.parametrize("module", ["mlxspec", "mlxspec.cli", "mlxspec.bench", "mlxspec.drafters.model"])
def test_tf32_is_off_before_mlx_is_imported(module):
    assert _run(_WATCH.format(module=module)) == "0 True"


def test_a_users_tf32_choice_is_kept():
    assert _run("import os, mlxspec; print(os.environ['MLX_ENABLE_TF32'])", MLX_ENABLE_TF32="1") == "1"
    env = {}
    assert P.keep_float32_exact(env) == "0" and env == {P.TF32_VARIABLE: "0"}


def _fake_unpacked(root, triplet="x86_64-linux-gnu"):
    """The layout `dpkg -x` leaves for libopenblas0-pthread and libgfortran5."""
    ob = root / "usr" / "lib" / triplet / "openblas-pthread"
    ob.mkdir(parents=True)
    (ob / "libblas.so.3").write_bytes(b"")
    (ob.parent / "libgfortran.so.5").write_bytes(b"")
    return ob / "libblas.so.3", ob.parent


def test_unpacked_openblas_is_found(tmp_path, monkeypatch):
    assert P.find_unpacked_openblas(str(tmp_path)) is None
    lib, libdir = _fake_unpacked(tmp_path / "ob")
    found = P.find_unpacked_openblas(str(tmp_path / "ob"))
    assert found == (str(lib), [str(lib.parent), str(libdir)])
    # the system's copy first; without one, $MLXSPEC_OPENBLAS_DIR, then <venv>/openblas
    monkeypatch.setattr(P, "OPENBLAS_CANDIDATES", (str(tmp_path / "none"),))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.delenv("MLXSPEC_OPENBLAS_DIR", raising=False)
    assert P.find_openblas() is None
    venv_lib, _ = _fake_unpacked(tmp_path / "venv" / "openblas", "aarch64-linux-gnu")
    assert P.find_openblas()[0] == str(venv_lib)
    monkeypatch.setenv("MLXSPEC_OPENBLAS_DIR", str(tmp_path / "ob"))
    assert P.find_openblas() == found
    system = tmp_path / "libblas.so.3"
    system.write_bytes(b"")
    monkeypatch.setattr(P, "OPENBLAS_CANDIDATES", (str(system),))
    assert P.find_openblas() == (str(system), [])


def test_reexec_preloads_the_unpacked_openblas(tmp_path, monkeypatch):
    lib, libdir = _fake_unpacked(tmp_path)
    monkeypatch.setattr(P, "OPENBLAS_CANDIDATES", ())
    monkeypatch.setenv("MLXSPEC_OPENBLAS_DIR", str(tmp_path))
    monkeypatch.setenv("LD_LIBRARY_PATH", "/keep")
    for var in ("MLXSPEC_NO_OPENBLAS", "_MLXSPEC_REEXEC", "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    if not sys.platform.startswith("linux"):
        pytest.skip("the re-exec is Linux only")
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append(env))
    P.maybe_reexec_with_openblas()
    env = calls[0]
    assert env["LD_PRELOAD"] == str(lib) and env["_MLXSPEC_REEXEC"] == "1"
    assert env["LD_LIBRARY_PATH"].split(":") == [str(lib.parent), str(libdir), "/keep"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux CPU wheel's BLAS")
def test_slow_blas_is_reported_in_one_line(monkeypatch, capsys):
    import mlx.core as mx

    monkeypatch.delenv("MLXSPEC_NO_OPENBLAS", raising=False)
    monkeypatch.setattr(P, "loaded_blas", lambda: "reference BLAS (bundled with the mlx-cpu wheel; slow)")
    if mx.default_device() != mx.cpu:
        assert P.slow_blas_warning() is None  # a GPU does its own matmuls
        return
    P.warn_if_slow_blas()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reference BLAS" in err and "5x slower" in err
    assert "quickstart.sh" in err and "libopenblas0-pthread" in err
    monkeypatch.setattr(P, "loaded_blas", lambda: "OpenBLAS")
    assert P.slow_blas_warning() is None
    monkeypatch.setattr(P, "loaded_blas", lambda: "reference BLAS (bundled with the mlx-cpu wheel; slow)")
    monkeypatch.setenv("MLXSPEC_NO_OPENBLAS", "1")  # the user chose the bundled BLAS
    assert P.slow_blas_warning() is None


def test_the_command_says_it_when_no_openblas_is_found(tmp_path):
    """The real `mlxspec` entry point, in a process where no OpenBLAS can be found."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    code = """
    import sys
    import mlxspec.platform as P
    P.OPENBLAS_CANDIDATES = ()
    sys.argv = ["mlxspec", "--version"]
    from mlxspec.cli import main
    main()
    """
    env = {k: v for k, v in os.environ.items() if k not in ("MLXSPEC_NO_OPENBLAS", "LD_PRELOAD", "_MLXSPEC_REEXEC")}
    env.update(MLXSPEC_OPENBLAS_DIR=str(tmp_path), VIRTUAL_ENV="")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "mlxspec, version" in out.stdout
    assert "MLX is using the slow reference BLAS" in out.stderr and out.stderr.count("\n") == 1


def test_loaded_blas_ignores_numpys_openblas():
    import mlx.core as mx  # noqa: F401
    import numpy  # noqa: F401  (loads scipy_openblas, whose renamed symbols MLX cannot use)

    if not sys.platform.startswith("linux") or os.environ.get("LD_PRELOAD"):
        pytest.skip("needs a Linux process without a preloaded BLAS")
    assert P.loaded_blas().startswith("reference")


def test_float32_products_do_not_depend_on_the_number_of_rows():
    """What greedy identity needs from the backend: a row of a several-row float32 product (a
    verify pass) equals the one-row product (one-token decoding) up to float32 rounding. Fails on
    a GPU computing in TF32 (3e-4 relative on an H200); full float32 measured 2e-5 there."""
    import mlx.core as mx

    if os.environ.get(P.TF32_VARIABLE) != "0":
        pytest.skip("the user chose TF32 (MLX_ENABLE_TF32 is not 0)")
    x = mx.random.normal((5, 1536), key=mx.random.key(0))
    w = mx.random.normal((1536, 2048), key=mx.random.key(1)) / 40
    many = x @ w
    for i in range(5):
        one = x[i : i + 1] @ w
        rel = (mx.abs(many[i] - one[0]).max() / mx.abs(one).max()).item()
        assert rel < 1e-4, f"row {i}: {rel:.1e} relative"
