#!/usr/bin/env bash
# One command that proves spchain's GPU paths on a machine with an NVIDIA GPU:
#
#   scripts/gpu-check.sh [OUT]      (OUT: where the logs and results go, default gpu-check-out)
#
# 1. installs this checkout into the current Python environment, from nothing but itself
#    (pip install --no-deps --no-build-isolation --no-index -e .: no network);
# 2. runs the `gpu` and `cuda_kernel` tests, on 8 workers where pytest-xdist is installed (CuPy,
#    numba-cuda, CUDA torch; the hot paths under
#    cupyx.allow_synchronize(False));
# 3. runs every benchmark workload with `python -m spchain bench --device cuda --json`, one
#    workload at a time (CUDA-event times after warm-up, peak device memory, device name,
#    torch and CuPy versions), until the time budget (about 9 minutes in all) is spent.
#
# Without a usable GPU it changes nothing, says why and what it would run, and exits with 2.
# See docs/tutorials/gpu.rst ("Checking a GPU machine").
set -u
cd "$(dirname "$0")/.." || exit 1
out=${1:-gpu-check-out}
python=${PYTHON:-python}
tests_s=${GPU_CHECK_TESTS_S:-200}
total_s=${GPU_CHECK_TOTAL_S:-530}
workers=$("$python" -c 'import xdist' 2>/dev/null && echo "-n 8")  # 8 workers compile the kernels: 72 s on an H200
workloads=$("$python" -c 'from spchain.bench import WORKLOADS; print(" ".join(WORKLOADS))' 2>/dev/null) \
  || workloads="(every workload of spchain.bench.WORKLOADS)"
plan="  1. $python -m pip install --no-deps --no-build-isolation --no-index -e .
  2. $python -m pytest -q -m 'gpu or cuda_kernel' $workers tests   (at most ${tests_s} s)
  3. $python -m spchain bench --device cuda --repeat 3 --budget 3 --only W --json $out/bench-W.json
     for W in: $workloads   (until ${total_s} s in all)"

if ! reason=$("$python" - <<'PY' 2>&1
import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"torch is not installed ({exc})")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
try:
    import cupy
    cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    sys.exit(f"CuPy cannot run here ({type(exc).__name__}: {exc})")
try:
    from numba import cuda
except Exception as exc:
    sys.exit(f"numba-cuda does not import ({type(exc).__name__}: {exc}); with NumPy 2.5 see "
             "docs/tutorials/gpu.rst for the np.row_stack workaround")
if not cuda.is_available():
    sys.exit("numba.cuda finds no usable GPU")
print(torch.cuda.get_device_name())
PY
); then
  echo "gpu-check: no GPU: ${reason}"
  echo "gpu-check: nothing was run. On a machine with an NVIDIA GPU, CuPy, numba-cuda and a CUDA torch it would run:"
  echo "$plan"
  exit 2
fi

start=$SECONDS
mkdir -p "$out"
echo "gpu-check: on ${reason}; results in $out"
echo "$plan"
"$python" -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
timeout "$tests_s" "$python" -m pytest -q -p no:cacheprovider -m "gpu or cuda_kernel" $workers tests 2>&1 | tee "$out/tests.log"
status=${PIPESTATUS[0]}
skipped=()
for w in $workloads; do
  if (( SECONDS - start > total_s - 30 )); then
    skipped+=("$w")
    continue
  fi
  left=$(( total_s - (SECONDS - start) ))
  timeout "$left" "$python" -m spchain bench --device cuda --repeat 3 --budget 3 --only "$w" \
    --json "$out/bench-$w.json" --png "$out/bench-$w.png" 2>"$out/bench-$w.err" | tee "$out/bench-$w.txt"
  (( PIPESTATUS[0] == 0 )) || { echo "gpu-check: bench $w failed, see $out/bench-$w.err"; status=1; }
done
if (( ${#skipped[@]} )); then
  echo "gpu-check: out of time, not benchmarked: ${skipped[*]}"
  status=1
fi
echo "gpu-check: done in $(( SECONDS - start )) s, exit status $status"
exit "$status"
