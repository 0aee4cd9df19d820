"""Tiny random Hugging Face checkpoints (and a matching tokenizer) for tests, built offline.

``make_tiny_checkpoint(dir, arch=...)`` writes a loadable model directory: ``config.json``,
fp32 ``model.safetensors`` and a byte-level BPE tokenizer whose vocabulary covers exactly the
model's ``vocab_size``, so ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(dir)``
and kvscope all load it without network access. ``tiny_checkpoint(...)`` memoises one per
argument set for the whole test session.

Weights are re-drawn (seeded) with a larger scale than HF's init, and norms and biases are
randomised too, so that a wrong bias, norm or rotary term visibly changes the logits.

``pack_metadata`` is a minimal reference "runner": it builds the AttentionMetadata for a step
from per-sequence (already cached, new tokens, block table) triples.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvscope.kernels.base import AttentionMetadata

if TYPE_CHECKING:  # at run time transformers is imported inside the helpers that need it:
    import transformers  # it costs seconds, and pack_metadata users should not pay for it

ARCHS = ("qwen3", "qwen2", "llama")

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=320, max_position_embeddings=512, rms_norm_eps=1e-6,
)
EOS, BOS, PAD = "<|endoftext|>", "<|bos|>", "<|pad|>"
EOS_ID, BOS_ID, PAD_ID = 0, 1, 2  # special tokens come first in the trained vocabulary

# arch -> (HF config class name, HF model class name, config fields beyond TINY)
_ARCH = {
    # Qwen3 decouples head_dim from hidden/heads; use that (32 != 64 / 4).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),
    # Llama 3.1-style RoPE scaling with a short original context so every band is exercised
    # (for head_dim 16, theta 1e4: wavelengths 6 .. 2e4 around thresholds 16 and 64).
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    )),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill.
A paged key value cache stores attention keys and values in fixed size blocks of tokens.
Every sequence owns a block table that maps logical positions to physical blocks in memory.
The scheduler decides which requests run in each step and how many tokens each may compute.
Prefix caching lets two prompts that start with the same words share their first blocks.
When memory runs out the engine preempts a request, frees its blocks, and recomputes later.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in text, as do symbols: ()[]{}!?.,;
Ünïcödé, naïve café, 日本語のテキスト, emoji 🙂 and other multi-byte characters matter too.
"""


def tiny_config(arch: str = "qwen3", tie: bool = False,
                **overrides: Any) -> transformers.PretrainedConfig:
    """The HF config of a tiny model; ``overrides`` replace any field (e.g. ``vocab_size``)."""
    if arch not in _ARCH:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    import transformers

    config_cls, model_cls, extra = _ARCH[arch]
    fields = {**TINY, **extra, **overrides}
    return getattr(transformers, config_cls)(
        **fields, tie_word_embeddings=tie, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, architectures=[model_cls],
    )


def make_tiny_tokenizer(
        vocab_size: int = TINY["vocab_size"]) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids: specials 0-2, the 256 byte
    symbols, merges learned from a fixed corpus, and ``<|extra_i|>`` fillers if needed."""
    import transformers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, BOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer")
    fillers = [f"<|extra_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_special_tokens(fillers)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=BOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == vocab_size and fast.eos_token_id == EOS_ID and fast.bos_token_id == BOS_ID
    return fast


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif p.ndim == 1:  # RMSNorm gains
            p.copy_(1.0 + 0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(noise * p.shape[1] ** -0.5)


def make_tiny_checkpoint(path: str | Path, arch: str = "qwen3", tie: bool = False,
                         seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random fp32 checkpoint + tokenizer of ``arch`` into ``path``; return it."""
    import transformers

    path = Path(path)
    config = tiny_config(arch, tie, **overrides)
    model = getattr(transformers, _ARCH[arch][1])(config).float()
    _randomise(model, seed)
    model.save_pretrained(path)
    make_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


_CACHE: dict[tuple, Path] = {}
_ROOT: Path | None = None


def tiny_checkpoint(arch: str = "qwen3", tie: bool = False, seed: int = 0,
                    **overrides: Any) -> Path:
    """Like ``make_tiny_checkpoint`` but built once per process and argument set (in a temp
    dir removed at exit). Treat the directory as read-only."""
    global _ROOT
    key = (arch, tie, seed, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        if _ROOT is None:
            _ROOT = Path(tempfile.mkdtemp(prefix="kvscope-tiny-"))
            atexit.register(shutil.rmtree, _ROOT, True)
        _CACHE[key] = make_tiny_checkpoint(_ROOT / f"ckpt{len(_CACHE)}-{arch}", arch, tie, seed,
                                           **overrides)
    return _CACHE[key]


def load_hf_model(path: str | Path) -> torch.nn.Module:
    """The transformers reference model for a checkpoint: fp32, eager attention, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.float().eval()


def pack_metadata(seqs: Sequence[tuple[int, int, Sequence[int] | None]], block_size: int,
                  device: str | torch.device = "cpu") -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and packed positions for one step.

    Each entry is ``(start, num_new_tokens, block_table)``: the sequence already has ``start``
    tokens in the cache and computes positions ``start .. start+num_new_tokens-1`` now. A
    ``None`` table means "no KV pool" (warm-up style: every ``start`` must be 0 and the slots
    are -1).
    """
    positions, slots, cu_q, cu_k, lens, tables = [], [], [0], [0], [], []
    for start, n, table in seqs:
        length = start + n
        positions.extend(range(start, length))
        if table is None:
            if start:
                raise ValueError("a sequence with a cached prefix needs a block table")
            slots.extend([-1] * n)
            tables.append([])
        else:
            if len(table) * block_size < length:
                raise ValueError(f"block table {table} too short for {length} tokens")
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, length))
            tables.append(list(table))
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + length)
        lens.append(length)
    width = max((len(t) for t in tables), default=0)
    padded = [t + [-1] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(seqs), width),
        max_seqlen_q=max(n for _, n, _ in seqs),
        max_seqlen_k=max(lens),
        num_seqs=len(seqs),
        num_tokens=len(positions),
        block_size=block_size,
        decode_only=all(n == 1 for _, n, _ in seqs),
        no_prefix=all(start == 0 for start, _, _ in seqs),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
