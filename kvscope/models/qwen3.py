"""Qwen3 dense: per-head RMSNorm on q and k, explicit ``head_dim``, biases per ``attention_bias``."""
from kvscope.models.decoder import ArchSpec

QWEN3 = ArchSpec(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True)
