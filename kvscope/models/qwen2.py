"""Qwen2 / Qwen2.5: q/k/v projections always carry a bias, the output projection never does."""
from kvscope.models.decoder import ArchSpec

QWEN2 = ArchSpec(architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True, o_bias=False)
