#!/usr/bin/env bash
# One device call for the attention kernels: GPU tests, then the benchmark (args pass through).
# Logs go to $OUT (default /tmp/kvscope-gpu). The two timeouts keep the call under 10 minutes.
# Usage: tools/gpu_kernel_check.sh [--sweep] [--tune] [--before REV]
source "$(dirname "$0")/gpu_env.sh"
timeout 180 python3 -m pytest -q -p no:cacheprovider -n 4 -k "gpu or select" \
    tests/test_triton_kernels.py 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?
timeout 390 python3 benchmarks/bench_attention.py "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=$?
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
