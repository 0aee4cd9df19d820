"""A model's generation_config.json sampling defaults, applied as vLLM applies them to prompts
given no ``SamplingParams`` (``generation_config``: "auto", "vllm" or a directory)."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from engine_helpers import drain, greedy, token_ids
from kvscope import LLM, SamplingParams
from tiny_models import tiny_checkpoint

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


def checkpoint_with(path, **generation) -> str:
    """A copy of the tiny qwen3 checkpoint whose generation_config.json also sets ``generation``."""
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **generation}))
    return str(path)


def make(path, **config) -> LLM:
    return LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=32, **config)


def test_prompts_without_sampling_params_sample_with_the_model_s_defaults(tmp_path):
    from transformers import GenerationConfig

    path = checkpoint_with(tmp_path / "m", temperature=0.0, max_new_tokens=5, top_k=7, top_p=0.9, min_p=0.05)
    llm = make(path)
    truth = GenerationConfig.from_pretrained(path)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (truth.temperature, truth.max_new_tokens)
    # (greedy: as vLLM's, the params read back the top-p, top-k and min-p that disable them)
    assert (defaults.top_k, defaults.top_p, defaults.min_p) == (0, 1.0, 0.0)
    by_default = llm.generate(PROMPTS, use_tqdm=False)
    assert token_ids(by_default) == token_ids(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5),
                                                           use_tqdm=False))
    assert [len(t) for t in token_ids(by_default)] == [5, 5]  # (SamplingParams() would give 16)
    added = llm.add_request(PROMPTS[0])
    assert drain(llm)[added].outputs[0].token_ids == token_ids(by_default)[0]
    chatted = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0]
    assert len(chatted.outputs[0].token_ids) == 5


def test_generation_config_vllm_ignores_them_and_a_directory_replaces_them(tmp_path):
    path = checkpoint_with(tmp_path / "m", temperature=0.0, max_new_tokens=5)
    assert make(path, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    sampling = {"temperature": 0.3, "top_k": 7, "top_p": 0.9, "min_p": 0.05}
    (other / "generation_config.json").write_text(json.dumps({**sampling, "max_new_tokens": 3}))
    defaults = make(path, generation_config=str(other)).get_default_sampling_params()
    assert defaults == SamplingParams(max_tokens=3, **sampling)
    plain = make(str(tiny_checkpoint("qwen3"))).get_default_sampling_params()
    assert plain == SamplingParams()  # (the file sets no sampling)
    assert token_ids(make(path, generation_config="vllm").generate(PROMPTS, use_tqdm=False)) != \
        token_ids(make(path).generate(PROMPTS, use_tqdm=False))


def test_a_repetition_penalty_there_is_applied(tmp_path):
    path = checkpoint_with(tmp_path / "m", temperature=0.0, max_new_tokens=6, repetition_penalty=1.9)
    llm = make(path)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.9)
    assert token_ids(llm.generate(PROMPTS, use_tqdm=False)) == token_ids(llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.9), use_tqdm=False))


@pytest.mark.parametrize("generation, config, error, named", [
    ({"top_p": 0.0}, {}, ValueError, r"generation_config.json sets sampling defaults.*top_p.*generation_config='vllm'"),
    ({"temperature": -1.0}, {}, ValueError, r"generation_config.json sets sampling defaults.*temperature"),
    ({}, {"generation_config": "nowhere"}, ValueError, "generation_config must be 'auto'"),
    ({}, {"generation_config": 3}, ValueError, "generation_config must be 'auto'"),
])
def test_bad_generation_configs_are_refused_by_name(tmp_path, generation, config, error, named):
    with pytest.raises(error, match=named):
        make(checkpoint_with(tmp_path / "m", **generation), **config)
    assert make(checkpoint_with(tmp_path / "ok", **generation), generation_config="vllm").generate(
        PROMPTS, greedy(2), use_tqdm=False)


def test_a_directory_without_the_file_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no generation_config.json"):
        make(checkpoint_with(tmp_path / "m"), generation_config=str(empty))


def test_defaults_are_a_fresh_object_a_caller_may_change(tmp_path):
    llm = make(checkpoint_with(tmp_path / "m", temperature=0.0, max_new_tokens=3))
    mine = llm.get_default_sampling_params()
    mine.max_tokens = 1
    assert llm.get_default_sampling_params().max_tokens == 3
    assert [len(t) for t in token_ids(llm.generate(PROMPTS, dataclasses.replace(mine), use_tqdm=False))] == [1, 1]


def test_an_unreadable_generation_config_is_named_in_a_warning_and_the_model_still_loads(tmp_path):
    path = checkpoint_with(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text("{ not json")
    with pytest.warns(UserWarning, match="generation_config.json could not be read"):
        llm = make(path)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert len(token_ids(llm.generate(PROMPTS, greedy(2), use_tqdm=False))[0]) == 2
    with pytest.raises(ValueError, match="generation_config="):
        make(path, generation_config=str(tmp_path / "m"))
