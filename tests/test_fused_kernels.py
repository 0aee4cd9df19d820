"""Fused Triton kernels (``kvscope.kernels.triton_fused``) against the torch layer code they
replace, which stays the reference: RMSNorm with and without the residual add, per-head q/k
RMSNorm + RoPE (and RoPE alone, either one also writing the step's K/V into the paged pool),
SiLU-and-mul.

Tiers, as in test_triton_kernels.py (``triton_testing`` says why the interpreter runs in a
subprocess):
- CPU, Triton interpreter: tiny fp32/fp16 shapes, odd sizes, GQA head counts, random positions.
- CPU, sm_90 compile check of the real launches at model shapes, in bf16.
- GPU (``-m gpu``): bf16 at model shapes, CUDA-graph replay, and whole models with the fused
  kernels on vs off, including how many kernels a decoder layer launches.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

triton = pytest.importorskip("triton")

from kvscope.kernels import fused as fused_switch
from kvscope.kernels import triton_attention as ta
from kvscope.kernels import triton_fused as tf
from kvscope.kernels.base import KVWrite
from kvscope.kernels.kv_quant import FP8_DTYPE
from kvscope.kernels.torch_attention import store_kv
from kvscope.layers import norm as norm_module
from kvscope.layers.activation import SiluAndMul
from kvscope.layers.norm import RMSNorm
from kvscope.layers.rotary import RopeConfig, RotaryEmbedding, rotate_qk
from triton_testing import (INTERPRETED, compile_recorded, compiled_only, interpreted_only,
                            record_launches, needs_cuda, rel_err, run_interpreted_tests)

EPS = 1e-6
LLAMA3 = RopeConfig(theta=10000.0, rope_type="llama3",
                    params=dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64))
DEFAULT_ROPE = RopeConfig(theta=1e6)


def tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed against an fp32 reference: one rounding to ``dtype``, plus slack."""
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def random_norm(size: int, gen: torch.Generator) -> RMSNorm:
    """An fp32 CPU RMSNorm with gains around 1: the reference layer."""
    norm = RMSNorm(size, EPS)
    norm.weight.copy_(1 + 0.3 * torch.randn(size, generator=gen))
    return norm


# --- the cases: each builds inputs, runs the fused kernel and checks it against the layers ---

def check_rms_norm(rows: int, hidden: int, residual: bool, dtype: torch.dtype,
                   device: str) -> None:
    """Row-strided ``x`` (a slice of a wider buffer, as a packed projection would give)."""
    gen = torch.Generator().manual_seed(rows * hidden + residual)
    norm = random_norm(hidden, gen)
    wide = (3 * torch.randn(rows, hidden + 5, generator=gen)).to(dtype)
    x = wide[:, 2:2 + hidden]
    weight = norm.weight.detach().to(dtype)
    if residual:
        res = torch.randn(rows, hidden, generator=gen).to(dtype)
        out, res_out = tf.fused_add_rms_norm(x.to(device), res.to(device), weight.to(device), EPS)
        assert torch.equal(res_out.cpu(), x + res)
        ref = norm((x + res).float())
    else:
        out = tf.rms_norm(x.to(device), weight.to(device), EPS)
        ref = norm(x.float())
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out.cpu(), ref) < tolerance(dtype)


def check_qk_norm_rope(tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       qk_norm: bool, rope: RopeConfig, dtype: torch.dtype, device: str) -> None:
    """q and k as the decoder has them: head views of one packed qkv row, rotated in place;
    cos/sin from the model's table at random positions."""
    gen = torch.Generator().manual_seed(tokens * head_dim + num_q_heads + qk_norm)
    rotary = RotaryEmbedding(head_dim, 512, rope)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    cos, sin = rotary.cos_sin[positions].chunk(2, dim=-1)  # the fused kernel's tables
    qkv = (2 * torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim,
                           generator=gen)).to(dtype)
    norms = (random_norm(head_dim, gen), random_norm(head_dim, gen)) if qk_norm else (None, None)

    def heads(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        return q.view(tokens, num_q_heads, head_dim), k.view(tokens, num_kv_heads, head_dim)

    ref_qk = qkv.float()[:, :(num_q_heads + num_kv_heads) * head_dim].view(tokens, -1, head_dim)
    ref_q, ref_k = rotate_qk(ref_qk, num_q_heads, *rotary(positions, ref_qk), *norms)
    fused_qkv = qkv.to(device)
    weights = [n.weight.detach().to(device, dtype) for n in norms] if qk_norm else [None, None]
    q, k = tf.qk_norm_rope(*heads(fused_qkv), cos.to(device), sin.to(device), *weights, EPS)
    assert q.data_ptr() == fused_qkv.data_ptr()  # in place, in the packed buffer
    v_cols = slice((num_q_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(fused_qkv[:, v_cols].cpu(), qkv[:, v_cols])  # v untouched
    for out, ref in ((q, ref_q), (k, ref_k)):
        assert rel_err(out.cpu(), ref) < tolerance(dtype)


def check_qk_norm_rope_store(tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                             qk_norm: bool, dtype: torch.dtype, pool_dtype: torch.dtype,
                             device: str) -> None:
    """The RoPE kernel's pool write against the backends' own store of the k it rotated and of
    v: the same qkv buffer and the same pool bytes, slot -1 skipped, untouched slots kept, an
    fp8 pool quantized with its scales.

    The truth is torch's ``store_kv``; for an fp8 pool in the interpreter it is the Triton
    store kernel, because the interpreter's float -> fp8 cast rounds some values wrongly (see
    test_triton_kernels.snap_to_fp8); on the GPU fp8 is checked against torch too.
    """
    gen = torch.Generator().manual_seed(tokens + num_q_heads * head_dim + qk_norm)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 512, DEFAULT_ROPE).cos_sin[positions].chunk(2, dim=-1)
    qkv = (2 * torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim,
                           generator=gen)).to(dtype)
    weights = ([random_norm(head_dim, gen).weight.detach().to(device, dtype) for _ in range(2)]
               if qk_norm else [None, None])
    pages, block = triton.cdiv(2 * tokens, 4), 4
    slots = torch.randperm(pages * block, generator=gen)[:tokens]
    slots[::3] = -1
    scales = [torch.tensor(x, device=device) for x in (0.5, 2.0)]
    empty = torch.full((pages, block, num_kv_heads, head_dim), 3.0).to(pool_dtype)

    def run(fused_store: bool) -> list[torch.Tensor]:
        work = qkv.clone().to(device)
        q, k, v = (x.view(tokens, -1, head_dim) for x in work.split(
            [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
        pool = [empty.clone().to(device), empty.clone().to(device)]
        slot_mapping = slots.to(device)
        store = KVWrite(v, *pool, slot_mapping, *scales) if fused_store else None
        tf.qk_norm_rope(q, k, cos.to(device), sin.to(device), *weights, EPS, store=store)
        if not fused_store:
            backend_store = (ta.store_kvcache if pool_dtype == FP8_DTYPE and INTERPRETED
                             else store_kv)
            backend_store(k, v, *pool, slot_mapping, *scales)
        return [x.cpu().view(torch.uint8) for x in (work, *pool)]

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)


def check_silu_and_mul(rows: int, width: int, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    x = (3 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    out = tf.silu_and_mul(x.to(device))
    assert out.dtype == dtype and out.shape == (rows, width)
    assert rel_err(out.cpu(), SiluAndMul()(x.float())) < tolerance(dtype)


# --- CPU: Triton interpreter -----------------------------------------------------------------

@compiled_only
def test_interpreter_suite() -> None:
    run_interpreted_tests(__file__)


DTYPES = [torch.float32, torch.float16]


@interpreted_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 7), (4, 100), (2, 333)])
def test_interpreted_rms_norm(rows: int, hidden: int, residual: bool, dtype: torch.dtype) -> None:
    check_rms_norm(rows, hidden, residual, dtype, "cpu")


@interpreted_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,rope", [
    (4, 2, 32, DEFAULT_ROPE), (6, 1, 64, LLAMA3), (3, 3, 128, DEFAULT_ROPE)])
def test_interpreted_qk_norm_rope(num_q_heads: int, num_kv_heads: int, head_dim: int,
                                  rope: RopeConfig, qk_norm: bool, dtype: torch.dtype) -> None:
    check_qk_norm_rope(5, num_q_heads, num_kv_heads, head_dim, qk_norm, rope, dtype, "cpu")


@interpreted_only
@pytest.mark.parametrize("pool_fp8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("tokens,num_q_heads,num_kv_heads,head_dim", [(7, 4, 2, 32), (4, 6, 1, 64)])
def test_interpreted_qk_norm_rope_store(tokens: int, num_q_heads: int, num_kv_heads: int,
                                        head_dim: int, qk_norm: bool, dtype: torch.dtype,
                                        pool_fp8: bool) -> None:
    check_qk_norm_rope_store(tokens, num_q_heads, num_kv_heads, head_dim, qk_norm, dtype,
                             FP8_DTYPE if pool_fp8 else dtype, "cpu")


@interpreted_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (3, 7), (2, 1500)])  # 1500: two column blocks
def test_interpreted_silu_and_mul(rows: int, width: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(rows, width, dtype, "cpu")


@interpreted_only
def test_interpreted_empty_and_nd_inputs() -> None:
    """No rows launches nothing; leading dims beyond one are flattened and restored."""
    norm = random_norm(8, torch.Generator().manual_seed(0))
    assert tf.rms_norm(torch.empty(0, 8), norm.weight, EPS).shape == (0, 8)
    assert tf.silu_and_mul(torch.empty(0, 16)).shape == (0, 8)
    x = torch.randn(2, 3, 8)
    assert rel_err(tf.rms_norm(x, norm.weight, EPS), norm(x)) < 1e-5
    assert rel_err(tf.silu_and_mul(x), SiluAndMul()(x)) < 1e-5


def tiny_model(arch: str, dtype: torch.dtype, device: str, **overrides):
    """A tiny random checkpoint of ``arch`` (tests/tiny_models.py) as a kvscope model."""
    from transformers import AutoConfig

    from kvscope.models import build_model
    from kvscope.models.loader import load_weights
    from tiny_models import tiny_checkpoint

    path = tiny_checkpoint(arch, **overrides)
    model = build_model(AutoConfig.from_pretrained(path), dtype=dtype, device=device)
    load_weights(model, path)
    return model


def run_model(model, seqs) -> torch.Tensor:
    """Hidden states of one packed step (``pack_metadata`` triples, block size 16)."""
    from kvscope.forward_context import forward_context
    from tiny_models import pack_metadata

    meta, positions = pack_metadata(seqs, 16, device=next(model.parameters()).device)
    ids = (positions * 7 + 3) % 320
    with torch.inference_mode(), forward_context(meta):
        return model(ids, positions)


@interpreted_only
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_interpreted_model_dispatch(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' dispatch, forced onto CPU: a whole fp32 model through the fused kernels
    (norm, add+norm, q/k norm + RoPE in place in the qkv buffer, RoPE alone, SiLU) matches
    the torch code."""
    from kvscope.layers import activation, rotary

    model = tiny_model(arch, torch.float32, "cpu")
    seqs = [(0, 7, None), (0, 4, None)]
    ref = run_model(model, seqs)
    for module in (norm_module, rotary, activation):
        monkeypatch.setattr(module, "fused_kernels", lambda x: tf)
    assert rel_err(run_model(model, seqs), ref) < 1e-5


def with_pools(model, pages: int = 8, block: int = 16):
    """Give ``model``'s attention layers zeroed paged pools and the batched torch backend (it
    reads the pools, wherever the step's K/V were written from)."""
    from kvscope.kernels.torch_attention import TorchAttentionBackend

    param = next(model.parameters())
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        attn.k_cache, attn.v_cache = torch.zeros(2, pages, block, attn.num_kv_heads,
                                                 attn.head_dim, dtype=param.dtype,
                                                 device=param.device)
        attn.backend = TorchAttentionBackend()
    return model


def prefill_then_decode(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Hidden states of a paged prefill and then a decode step that reads it back, and every
    layer's pool after them."""
    steps = ([(0, 19, [0, 1]), (0, 5, [2])], [(19, 1, [0, 1]), (5, 1, [2])])
    hidden = torch.cat([run_model(model, seqs) for seqs in steps])
    return hidden, [torch.stack((layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache))
                    for layer in model.model.layers]


@interpreted_only
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_interpreted_model_stores_kv_in_rope(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' dispatch forced onto the fused kernels with a paged pool: the RoPE kernel
    writes each layer's K/V and the backend skips its store (no launch of its own is left to
    do it), and the hidden states and the pools match the torch code's."""
    from kvscope.layers import activation, attention, rotary

    ref_hidden, ref_pools = prefill_then_decode(with_pools(tiny_model(arch, torch.float32, "cpu")))
    for module in (norm_module, rotary, activation, attention):
        monkeypatch.setattr(module, "fused_kernels", lambda x: tf)
    stored = []
    monkeypatch.setattr(ta, "store_kvcache", lambda *args: stored.append(args))
    monkeypatch.setattr("kvscope.kernels.torch_attention.store_kv",
                        lambda *args, **kwargs: stored.append(args))
    hidden, pools = prefill_then_decode(with_pools(tiny_model(arch, torch.float32, "cpu")))
    assert not stored
    assert rel_err(hidden, ref_hidden) < 1e-5
    for pool, ref in zip(pools, ref_pools):
        assert rel_err(pool, ref) < 1e-5


# --- CPU: compile the real launches for sm_90 ------------------------------------------------

# (hidden, q heads, kv heads, head_dim, intermediate): Qwen3-0.6B and Llama-3-8B
MODEL_SHAPES = [(1024, 16, 8, 128, 3072), (4096, 32, 8, 128, 14336)]


def launch_all(tokens: int, hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               intermediate: int, dtype: torch.dtype, device: str) -> None:
    """Every fused kernel once at a model's shapes (random data, results unchecked)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype)

    w = rand(hidden)
    tf.rms_norm(rand(tokens, hidden), w, EPS)
    tf.fused_add_rms_norm(rand(tokens, hidden), rand(tokens, hidden), w, EPS)
    qkv = rand(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, :num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim:][:, :num_kv_heads * head_dim].view(
        tokens, num_kv_heads, head_dim)
    cos, sin = torch.randn(tokens, head_dim, device=device).chunk(2, dim=-1)
    tf.qk_norm_rope(q, k, cos, sin, rand(head_dim), rand(head_dim), EPS)
    tf.qk_norm_rope(q, k, cos, sin)
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    slots = torch.arange(tokens, device=device)
    scale = torch.ones((), device=device)
    for pool_dtype in (dtype, FP8_DTYPE):
        pool = torch.zeros(2, 4, 16, num_kv_heads, head_dim, device=device).to(pool_dtype)
        tf.qk_norm_rope(q, k, cos, sin, rand(head_dim), rand(head_dim), EPS,
                        store=KVWrite(v, *pool, slots, scale, scale))
    tf.silu_and_mul(rand(tokens, 2 * intermediate))


@pytest.mark.slow
@compiled_only
def test_kernels_compile_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = record_launches(monkeypatch, tf, ("_rms_norm_kernel", "_qk_norm_rope_kernel", "_silu_and_mul_kernel"))
    for shape in MODEL_SHAPES:
        launch_all(3, *shape, torch.bfloat16, "cpu")
    assert [len(r.calls) for r in kernels.values()] == [4, 8, 2]
    compile_recorded(kernels)


# --- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("hidden,num_q_heads,num_kv_heads,head_dim,intermediate", MODEL_SHAPES)
def test_gpu_kernels_bf16(tokens: int, hidden: int, num_q_heads: int, num_kv_heads: int,
                          head_dim: int, intermediate: int) -> None:
    bf16 = torch.bfloat16
    for residual in (False, True):
        check_rms_norm(tokens, hidden, residual, bf16, "cuda")
    for qk_norm, rope in ((True, DEFAULT_ROPE), (False, LLAMA3)):
        check_qk_norm_rope(tokens, num_q_heads, num_kv_heads, head_dim, qk_norm, rope, bf16,
                           "cuda")
        for pool_dtype in (bf16, FP8_DTYPE):
            check_qk_norm_rope_store(tokens, num_q_heads, num_kv_heads, head_dim, qk_norm, bf16,
                                     pool_dtype, "cuda")
    check_silu_and_mul(tokens, intermediate, bf16, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay() -> None:
    """Every kernel captured in one graph and replayed on new inputs: equal to eager."""
    hidden, hq, hkv, d, inter = MODEL_SHAPES[0]
    tokens = 64

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda").to(torch.bfloat16)

    x, res, w, qw, kw = rand(tokens, hidden), rand(tokens, hidden), rand(hidden), rand(d), rand(d)
    qkv, gate_up = rand(tokens, (hq + 2 * hkv) * d), rand(tokens, 2 * inter)
    table = RotaryEmbedding(d, 4096, DEFAULT_ROPE).cos_sin.cuda()
    positions = torch.randint(0, 4096, (tokens,), device="cuda")

    def step() -> list[torch.Tensor]:
        normed, new_res = tf.fused_add_rms_norm(x, res, w, EPS)
        work = qkv.clone()
        q = work[:, :hq * d].view(tokens, hq, d)
        k = work[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
        tf.qk_norm_rope(q, k, *table[positions].chunk(2, dim=-1), qw, kw, EPS)
        return [tf.rms_norm(x, w, EPS), normed, new_res, work, tf.silu_and_mul(gate_up)]

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, res, qkv, gate_up):
        t.copy_(torch.randn_like(t, dtype=torch.float32))
    positions.random_(0, 4096)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [o.clone() for o in outs]
    for got, want in zip(replayed, step()):
        assert torch.equal(got, want)




@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_gpu_model_fused_matches_torch(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole model, bf16, one packed prefill: fused kernels on vs off."""
    monkeypatch.setattr(fused_switch, "USE_FUSED_KERNELS", True)
    model = tiny_model(arch, torch.bfloat16, "cuda")
    seqs = [(0, 37, None), (0, 21, None)]
    assert fused_switch.fused_kernels(next(model.parameters())) is not None
    fused = run_model(model, seqs)
    monkeypatch.setattr(fused_switch, "USE_FUSED_KERNELS", False)
    assert rel_err(fused.float(), run_model(model, seqs).float()) <= 1e-2


def cuda_kernel_names(model, seqs, fused: bool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the CUDA kernels one step launches (after a warm-up step that compiles)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(fused_switch, "USE_FUSED_KERNELS", fused)
    run_model(model, seqs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_model(model, seqs)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def paged_tiny_model(arch: str, layers: int):
    """A bf16 CUDA ``tiny_model`` with a zeroed paged KV pool (8 pages of 16) and Triton
    attention, as the runner sets it up."""
    from kvscope.kernels.triton_attention import TritonAttentionBackend

    model = tiny_model(arch, torch.bfloat16, "cuda", num_hidden_layers=layers)
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        attn.k_cache, attn.v_cache = torch.zeros(2, 8, 16, attn.num_kv_heads, attn.head_dim,
                                                 dtype=torch.bfloat16, device="cuda")
        attn.backend = TritonAttentionBackend()
    return model


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gpu_kernels_per_decoder_layer(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step through the paged pool: kernels per decoder layer, read as the difference
    between a 3-layer and a 1-layer model, with the fused kernels and with the torch code."""
    seqs = [(5, 1, [0]), (20, 1, [1, 2]), (0, 1, [3]), (9, 1, [4])]
    models = {layers: paged_tiny_model(arch, layers) for layers in (1, 3)}
    names = {(fused, layers): cuda_kernel_names(model, seqs, fused, monkeypatch)
             for fused in (True, False) for layers, model in models.items()}
    if not names[True, 1]:
        pytest.skip("the profiler recorded no CUDA kernels")
    per_layer = {fused: (len(names[fused, 3]) - len(names[fused, 1])) / 2
                 for fused in (True, False)}
    two_layers = Counter(names[True, 3]) - Counter(names[True, 1])
    print(f"{arch}: CUDA kernels per decoder layer: fused {per_layer[True]:g}, "
          f"torch {per_layer[False]:g}; two fused layers: {sorted(two_layers.items())}")

    def launches(kernel: str) -> int:
        return sum(kernel in name for name in names[True, 3])

    # 3 layers of 2 norms (the first layer's input norm has no residual), then the final norm
    assert launches("_rms_norm_kernel") == 7
    assert launches("_qk_norm_rope_kernel") == launches("_silu_and_mul_kernel") == 3
    assert launches("_store_kvcache_kernel") == 0  # the RoPE kernel wrote the pool
    assert per_layer[True] + 20 <= per_layer[False]
