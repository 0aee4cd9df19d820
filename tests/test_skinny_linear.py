"""kvscope's matmul for a decode step's few rows (``kvscope.kernels.triton_linear``) against a
float64 torch reference, and the dispatch that decides when the layers take it.

Tiers, as in test_fused_kernels.py (``triton_testing`` says why the interpreter runs in a
subprocess):
- CPU, Triton interpreter: fp32/fp16, odd sizes, one to three K splits, with and without bias;
  whole tiny models with every layer matmul through the kernel.
- CPU, sm_90 compile check of the real launches at Qwen3-0.6B's shapes, in bf16.
- GPU (``-m gpu``): bf16 at model shapes, CUDA-graph replay behind a PDL kernel, the dispatch.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kvscope.kernels import triton_linear as tlin
from triton_testing import (compile_recorded, compiled_only, interpreted_only, needs_cuda,
                            record_launches, rel_err, run_interpreted_tests)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (rows, N, K, bias, dtype): splits of K are cdiv(K, BLOCK_K), column blocks cdiv(N, BLOCK_N)
CASES = [
    (1, 32, 64, False, torch.float32),      # one split, one column block
    (3, 45, 600, True, torch.float32),      # two splits, a partial column block, K ragged
    (8, 100, 1100, True, torch.float16),    # three splits
    (17, 33, 512, False, torch.float32),    # exactly one split, a 32-row tile
    (32, 64, 1536, True, torch.float32),    # a full tile, three splits
]
# Qwen3-0.6B's four matmuls per layer: (N, K) of qkv, o, gate/up, down
QWEN3_06B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


def operands(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + rows * n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    return tuple(None if t is None else t.to(device, dtype) for t in (x, w, b))


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def check_case(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype, device: str) -> None:
    x, w, b = operands(rows, n, k, bias, dtype, device)
    y = tlin.skinny_linear(x, w, b)
    assert y.shape == (rows, n) and y.dtype == dtype
    assert rel_err(y, reference(x, w, b)) < TOLERANCE[dtype]
    # The split-K sum's order does not depend on which program finished last: the same bits.
    assert torch.equal(tlin.skinny_linear(x, w, b), y)
    # Every arrival count is back to zero, so the next launch (or graph replay) starts clean.
    assert not tlin._counters(x.device, 1).any()


def test_interpreter_suite() -> None:
    run_interpreted_tests(__file__)


@interpreted_only
@pytest.mark.parametrize("rows,n,k,bias,dtype", CASES)
def test_interpreted_skinny_linear(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    check_case(rows, n, k, bias, dtype, "cpu")


@interpreted_only
def test_interpreted_shapes_and_bad_input() -> None:
    """Leading dims are flattened and restored, no rows launch nothing, and inputs the kernel
    cannot take are refused by name."""
    x, w, b = operands(6, 40, 300, True, torch.float32, "cpu")
    y = tlin.skinny_linear(x.view(2, 3, 300), w, b)
    assert y.shape == (2, 3, 40) and rel_err(y.view(6, 40), reference(x, w, b)) < 1e-5
    assert tlin.skinny_linear(torch.empty(0, 300), w).shape == (0, 40)
    with pytest.raises(ValueError, match="TILE_ROWS"):
        tlin.skinny_linear(torch.randn(tlin.TILE_ROWS + 1, 300), w)
    with pytest.raises(ValueError, match="features"):
        tlin.skinny_linear(torch.randn(2, 299), w)


@interpreted_only
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_interpreted_model_through_the_kernel(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole fp32 model with every layer matmul sent through the kernel by the layers'
    dispatch (as a decode step's few rows are on CUDA; Qwen2's q/k/v with biases) matches the
    model on F.linear."""
    from test_fused_kernels import run_model, tiny_model

    from kvscope.layers import weight_layout

    model = tiny_model(arch, torch.float32, "cpu")
    seqs = [(0, 3, None), (0, 4, None)]
    ref = run_model(model, seqs)
    shapes = []

    def through_kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        shapes.append(tuple(w.shape))
        return tlin.skinny_linear(x, w, b)

    monkeypatch.setattr(weight_layout, "linear_kernels", lambda x: SimpleNamespace(linear=through_kernel))
    assert rel_err(run_model(model, seqs), ref) < 1e-5
    assert len(shapes) == 4 * len(model.model.layers)


@pytest.mark.slow
@compiled_only
def test_kernel_compiles_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = record_launches(monkeypatch, tlin, ("_skinny_linear_kernel",))
    for rows in (1, tlin.MAX_ROWS, tlin.TILE_ROWS):
        for n, k in QWEN3_06B:
            tlin.skinny_linear(*operands(rows, n, k, False, torch.bfloat16, "cpu"))
    tlin.skinny_linear(*operands(4, 1152, 896, True, torch.bfloat16, "cpu"))  # Qwen2's qkv bias
    compile_recorded(kernels)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 8, 32])
@pytest.mark.parametrize("n,k", QWEN3_06B + [(1152, 896), (4864, 896)])
def test_gpu_bf16_model_shapes(rows: int, n: int, k: int) -> None:
    """At model shapes, no further from the float64 product than cuBLAS's own bf16 result."""
    x, w, b = operands(rows, n, k, n == 1152, torch.bfloat16, "cuda")
    ref = reference(x, w, b)
    y = tlin.skinny_linear(x, w, b)
    err, cublas_err = ((out.double() - ref).abs().max().item() for out in (y, F.linear(x, w, b)))
    assert err <= 2 * cublas_err + 1e-3
    assert torch.equal(tlin.skinny_linear(x, w, b), y)


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_behind_a_pdl_kernel() -> None:
    """Captured right after a PDL-launched RMSNorm (so its weights load while the norm runs),
    replays on new inputs give the eager result bit for bit, replay after replay."""
    from kvscope.kernels import triton_fused as tf

    n, k = QWEN3_06B[3]
    x, w, _ = operands(8, n, k, False, torch.bfloat16, "cuda")
    norm_w = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    step = lambda: tlin.skinny_linear(tf.rms_norm(x, norm_w, 1e-6), w)  # noqa: E731
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        x.copy_(operands(8, n, k, False, torch.bfloat16, "cuda", seed=seed + 1)[0])
        graph.replay()
        assert torch.equal(out, step())


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers take the kernel for a decode step's few rows of a layer's matmul, and
    F.linear for more rows, an LM head's many programs, float32, or with the switch off."""
    x, w, _ = operands(tlin.MAX_ROWS + 1, *QWEN3_06B[2], False, torch.bfloat16, "cuda")
    assert tlin.takes(x[:tlin.MAX_ROWS], w) and tlin.takes(x[:1], w)
    assert not tlin.takes(x, w)
    assert not tlin.takes(x[:1], torch.empty(151936, 1024, dtype=torch.bfloat16, device="cuda"))
    assert not tlin.takes(x[:1].float(), w.float())
    monkeypatch.setattr(tlin, "USE_SKINNY_LINEAR", False)
    assert not tlin.takes(x[:1], w)
