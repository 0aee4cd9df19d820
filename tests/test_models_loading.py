"""Checkpoints a vLLM user brings, loaded through ``LLM(...)``: what kvscope cannot run is refused
at the call by name, before any worker starts or weight loads."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvscope import LLM
from tiny_models import TINY, make_tiny_checkpoint


def load(path: Path, **config) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, **config)


def test_an_architecture_without_llama_fields_is_refused_by_name(tmp_path: Path) -> None:
    """GPT-2's config has no ``num_key_value_heads``: the check of the heads raised a bare
    AttributeError before the architecture was ever looked at."""
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=TINY["vocab_size"],
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported model \(architectures=\['GPT2LMHeadModel'\].*"
                                         r"LlamaForCausalLM"):
        load(tmp_path)


def test_an_unsupported_rope_is_refused_before_tensor_parallel_workers_start(tmp_path: Path) -> None:
    """Only the model's build read the RoPE settings, so under tensor parallelism a YaRN
    checkpoint started the workers and came back as a worker's traceback."""
    yarn = dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64)
    path = make_tiny_checkpoint(tmp_path, "llama", rope_scaling=yarn)
    with pytest.raises(NotImplementedError, match=r"^rope_type 'yarn' is not supported"):
        load(path, tensor_parallel_size=2)
