#!/usr/bin/env bash
# `make gpu-wheels`: the wheels benchmarks/gpu_check.sh installs on the lent GPU machine (Python
# 3.12, manylinux x86-64, no package registry there), downloaded here into .whl/ (git-ignored).
#
#   benchmarks/gpu_wheels.sh [--no-prefect]
#
# The list is benchmarks/gpu-wheels.txt, each at its constraints-gpu.txt version, without their
# dependencies (the machine has the rest: the list's header names them). Prefect, prefect-dask and
# everything they resolve to come too unless --no-prefect or they would not fit: the tree and the
# wheels travel together under the device tool's 64 MiB, and this keeps them under LIMIT_MIB (60).
# It says what it left out. Needs a Python with pip (PYTHON, default python3) and the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=${GPU_WHEELS_DIR:-.whl}
LIMIT_MIB=${LIMIT_MIB:-60}
CONSTRAINTS=constraints-gpu.txt
PREFECT=1
[ "${1:-}" = "--no-prefect" ] && PREFECT=0
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
          --platform manylinux1_x86_64 --platform any)

pinned() {  # NAME -> NAME==VERSION from constraints-gpu.txt
  local line
  line=$(grep -i -E "^$(sed 's/[._-]/[._-]/g' <<<"$1")==" "$CONSTRAINTS" | head -1) || true
  [ -n "$line" ] || { echo "error: $1 has no pin in $CONSTRAINTS" >&2; exit 1; }
  echo "$line"
}
project() {  # wheel file -> normalised project name
  basename "$1" | sed -E 's/-[0-9].*//' | tr 'A-Z_.' 'a-z--'
}

rm -rf "$DEST"
mkdir -p "$DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
while read -r name; do
  spec=$(pinned "$name")
  if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DEST" "$spec" 2>"$tmp/err"; then
    # no wheel on the registry (antlr4-python3-runtime 4.9.3 is a pure-Python sdist): build one
    "$PYTHON" -m pip wheel -q --no-deps -w "$DEST" "$spec" 2>>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  fi
done < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' benchmarks/gpu-wheels.txt)

tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
size() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
left_out="nothing"
if [ "$PREFECT" = 1 ]; then
  prefect=$(pinned prefect) prefect_dask=$(pinned prefect-dask)
  "$PYTHON" -m pip download -q --only-binary=:all: "${PLATFORM[@]}" -c "$CONSTRAINTS" -d "$tmp/prefect" \
    "$prefect" "$prefect_dask" "$(pinned fastapi)" >/dev/null 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  have=" $(for w in "$DEST"/*.whl; do project "$w"; done | tr '\n' ' ') "
  # what the machine has and must keep its own build of (torch's stack)
  keep_theirs=" numpy scipy pandas torch torchaudio "
  for w in "$tmp/prefect"/*.whl; do
    p=$(project "$w")
    [[ "$have" == *" $p "* || "$keep_theirs" == *" $p "* ]] || cp "$w" "$DEST/"
  done
  if (( tree_bytes + $(size "$DEST") > LIMIT_MIB * 1024 * 1024 )); then
    for w in "$tmp/prefect"/*.whl; do
      [[ "$have" == *" $(project "$w") "* ]] || rm -f "$DEST/$(basename "$w")"
    done
    left_out="Prefect (the flow path on local_gpu: its wheels would take the total over $LIMIT_MIB MiB)"
  fi
else
  left_out="Prefect (--no-prefect)"
fi
total=$(( tree_bytes + $(size "$DEST") ))
if (( total > LIMIT_MIB * 1024 * 1024 )); then
  echo "error: the tree and $DEST come to $(( total / 1048576 )) MiB, over $LIMIT_MIB MiB" >&2
  exit 1
fi
echo "gpu-wheels: $(ls "$DEST"/*.whl | wc -l) wheels in $DEST, $(( $(size "$DEST") / 1048576 )) MiB;" \
     "with the tree $(( total / 1048576 )) MiB of the $LIMIT_MIB MiB that travel. Left out: $left_out."
