"""Checkpoints a vLLM user brings, loaded through ``LLM(...)``: what loads gives transformers'
log-probs on the same weights, and what kvscope cannot run is refused at the call by name,
before any worker starts or weight loads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvscope import LLM, SamplingParams
from kvscope.models.loader import CheckpointMismatchError
from tiny_models import TINY, load_hf_model, make_tiny_checkpoint, tiny_checkpoint

PROMPT = [7, 3, 250, 41, 99, 12, 180, 5, 64, 33, 201, 8]


def load(path: Path, **config) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, **config)


def assert_matches_transformers(path: Path) -> None:
    """Every prompt token's log-prob, and the greedy continuation's, as transformers gives them
    (float32 on both sides: a wrong weight or rotation is far outside the tolerance)."""
    out = load(path).generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = PROMPT + list(completion.token_ids)
    with torch.no_grad():
        truth = torch.log_softmax(load_hf_model(path)(torch.tensor([ids])).logits[0], dim=-1)
    assert list(completion.token_ids) == truth[len(PROMPT) - 1:-1].argmax(-1).tolist()
    got = [lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:] + completion.logprobs)]
    want = [truth[i, t].item() for i, t in enumerate(ids[1:])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_a_sharded_checkpoint_loads_the_files_its_index_names(tmp_path: Path) -> None:
    """A safetensors file beside the shards that the index does not name (Mistral's repositories
    ship ``consolidated.safetensors`` so) is not part of the model for transformers or vLLM;
    kvscope loaded every file it found, and refused the checkpoint for tensors that "appear twice"."""
    load_hf_model(tiny_checkpoint("llama")).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    stray = make_tiny_checkpoint(tmp_path / "other", "llama", seed=1) / "model.safetensors"
    shutil.copy(stray, tmp_path / "consolidated.safetensors")
    assert_matches_transformers(tmp_path)


def test_a_config_naming_no_architecture_runs_as_its_model_type(tmp_path: Path) -> None:
    shutil.copytree(tiny_checkpoint("qwen2"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_matches_transformers(tmp_path)


def test_rotary_tables_a_training_framework_saved_are_ignored(tmp_path: Path) -> None:
    """ColossalAI-trained Llamas carry each layer's ``rotary_emb.cos_cached`` / ``sin_cached``
    buffers; transformers and vLLM skip them, kvscope refused them as unexpected tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_checkpoint("llama"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(TINY["num_hidden_layers"]):
        for table in ("cos_cached", "sin_cached"):
            tensors[f"model.layers.{layer}.self_attn.rotary_emb.{table}"] = torch.zeros(1, 1, 64, 16)
    save_file(tensors, tmp_path / "model.safetensors")
    assert_matches_transformers(tmp_path)


def test_a_shard_its_index_names_but_the_directory_lacks_is_named(tmp_path: Path) -> None:
    load_hf_model(tiny_checkpoint("llama")).save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointMismatchError, match=rf"names 1 file\(s\) that .* lacks: {shard.name}$"):
        load(tmp_path)


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


def test_an_architecture_kvscope_does_not_run_is_refused_by_name_on_a_family_it_runs(tmp_path: Path) -> None:
    """A Llama reward model (``LlamaForSequenceClassification``, model_type ``llama``) was taken
    for a ``LlamaForCausalLM`` by its model_type, built, and refused for a tensor, ``score.weight``."""
    import transformers

    architecture = "LlamaForSequenceClassification"
    config = transformers.LlamaConfig(**TINY, pad_token_id=2, architectures=[architecture])
    getattr(transformers, architecture)(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^unsupported model \(architectures=\['{architecture}'\]"):
        load(tmp_path)


def test_query_heads_the_kv_heads_do_not_divide_are_refused_at_load(tmp_path: Path) -> None:
    """transformers cannot run such a model either; kvscope built it, warmed it up and raised
    only from the attention of every step."""
    path = make_tiny_checkpoint(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=3, head_dim=16)
    with pytest.raises(ValueError, match=r"^num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        load(path)


def fp8_checkpoint(path: Path) -> Path:
    """A Qwen3 checkpoint laid out as its FP8 releases are: e4m3 projection weights, each with a
    ``weight_scale_inv`` per 128x128 block, and the config's ``quantization_config`` saying so."""
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(path, "qwen3")
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        rows, cols = tensors[name].shape
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        tensors[f"{name}_scale_inv"] = torch.ones(-(-rows // 128), -(-cols // 128))
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                         weight_block_size=[128, 128])
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_quantized_checkpoint_is_refused_by_its_quantization(tmp_path: Path) -> None:
    """The model was built in full and then refused for a tensor it has no parameter for
    (``...weight_scale_inv``), never naming the quantization."""
    with pytest.raises(NotImplementedError, match=r"^quantization_config \(quant_method='fp8'\) is not supported"):
        load(fp8_checkpoint(tmp_path))


def test_an_unsupported_rope_is_refused_before_tensor_parallel_workers_start(tmp_path: Path) -> None:
    """Only the model's build read the RoPE settings, so under tensor parallelism a YaRN
    checkpoint started the workers and came back as a worker's traceback."""
    yarn = dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64)
    path = make_tiny_checkpoint(tmp_path, "llama", rope_scaling=yarn)
    with pytest.raises(NotImplementedError, match=r"^rope_type 'yarn' is not supported"):
        load(path, tensor_parallel_size=2)


def test_a_checkpoint_without_safetensors_is_refused_before_tensor_parallel_workers_start(tmp_path: Path) -> None:
    """kvscope reads safetensors only: a checkpoint saved as ``pytorch_model.bin`` is refused by
    name in the caller's process. Only the weights' load looked, so under tensor parallelism the
    workers started first and the refusal came back as a worker's traceback."""
    from safetensors.torch import load_file

    path = tmp_path / "bin"
    shutil.copytree(tiny_checkpoint("llama"), path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"^no \*\.safetensors files in {path}"):
        load(path, tensor_parallel_size=2)
