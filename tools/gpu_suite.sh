#!/usr/bin/env bash
# Everything kvscope needs a GPU for, in one device call: GPU tests, then the benchmarks.
#   bash tools/gpu_suite.sh [tests|bench|all]     (results and logs go to $OUT, default /tmp/kvscope-gpu)
# On an H200: bench ~6 min; `all` comes close to a device call's 10-minute limit,
# so run `tests` and `bench` as two calls (the second within the machine's warm window).
source "$(dirname "$0")/gpu_env.sh"
what="${1:-all}"
rc=0
if [[ "$what" == tests || "$what" == all ]]; then
    # Engines size their pools by the GPU's free memory: their tests run one at a time; the kernel
    # tests run four at once.
    python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_kv_fp8.py 2>&1 \
        | tee "$OUT/pytest_gpu.log" || rc=1
    python -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/test_triton_kernels.py tests/test_fused_kernels.py \
        tests/test_skinny_linear.py tests/test_decode_advance.py tests/test_sampling_kernels.py 2>&1 | tee -a "$OUT/pytest_gpu.log" || rc=1
fi
if [[ "$what" == bench || "$what" == all ]]; then
    python benchmarks/bench_control_plane.py 2>&1 | tee "$OUT/control_plane.log"
    python benchmarks/bench_throughput.py --config benchmarks/configs/qwen3-0.6b --hf-requests 64 --async-scheduling \
        --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" || rc=1
    python benchmarks/bench_throughput.py --config benchmarks/configs/qwen3-0.6b --hf-requests 0 \
        --json "$OUT/throughput_sync.json" 2>&1 | tee "$OUT/throughput_sync.log" || rc=1
    python benchmarks/bench_trace_overhead.py --device cuda --config benchmarks/configs/qwen3-0.6b \
        --requests 256 --prompt-len 512 --max-tokens 128 --repeats 5 2>&1 | tee "$OUT/trace_overhead.log" || rc=1
    python benchmarks/bench_trace_overhead.py --device cuda --config benchmarks/configs/qwen3-0.6b --async-scheduling \
        --requests 256 --prompt-len 512 --max-tokens 128 --repeats 5 2>&1 | tee "$OUT/trace_overhead_async.log" || rc=1
fi
exit $rc
