"""The torch paged-attention backends (batched, and the reference) against naive dense attention
on random paged layouts."""
from __future__ import annotations

import random

import pytest
import torch

from kvscope.kernels.torch_attention import (
    TorchAttentionBackend, TorchReferenceBackend, paged_attention_reference, store_kv,
    varlen_attention_no_cache,
)
from kvscope.layers.attention import Attention
from kvscope.forward_context import forward_context
from tiny_models import pack_metadata

HKV, D = 2, 8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64, one sequence, query rows = the last len(q) positions, heads expanded explicitly."""
    n, hq, _ = q.shape
    length = k.shape[0]
    k = k.double().repeat_interleave(hq // k.shape[1], dim=1)
    v = v.double().repeat_interleave(hq // v.shape[1], dim=1)
    out = torch.empty(n, hq, q.shape[2], dtype=torch.float64)
    for j in range(n):
        visible = length - n + j + 1
        for h in range(hq):
            w = torch.softmax(k[:visible, h] @ q[j, h].double() * scale, dim=0)
            out[j, h] = w @ v[:visible, h]
    return out


def random_layout(rng: random.Random, block_size: int):
    """Sequences with (context length, query rows) mixing decode rows, whole prompts and
    chunks after a cached prefix; pages drawn from a shuffled pool so tables are fragmented."""
    shapes = []
    for kind in ("decode", "prefill", "chunk", "decode", "chunk"):
        length = rng.randint(1, 23)
        n = {"decode": 1, "prefill": length, "chunk": rng.randint(1, length)}[kind]
        shapes.append((length, n))
    need = sum(-(-length // block_size) for length, _ in shapes)
    num_blocks = need + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-length // block_size))] for length, _ in shapes]
    return shapes, tables, num_blocks


@pytest.mark.parametrize("backend", [TorchAttentionBackend, TorchReferenceBackend])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_backend_matches_dense(block_size: int, group: int, backend: type) -> None:
    rng = random.Random(block_size * 10 + group)
    gen = torch.Generator().manual_seed(block_size * 10 + group)
    hq, scale = HKV * group, D ** -0.5
    shapes, tables, num_blocks = random_layout(rng, block_size)
    # garbage everywhere, so reading any slot that is not part of the history shows up
    k_cache = 100 * torch.randn(num_blocks, block_size, HKV, D, generator=gen)
    v_cache = 100 * torch.randn(num_blocks, block_size, HKV, D, generator=gen)
    hist_k = [torch.randn(length, HKV, D, generator=gen) for length, _ in shapes]
    hist_v = [torch.randn(length, HKV, D, generator=gen) for length, _ in shapes]
    queries = [torch.randn(n, hq, D, generator=gen) for _, n in shapes]
    for (length, n), table, hk, hv in zip(shapes, tables, hist_k, hist_v):
        for p in range(length - n):  # the cached prefix, placed page by page
            k_cache[table[p // block_size], p % block_size] = hk[p]
            v_cache[table[p // block_size], p % block_size] = hv[p]

    meta, _ = pack_metadata([(length - n, n, table) for (length, n), table in zip(shapes, tables)],
                            block_size)
    new_k = torch.cat([hk[length - n:] for (length, n), hk in zip(shapes, hist_k)])
    new_v = torch.cat([hv[length - n:] for (length, n), hv in zip(shapes, hist_v)])
    out = backend().forward(torch.cat(queries), new_k, new_v, k_cache, v_cache, meta, scale)

    expected = torch.cat([dense_attention(q, hk, hv, scale)
                          for q, hk, hv in zip(queries, hist_k, hist_v)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for (length, _), table, hk in zip(shapes, tables, hist_k):
        stored = torch.stack([k_cache[table[p // block_size], p % block_size] for p in range(length)])
        torch.testing.assert_close(stored, hk, atol=0, rtol=0)


def test_store_writes_exactly_the_given_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(6, 4, HKV, D)
    v_cache = torch.zeros(6, 4, HKV, D)
    slots = torch.tensor([13, -1, 0, 23, -1, 7])
    k = torch.randn(len(slots), HKV, D, generator=gen) + 1
    v = torch.randn(len(slots), HKV, D, generator=gen) + 1
    store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    written = {13: 0, 0: 2, 23: 3, 7: 5}
    for slot in range(flat_k.shape[0]):
        if slot in written:
            assert torch.equal(flat_k[slot], k[written[slot]])
            assert torch.equal(flat_v[slot], v[written[slot]])
        else:
            assert not flat_k[slot].any() and not flat_v[slot].any()


def test_reference_rejects_a_table_shorter_than_the_context() -> None:
    meta, _ = pack_metadata([(0, 3, [0])], block_size=4)
    meta.context_lens[0] = 6  # claims a second page the table does not have
    cache = torch.zeros(2, 4, HKV, D)
    with pytest.raises(ValueError, match="no page"):
        paged_attention_reference(torch.zeros(3, HKV, D), cache, cache, meta, 1.0)


def test_attention_layer_without_a_pool() -> None:
    """Warm-up path (empty cache, no prefix) equals the paged path and dense attention; a step
    that needs a cached prefix refuses to run without a pool."""
    gen = torch.Generator().manual_seed(1)
    hq, lens = 4, [5, 1, 9]
    layer = Attention(hq, HKV, D, scale=0.3)
    q = torch.randn(sum(lens), hq * D, generator=gen)
    k = torch.randn(sum(lens), HKV * D, generator=gen)
    v = torch.randn(sum(lens), HKV * D, generator=gen)

    meta, _ = pack_metadata([(0, n, None) for n in lens], block_size=4)
    with forward_context(meta):
        no_pool = layer(q, k, v)
    cu = [0, 5, 6, 15]
    dense = torch.cat([dense_attention(q[a:b].view(-1, hq, D), k[a:b].view(-1, HKV, D),
                                       v[a:b].view(-1, HKV, D), 0.3) for a, b in zip(cu, cu[1:])])
    torch.testing.assert_close(no_pool.double(), dense.view(-1, hq * D), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        varlen_attention_no_cache(q.view(-1, hq, D), k.view(-1, HKV, D), v.view(-1, HKV, D),
                                  meta.cu_seqlens_q, 0.3).view(-1, hq * D), no_pool)

    layer.k_cache, layer.v_cache = torch.zeros(2, 10, 4, HKV, D)
    paged_meta, _ = pack_metadata([(0, 5, [7, 2]), (0, 1, [4]), (0, 9, [0, 9, 5])], block_size=4)
    with forward_context(paged_meta):
        paged = layer(q, k, v)
    torch.testing.assert_close(paged, no_pool, atol=1e-6, rtol=1e-6)

    layer.k_cache = layer.v_cache = torch.empty(0)
    prefix_meta, _ = pack_metadata([(3, 2, [1, 2])], block_size=4)
    with forward_context(prefix_meta), pytest.raises(RuntimeError, match="not allocated"):
        layer(q[:2], k[:2], v[:2])
