"""A tensor-parallel worker process (ranks 1..N-1): build this rank's shard, then run every step
in lockstep with rank 0 until told to stop.

Replies go back on the worker's own pipe: ``("ready", kv_shard)`` once the shard is built,
``("done",)`` after each step, and ``("error", traceback)`` when anything raises, after which
the worker exits at once: leaving closes its sockets, which fails rank 0's pending gloo
collective immediately instead of at a timeout.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Semaphore
from typing import Any

import torch

from kvscope.config import EngineConfig
from kvscope.distributed.channel import ChannelReader
from kvscope.distributed.group import make_group, make_store, release_group
from kvscope.distributed.parallel_state import init_tp
from kvscope.distributed.step_message import decode_step
from kvscope.runner.model_runner import ModelRunner

_IDLE_POLL_S = 1.0  # how often an idle worker checks that rank 0's process still exists
_RELEASE_S = 5.0


@dataclass
class WorkerArgs:
    """Everything a worker needs, pickled once at spawn."""

    rank: int
    tp_size: int
    device: str
    store_port: int
    timeout: timedelta
    channel_name: str
    config: EngineConfig
    hf_config: Any  # a plain namespace of the HF config's fields: workers never import transformers
    model_dir: str
    max_model_len: int
    num_threads: int


def worker_main(args: WorkerArgs, doorbell: Semaphore, reply: Connection) -> None:
    """Process entry point: report every failure to rank 0 and exit non-zero; exit 0 when stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    code = 0
    try:
        torch.set_num_threads(args.num_threads)
        _serve(args, doorbell, reply)
    except BaseException:
        code = 1
        reply.send(("error", traceback.format_exc()))
    finally:
        # No destructors either way: a group with a collective in flight could block exit, and
        # gloo's background threads, destroyed at interpreter teardown, abort the process
        # ("terminate called without an active exception") once in a few clean exits.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(args: WorkerArgs, doorbell: Semaphore, reply: Connection) -> None:
    device = torch.device(args.device)
    store = make_store(args.store_port, args.rank, args.tp_size, args.timeout)
    group = make_group(device, store, args.rank, args.tp_size, args.timeout)
    init_tp(args.rank, args.tp_size, group)
    runner = ModelRunner(args.config, args.hf_config, args.model_dir, args.max_model_len,
                         rank=args.rank, tp_size=args.tp_size, device=device)
    (shard,) = runner.kv_shards()
    reader = ChannelReader(args.channel_name, doorbell)
    reply.send(("ready", shard))
    parent = mp.parent_process()
    try:
        while True:
            got, command = reader.receive(_IDLE_POLL_S)
            if not got:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if command[0] == "shutdown":
                return
            if command[0] != "execute":
                raise ValueError(f"unknown command {command[0]!r}")
            runner.execute(decode_step(command[1]))
            reply.send(("done",))
    finally:
        reader.close()
        runner.shutdown()  # drops the CUDA graphs, which an NCCL abort would otherwise wait for
        release_group(group, device, _RELEASE_S)
