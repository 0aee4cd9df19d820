#!/usr/bin/env bash
# Everything kvscope needs a GPU for: GPU tests, then the benchmarks.
#   bash tools/gpu_suite.sh [tests|engine-a|engine-b|kernels|bench|all]
# (results and logs go to $OUT, default /tmp/kvscope-gpu). A device call has 10 minutes, start-up
# included; on an H200 the engine tests alone take longer than that, so give each of `engine-a`
# (the first half of them), `engine-b` (the rest), `kernels` and `bench` a call of its own (the
# later ones within the machine's warm window). `tests` runs the three test parts in one go.
source "$(dirname "$0")/gpu_env.sh"
what="${1:-all}"
rc=0
ENGINE_TESTS=(tests/test_gpu_engine.py tests/test_kv_fp8.py)
if [[ "$what" == engine-a || "$what" == engine-b ]]; then
    # Engines size their pools by the GPU's free memory: their tests run one at a time.
    mapfile -t ids < <(python -m pytest -q -m gpu -p no:cacheprovider --collect-only "${ENGINE_TESTS[@]}" | grep '::')
    half=$(( ${#ids[@]} / 2 ))
    if [[ "$what" == engine-a ]]; then part=("${ids[@]:0:half}"); else part=("${ids[@]:half}"); fi
    python -m pytest -q -m gpu -p no:cacheprovider "${part[@]}" 2>&1 | tee -a "$OUT/pytest_gpu.log" || rc=1
fi
if [[ "$what" == tests || "$what" == all ]]; then
    python -m pytest -q -m gpu -p no:cacheprovider "${ENGINE_TESTS[@]}" 2>&1 | tee "$OUT/pytest_gpu.log" || rc=1
fi
if [[ "$what" == tests || "$what" == kernels || "$what" == all ]]; then
    # The kernel tests run four at once.
    python -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/test_triton_kernels.py tests/test_fused_kernels.py \
        tests/test_skinny_linear.py tests/test_decode_advance.py tests/test_sampling_kernels.py \
        tests/test_penalty_kernels.py 2>&1 | tee -a "$OUT/pytest_gpu.log" || rc=1
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
