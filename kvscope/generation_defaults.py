"""A model's own default sampling parameters, read as vLLM reads them (``generation_config``).

A checkpoint's ``generation_config.json`` may set the sampling its authors recommend (Qwen3's
temperature 0.6, top-k 20 and top-p 0.95). vLLM applies them to prompts given no
``SamplingParams``, and so does kvscope; ``generation_config="vllm"`` ignores them, and a
directory reads them from there instead of the model's.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from kvscope.sampling_params import SamplingParams

# generation_config.json's keys that set sampling, and their SamplingParams names (vLLM's list)
SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_defaults(generation_config: str, model_dir: str) -> dict[str, Any]:
    """The ``SamplingParams`` keywords the generation config sets (none for ``"vllm"``, or for a
    model without the file), checked as ``SamplingParams`` checks them."""
    from transformers import GenerationConfig

    if generation_config == "vllm":
        return {}
    directory = Path(model_dir if generation_config == "auto" else generation_config)
    if not (directory / "generation_config.json").is_file():
        if generation_config == "auto":
            return {}
        raise FileNotFoundError(f"generation_config={generation_config!r} has no generation_config.json")
    try:
        set_there = GenerationConfig.from_pretrained(directory).to_diff_dict()
    except (OSError, ValueError) as exc:  # (transformers' error for a file it cannot read)
        if generation_config != "auto":
            raise ValueError(f"generation_config={generation_config!r}: {exc}") from exc
        # The model loaded before this file was read for defaults (as vLLM, which then uses its own).
        warnings.warn(f"{directory / 'generation_config.json'} could not be read ({exc}); prompts without "
                      "SamplingParams sample with SamplingParams()", stacklevel=3)
        return {}
    defaults = {name: set_there[key] for key, name in SAMPLING_KEYS.items() if set_there.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{directory / 'generation_config.json'} sets sampling defaults kvscope cannot use: {exc}. "
                         "Pass generation_config='vllm' to ignore them") from exc
    return defaults
