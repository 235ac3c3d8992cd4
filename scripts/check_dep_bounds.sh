#!/usr/bin/env bash
# Check that the dependency ranges in pyproject.toml hold: build a fresh virtualenv with the
# LOWEST versions the project declares (uv's lowest-direct resolution: every direct dependency,
# the test extra included, at its declared floor; the rest at the newest version that fits) and
# one with the NEWEST, and run the test suite in each.
#
#   scripts/check_dep_bounds.sh            # both
#   scripts/check_dep_bounds.sh lowest     # or: newest
#   scripts/check_dep_bounds.sh lowest -- tests/test_convert.py   # pytest arguments after --
#
# In the lowest environment every direct dependency must install at exactly its declared floor;
# one that cannot (the resolver had to go higher) is reported and fails the run: raise that
# floor in pyproject.toml to the version the resolver picked.
#
# Environment: DEPS_DIR (default /tmp/mlxspec-deps) holds the virtualenvs and logs;
# PYTHON_LOWEST / PYTHON_NEWEST pick the interpreters (default: the oldest / newest python3.X on
# PATH or under pyenv that requires-python allows); UV is a uv binary (default: `uv` on PATH, or
# one installed with pip into DEPS_DIR/uv-tool). Needs the package index, nothing else.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEPS_DIR="${DEPS_DIR:-/tmp/mlxspec-deps}"
mkdir -p "$DEPS_DIR"

modes=()
while [ $# -gt 0 ]; do
  case "$1" in
    lowest|newest) modes+=("$1"); shift ;;
    both) modes+=(lowest newest); shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (lowest, newest, both, then -- pytest args)" >&2; exit 2 ;;
  esac
done
[ ${#modes[@]} -gt 0 ] || modes=(lowest newest)
pytest_args=("$@")

# -- uv ---------------------------------------------------------------------------------------
UV="${UV:-$(command -v uv || true)}"
if [ -z "$UV" ]; then
  UV="$DEPS_DIR/uv-tool/bin/uv"
  if [ ! -x "$UV" ]; then
    echo "installing uv into $DEPS_DIR/uv-tool ..."
    python3 -m venv "$DEPS_DIR/uv-tool"
    "$DEPS_DIR/uv-tool/bin/python" -m pip install -q uv
  fi
fi

# -- interpreters: the oldest and newest CPython 3.X that requires-python allows -------------
min_minor="$(sed -n 's/^requires-python *= *">=3\.\([0-9]*\)".*/\1/p' "$ROOT/pyproject.toml")"
min_minor="${min_minor:-10}"
find_python() {  # $1: "asc" or "desc"
  local order minors m cand
  if [ "$1" = asc ]; then minors="$(seq "$min_minor" 20)"; else minors="$(seq 20 -1 "$min_minor")"; fi
  for m in $minors; do
    for cand in "python3.$m" "$HOME/.pyenv/versions/3.$m"*/bin/python3; do
      if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import venv' >/dev/null 2>&1; then
        command -v "$cand"; return
      fi
    done
  done
  command -v python3
}

status=0
summary=()
for mode in "${modes[@]}"; do
  if [ "$mode" = lowest ]; then
    py="${PYTHON_LOWEST:-$(find_python asc)}"; resolution=(--resolution lowest-direct)
  else
    py="${PYTHON_NEWEST:-$(find_python desc)}"; resolution=()
  fi
  venv="$DEPS_DIR/$mode"
  log="$DEPS_DIR/$mode.log"
  echo "== $mode: fresh virtualenv $venv ($("$py" --version 2>&1))"
  rm -rf "$venv"
  "$UV" venv -q -p "$py" "$venv"
  "$UV" pip install -q -p "$venv/bin/python" "${resolution[@]}" -e "$ROOT[test]"

  # the installed versions of every declared dependency; in the lowest run, each must sit at its floor
  check=0
  "$venv/bin/python" - "$mode" <<'EOF' || check=$?
import re, sys
from importlib import metadata

mode = sys.argv[1]
norm = lambda v: re.sub(r"(\.0)+$", "", v)  # 0.29.0 == 0.29
bad = []
print(f"   {'package':<18} {'declared':<12} installed")
for req in metadata.requires("mlxspec") or []:
    m = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(?:>=\s*([^,;\s]+))?[^;]*(?:;(.*))?$", req)
    name, floor, marker = m.group(1), m.group(2), (m.group(3) or "")
    if "platform" in marker and sys.platform not in marker:
        continue  # e.g. mlx (darwin) vs mlx[cpu] (linux)
    if name == "mlxspec":
        continue  # mlxspec[serve] inside the test extra
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        if "extra ==" in marker:
            continue  # an extra that the test extra does not pull in
        have = "(missing)"
    flag = ""
    if mode == "lowest" and floor and norm(have) != norm(floor):
        flag = "  <-- floor not installable here: raise it"
        bad.append(name)
    print(f"   {name:<18} {'>=' + floor if floor else '-':<12} {have}{flag}")
for name in ("transformers", "tokenizers", "mlx-cpu", "numpy"):
    try:
        print(f"   {name:<18} {'(transitive)':<12} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
sys.exit(1 if bad else 0)
EOF
  [ $check -eq 0 ] || status=1

  echo "   running the tests (log: $log) ..."
  rc=0
  (cd "$ROOT" && env -u PYTHONPATH "$venv/bin/python" -m pytest -q -p no:cacheprovider \
     "${pytest_args[@]}" >"$log" 2>&1) || rc=$?
  result="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|no tests ran' "$log" | tail -1 | tr -d '=')"
  echo "   $mode: ${result:-pytest exit $rc}"
  [ $rc -eq 0 ] || { status=1; grep -E '^(FAILED|ERROR) ' "$log" | head -30 || true; }
  [ $check -eq 0 ] || result="$result; some floors not installable"
  summary+=("$mode ($("$py" --version 2>&1)): $result")
done

echo
printf '%s\n' "${summary[@]}"
exit $status
