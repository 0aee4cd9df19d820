#!/usr/bin/env bash
# One device call for the attention kernels: GPU tests, then the benchmark (args pass through).
# Logs go to $OUT (the device tool's folder) or ./out. Usage: tools/gpu_kernel_check.sh [--sweep]
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 -k "gpu or select" \
    tests/test_triton_kernels.py 2>&1 | tee "$out/gpu_tests.log"
tests_rc=$?
timeout 360 python3 benchmarks/bench_attention.py "$@" 2>&1 | tee "$out/bench.log"
bench_rc=$?
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
