#!/usr/bin/env bash
# Issue 8 in one device call on a machine of two or more GPUs: TP=2 vs TP=1 tests, then scaling
# on bench_throughput's workload (Qwen3-0.6B shapes at TP 1,2; Qwen3-8B shapes at TP 1,2).
#   bash tools/gpu_multi.sh          (logs and JSON go to $OUT, default /tmp/kvscope-gpu)
# Each part has a time limit, so a hang costs minutes, not the session's device time.
source "$(dirname "$0")/gpu_env.sh"
rc=0
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_tp_gpu.py 2>&1 | tee "$OUT/pytest_tp.log" || rc=1
for model in qwen3-0.6b qwen3-8b; do
    timeout 200 python benchmarks/bench_throughput.py --config "benchmarks/configs/$model" --tp 1,2 \
        --hf-requests 0 --json "$OUT/tp_$model.json" 2>&1 | tee "$OUT/tp_$model.log" || rc=1
    timeout 200 python benchmarks/bench_throughput.py --config "benchmarks/configs/$model" --tp 1,2 \
        --async-scheduling --hf-requests 0 --json "$OUT/tp_async_$model.json" 2>&1 | tee "$OUT/tp_async_$model.log" || rc=1
done
exit $rc
