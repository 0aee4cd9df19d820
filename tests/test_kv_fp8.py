"""The fp8 KV cache (``kv_cache_dtype="fp8"``) on CPU, through the torch backend.

Truths: the same engine with an unquantized (fp32) pool; transformers on the same weights for
the K/V that ``calculate_kv_scales`` must measure; the pool sizing of the unquantized engine.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import greedy, make_llm, token_ids
from kvscope import LLM
from kvscope.config import EngineConfig
from kvscope.kernels.kv_quant import FP8_DTYPE, FP8_MAX, dequantize_kv, quantize_kv
from kvscope.kernels.torch_attention import store_kv
from tiny_models import tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_kv_fp8_accuracy import compare, teacher_forced  # noqa: E402

SMALL_POOL = 1 << 20


def runner(llm):
    return llm.llm_engine.executor


def test_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', got 'int8'"):
        EngineConfig.from_kwargs(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="calculate_kv_scales must be a bool"):
        EngineConfig.from_kwargs(calculate_kv_scales=1)
    assert EngineConfig.from_kwargs(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"


def test_store_and_read_quantize_with_the_scales() -> None:
    """The torch backend's store holds ``x / scale`` rounded to e4m3 and clamped; reading gives
    back ``x`` within e4m3's relative step (2**-3 rounding: 1/16) where it was not clamped."""
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    k[0, 0, 0] = 500.0
    caches = [torch.zeros(4, 2, 2, 8, dtype=FP8_DTYPE) for _ in range(2)]
    slots = torch.tensor([0, 3, -1, 5, 6, 7])
    store_kv(k, v, *caches, slots, 0.5, 0.01)
    kept = slots >= 0
    for x, cache, scale in ((k, caches[0], 0.5), (v, caches[1], 0.01)):
        stored = cache.view(-1, 2, 8)[slots[kept]]
        expect = (x[kept] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        assert torch.equal(stored.view(torch.uint8), expect.view(torch.uint8))
        back = dequantize_kv(stored, scale, torch.float32)
        inside = (x[kept] / scale).abs() <= FP8_MAX
        err = (back - x[kept]).abs()[inside]
        assert bool((err <= x[kept].abs()[inside] / 16 + scale * 2.0 ** -9).all())
    assert float(dequantize_kv(caches[0].view(-1, 2, 8)[0, 0, 0], 0.5, torch.float32)) == 448 * 0.5
    assert torch.equal(quantize_kv(k, 0.5, torch.float32), k)  # an unquantized pool ignores scales


def test_fp8_pool_holds_twice_the_blocks_of_fp16() -> None:
    """Same ``kv_cache_memory_bytes``: 1 byte per element instead of 2 (4 of fp32)."""
    blocks = {}
    for dtype in ("float16", "float32"):
        for kv in ("auto", "fp8"):
            llm = make_llm(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=SMALL_POOL)
            blocks[dtype, kv] = llm.llm_engine.block_manager.num_blocks
            pool = runner(llm).kv_cache
            assert pool.dtype == (FP8_DTYPE if kv == "fp8" else getattr(torch, dtype))
            assert pool.numel() * pool.element_size() <= SMALL_POOL
            llm.shutdown()
    assert blocks["float16", "fp8"] == 2 * blocks["float16", "auto"]
    assert blocks["float32", "fp8"] == 4 * blocks["float32", "auto"]


def test_fp8_engine_tracks_the_unquantized_one() -> None:
    """Teacher-forced on random sequences: the fp8 pool moves log-probs a little, not a lot,
    and rarely changes the greedy choice. Bounds hold with room to spare for this seed (the
    measured figures are in benchmarks/RESULTS.md); a broken scale or clamp breaks them."""
    gen = torch.Generator().manual_seed(3)
    seqs = torch.randint(3, 320, (4, 40), generator=gen).tolist()
    runs = {}
    for kv in ("auto", "fp8"):
        llm = make_llm(kv_cache_dtype=kv, kv_cache_memory_bytes=SMALL_POOL, max_logprobs=-1)
        runs[kv] = teacher_forced(llm, seqs)
        llm.shutdown()
    f = compare(runs["auto"], runs["fp8"])
    assert 0 < f["logprob_diff_mean"] < 0.05
    assert f["logprob_diff_p99"] < 0.25
    assert f["greedy_agreement"] >= 0.9


def test_fp8_generation_is_consistent_across_steps() -> None:
    """Greedy decoding with the fp8 pool is the same whether the prompt is prefilled at once or
    in chunks of 5 tokens (each chunk then reads the previous ones back from the fp8 pool)."""
    prompts = [[5 + i for i in range(23)], [40 + 3 * i for i in range(17)]]
    outs = []
    for batched in (8192, 5):
        llm = make_llm(kv_cache_dtype="fp8", kv_cache_memory_bytes=SMALL_POOL,
                       max_num_batched_tokens=batched)
        outs.append(token_ids(llm.generate(prompts, greedy(12), use_tqdm=False)))
        llm.shutdown()
    assert outs[0] == outs[1]


def _hf_scales(prompt: list[int]) -> list[float]:
    """Per layer, amax(|K|) / 448 and amax(|V|) / 448 of transformers' K/V (after k-norm and
    RoPE) for ``prompt``, each layer's K/V then rounded through e4m3 with those scales, as the
    engine's pool does (so later layers see what the engine's see)."""
    import transformers
    from transformers.masking_utils import eager_mask
    from transformers.models.qwen3 import modeling_qwen3

    scales: dict[int, list[float]] = {}

    def fake_quant(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        scale = x.abs().max() / 448
        return (x / scale).to(torch.float8_e4m3fn).float() * scale, float(scale)

    def capture(module, query, key, value, *args, **kwargs):
        (key, k_scale), (value, v_scale) = fake_quant(key), fake_quant(value)
        scales[module.layer_idx] = [k_scale, v_scale]
        return modeling_qwen3.eager_attention_forward(module, query, key, value, *args, **kwargs)

    transformers.AttentionInterface.register("kvscope_fp8_capture", capture)
    # A new attention name gets no causal mask unless it names its mask function.
    transformers.AttentionMaskInterface.register("kvscope_fp8_capture", eager_mask)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("qwen3"), attn_implementation="kvscope_fp8_capture").float().eval()
    with torch.no_grad():
        model(torch.tensor([prompt]))
    return [s for i in sorted(scales) for s in scales[i]]


def test_calculate_kv_scales_from_the_first_prefill() -> None:
    """Each layer's scales are amax(|K|) / 448 and amax(|V|) / 448 of the first prefill's keys
    and values, and stay so through decode and later prefills."""
    first = [7 + i for i in range(19)]
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_cache_memory_bytes=SMALL_POOL)
    llm.generate([first], greedy(6), use_tqdm=False)
    layers = runner(llm).attn_layers
    scales = [float(s) for a in layers for s in (a.k_scale, a.v_scale)]
    expect = _hf_scales(first)
    assert len(scales) == len(expect) == 4
    assert scales == pytest.approx(expect, rel=1e-4)
    assert all(s != 1.0 for s in scales)
    llm.generate([[300 - i for i in range(30)]], greedy(4), use_tqdm=False)
    assert [float(s) for a in layers for s in (a.k_scale, a.v_scale)] == scales
    # Each layer's pool holds its largest key and value at exactly the e4m3 maximum.
    for a in layers:
        for cache in (a.k_cache, a.v_cache):
            assert float(dequantize_kv(cache, 1.0, torch.float32).abs().max()) == FP8_MAX
    llm.shutdown()


def test_scales_default_to_one() -> None:
    llm = make_llm(kv_cache_dtype="fp8", kv_cache_memory_bytes=SMALL_POOL)
    llm.generate([[9, 8, 7, 6, 5]], greedy(3), use_tqdm=False)
    assert all(float(a.k_scale) == float(a.v_scale) == 1.0 for a in runner(llm).attn_layers)
    llm.shutdown()


def test_trace_meta_shows_the_kv_dtype_and_bytes_per_block() -> None:
    """``trace.meta``: the pool's element type and one block's bytes, from the model's shape."""
    from kvscope.widgets.views import kv_pool_label
    from tiny_models import TINY

    per_element = {"auto": 4, "fp8": 1}  # the fp32 engine's pool, or e4m3
    for kv, name in (("auto", "float32"), ("fp8", "float8_e4m3fn")):
        llm = make_llm(kv_cache_dtype=kv, kv_cache_memory_bytes=SMALL_POOL)
        with llm.record("summary") as trace:
            llm.generate([[4, 5, 6]], greedy(2), use_tqdm=False)
        expect = (2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * 32 * per_element[kv])
        assert trace.meta["kv_cache_dtype"] == name
        assert trace.meta["bytes_per_block"] == expect
        assert kv_pool_label(trace.meta) == f" · KV {name}, {expect:,} B/block"
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_triton_engine_matches_the_torch_backend() -> None:
    """On the GPU: the Triton backend with CUDA graphs over an fp8 pool (calculated scales)
    against the torch backend, eager, over the same fp8 pool: teacher-forced log-probs agree far
    more closely than fp8 and fp32 pools do (same quantization on both sides; what remains is
    TF32 in the Triton kernel's fp32 dots)."""
    gen = torch.Generator().manual_seed(5)
    seqs = torch.randint(3, 320, (6, 48), generator=gen).tolist()
    runs = []
    for backend, eager in (("triton", False), ("torch", True)):
        llm = LLM(str(tiny_checkpoint("qwen3")), device="cuda", dtype="float32", kv_cache_dtype="fp8",
                  calculate_kv_scales=True, attention_backend=backend, enforce_eager=eager,
                  num_kv_blocks=256, max_logprobs=-1)
        runs.append(teacher_forced(llm, seqs))
        llm.shutdown()
    f = compare(*runs)
    assert f["logprob_diff_mean"] < 2e-3 and f["logprob_diff_p99"] < 1e-2
    assert f["greedy_agreement"] >= 0.97
