"""Llama 2/3.x: biases per ``attention_bias`` / ``mlp_bias``; Llama 3 RoPE scaling via the config."""
from kvscope.models.decoder import ArchSpec

LLAMA = ArchSpec(architecture="LlamaForCausalLM", model_type="llama")
