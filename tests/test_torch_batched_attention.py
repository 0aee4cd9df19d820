"""The batched torch backend against the one-sequence-at-a-time reference (kernel level) and
against transformers (whole engine), for GQA groups 1/2/4/8 and block sizes 1/16/256, on
decode, whole-prompt, chunked, prefix-hit and mixed steps."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from engine_helpers import greedy, token_ids
from kvscope import LLM
from kvscope.kernels.torch_attention import TorchAttentionBackend, TorchReferenceBackend
from kvscope.kernels.torch_batched_attention import paged_attention_batched
from kvscope.kernels.base import AttentionMetadata
from tiny_models import load_hf_model, pack_metadata, tiny_checkpoint

D = 8
GROUPS = [1, 2, 4, 8]
BLOCK_SIZES = [1, 16, 256]
LAYOUTS = {  # kind of each sequence in the step
    "decode": ["decode"] * 5,
    "prefill": ["prefill"] * 4,
    "chunks": ["chunk", "chunk", "prefill", "chunk"],
    "mixed": ["decode", "prefill", "chunk", "decode", "chunk", "decode"],
    "one prompt": ["prefill"],
    "one chunk": ["chunk"],
    "equal prompts": ["prefill 9"] * 3,
}
PADDING_ROWS = 3  # rows past cu_seqlens_q[-1], slot -1, as a padded runner batch has


def kv_heads_for(group: int) -> int:
    return 1 if group == 8 else 2


def random_step(layout: str, group: int, block_size: int, seed: int, padding: int = PADDING_ROWS):
    """One step of ``layout`` on a fragmented pool full of garbage, with ``padding`` rows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hkv = kv_heads_for(group)
    shapes = []  # (context length, query rows)
    for kind in LAYOUTS[layout]:
        length = 9 if kind == "prefill 9" else rng.randint(3, 40)
        n = {"decode": 1, "chunk": rng.randint(2, length - 1)}.get(kind, length)
        shapes.append((length, n))
    pages = [-(-length // block_size) for length, _ in shapes]
    num_blocks = sum(pages) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(p)] for p in pages]
    meta, _ = pack_metadata([(length - n, n, t) for (length, n), t in zip(shapes, tables)], block_size)
    # garbage everywhere, so reading any slot outside a history shows up
    k_cache = 100 * torch.randn(num_blocks, block_size, hkv, D, generator=gen)
    v_cache = 100 * torch.randn(num_blocks, block_size, hkv, D, generator=gen)
    for (length, n), table in zip(shapes, tables):  # the cached prefix of each sequence
        for p in range(length - n):
            k_cache[table[p // block_size], p % block_size] = torch.randn(hkv, D, generator=gen)
            v_cache[table[p // block_size], p % block_size] = torch.randn(hkv, D, generator=gen)
    rows = meta.num_tokens + padding
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((padding,), -1)])
    q = torch.randn(rows, hkv * group, D, generator=gen)
    k = torch.randn(rows, hkv, D, generator=gen)
    v = torch.randn(rows, hkv, D, generator=gen)
    return meta, q, k, v, k_cache, v_cache


@pytest.mark.parametrize("padding", [PADDING_ROWS, 0])  # without: a decode step or one sequence is attended in place
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GROUPS)
def test_batched_backend_matches_the_reference(group: int, block_size: int, layout: str, padding: int) -> None:
    meta, q, k, v, k_cache, v_cache = random_step(layout, group, block_size, seed=group * 1000 + block_size,
                                                  padding=padding)
    assert meta.decode_only == (layout == "decode") and meta.no_prefix == (layout in ("prefill", "one prompt", "equal prompts"))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = TorchReferenceBackend().forward(q, k, v, ref_k, ref_v, meta, D ** -0.5)
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, D ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not out[meta.num_tokens:].any(), "padding rows must come back as zeros"
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_whole_prompt_step_reads_this_steps_keys_not_the_pool() -> None:
    """With ``no_prefix`` the history is the step's own k/v: a pool of NaN must not matter."""
    meta, q, k, v, k_cache, v_cache = random_step("prefill", 2, 16, seed=5)
    expected = TorchReferenceBackend().forward(q, k, v, k_cache, v_cache, meta, 0.3)
    nan_pool = torch.full_like(k_cache, float("nan"))
    out = paged_attention_batched(q, k, v, nan_pool, nan_pool, meta, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_one_backend_serves_successive_steps_and_layers() -> None:
    """The layout is planned once per step and reused by the layers: a new step must re-plan,
    the layers of one step (other pools, same metadata) must reuse it correctly."""
    backend = TorchAttentionBackend()
    for seed, layout in enumerate(["mixed", "decode", "chunks", "prefill", "mixed"]):
        meta, q, k, v, k_cache, v_cache = random_step(layout, 2, 16, seed=seed)
        for layer in range(2):
            pools = (k_cache + layer, v_cache - layer)
            ref_pools = tuple(p.clone() for p in pools)
            expected = TorchReferenceBackend().forward(q * (layer + 1), k, v, *ref_pools, meta, 0.5)
            out = backend.forward(q * (layer + 1), k, v, *pools, meta, 0.5)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_batched_rejects_a_table_shorter_than_the_context() -> None:
    meta, _ = pack_metadata([(0, 5, [0, 2]), (3, 1, [1])], block_size=4)
    meta.context_lens[1] = meta.max_seqlen_k = 6  # claims a second page the table does not have
    cache = torch.zeros(3, 4, 2, D)
    x = torch.zeros(meta.num_tokens, 2, D)
    with pytest.raises(ValueError, match="sequence 1: block table has no page for context length 6"):
        paged_attention_batched(x, x, x, cache, cache, meta, 1.0)
    meta.max_seqlen_k = 9  # more than the table's two pages of 4 slots
    with pytest.raises(ValueError, match="block_tables has 2 pages per sequence, too few for max_seqlen_k=9"):
        paged_attention_batched(x, x, x, cache, cache, meta, 1.0)


# ------------------------------------------------------------------ whole engine
class LayoutSpy(TorchAttentionBackend):
    """The batched backend, noting which kinds of step it served."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: set[str] = set()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, *scales,
                **options) -> torch.Tensor:
        q_lens = meta.cu_seqlens_q.diff()
        longer = q_lens > 1
        if bool((q_lens == 1).any()) and bool(longer.any()):
            self.kinds.add("mixed")
        if bool((longer & (meta.context_lens > q_lens)).any()):
            self.kinds.add("chunk after a cached prefix")
        return super().forward(q, k, v, k_cache, v_cache, meta, scale, *scales, **options)


PREFIX = 260  # more than one 256-slot block, so every block size can hit the prefix cache
MAX_NEW = 12


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    return [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (9, 30, 3, 17)]


@functools.lru_cache(maxsize=None)
def _transformers_tokens(group: int) -> list[list[int]]:
    path = tiny_checkpoint("qwen3", num_attention_heads=8, num_key_value_heads=8 // group)
    model = load_hf_model(path)
    model.generation_config.eos_token_id = None  # kvscope side runs with ignore_eos
    out = []
    with torch.no_grad():
        for p in _prompts(model.config.vocab_size):
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 do_sample=False, pad_token_id=2)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GROUPS)
def test_engine_on_the_batched_backend_matches_transformers(group: int, block_size: int) -> None:
    """Greedy tokens equal transformers' through prefix hits, chunked prefill and mixed steps
    (the unified scheduler, a small token budget)."""
    path = tiny_checkpoint("qwen3", num_attention_heads=8, num_key_value_heads=8 // group)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=block_size, max_num_batched_tokens=16)
    llm.llm_engine.validate_every_step = True
    assert llm.llm_engine.executor.backend.name == "torch"
    spy = LayoutSpy()
    for layer in llm.llm_engine.executor.attn_layers:
        layer.backend = spy
    prompts = _prompts(llm.hf_config.vocab_size)
    first = llm.generate(prompts[:1], greedy(MAX_NEW), use_tqdm=False)  # caches the shared prefix
    rest = llm.generate(prompts[1:], greedy(MAX_NEW), use_tqdm=False)
    assert all(o.metrics.num_cached_tokens >= PREFIX // block_size * block_size for o in rest)
    assert {"mixed", "chunk after a cached prefix"} <= spy.kinds
    assert token_ids(first + rest) == _transformers_tokens(group)
