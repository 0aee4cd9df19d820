"""Model construction: pick the architecture spec for a Hugging Face config and build it.

Weights are loaded separately by :func:`kvscope.models.loader.load_weights`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from kvscope.models.decoder import ArchSpec, DecoderForCausalLM
from kvscope.models.llama import LLAMA
from kvscope.models.qwen2 import QWEN2
from kvscope.models.qwen3 import QWEN3

SPECS: tuple[ArchSpec, ...] = (QWEN3, QWEN2, LLAMA)
SUPPORTED_ARCHITECTURES = tuple(s.architecture for s in SPECS)


def spec_for(hf_config: Any) -> ArchSpec:
    """The spec of the first of ``architectures`` kvscope runs (vLLM's order); by ``model_type``
    only when the config names none. A config naming only other classes is another model over
    the family's layers (a ``LlamaForSequenceClassification`` reward model), not the causal LM."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    by_architecture = {spec.architecture: spec for spec in SPECS}
    for arch in archs:
        if arch in by_architecture:
            return by_architecture[arch]
    for spec in SPECS:
        if not archs and model_type == spec.model_type:
            return spec
    raise ValueError(f"unsupported model (architectures={archs}, model_type={model_type!r}); "
                     f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(hf_config: Any, *, dtype: torch.dtype,
                device: torch.device | str) -> DecoderForCausalLM:
    """Build the (uninitialised) model for this TP rank directly on ``device`` in ``dtype``.

    Parameters are allocated once, where they will live; fill them with ``load_weights``.
    The RoPE table stays float32.
    """
    spec = spec_for(hf_config)
    with torch.device(device), _default_dtype(dtype):
        model = DecoderForCausalLM(hf_config, spec)
    return model.eval()
