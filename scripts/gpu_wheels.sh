#!/usr/bin/env bash
# Run on the dev box (it reaches the package registry), before bench/gpu_check.sh:
#   bash scripts/gpu_wheels.sh                 # from anywhere in the repository
#   GPU_PY=3.12 bash scripts/gpu_wheels.sh     # also numpy, for that CPython on x86_64
# Downloads into .whl/ the pure-Python wheels the GPU check installs (the GPU machine has
# torch but no network): pytest and its plugins, hypothesis, anyio and their
# dependencies, plus setuptools (the build backend of `pip install -e .`), each pinned to
# the version in .venv. Binary wheels come only with GPU_PY, for that Python: a wheel
# for another Python would make gpu_check.sh's one `pip install .whl/*.whl` fail whole.
# So numpy comes only then, and hypothesis (no pure wheel since 6.156) is by default its
# last pure one, HYPOTHESIS_PURE; with GPU_PY, .venv's version built for that Python.
# Carry .whl/ to the GPU machine with the tree. Prints the total size.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/pip}"
PKGS="pytest iniconfig packaging pluggy pygments sortedcontainers pytest-asyncio
pytest-timeout anyio idna typing-extensions setuptools"
HYPOTHESIS_PURE=6.155.7

norm() { tr 'A-Z_.' 'a-z--' <<<"$1"; }
FROZEN="$("$PIP" freeze --all)"
pin() {  # the version .venv holds of package $1
  local want line
  want="$(norm "$1")"
  while IFS= read -r line; do
    [[ "$line" == *==* ]] || continue
    [ "$(norm "${line%%==*}")" = "$want" ] && { echo "${line#*==}"; return; }
  done <<<"$FROZEN"
  echo "gpu_wheels: $1 is not installed in .venv" >&2; return 1
}

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
dl() { "$PIP" download -q --only-binary=:all: --no-deps -d "$TMP" "$@" \
         2> >(grep -v "is ignored: it is neither" >&2); }
reqs=()
for p in $PKGS; do reqs+=("$p==$(pin "$p")"); done
[ -n "${GPU_PY:-}" ] || reqs+=("hypothesis==$HYPOTHESIS_PURE")
dl "${reqs[@]}"
for w in "$TMP"/*.whl; do
  case "$w" in *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
    *) echo "gpu_wheels: not a pure-Python wheel: ${w##*/}" >&2; exit 1 ;; esac
done
if [ -n "${GPU_PY:-}" ]; then
  dl --python-version "$GPU_PY" --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 \
    "numpy==$(pin numpy)" "hypothesis==$(pin hypothesis)"
fi

mkdir -p .whl
[ -n "${GPU_PY:-}" ] || rm -f .whl/numpy-*.whl  # a binary left by an earlier GPU_PY run
for w in "$TMP"/*.whl; do  # replace any other version of the same package
  name="$(basename "$w")"
  find .whl -maxdepth 1 -iname "${name%%-*}-*.whl" ! -name "$name" -delete
  mv -f "$w" .whl/
done
ls -1 .whl/*.whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $(( total / 1024 )) KiB in $(ls .whl/*.whl | wc -l) wheels"
if [ "$total" -gt $(( 32 << 20 )) ]; then
  echo "gpu_wheels: .whl/ is over 32 MiB; the device carry holds 64 MiB in all" >&2; exit 1
fi
