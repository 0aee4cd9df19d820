#!/usr/bin/env bash
# A change on the GPU, before vs after: the GPU tests and the host work per decode step on the
# working tree (`tests`), then the control plane and throughput alternately in the two
# checkouts (tools/ab.sh) and the fp8 KV cache against the model's dtype (`bench`).
#   bash tools/gpu_ab.sh BEFORE [tests|bench|all]
# BEFORE is a checkout directory carried to the device machine (there is no git there), e.g.
# `.ab/before`, made with `git archive REV | tar x -C .ab/before` and named in the call's carry.
source "$(dirname "$0")/gpu_env.sh"
before="$1" what="${2:-all}"
rc=0
if [[ "$what" == tests || "$what" == all ]]; then
    timeout 330 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_triton_kernels.py \
        tests/test_fused_kernels.py tests/test_kv_fp8.py 2>&1 | tee "$OUT/pytest_gpu.log" || rc=1
    for seqs in 256 32; do
        timeout 60 python benchmarks/profile_decode.py --config benchmarks/configs/qwen3-small-kv --seqs "$seqs" \
            --async-scheduling 2>&1 | grep -v "^ " | tee -a "$OUT/profile_decode.log"
    done
fi
if [[ "$what" == bench || "$what" == all ]]; then
    bash tools/ab.sh "$before" . 3 -- python benchmarks/bench_control_plane.py 2>&1 | tee "$OUT/ab_control_plane.log"
    bash tools/ab.sh "$before" . 3 -- python benchmarks/bench_control_plane.py --seqs 32 2>&1 | tee -a "$OUT/ab_control_plane.log"
    bash tools/ab.sh "$before" . 1 -- timeout 150 python benchmarks/bench_throughput.py \
        --config benchmarks/configs/qwen3-0.6b --hf-requests 0 --async-scheduling 2>&1 | tee "$OUT/ab_throughput_async.log"
    bash tools/ab.sh "$before" . 1 -- timeout 150 python benchmarks/bench_throughput.py \
        --config benchmarks/configs/qwen3-0.6b --hf-requests 0 2>&1 | tee "$OUT/ab_throughput_sync.log"
    timeout 200 python benchmarks/bench_throughput.py --config benchmarks/configs/qwen3-0.6b --hf-requests 0 \
        --async-scheduling --kv-cache-dtype auto,fp8 2>&1 | tee "$OUT/throughput_fp8.log"
fi
exit $rc
