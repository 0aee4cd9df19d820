"""kvscope models vs transformers on tiny random checkpoints (fp32 logits parity).

transformers runs each prompt whole and unbatched; kvscope runs the same tokens packed into one
step, or fed in chunks across steps through a fragmented paged KV cache. Every logit row must
agree: that covers weight mapping/sharding, RoPE (incl. Llama 3 scaling), norms, biases, GQA,
and the torch attention backend's use of the cache.
"""
from __future__ import annotations

import copy
import random
import re
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvscope.distributed.parallel_state import destroy_tp, init_tp
from kvscope.layers.rotary import RotaryEmbedding, rope_config_from_hf
from kvscope.layers import weight_layout
from kvscope.layers.weight_layout import pack_cpu_weights
from kvscope.models import build_model, spec_for
from kvscope.models.loader import CheckpointMismatchError, load_weights
from kvscope.forward_context import forward_context
from tiny_models import load_hf_model, pack_metadata, tiny_checkpoint, tiny_config

CASES = {
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied": dict(arch="qwen3", tie=True),
    "qwen2-bias": dict(arch="qwen2"),
    "llama3-rope": dict(arch="llama"),
    "llama-tied-biases": dict(arch="llama", tie=True, attention_bias=True, mlp_bias=True),
}
PROMPT_LENS = (1, 6, 13, 30)
ATOL, RTOL = 1e-4, 1e-5


def _config(path: Path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def _kvscope_model(path: Path) -> torch.nn.Module:
    model = build_model(_config(path), dtype=torch.float32, device="cpu")
    load_weights(model, path)
    return model


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request):
    """(kvscope model, prompts, transformers logits per prompt) for one architecture."""
    path = tiny_checkpoint(**CASES[request.param])
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (n,), generator=gen) for n in PROMPT_LENS]
    hf = load_hf_model(path)
    with torch.no_grad():
        expected = [hf(p[None]).logits[0] for p in prompts]
    return _kvscope_model(path), prompts, expected


def _step(model, prompts, chunks, block_size, tables=None) -> torch.Tensor:
    """Run one packed step; ``chunks`` are (prompt index, start, n)."""
    seqs = [(start, n, None if tables is None else tables[i]) for i, start, n in chunks]
    meta, positions = pack_metadata(seqs, block_size)
    input_ids = torch.cat([prompts[i][start:start + n] for i, start, n in chunks])
    with torch.no_grad(), forward_context(meta):
        return model.compute_logits(model(input_ids, positions))


def _attach_pool(model, num_blocks: int, block_size: int) -> None:
    """What the runner does: one pool, each attention layer gets its per-layer K and V view."""
    attn_layers = [layer.self_attn.attn for layer in model.model.layers]
    a = attn_layers[0]
    pool = torch.zeros(2, len(attn_layers), num_blocks, block_size, a.num_kv_heads, a.head_dim)
    for i, layer in enumerate(attn_layers):
        layer.k_cache, layer.v_cache = pool[0, i], pool[1, i]


def _detach_pool(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = torch.empty(0)


def test_one_packed_step_matches_transformers(case) -> None:
    model, prompts, expected = case
    chunks = [(i, 0, len(p)) for i, p in enumerate(prompts)]
    _detach_pool(model)  # warm-up style: no KV pool at all
    no_pool = _step(model, prompts, chunks, block_size=4)
    torch.testing.assert_close(no_pool, torch.cat(expected), atol=ATOL, rtol=RTOL)

    block_size = 4
    tables, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])
        next_block += n
    _attach_pool(model, next_block, block_size)
    try:
        paged = _step(model, prompts, chunks, block_size, tables)
    finally:
        _detach_pool(model)
    torch.testing.assert_close(paged, torch.cat(expected), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "input-major"])
def test_cpu_weights_keep_values_ties_and_logits(case, packed, monkeypatch) -> None:
    """The CPU runner's matmul weights (packed for oneDNN, or input-major where it cannot pack)
    hold the same values, keep the tie of embedding and LM head, and give the same logits as
    transformers; a packed weight's plain copy is dropped unless another module reads it."""
    model, prompts, expected = case
    relaid = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if not packed:
        monkeypatch.setattr(weight_layout, "can_pack", lambda dtype: False)
    assert pack_cpu_weights(relaid) is packed
    matmuls = {name: m for name, m in relaid.named_modules() if hasattr(m, "packed_weight")}
    assert len(matmuls) == 4 * len(relaid.model.layers) + 1
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert (relaid.lm_head.weight is relaid.model.embed_tokens.weight) == tied
    for name, m in matmuls.items():
        original = before.get(f"{name}.weight", before["model.embed_tokens.weight"])
        if packed:
            assert torch.equal(m.packed_weight.to_dense(), original), name
            assert m.weight.is_meta == (not (tied and name == "lm_head")), name
        else:
            assert m.packed_weight is None
            assert m.weight.t().is_contiguous() and not m.weight.is_contiguous(), name
            assert torch.equal(m.weight, original), name
    assert torch.equal(relaid.model.embed_tokens.weight, before["model.embed_tokens.weight"])
    chunks = [(i, 0, len(p)) for i, p in enumerate(prompts)]
    _detach_pool(relaid)
    torch.testing.assert_close(_step(relaid, prompts, chunks, block_size=4), torch.cat(expected),
                               atol=ATOL, rtol=RTOL)


def test_chunked_steps_through_fragmented_cache_match_transformers(case) -> None:
    """Random chunk sizes per sequence per step (single-token rows included), so most steps
    mix a cached prefix with new tokens; pages come from a shuffled pool."""
    model, prompts, expected = case
    rng = random.Random(3)
    block_size = 4
    need = sum(-(-len(p) // block_size) for p in prompts)
    free = list(range(need + 6))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(p) // block_size))] for p in prompts]
    done = [0] * len(prompts)
    _attach_pool(model, need + 6, block_size)
    try:
        steps = 0
        while any(d < len(p) for d, p in zip(done, prompts)):
            chunks = [(i, done[i], min(rng.choice([1, 1, 2, 3, 5, 8]), len(p) - done[i]))
                      for i, p in enumerate(prompts) if done[i] < len(p)]
            logits = _step(model, prompts, chunks, block_size, tables)
            want = torch.cat([expected[i][start:start + n] for i, start, n in chunks])
            torch.testing.assert_close(logits, want, atol=ATOL, rtol=RTOL)
            for i, start, n in chunks:
                done[i] = start + n
            steps += 1
        assert steps > 4
    finally:
        _detach_pool(model)


def test_loader_names_missing_and_unexpected_tensors(tmp_path: Path) -> None:
    src = tiny_checkpoint("qwen2")
    tensors = load_file(src / "model.safetensors")
    config = _config(src)

    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    model = build_model(config, dtype=torch.float32, device="cpu")
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_weights(model, tmp_path)

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    tensors["model.rotary_emb.inv_freq"] = torch.zeros(8)  # old checkpoints carry this: ignored
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight"):
        load_weights(model, tmp_path)


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_loader_names_a_damaged_safetensors_file(tmp_path: Path, damage: str) -> None:
    """A download cut short, or a file that is not safetensors: the error names the file (a
    bare SafetensorError from the reader before); the whole file still loads."""
    src = tiny_checkpoint("qwen3")
    data = (src / "model.safetensors").read_bytes()
    model = build_model(_config(src), dtype=torch.float32, device="cpu")
    (tmp_path / "model.safetensors").write_bytes(data)
    load_weights(model, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2] if damage == "cut" else b"not safetensors")
    with pytest.raises(CheckpointMismatchError, match=rf"^{re.escape(str(tmp_path / 'model.safetensors'))} is not a whole "
                                                      r"safetensors file"):
        load_weights(model, tmp_path)


def test_loader_rejects_a_misshapen_tensor(tmp_path: Path) -> None:
    src = tiny_checkpoint("llama")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(tensors, tmp_path / "model.safetensors")
    model = build_model(_config(src), dtype=torch.float32, device="cpu")
    with pytest.raises(CheckpointMismatchError, match=r"up_proj\.weight"):
        load_weights(model, tmp_path)


def test_tp_indivisible_config_is_refused_by_name() -> None:
    config = tiny_config("qwen3")  # 4 heads, 2 KV heads
    init_tp(0, 4)
    try:
        with pytest.raises(ValueError, match=r"num_key_value_heads=2.*divisible by 4"):
            build_model(config, dtype=torch.float32, device="cpu")
    finally:
        destroy_tp()


def test_tp_shards_hold_this_ranks_slice() -> None:
    """Without real collectives: each simulated rank of TP=2 loads exactly its rows/columns."""
    path = tiny_checkpoint("qwen2")
    full = load_file(path / "model.safetensors")
    heads, kv_heads, d = 2, 1, 16  # per rank: 4 / 2 query heads, 2 / 2 KV heads, head_dim 16
    for rank in range(2):
        init_tp(rank, 2)
        try:
            model = _kvscope_model(path)
        finally:
            destroy_tp()
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        pre = "model.layers.1."
        q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
        kv_rows = slice(rank * kv_heads * d, (rank + 1) * kv_heads * d)
        for suffix in ("weight", "bias"):
            want = torch.cat([full[f"{pre}self_attn.q_proj.{suffix}"][q_rows],
                              full[f"{pre}self_attn.k_proj.{suffix}"][kv_rows],
                              full[f"{pre}self_attn.v_proj.{suffix}"][kv_rows]])
            assert torch.equal(getattr(attn.qkv_proj, suffix), want)
        cols = slice(rank * heads * d, (rank + 1) * heads * d)
        assert torch.equal(attn.o_proj.weight, full[f"{pre}self_attn.o_proj.weight"][:, cols])
        inter = slice(rank * 64, (rank + 1) * 64)
        assert torch.equal(mlp.gate_up_proj.weight,
                           torch.cat([full[f"{pre}mlp.gate_proj.weight"][inter],
                                      full[f"{pre}mlp.up_proj.weight"][inter]]))
        assert torch.equal(mlp.down_proj.weight, full[f"{pre}mlp.down_proj.weight"][:, inter])
        vocab = slice(rank * 160, (rank + 1) * 160)
        assert torch.equal(model.model.embed_tokens.weight, full["model.embed_tokens.weight"][vocab])
        assert torch.equal(model.lm_head.weight, full["lm_head.weight"][vocab])


def test_rope_settings_read_from_either_config_spelling() -> None:
    scaling = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    legacy = types.SimpleNamespace(rope_theta=5e5, rope_scaling=dict(type="llama3", **scaling))
    v5 = types.SimpleNamespace(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, **scaling))
    a, b = rope_config_from_hf(legacy), rope_config_from_hf(v5)
    assert a == b and a.rope_type == "llama3" and a.theta == 5e5
    assert torch.equal(RotaryEmbedding(16, 128, a).cos_sin, RotaryEmbedding(16, 128, b).cos_sin)
    assert rope_config_from_hf(types.SimpleNamespace()).theta == 10000.0
    with pytest.raises(NotImplementedError, match="yarn"):
        rope_config_from_hf(types.SimpleNamespace(rope_parameters=dict(rope_type="yarn")))


def test_unknown_architecture_lists_the_supported_ones() -> None:
    config = types.SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*Qwen2ForCausalLM.*LlamaForCausalLM"):
        spec_for(config)


def _tp_worker(rank: int, port: int, config_dict: dict, path: str, prompts: list,
               out_file: str) -> None:
    """One rank of a real TP=2 group over gloo (CPU): build, load this rank's shards, run a
    prefill chunk then the rest of each prompt through the paged cache."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    init_tp(rank, 2)
    try:
        config = types.SimpleNamespace(**config_dict)  # no transformers import in workers
        model = build_model(config, dtype=torch.float32, device="cpu")
        load_weights(model, path)
        tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
        _attach_pool(model, 2 * len(prompts), 8)
        first = _step(model, prompts, [(i, 0, 3) for i in range(len(prompts))], 8, tables)
        rest = _step(model, prompts, [(i, 3, len(p) - 3) for i, p in enumerate(prompts)], 8,
                     tables)
        if rank == 0:
            torch.save((first, rest), out_file)
        else:
            assert first is None and rest is None
    finally:
        destroy_tp()
        dist.destroy_process_group()


def test_tensor_parallel_2_over_gloo_matches_transformers(tmp_path: Path) -> None:
    """Real collectives: row-parallel all-reduce (with biases), vocab-parallel embedding of a
    tied model, LM-head gather to rank 0."""
    import socket

    import torch.multiprocessing as mp

    kwargs = CASES["llama-tied-biases"]
    path = tiny_checkpoint(**kwargs)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=gen) for n in (9, 14)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = str(tmp_path / "logits.pt")
    # fork: a spawned child would spend seconds re-importing torch
    mp.start_processes(_tp_worker, nprocs=2, start_method="fork",
                       args=(port, _config(path).to_dict(), str(path), prompts, out_file))
    first, rest = torch.load(out_file)
    hf = load_hf_model(path)
    with torch.no_grad():
        expected = [hf(p[None]).logits[0] for p in prompts]
    torch.testing.assert_close(first, torch.cat([e[:3] for e in expected]), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(rest, torch.cat([e[3:] for e in expected]), atol=ATOL, rtol=RTOL)
