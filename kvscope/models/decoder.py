"""One pre-norm decoder-only transformer for every supported family.

Llama, Qwen2 and Qwen3 differ only in a few switches (biases, per-head q/k norm, RoPE
scaling), captured by :class:`ArchSpec`; everything else, including parameter names that
mirror the Hugging Face checkpoints, is shared. Module layout:

``model.embed_tokens`` -> ``model.layers[i].{input_layernorm, self_attn, post_attention_layernorm,
mlp}`` -> ``model.norm`` -> ``lm_head``, with ``self_attn.qkv_proj`` packing q/k/v and
``mlp.gate_up_proj`` packing gate/up (see ``packed_modules_mapping``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvscope.distributed.parallel_state import get_tp_size
from kvscope.layers.activation import SiluAndMul
from kvscope.layers.attention import Attention
from kvscope.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvscope.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvscope.layers.norm import RMSNorm
from kvscope.layers.rotary import RotaryEmbedding, rope_config_from_hf, rotate_qk


@dataclass(frozen=True)
class ArchSpec:
    """What sets one checkpoint family apart from the generic decoder."""

    architecture: str             # HF class name in ``config.architectures``
    model_type: str               # HF ``config.model_type``
    qk_norm: bool = False         # per-head RMSNorm on q and k before RoPE (Qwen3)
    qkv_bias: bool | None = None  # None: follow ``config.attention_bias``
    o_bias: bool | None = None    # None: follow ``config.attention_bias``


def head_dim_of(config: Any) -> int:
    """Explicit ``head_dim`` when the config has one (Qwen3 decouples it), else hidden/heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_supported(config: Any, tp: int | None = None) -> None:
    """Refuse configs this decoder would silently compute wrongly, or could not shard over
    ``tp`` ranks (default: this process's tensor-parallel group).

    ``LLM`` calls it before any weight loads or worker starts, so it refuses everything the
    build would: the architecture first (another family's config may lack the fields read
    below), then the RoPE settings, which only the build read before, and a quantization,
    which the loader would refuse only for a tensor that names no parameter.
    """
    from kvscope.models import spec_for  # (the package imports this module)

    spec_for(config)
    rope_config_from_hf(config)
    _refuse_quantized(config)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported (only 'silu')")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(f"only full attention is supported, got layer_types={layer_types}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:  # (each KV head serves a whole group of query heads)
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    tp = get_tp_size() if tp is None else tp
    fields = ("num_attention_heads", "num_key_value_heads", "intermediate_size")  # the vocabulary is padded
    bad = [f"{f}={getattr(config, f)}" for f in fields if getattr(config, f) % tp]
    if bad:
        raise ValueError(f"tensor_parallel_size={tp} cannot shard this model: "
                         f"{', '.join(bad)} not divisible by {tp}")


def _refuse_quantized(config: Any) -> None:
    """A quantized checkpoint's scales and packed weights are tensors no layer here holds."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    raise NotImplementedError(f"quantization_config (quant_method={method!r}) is not supported: "
                              "kvscope runs unquantized float32 / float16 / bfloat16 checkpoints")


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec) -> None:
        super().__init__()
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias if spec.qkv_bias is None else spec.qkv_bias
        o_bias = attention_bias if spec.o_bias is None else spec.o_bias
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=o_bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qk, v = self.qkv_proj.split_qk_v(self.qkv_proj(hidden))
        store = self.attn.kv_write(v)
        q, k = rotate_qk(qk, self.num_heads, cos, sin, self.q_norm, self.k_norm, store)
        return self.o_proj(self.attn(q, k, v, kv_stored=store is not None))


class DecoderMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, spec)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_config_from_hf(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rotary_emb(positions, hidden)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """The model API the runner uses: ``forward`` for hidden states, ``compute_logits`` for the
    rows that are sampled."""

    # checkpoint projection name -> (packed parameter module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, spec: ArchSpec) -> None:
        super().__init__()
        check_supported(config)
        self.config, self.spec = config, spec
        self.model = DecoderModel(config, spec)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``positions``: int64 ``[T]`` packed tokens -> hidden ``[T, H]``."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[n, vocab]`` in the model's dtype on TP rank 0 (``None`` on other ranks)."""
        return self.lm_head(hidden)
