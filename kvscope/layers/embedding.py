"""Vocabulary-parallel token embedding and LM head.

Each rank owns a contiguous range of ``vocab_size / tp`` rows. The embedding looks up the ids
that fall in its range, zeros the rest, and all-reduces; the LM head computes logits for its
range and gathers them on rank 0, which is the only rank that samples.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.distributed.parallel_state import (
    get_tp_rank, get_tp_size, tp_all_reduce, tp_gather_to_rank0,
)
from kvscope.layers.sharding import WeightSource, copy_checked, divide, read_shard, source_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.local_vocab = divide(vocab_size, self.tp_size, "vocab_size")
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
        copy_checked(param.data, read_shard(src, 0, self.vocab_start, self.local_vocab))

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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary float32 logits on TP rank 0; ``None`` on the other ranks."""
        logits = tp_gather_to_rank0(F.linear(hidden, self.weight), dim=-1)
        return None if logits is None else logits.float()
