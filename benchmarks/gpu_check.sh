#!/usr/bin/env bash
# The one GPU check: on the lent GPU machine it installs the carried wheels, runs the tests marked
# gpu and every GPU benchmark (benchmarks/bench_gpu.py), and writes under $OUT a log, gpu.json and
# gpu/<part>.json; the table comes last. Sized to end in under 6 minutes on one H100.
#
#   benchmarks/gpu_check.sh [--device cuda|cuda:N|cpu] [--quick] [--rehearse] [--only PART...]
#
# --only runs those parts of bench_gpu.py (hubert fbank ecapa rawnet3 local_gpu) and the frontend
# tests alone (a second try that re-measures one part).
# On the device (wheels from `make gpu-wheels` in .whl/, carried with the call):
#   run(command="OUT=$OUT benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=420)
# On a CPU, as CI runs it, so that every step the device takes has run before:
#   benchmarks/gpu_check.sh --device cpu --quick --rehearse
# --rehearse hides what the device machine lacks unless it is carried (Prefect: see
# benchmarks/device_absent), so an import of it fails here as it would there. Exit status: 0 when
# the tests and every benchmark part passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda QUICK="" REHEARSE=0 ONLY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --device=*) DEVICE=${1#*=}; shift ;;
    --quick) QUICK=--quick; shift ;;
    --rehearse) REHEARSE=1; shift ;;
    --only) shift; ONLY=("$@"); set -- ;;
    *) echo "usage: benchmarks/gpu_check.sh [--device cuda|cuda:N|cpu] [--quick] [--rehearse] [--only PART...]" >&2
       exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
t0=$SECONDS
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WHEELS=${GPU_CHECK_WHEELS:-.whl}  # (the tests point it elsewhere: cp312 wheels do not install on this 3.11)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  site=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl \
    || { echo "gpu_check: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=$site:$PYTHONPATH
  echo "gpu_check: $(ls "$WHEELS"/*.whl | wc -l) wheels installed in $((SECONDS - t0)) s"
fi
[ "$REHEARSE" = 1 ] && export PYTHONPATH=$PWD/benchmarks/device_absent:$PYTHONPATH
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'

tests=(tests/frontends/test_gpu_paths.py tests/parallel/test_local_gpu.py)
[ ${#ONLY[@]} -gt 0 ] && tests=(tests/frontends/test_gpu_paths.py)
# on the CPU (the rehearsal) the suite runs these files' tests already: here the step itself is
# rehearsed, on their cheap fbank tests
select=(-m "not gpu" -k fbank)
[ "$DEVICE" = cpu ] || select=(--run-gpu -m gpu)
if ! "$PYTHON" -c 'import prefect' 2>/dev/null; then
  echo "gpu_check: no Prefect here: the flow test on local_gpu is left out (the engine path runs: bench part local_gpu)"
  select+=(--deselect tests/parallel/test_local_gpu.py::test_collect_stats_flow_on_local_gpu_equals_a_cpu_cluster)
fi
timeout 300 "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider -o addopts="" "${select[@]}" "${tests[@]}"
tests_rc=$?
ESPNET3_BENCH_RESULTS=$OUT ESPNET3_BENCH_DATA=${ESPNET3_BENCH_DATA:-/tmp/gpu-check-data} \
  timeout 330 "$PYTHON" -m benchmarks.bench_gpu --device "$DEVICE" $QUICK ${ONLY[@]:+--only "${ONLY[@]}"} \
  >"$OUT/.bench.out"
bench_rc=$?
grep -v '^|\|^$\|^Device:' "$OUT/.bench.out"  # its progress lines; the table follows
echo "gpu_check: tests exit $tests_rc, benchmarks exit $bench_rc, $((SECONDS - t0)) s in all"
"$PYTHON" -m benchmarks.bench_gpu --table "$OUT/gpu.json"
rm -f "$OUT/.bench.out"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
