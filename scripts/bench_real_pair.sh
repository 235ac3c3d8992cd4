#!/usr/bin/env bash
# The benchmark whose results are kept in the repo: models/qwen2.5-coder-bench.{json,png,md}.
#
# The offline Qwen2.5-Coder 1.5B target / 0.5B draft pair (scripts/get_offline_models.py makes
# it), float32, greedy, the first code-writing and the first code-editing prompt of the built-in
# suite (PER_KIND=2 for two of each), 32 tokens each, draft lengths 1,2,3,4,6, two repeats, with
# mlx-lm's own generation alternating with ours. On a 2-core x86 machine with OpenBLAS it takes
# about 20 minutes (PER_KIND=2: about 35); the run holds /tmp/mlxspec-heavy.lock so that other
# heavy jobs of the team do not run beside it.
#
#   scripts/bench_real_pair.sh                 # writes models/qwen2.5-coder-bench.*
#   OUT=/tmp/mybench scripts/bench_real_pair.sh   # writes /tmp/mybench.{json,png,md}
set -euo pipefail
cd "$(dirname "$0")/.."
PAIR=${PAIR:-models/offline/qwen2.5-coder}
OUT=${OUT:-models/qwen2.5-coder-bench}
if [ ! -f "$PAIR/mlxspec-pair.json" ]; then
    echo "no pair folder at $PAIR: run scripts/get_offline_models.py first" >&2
    exit 1
fi
MLXSPEC=${MLXSPEC:-mlxspec}
if [ -x .venv/bin/mlxspec ]; then MLXSPEC=.venv/bin/mlxspec; fi
# the CLI preloads OpenBLAS itself when it is installed (see docs: platform notes)
exec flock /tmp/mlxspec-heavy.lock "$MLXSPEC" bench \
    --target "$PAIR" --dtype float32 \
    --kinds code,edit --per-kind "${PER_KIND:-1}" \
    --max-tokens "${MAX_TOKENS:-32}" --num-draft "${NUM_DRAFT:-1,2,3,4,6}" --repeats "${REPEATS:-2}" \
    --compare-mlx-lm \
    --json "$OUT.json" --plot "$OUT.png" --markdown "$OUT.md"
