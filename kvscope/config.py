"""Engine configuration: every key is known and checked at the boundary.

vLLM and nano-vLLM silently drop unknown keyword arguments; a typo such as ``block_szie=32``
then changes nothing and nobody notices. kvscope refuses unknown keys and names the nearest
valid one.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields
from typing import Any

from kvscope.arg_checks import (MAX_HWM, MAX_PORT, check_int, check_seed, check_text, is_finite_number, offset_endpoint,
                                tcp_port)

SCHEDULING_POLICIES = ("unified", "prefill_first")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names for two of them
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; "fp8" is e4m3, as in vLLM


CPU_KV_CACHE_BYTES = 256 * 1024 * 1024  # a CPU pool's bytes per rank when kv_cache_memory_bytes is None


@dataclass
class EngineConfig:
    """All engine settings. Pass them as keyword arguments to ``LLM(...)``."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # vLLM's: the KV pool's bytes per rank (None: see kv_cache_budget)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "unified"
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    seed: int = 0
    max_logprobs: int = 20  # vLLM's: the most log-probs a request may ask for (-1: the whole vocabulary)
    cpu_threads: int | None = None
    async_scheduling: bool = False
    generation_config: str = "auto"  # vLLM's: the model's sampling defaults, "vllm" for none, or a directory
    # --- KV events in vLLM's wire format (kvscope.attach.publisher; docs/ATTACH.md)
    kv_events_config: "KVEventsConfig | dict | None" = None
    data_parallel_rank: int = 0  # vLLM's name; here it only offsets the KV-event ports and stamps batches

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"unknown engine config key {key!r}{hint} Valid keys: {', '.join(sorted(known))}"
                )
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("model", "tokenizer"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a local directory or a hub id (a str or a path), "
                                f"got {type(value).__name__} {value!r}")
            if isinstance(value, os.PathLike):  # (a str in the trace's metadata)
                setattr(self, name, os.fspath(value))
        check_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len)
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.cpu_threads is not None:
            check_int("cpu_threads", self.cpu_threads)
            cpus = os.cpu_count() or 1
            if self.cpu_threads > cpus:  # (torch would try to start them all, and may crash)
                raise ValueError(f"cpu_threads must be at most this machine's {cpus} CPUs, got {self.cpu_threads}")
        check_seed("seed", self.seed)
        check_int("max_logprobs", self.max_logprobs, minimum=-1)
        self.dtype = _dtype_name(self.dtype)
        gmu = self.gpu_memory_utilization
        if not is_finite_number(gmu) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gmu!r}")
        for name, value, allowed in (
            ("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES),
            ("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
            ("dtype", self.dtype, DTYPES),
            ("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
        ):
            if not isinstance(value, str) or value not in allowed:  # (an array's `in` asks its truth value)
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "skip_tokenizer_init",
                     "async_scheduling", "calculate_kv_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        gc = self.generation_config
        if isinstance(gc, os.PathLike):
            gc = self.generation_config = os.fspath(gc)
        if not isinstance(gc, str) or (gc not in ("auto", "vllm") and not os.path.isdir(gc)):
            raise ValueError(f"generation_config must be 'auto' (the model's), 'vllm' (none) or a directory, "
                             f"got {gc!r}")
        check_int("data_parallel_rank", self.data_parallel_rank, minimum=0)
        if self.kv_events_config is not None:
            self.kv_events_config = kv = KVEventsConfig.from_value(self.kv_events_config)
            if kv.publishes:  # (the publisher offsets its ports by the rank once the engine is built)
                for endpoint in (kv.endpoint, kv.replay_endpoint):
                    offset_endpoint(endpoint, self.data_parallel_rank)

    def kv_cache_budget(self, on_cuda: bool) -> int | None:
        """The KV pool's bytes per rank: ``kv_cache_memory_bytes`` (vLLM's, on any device); unset,
        ``CPU_KV_CACHE_BYTES`` on CPU, and None on CUDA, where the pool takes what
        ``gpu_memory_utilization`` leaves."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return None if on_cuda else CPU_KV_CACHE_BYTES


def _dtype_name(dtype: Any) -> Any:
    """vLLM's other ways to ask for one of ``DTYPES`` (``"half"``, ``"float"``, a ``torch.dtype``) as
    its name there; anything else as it is, for the check to refuse."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        return name if name in DTYPES else dtype
    return DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config``, same keys and defaults: publish KV events over ZMQ."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000  # accepted for vLLM compatibility; kvscope publishes in the engine's thread
    topic: str = ""

    @classmethod
    def from_value(cls, value: "KVEventsConfig | dict") -> "KVEventsConfig":
        if isinstance(value, cls):
            cfg = value
        elif isinstance(value, dict):
            known = [f.name for f in fields(cls)]
            for key in value:
                if key not in known:
                    close = difflib.get_close_matches(str(key), known, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise TypeError(
                        f"unknown kv_events_config key {key!r}{hint} Valid keys: {', '.join(known)}"
                    )
            cfg = cls(**value)
        else:
            raise TypeError(
                f"kv_events_config must be a dict of vLLM's KVEventsConfig keys, got {type(value).__name__}"
            )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv_events_config.enable_kv_cache_events must be a bool, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if not isinstance(self.publisher, str) or self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        # (each a ZMQ high-water mark: the replay socket's is buffer_steps + 1)
        check_int("kv_events_config.hwm", self.hwm, maximum=MAX_HWM)
        check_int("kv_events_config.buffer_steps", self.buffer_steps, maximum=MAX_HWM - 1)
        check_int("kv_events_config.max_queue_size", self.max_queue_size)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(_ZMQ_SCHEMES)
                                          and value.partition("://")[2]):
                raise ValueError(
                    f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// address, got {value!r}"
                )
            folder = os.path.dirname(value[len("ipc://"):]) if value and value.startswith("ipc://") else ""
            if folder and not os.path.isdir(folder):  # (ZMQ's "No such file or directory" once the engine is built)
                raise ValueError(f"kv_events_config.{name} {value!r} is in no directory: {folder} does not exist")
            if value is None or not value.startswith("tcp://") or value.endswith(":*"):
                continue
            port = tcp_port(value)
            if port is None or not 1 <= port <= MAX_PORT:  # (ZMQ took 99999 without a word)
                raise ValueError(f"kv_events_config.{name} needs a tcp port in 1..{MAX_PORT} (or *), got {value!r}")
        if (self.replay_endpoint is not None and self.replay_endpoint == self.endpoint
                and not self.endpoint.endswith(":*")):  # (a * port binds one of its own for each)
            raise ValueError(f"kv_events_config.replay_endpoint must differ from endpoint, got {self.endpoint!r} "
                             "for both (each is a socket of its own)")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a str, got {self.topic!r}")
        check_text("kv_events_config.topic", self.topic)  # (sent as UTF-8)

    @property
    def publishes(self) -> bool:
        """Whether an engine with this config publishes (vLLM: enabled and the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"
