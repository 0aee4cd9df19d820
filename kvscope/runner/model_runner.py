"""Runs the model for one scheduled step: pack inputs, publish attention metadata, forward, sample.

The runner owns the KV pool (one tensor ``[2, L, N, block_size, H_kv, D]`` per rank), the
attention backend and the decode CUDA graphs. It consumes integer block ids from the
scheduler and never decides anything.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from kvscope.config import EngineConfig
from kvscope.distributed.parallel_state import tp_all_reduce, tp_broadcast_from_rank0
from kvscope.engine.executor import DoneStep, StepHandle, StepResult
from kvscope.engine.scheduler_output import (
    PLACEHOLDER, DecodeRows, ScheduledRequest, SchedulerOutput, TokenHistory,
)
from kvscope.forward_context import forward_context
from kvscope.kernels.base import AttentionMetadata
from kvscope.kernels.select import select_backend
from kvscope.layers.attention import Attention
from kvscope.layers.weight_layout import pack_cpu_weights
from kvscope.models import build_model
from kvscope.models.decoder import head_dim_of
from kvscope.models.loader import load_weights
from kvscope.runner import cuda_graphs
from kvscope.runner.cuda_graphs import DecodeGraphs
from kvscope.runner.inputs import BlockTables, StepInputs, build_step_inputs
from kvscope.runner.packed_inputs import DeviceInputs, PackedLayout, pack, views
from kvscope.runner.prompt_logprobs import PromptLogprobs, prompt_positions
from kvscope.runner.sampler import DeviceSample, Sampler
from kvscope.runner.token_counts import Histories, histories_of
from kvscope.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FALLBACK = SamplingParams(temperature=0)  # stands in for a row whose own parameters fail
INITIAL_ROWS = 256  # the host arrays' rows at start (they grow with the requests held)


def resolve_device(config: EngineConfig) -> torch.device:
    """The device to run on, with an explicit index for CUDA (graphs and set_device need one)."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} but CUDA is not available on this machine")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(config: EngineConfig, hf_config: Any, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (exact, and fast enough there); the checkpoint's half type on GPU."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: the model's ``dtype``, or e4m3 for ``kv_cache_dtype="fp8"``/``"fp8_e4m3"``."""
    return dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn


CPU_THREAD_HIDDEN = 128  # auto cpu_threads: one intra-op thread per this much hidden size


def resolve_cpu_threads(config: EngineConfig, hf_config: Any) -> int:
    """Intra-op threads for CPU steps: torch's setting (the physical cores), but no more than
    one per ``CPU_THREAD_HIDDEN`` of hidden size, since a small model's matmuls split further
    cost more in synchronisation than they gain (README, ``cpu_threads``)."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    return max(1, min(torch.get_num_threads(), hf_config.hidden_size // CPU_THREAD_HIDDEN))


def kv_geometry(hf_config: Any, tp_size: int) -> tuple[int, int, int]:
    """(layers, KV heads per rank, head_dim) of the pool."""
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return hf_config.num_hidden_layers, kv_heads // tp_size, head_dim_of(hf_config)


def kv_block_bytes(hf_config: Any, tp_size: int, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one KV block on one rank: K and V of every layer."""
    layers, kv_heads, head_dim = kv_geometry(hf_config, tp_size)
    return 2 * layers * block_size * kv_heads * head_dim * kv_dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        model_dir: str,
        max_model_len: int,
        rank: int = 0,
        tp_size: int = 1,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.rank = rank
        self.tp_size = tp_size
        self.max_model_len = max_model_len
        self.device = device if device is not None else resolve_device(config)
        self.dtype = resolve_dtype(config, hf_config, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config, self.dtype)
        self.block_size = config.block_size
        self.vocab_size = hf_config.vocab_size
        # The most sequences one step schedules (each has at least one token): what the start-up
        # warm-ups are run for. Both bounds may be far above anything held ("no limit"): the
        # host arrays per request or row start small and grow with what the steps hold.
        self.max_rows = min(config.max_num_seqs, config.max_num_batched_tokens)
        rows = min(self.max_rows, INITIAL_ROWS)
        self.cpu_threads = resolve_cpu_threads(config, hf_config) if self.device.type == "cpu" else None
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            gc.collect()  # an earlier engine nobody holds may still pin its KV pool in a reference cycle
            torch.cuda.empty_cache()
        self.model = build_model(hf_config, dtype=self.dtype, device=self.device)
        load_weights(self.model, model_dir)
        if self.device.type == "cpu":
            pack_cpu_weights(self.model)
        self.model.eval()
        self.backend = select_backend(config.attention_backend, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.sampler = Sampler(config.seed, self.device)
        self.num_kv_blocks = self._size_pool(tp_size)
        if tp_size > 1:  # the ranks share one block-id space: all take the smallest pool
            blocks = torch.tensor([self.num_kv_blocks], dtype=torch.int64, device=self.device)
            self.num_kv_blocks = int(tp_all_reduce(blocks, op=dist.ReduceOp.MIN).item())
        self._allocate_pool(tp_size)
        if self.device.type == "cuda":
            self._compile_step_kinds()
        for layer in self.attn_layers:  # (after the dummy steps: the scales come from the first real prefill)
            layer.calculate_kv_scales = config.calculate_kv_scales
        self.graphs: DecodeGraphs | None = None
        # Two pinned staging buffers, alternating: filling one never waits on the copy in flight.
        self._staging: list[tuple[torch.Tensor, np.ndarray] | None] = [None, None]
        self._upload_done = [torch.cuda.Event(), torch.cuda.Event()] if self.device.type == "cuda" else None
        self._uploads = 0
        self.block_tables = BlockTables(capacity=rows)
        # The last step's sampled tokens on the device, and (per BlockTables row) each sampling
        # sequence's row in them, -1 for the others: async scheduling's placeholder tokens are
        # read from there.
        self._last_sample: torch.Tensor | None = None
        self._sample_row = np.full(rows, -1, dtype=np.int64)
        self._sampled_rows: np.ndarray | None = None  # the table_rows the last step sampled, all of them
        # The sampling parameters of the rows array they were built for (a launch that failed
        # after building them left _sampled_rows as it was: they belong together only by identity).
        self._sampled_params: tuple[np.ndarray, list[SamplingParams]] | None = None
        self._row_numbers = np.arange(rows)
        # The last step's table rows and starts, when it ran a decode graph: a steady step
        # after it moves that graph's inputs on (_advance).
        self._graph_step: tuple[np.ndarray, np.ndarray] | None = None
        # Tensor parallelism with async scheduling: rank 0 broadcasts each step's sampled tokens
        # on the device, so every rank fills the next step's placeholders without a readback.
        self.share_sampled = config.async_scheduling and tp_size > 1
        if self.device.type == "cuda" and not config.enforce_eager:
            # One rank samples: with tensor parallelism the draw stays out of the graphs.
            head = None
            if tp_size == 1 and self.sampler.kernels is not None and cuda_graphs.CAPTURE_DRAW:
                self.sampler.enable_captured_draws(min(self.max_rows, cuda_graphs.BUCKETS[-1]))
                head = self._head
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    self._forward, hf_config.hidden_size, self.max_rows,
                    -(-max_model_len // self.block_size), max_model_len, self.block_size,
                    self.dtype, self.device, head,
                )

    # ------------------------------------------------------------- KV pool
    def _size_pool(self, tp_size: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        block_bytes = kv_block_bytes(self.hf_config, tp_size, self.block_size, self.kv_cache_dtype)
        budget = self.config.kv_cache_budget(self.device.type == "cuda")
        if budget is not None:
            return max(1, budget // block_bytes)
        try:
            self._warm_up()
            short = None
        except (torch.OutOfMemoryError, MemoryError) as e:  # (host arrays of an absurd step, too)
            short = str(e).splitlines()[0]  # (not the error: its frames hold the step's tensors)
        if short is not None:
            torch.cuda.empty_cache()
            c = self.config
            raise ValueError(
                f"the largest step max_num_batched_tokens={c.max_num_batched_tokens} and max_num_seqs="
                f"{c.max_num_seqs} allow (its forward and the sampler on {self.max_rows} rows) does not fit in "
                f"{self.device}'s memory beside the weights, before any KV cache; lower them ({short})")
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        # Budget this process's own peak (weights + activations), not other processes' memory,
        # but never ask for more than is free now.
        budget = int(total * self.config.gpu_memory_utilization) - peak
        budget = min(budget, free - (peak - current) - (256 << 20))
        if budget < block_bytes:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}, model peak {peak / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB); raise gpu_memory_utilization or use a smaller model"
            )
        return budget // block_bytes

    def _warm_up(self) -> None:
        """One forward of the largest step, then the head and the sampler's most costly path on
        the most rows a step samples, so the KV pool is sized after activations and sampling
        peak (as vLLM's profile run does with its dummy sampler pass)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        n_tok = min(self.config.max_num_batched_tokens, self.max_model_len * self.config.max_num_seqs)
        n_seq = max(1, min(self.config.max_num_seqs, n_tok // self.max_model_len or 1))
        lens = np.full(n_seq, n_tok // n_seq, dtype=np.int64)
        lens[: n_tok - int(lens.sum())] += 1
        self._dummy_step(lens, lens)
        self._dummy_sampling()
        torch.cuda.synchronize(self.device)

    def _dummy_sampling(self) -> None:
        """Penalties, min-p, top-k, top-p and as many log-probs as a request may ask for
        (``max_logprobs``) on every row a step can sample: float32 copies, masks, a softmax and a
        sort of ``[rows, vocab]``, and the penalties' token counts of as many sequences. A
        sampler of its own draws, so the engine's random streams are untouched."""
        rows = self.max_rows
        hidden = self._dummy_hidden()
        cap = self.config.max_logprobs
        logprobs = self.vocab_size if cap == -1 else min(cap, self.vocab_size)
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=logprobs,
                                presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
        one_token = TokenHistory([0], 1)

        def history_of(which: list[int]) -> Histories:
            return Histories(which, [one_token] * len(which), [], None)

        with torch.inference_mode():
            logits = self.model.compute_logits(hidden)
            if logits is not None:  # (tensor parallelism: rank 0 samples)
                Sampler(self.config.seed, self.device).sample(logits, [params] * rows, list(range(rows)),
                                                              history_of=history_of)

    def _compile_step_kinds(self) -> None:
        """A short and the longest fresh prefill (the kernels pick tiles by prompt length) and a
        mixed step (a decode row beside a chunk after a cached prefix) run once on the pool,
        writing nothing, so the attention kernel variants of those steps compile at start-up
        rather than inside the first run that has them (the decode graphs compile theirs when
        captured), and so do the sampling kernels'."""
        for n in sorted({2, min(self.config.max_num_batched_tokens, self.max_model_len)}):
            self._dummy_step(np.array([n]), np.array([n]))
        self._dummy_step(np.array([1, 2]), np.array([2, 3]))
        self._warm_head()
        self.sampler.compile_kernels(self.vocab_size, self.dtype)
        torch.cuda.synchronize(self.device)

    def _warm_head(self) -> None:
        """The LM head once at every number of rows a step can sample. Its matmul meets a new
        shape at each: the first call at a shape costs the host far more than later ones, and
        without this the first run pays it on a step of each size, where the device waits."""
        hidden = self._dummy_hidden()
        with torch.inference_mode():
            for rows in range(1, self.max_rows + 1):
                self.model.compute_logits(hidden[:rows])

    def _dummy_hidden(self) -> torch.Tensor:
        """Zero hidden states for the most rows a step samples: the LM head's input at start-up."""
        return torch.zeros(self.max_rows, self.hf_config.hidden_size, dtype=self.dtype,
                           device=self.device)

    def _dummy_step(self, q_lens: np.ndarray, context_lens: np.ndarray) -> None:
        """A forward of sequences with ``q_lens`` new tokens and ``context_lens`` in all, every
        key read from pool block 0 and no slot written."""
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(context_lens)]).astype(np.int32)
        t, width = int(cu_q[-1]), -(-int(context_lens.max()) // self.block_size)
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=self.device),
            cu_seqlens_q=dev(cu_q), cu_seqlens_k=dev(cu_k), context_lens=dev(context_lens.astype(np.int32)),
            block_tables=torch.zeros((len(q_lens), width), dtype=torch.int32, device=self.device),
            max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(context_lens.max()), num_seqs=len(q_lens),
            num_tokens=t, block_size=self.block_size, decode_only=False,
            no_prefix=bool((q_lens == context_lens).all()),
        )
        ids = torch.zeros(t, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), forward_context(meta):
            self.model(ids, ids)

    def _allocate_pool(self, tp_size: int) -> None:
        """The KV pool, in one piece. An allocation the device refuses now (memory taken by
        others, a limit on this process) is reported naming the setting that sized the pool:
        the allocator's own error names none."""
        layers, kv_heads, head_dim = kv_geometry(self.hf_config, tp_size)
        try:
            self.kv_cache = torch.zeros(
                2, layers, self.num_kv_blocks, self.block_size, kv_heads, head_dim,
                dtype=self.kv_cache_dtype, device=self.device,
            )
        except (RuntimeError, MemoryError) as e:
            short = str(e).splitlines()[0] if str(e) else type(e).__name__
            if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and "allocate" not in short:
                raise
            c = self.config
            budget = c.kv_cache_budget(self.device.type == "cuda")
            setting = (f"num_kv_blocks={c.num_kv_blocks}" if c.num_kv_blocks is not None
                       else f"kv_cache_memory_bytes={budget}" if budget is not None
                       else f"gpu_memory_utilization={c.gpu_memory_utilization}")
            need = self.num_kv_blocks * kv_block_bytes(self.hf_config, tp_size, self.block_size, self.kv_cache_dtype)
            raise ValueError(f"{setting} asks for a KV pool of {need / 2**30:.2f} GiB ({self.num_kv_blocks} blocks), "
                             f"which {self.device} could not allocate now; lower {setting.split('=')[0]} "
                             f"({short})") from e
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
            layer.k_scale = torch.ones((), dtype=torch.float32, device=self.device)
            layer.v_scale = torch.ones((), dtype=torch.float32, device=self.device)

    # ---------------------------------------------------------------- step
    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """Run a CPU step on ``cpu_threads`` intra-op threads, restoring the caller's setting."""
        if self.cpu_threads is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(self.cpu_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def _staging_buffer(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]:
        """Host bytes to pack a step's inputs into (as a tensor and as the numpy array that
        views it, both kept), and on CUDA the event to record once they are copied: one of two
        buffers, pinned on CUDA, reused after waiting for the copy that last read it (the step
        before last: long done). On CPU a step's tensors are views of its buffer, and its
        forward pass is over before the next step packs."""
        k = self._uploads % 2
        self._uploads += 1
        staged = self._staging[k]
        if staged is None or staged[0].numel() < nbytes:
            buf = torch.empty(2 * nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            staged = self._staging[k] = (buf, buf.numpy())
        if self._upload_done is None:
            return staged[0], staged[1], None
        self._upload_done[k].synchronize()
        return staged[0], staged[1], self._upload_done[k]

    def _upload(self, x: StepInputs, fill: np.ndarray, src: np.ndarray, layout: PackedLayout,
                into: torch.Tensor | None) -> torch.Tensor:
        """All of a step's integer inputs in one host buffer and one copy to the device: into
        ``into`` (a CUDA graph's input buffer) or a new device buffer. Returns the device bytes."""
        buf, host, copied = self._staging_buffer(layout.nbytes)
        pack(x, fill, src, layout, host)
        flat = buf[: layout.nbytes]  # (on CPU the step's tensors may be views of it)
        if into is not None:
            flat = into[: layout.nbytes].copy_(flat, non_blocking=copied is not None)
        elif copied is not None:
            flat = flat.to(self.device, non_blocking=True)
        self._record(copied)
        return flat

    def _upload_bytes(self, a: np.ndarray, into: torch.Tensor) -> None:
        """``a``'s bytes to the start of the CUDA bytes ``into`` (the rest of ``into`` gets
        whatever the staging buffer holds past them), through a pinned staging buffer."""
        buf, host, copied = self._staging_buffer(into.numel())
        host[: a.nbytes] = a.reshape(-1).view(np.uint8)
        into.copy_(buf[: into.numel()], non_blocking=True)
        self._record(copied)

    def _record(self, copied: torch.cuda.Event | None) -> None:
        if copied is not None:  # (naming the device skips torch's slower search for the current one)
            copied.record(torch.cuda.current_stream(self.device))

    def _first(self, n: int) -> np.ndarray:
        """``np.arange(n)`` as a view of one made once (and grown if a step ever has more rows)."""
        if n > self._row_numbers.size:
            self._row_numbers = np.arange(2 * n)
        return self._row_numbers[:n]

    def _placeholder_sources(self, x: StepInputs) -> tuple[np.ndarray, np.ndarray, bool]:
        """Where the step's placeholder input ids are, each one's row in the last step's sampled
        tokens (the previous launched step sampled every such sequence, in the same BlockTables
        row: a sequence is re-admitted only once no token of it is in flight), and whether the
        step is steady: every input id is a placeholder and the last step sampled these rows in
        this order, so its sampled tokens are the input ids as they stand. A step scheduling the
        same sequences as the last gets the very same ``table_rows`` array from BlockTables, so
        the steady state is known without looking its rows up."""
        fill = np.flatnonzero(x.input_ids == PLACEHOLDER)
        if not fill.size:
            return fill, fill, False
        if x.table_rows is self._sampled_rows and fill.size == x.num_tokens:
            return fill, self._first(fill.size), True
        seq_rows = fill if x.decode_only else np.searchsorted(x.cu_seqlens_q, fill, side="right") - 1
        src = self._sample_row[x.table_rows[seq_rows]]
        if (src < 0).any():
            raise RuntimeError("a placeholder input token was not sampled by the previous step; this is a kvscope bug")
        steady = fill.size == x.num_tokens == self._last_sample.numel() and bool((src == self._first(src.size)).all())
        return fill, src, steady

    def _remember_sampled(self, tokens: torch.Tensor, table_rows: np.ndarray) -> None:
        """This step's sampled tokens on the device, and the sampling sequences' rows in them,
        by BlockTables row: what the next step's placeholders read. The same ``table_rows``
        array as the last step's (the same sequences, all sampled) leaves the rows as they are."""
        self._last_sample = tokens
        if table_rows is self._sampled_rows:
            return
        self._sampled_rows = table_rows
        capacity = self.block_tables.table.shape[0]
        if self._sample_row.size < capacity:
            self._sample_row = np.full(capacity, -1, dtype=np.int64)
        else:
            self._sample_row.fill(-1)
        self._sample_row[table_rows] = self._first(table_rows.size)

    def _metadata(self, x: StepInputs, d: DeviceInputs) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=d.slot_mapping, cu_seqlens_q=d.cu_seqlens_q, cu_seqlens_k=d.cu_seqlens_k,
            context_lens=d.context_lens, block_tables=d.block_tables, max_seqlen_q=x.max_seqlen_q,
            max_seqlen_k=x.max_seqlen_k, num_seqs=x.num_seqs, num_tokens=x.num_tokens,
            block_size=self.block_size, decode_only=x.decode_only, no_prefix=x.no_prefix,
        )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The end of the decode graphs that draw: the LM head and the sampler's draw."""
        return self.sampler.draw_captured(self.model.compute_logits(hidden))

    def _prepare(self, out: SchedulerOutput) -> "_PreparedStep":
        """Pack and upload one step's inputs, on the graph's buffer where a decode graph runs it.

        The placeholder input ids take the previous step's sampled rows on the device; in the
        steady state (the same sequences as the last step, in order, all sampled) they are
        those tokens, as they stand. A steady step right after a graph step is not packed at
        all: the graph's inputs move on by one on the device (:meth:`_advance`)."""
        table_rows = self.block_tables.update(out)
        self.sampler.token_counts.forget(out.finished_seq_ids)
        step = self._advance(out, table_rows)
        if step is None:
            step = self._pack(out, table_rows)
        self._graph_step = (table_rows, out.columns.start) if step.graphs is not None else None
        return step

    def _pack(self, out: SchedulerOutput, table_rows: np.ndarray) -> "_PreparedStep":
        x = build_step_inputs(out, self.block_size, self.block_tables, table_rows)
        fill, src, steady = self._placeholder_sources(x)
        graphs = self.graphs if self.graphs is not None and self.graphs.can_run(x) else None
        layout = PackedLayout.of(x, fill.size, None if graphs is None else graphs.bucket(x.num_seqs))
        flat = self._upload(x, fill, src, layout, None if graphs is None else graphs.inputs)
        # The step's views are made only where they are read (a graph reads its own).
        wanted = graphs is None or (fill.size and not steady) or x.logits_indices.size != x.num_tokens
        d = views(flat, layout) if wanted else None
        ids = d.input_ids if graphs is None else graphs.input_ids(x.num_seqs)
        if steady:  # a graph reads its ids in place; an eager pass can take the tokens as they are
            ids = self._last_sample if graphs is None else ids.copy_(self._last_sample)
        elif fill.size:
            ids[d.fill] = self._last_sample[d.src]
        return _PreparedStep(x.table_rows, x.num_seqs, x.num_tokens, x.logits_indices.size, graphs, layout, d,
                             ids, x)

    def _advance(self, out: SchedulerOutput, table_rows: np.ndarray) -> "_PreparedStep | None":
        """A steady step that follows a graph step, on that graph's inputs moved on by one on
        the device; None where the step must be packed. Steady here means: the same rows as
        the last step (``BlockTables`` handed back the very same rows array), which sampled
        all of them, each one decode token further on, all sampling, and every block the step
        appends within the graphs' tables."""
        last, graphs, cols = self._graph_step, self.graphs, out.columns
        b = table_rows.size
        if (last is None or last[0] is not table_rows or table_rows is not self._sampled_rows
                or cols.token_ids.size != b or not cols.sample.all() or not np.array_equal(cols.start, last[1] + 1)):
            return None
        index, column = self.block_tables.appended
        new = None
        if index.size:
            if column.max() >= graphs.width:
                return None
            new = np.empty((3, index.size), dtype=np.int32)
            new[0], new[1] = index, column
            new[2] = self.block_tables.table[table_rows[index], column]
            self._upload_bytes(new, graphs.new_block_bytes)
        graphs.advance(b, self._last_sample, new)
        return _PreparedStep(table_rows, b, b, b, graphs, None, None, None, None)

    def _forward_rows(self, step: "_PreparedStep", prompt_at: np.ndarray | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the model on a prepared step; returns the hidden rows to sample (or None), and
        those at ``prompt_at`` (positions giving prompt log-probs; prefill steps run eagerly)."""
        d = step.d
        if step.graphs is not None:
            hidden = step.graphs.run(step.num_seqs, step.layout)
        else:
            with forward_context(self._metadata(step.x, d)), self._threads():
                hidden = self._forward(step.ids, d.positions)
        prompt = None if prompt_at is None else hidden[self.sampler.upload(prompt_at, torch.int64)]
        if step.num_logits == step.num_tokens:
            return hidden, prompt
        if step.num_logits:
            return hidden[d.logits_indices], prompt
        return None, prompt

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.execute_async(out).result()

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Launch the step; the handle's ``result()`` waits for this step's tokens only.

        With ``cuda_graphs.CAPTURE_DRAW``, a decode step whose rows can draw in a CUDA graph
        (see ``Sampler.sample_captured``) replays the graph of the whole step, draw included;
        any other step runs the forward (a graph of it, or eagerly) and samples after it."""
        t0 = time.perf_counter()
        step = self._prepare(out)
        cols = out.columns
        every_row = step.num_logits == step.num_seqs
        if every_row:  # every row samples (steady decode): nothing to select
            sampled, table_rows, seq_ids, index = out.requests, step.table_rows, cols.seq_id, cols.output_index
        else:
            sample = cols.sample
            sampled = [r for r in out.requests if r.sample]
            table_rows, seq_ids, index = step.table_rows[sample], cols.seq_id[sample], cols.output_index[sample]
        params = self._params_of(sampled, table_rows)
        index = index.tolist()
        t1 = time.perf_counter()
        prepare_s = t1 - t0
        use_graph = step.graphs is not None
        if use_graph and step.graphs.draws and every_row:
            s = self.sampler.sample_captured(
                params, index, lambda: step.graphs.run_and_draw(step.num_seqs, step.layout))
            if s is not None:
                t2 = time.perf_counter()
                return self._launched(s, table_rows, seq_ids, prepare_s, t2 - t1, t2, use_graph, {})
        which = cols.prompt_logit_rows
        prompt_at = prompt_positions(step.x.cu_seqlens_q, out.requests, which) if which.size else None
        rows, prompt_rows = self._forward_rows(step, prompt_at)
        t2 = time.perf_counter()
        forward_s = t2 - t1
        with self._threads():
            # None on tensor-parallel ranks != 0: the logits were gathered to rank 0, which samples.
            # (Every rank computes the prompt positions' logits too: the LM head is a collective.)
            prompt = None if prompt_rows is None else PromptLogprobs.of(
                (self.model.compute_logits(prompt_rows[i:i + self.max_rows])
                 for i in range(0, prompt_rows.shape[0], self.max_rows)), out.requests, which, self.sampler.upload)
            logits = None if rows is None else self.model.compute_logits(rows)
            if logits is None:
                if rows is not None and self.share_sampled:  # this rank's next step reads them
                    tokens = tp_broadcast_from_rank0(torch.empty(len(sampled), dtype=torch.int64, device=self.device))
                    self._remember_sampled(tokens, table_rows)
                return DoneStep(StepResult(tokens={}, timings={"prepare_s": prepare_s, "forward_s": forward_s},
                                           cuda_graph=use_graph,
                                           prompt_logprobs={} if prompt is None else prompt.to_host()))
            s, errors = self._sample(logits, sampled, params, index, table_rows)
            if self.share_sampled:
                tp_broadcast_from_rank0(s.tokens)
        return self._launched(s, table_rows, seq_ids, prepare_s, forward_s, t2, use_graph, errors, prompt)

    def _launched(self, s: DeviceSample, table_rows: np.ndarray, seq_ids: np.ndarray, prepare_s: float,
                  forward_s: float, t0: float, use_graph: bool, errors: dict[int, str],
                  prompt: PromptLogprobs | None = None) -> StepHandle:
        self._remember_sampled(s.tokens, table_rows)
        timings = {"prepare_s": prepare_s, "forward_s": forward_s, "sample_s": time.perf_counter() - t0}
        step = _LaunchedStep(s, seq_ids, timings, use_graph, errors, prompt)
        return step if self.device.type == "cuda" else DoneStep(step.result())

    def _params_of(self, rows: Sequence[ScheduledRequest], table_rows: np.ndarray) -> list[SamplingParams]:
        """The sampled rows' params list. When they are the same sequences as the last step
        sampled, in order (BlockTables handed the very same rows array back), it is the last
        step's very list, which the sampler has read already."""
        cached = self._sampled_params
        if cached is not None and cached[0] is table_rows and table_rows is self._sampled_rows:
            return cached[1]
        params = [r.params for r in rows]
        self._sampled_params = (table_rows, params)
        return params

    def _sample(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest], params: list[SamplingParams],
                index: list[int], table_rows: np.ndarray) -> tuple[DeviceSample, dict[int, str]]:
        """Sample every row (``params``, ``index`` and ``table_rows``: their parameters, from
        :meth:`_params_of`, output indices and BlockTables rows); a row whose own parameters
        make sampling fail fails alone.

        When the batch's draw fails, its rows are drawn one at a time (``Sampler.sample_each``):
        a row that fails by itself is drawn greedily so the others keep their places, and its
        error goes back to the scheduler, which ends the request with ``finish_reason="error"``;
        a fault of the whole batch that no row causes alone costs no row at all.
        """
        def stop_token_ids_of(i: int) -> frozenset[int]:
            return rows[i].all_stop_token_ids

        # (A steady step's rows are made only when read; its requests carry the same histories.)
        source = rows.reqs if type(rows) is DecodeRows else rows

        def in_flight_tokens(flying: list[int]) -> torch.Tensor:
            return self._last_sample[self.sampler.upload(self._sample_row[table_rows[flying]], torch.int64)]

        def history_of(which: list[int]) -> Histories:
            """Penalized rows' tokens, outputs in flight read from the last step's draw."""
            return histories_of(source, which, index, in_flight_tokens)

        try:
            return self.sampler.sample(logits, params, index, stop_token_ids_of, history_of), {}
        except Exception:
            s, failed = self.sampler.sample_each(logits, params, index, stop_token_ids_of, _FALLBACK, history_of)
            return s, {rows[i].seq_id: f"{type(exc).__name__}: {exc}" for i, exc in failed.items()}

    def kv_shards(self) -> list[dict[str, int | str]]:
        """This rank's share of the KV heads and of the pool's bytes, and the pool's element type
        (see docs/TRACE_API.md)."""
        _, kv_heads, _ = kv_geometry(self.hf_config, self.tp_size)
        start = self.rank * kv_heads
        return [dict(rank=self.rank, kv_head_start=start, kv_head_end=start + kv_heads,
                     num_kv_heads=kv_heads, num_blocks=self.num_kv_blocks,
                     bytes=self.kv_cache.numel() * self.kv_cache.element_size(),
                     kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."))]

    def shutdown(self) -> None:
        """Release the graphs, the KV pool and the weights now, so a next engine in this
        process can size its pool from free memory (the layers hold views of the pool). A
        step launched under async scheduling may still run: CUDA frees a graph in flight when
        it completes, and the allocator reuses memory in stream order, so nothing waits for it
        (a wait could hang on a collective whose peer is gone)."""
        self.graphs = None
        self.kv_cache = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = None
        self.attn_layers = []
        self.model = None
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


class _LaunchedStep:
    """A step whose tokens are still being copied back from the device."""

    def __init__(self, sample: DeviceSample, seq_ids: np.ndarray, timings: dict[str, float],
                 cuda_graph: bool, errors: dict[int, str], prompt: PromptLogprobs | None) -> None:
        self._sample, self._seq_ids, self._timings, self._graph = sample, seq_ids, timings, cuda_graph
        self._errors, self._prompt = errors, prompt

    def result(self) -> StepResult:
        t0 = time.perf_counter()
        s = self._sample.to_output()
        timings = {**self._timings, "sample_s": self._timings["sample_s"] + time.perf_counter() - t0}
        seq_ids = self._seq_ids.tolist()
        logprobs = {} if s.logprobs is None else dict(zip(seq_ids, s.logprobs))
        return StepResult(tokens=dict(zip(seq_ids, s.tokens)), logprobs=logprobs,
                          timings=timings, cuda_graph=self._graph, errors=self._errors,
                          prompt_logprobs={} if self._prompt is None else self._prompt.to_host())


@dataclass(slots=True)
class _PreparedStep:
    """A step whose inputs are on the device, ready to run (``ModelRunner._prepare``)."""

    table_rows: np.ndarray  # each row's BlockTables row
    num_seqs: int
    num_tokens: int
    num_logits: int  # rows sampled
    graphs: DecodeGraphs | None  # the decode graphs, where one runs this step
    layout: PackedLayout | None  # where its inputs were packed; None: the graph's, moved on (_advance)
    d: DeviceInputs | None  # the step's views of its uploaded inputs, where something reads them
    ids: torch.Tensor | None  # the input ids the forward reads (None: the graph's own)
    x: StepInputs | None  # the packed step (None when moved on)
