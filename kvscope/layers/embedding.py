"""Vocabulary-parallel token embedding and LM head.

Each rank owns a contiguous range of ``padded_vocab / tp`` rows, where ``padded_vocab`` is the
vocabulary rounded up to a multiple of the TP size (as vLLM pads it), so a vocabulary the rank
count does not divide still shards. The padding rows are zero and never looked up (prompt ids
are checked against the real vocabulary). The embedding looks up the ids that fall in its
range, zeros the rest, and all-reduces; the LM head computes logits for its range and gathers
them on rank 0, which is the only rank that samples, and cuts the padding columns off there,
so a padded id can be neither sampled nor reported in logprobs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.distributed.parallel_state import (
    get_tp_rank, get_tp_size, tp_all_reduce, tp_gather_to_rank0,
)
from kvscope.layers.sharding import WeightSource, copy_checked, pad_vocab_size, read_shard, source_shape
from kvscope.layers.weight_layout import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.local_vocab = pad_vocab_size(vocab_size, self.tp_size) // self.tp_size
        self.vocab_start = self.tp_rank * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src: WeightSource,
                      shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"embedding takes no shard id, got {shard_id!r}")
        rows = source_shape(src)[0]
        if rows != self.vocab_size:
            raise ValueError(f"checkpoint has {rows} vocabulary rows, expected {self.vocab_size}")
        real = max(0, min(self.local_vocab, self.vocab_size - self.vocab_start))  # rows before the padding
        if real:
            copy_checked(param.data[:real], read_shard(src, 0, self.vocab_start, real))
        param.data[real:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits. Share the embedding's ``weight`` to tie them."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.packed_weight: torch.Tensor | None = None  # set on a CPU (layers/weight_layout.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits in the weights' dtype on TP rank 0 (padding cut off); ``None`` on
        the other ranks. The sampler reads them as they are: a float32 copy of ``[rows, vocab]``
        would cost a pass over memory the fused sampling kernel does not need."""
        logits = tp_gather_to_rank0(linear(hidden, self.weight, None, self.packed_weight), dim=-1)
        if logits is None:
            return None
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size].contiguous()
        return logits
