"""Tensor parallelism on one host: rank 0 in the caller's process, ranks 1..N-1 spawned.

Each step, rank 0 encodes the ``SchedulerOutput`` as a ``StepMessage`` (this step's tokens,
the scheduler's block-table deltas), publishes it on the shared-memory channel, runs its own shard of the
forward pass, samples from the logits the LM head gathered to it, and waits for every worker's
``done``. The scheduler and block manager exist only here; each worker's runner applies the same
block-table deltas as rank 0's.

Failure is never a hang. A worker that raises reports its traceback and exits; a worker that
dies closes its sockets, which fails rank 0's pending gloo collective at once (NCCL kernels
would spin instead, so for NCCL a watchdog thread aborts the communicator when a worker
exits). Every wait for a worker also watches its process sentinel, with a timeout. After any
failure the executor tears the workers down and refuses further steps: a group that lost a
rank mid-collective cannot be resumed.

Shutdown (``shutdown()``, garbage collection, or interpreter exit through
``weakref.finalize``) tells live workers to stop, terminates any that do not, and unlinks the
channel's shared memory.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
import types
import warnings
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, TypeVar

import torch

from kvscope.config import EngineConfig
from kvscope.distributed.channel import ChannelWriter
from kvscope.distributed.group import backend_for, make_group, make_store, release_group
from kvscope.distributed.parallel_state import tp_scope
from kvscope.distributed.step_message import encode_step
from kvscope.distributed.worker import WorkerArgs, worker_main
from kvscope.engine.executor import StepHandle, StepResult
from kvscope.engine.scheduler_output import SchedulerOutput
from kvscope.interrupts import deferred_interrupts
from kvscope.kernels.select import select_backend
from kvscope.models import spec_for
from kvscope.runner.model_runner import ModelRunner, resolve_device

TIMEOUT = timedelta(minutes=10)  # collectives, rendezvous, and any single wait for a live worker
_STOP_GRACE_S = 5.0              # how long a worker may take to leave after "shutdown"
_REPORT_GRACE_S = 2.0            # after rank 0 fails, how long to wait for a worker's own report
_POLL_S = 0.1

T = TypeVar("T")


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed; the engine's workers are gone and it must be rebuilt."""


def rank_devices(base: torch.device, tp_size: int) -> list[torch.device]:
    """Rank r runs on ``cuda:(base + r)``; on CPU every rank is a CPU process."""
    if base.type != "cuda":
        return [base] * tp_size
    first = base.index or 0
    if first + tp_size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={tp_size} from {base} needs GPUs {first}..{first + tp_size - 1}, "
            f"but {torch.cuda.device_count()} are visible"
        )
    return [torch.device("cuda", first + r) for r in range(tp_size)]


class _Ranks:
    """Rank 0's runner, the spawned ranks, and everything shared with them. ``close`` must work
    from any state, because it also runs from a finalizer (which must not hold the executor)."""

    def __init__(self, tp_size: int, device: torch.device) -> None:
        self.ctx = mp.get_context("spawn")
        self.device = device
        self.runner: ModelRunner | None = None
        self.store = make_store(0, 0, tp_size, TIMEOUT)
        self.doorbells = [self.ctx.Semaphore(0) for _ in range(1, tp_size)]
        self.channel = ChannelWriter(self.doorbells)
        self.procs: list[mp.process.BaseProcess] = []
        self.replies: list[Connection] = []
        self.group: Any = None
        self.failure: str | None = None
        self.closed = False
        self._stop_watch: Connection | None = None

    def start(self, args: list[WorkerArgs]) -> None:
        """Spawn the workers. A Ctrl-C lands once every started one is in ``procs``: landing
        between a spawn and its record, it left that worker to ``close`` unseen."""
        with deferred_interrupts():
            for a, doorbell in zip(args, self.doorbells):
                receive, send = self.ctx.Pipe(duplex=False)
                proc = self.ctx.Process(target=worker_main, args=(a, doorbell, send), daemon=True,
                                        name=f"kvscope-tp-rank{a.rank}")
                proc.start()
                send.close()  # the worker holds the only write end: EOF means it is gone
                self.procs.append(proc)
                self.replies.append(receive)

    # ------------------------------------------------------------ waiting
    def watched(self, fn: Callable[[], T]) -> T:
        """Run a blocking call (the rendezvous) in a helper thread, returning early with an error
        if a worker dies meanwhile: rank 0 alone cannot tell a slow peer from a dead one."""
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(_capture(fn)), daemon=True)
        thread.start()
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while thread.is_alive():
            for rank, proc in enumerate(self.procs, 1):
                if not proc.is_alive():
                    raise TensorParallelError(self._report(rank))
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rendezvous timed out after {TIMEOUT}")
            thread.join(_POLL_S)
        value, exc = result[0]
        if exc is not None:
            raise exc
        return value

    def collect(self, what: str) -> list[Any]:
        """One reply per worker, in rank order: ``what`` and its payload. A worker that raised,
        died or stayed silent for ``TIMEOUT`` raises TensorParallelError naming it."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while len(got) < len(self.procs):
            pending = [r for r in range(1, len(self.procs) + 1) if r not in got]
            ready = self._wait(pending, deadline)
            if not ready:
                raise TensorParallelError(f"tensor-parallel ranks {pending} did not answer "
                                          f"{what!r} within {TIMEOUT}")
            for rank in ready:
                reply = self._receive(rank)
                if reply is None or reply[0] != what:
                    raise TensorParallelError(self._report(rank, reply))
                got[rank] = reply[1:]
        return [got[r] for r in sorted(got)]

    def find_failure(self, grace: float) -> str | None:
        """After rank 0 itself failed: a worker's error report or death, if one shows up soon."""
        deadline = time.monotonic() + grace
        pending = set(range(1, len(self.procs) + 1))
        while pending:
            ready = self._wait(pending, deadline)
            if not ready:
                return None
            for rank in ready:
                reply = self._receive(rank)
                if reply is None or reply[0] == "error":
                    return self._report(rank, reply)
                pending.discard(rank)
        return None

    def _wait(self, ranks: Iterable[int], deadline: float) -> list[int]:
        """The ranks among ``ranks`` that replied or exited, waiting until ``deadline`` at most."""
        handles = {h: r for r in ranks for h in (self.replies[r - 1], self.procs[r - 1].sentinel)}
        ready = wait(list(handles), timeout=max(0.0, deadline - time.monotonic()))
        return sorted({handles[h] for h in ready})

    def _receive(self, rank: int) -> tuple | None:
        conn = self.replies[rank - 1]
        try:
            return conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            return None

    def _report(self, rank: int, reply: tuple | None = None) -> str:
        proc = self.procs[rank - 1]
        if reply is None:
            reply = self._receive(rank)
        if reply is not None and reply[0] == "error":
            return f"tensor-parallel worker rank {rank} (pid {proc.pid}) raised:\n{reply[1]}"
        if reply is not None:
            return f"tensor-parallel worker rank {rank} sent an unexpected reply {reply[0]!r}"
        proc.join(_STOP_GRACE_S)
        code = proc.exitcode
        how = ("is still running but closed its channel" if code is None
               else f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code} before it could report why (see its stderr); a "
                    "script that builds the engine at import time must do so under "
                    "`if __name__ == '__main__':`, since spawned workers re-import it")
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"

    # --------------------------------------------------------- watchdog
    def watch(self) -> None:
        """NCCL only: abort the communicator when a worker exits, so rank 0's spinning kernels
        (and the caller's step) return and ``collect`` can report the death."""
        if backend_for(self.device) != "nccl":
            return
        stop, self._stop_watch = self.ctx.Pipe(duplex=False)
        group, sentinels = self.group, [p.sentinel for p in self.procs]

        def run() -> None:
            if stop not in wait(sentinels + [stop]):
                group.abort()
            stop.close()

        threading.Thread(target=run, daemon=True, name="kvscope-tp-watchdog").start()

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop every worker (politely if the group is healthy), free rank 0's shard, release
        the group and unlink the shared memory. A Ctrl-C lands once all that is done: it is
        marked closed at once, so one landing half-way left the rest undone for good."""
        if self.closed:
            return
        with deferred_interrupts():
            self.closed = True
            if self._stop_watch is not None:
                self._stop_watch.close()  # the watchdog's wait sees EOF and returns without aborting
            alive = [p for p in self.procs if p.is_alive()]
            if alive and self.failure is None:
                self.channel.send(("shutdown",))
                for p in alive:
                    p.join(_STOP_GRACE_S)
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
                    p.join(_STOP_GRACE_S)
                if p.is_alive():
                    p.kill()
                    p.join(_STOP_GRACE_S)
                if p.is_alive():  # e.g. stuck in the GPU driver: never hang the caller on it
                    warnings.warn(f"kvscope tensor-parallel worker (pid {p.pid}) survived SIGKILL for "
                                  f"{_STOP_GRACE_S:.0f} s; leaving it behind", RuntimeWarning, stacklevel=2)
            for conn in self.replies:
                conn.close()
            self.channel.close()
            self.doorbells.clear()  # the last references: their named semaphores are unlinked on collection
            if self.runner is not None:
                self.runner.shutdown()  # first: its CUDA graphs pin the NCCL communicator
                self.runner = None
            if self.group is not None:
                release_group(self.group, self.device, _STOP_GRACE_S)
            self.group = self.store = None


def _capture(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return fn(), None
    except BaseException as exc:  # handed to the waiting thread
        return None, exc


class TensorParallelExecutor:
    """The :class:`~kvscope.engine.executor.Executor` for ``tensor_parallel_size > 1``."""

    def __init__(self, config: EngineConfig, hf_config: Any, model_dir: str, max_model_len: int) -> None:
        tp = self.tp_size = config.tensor_parallel_size
        devices = rank_devices(resolve_device(config), tp)
        with tp_scope(0, tp):  # refuse what no rank could build before starting any process
            spec_for(hf_config)
            select_backend(config.attention_backend, devices[0])
        # Every rank builds from the same snapshot of the config; workers never import transformers.
        snapshot = types.SimpleNamespace(**hf_config.to_dict())
        self._ranks = ranks = _Ranks(tp, devices[0])
        self._finalizer = weakref.finalize(self, ranks.close)
        try:
            ranks.start([
                WorkerArgs(rank=r, tp_size=tp, device=str(devices[r]), store_port=ranks.store.port,
                           timeout=TIMEOUT, channel_name=ranks.channel.name, config=config,
                           hf_config=snapshot, model_dir=model_dir, max_model_len=max_model_len,
                           num_threads=torch.get_num_threads())
                for r in range(1, tp)
            ])
            ranks.group = ranks.watched(lambda: make_group(devices[0], ranks.store, 0, tp, TIMEOUT))
            ranks.watch()
            with tp_scope(0, tp, ranks.group):
                runner = ranks.runner = ModelRunner(config, snapshot, model_dir, max_model_len,
                                                    rank=0, tp_size=tp, device=devices[0])
            self._shards = runner.kv_shards() + [s for (s,) in ranks.collect("ready")]
        except BaseException as exc:
            self._raise_failure(exc)
        self.device = devices[0]  # rank 0's, where the engine's process runs its shard
        self.num_kv_blocks = runner.num_kv_blocks
        self.vocab_size = runner.vocab_size
        self._workers_busy = False  # a step was sent whose ``done`` is not collected yet

    def execute(self, out: SchedulerOutput) -> StepResult:
        handle = self.execute_async(out)
        try:
            self._collect_done()
        except BaseException as exc:
            self._raise_failure(exc)
        return handle.result()

    def _collect_done(self) -> None:
        """The workers' ``done`` for the step last sent, unless it was collected already."""
        if self._workers_busy:
            self._ranks.collect("done")
            self._workers_busy = False

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Send the step to the workers and launch rank 0's shard; the handle's ``result()``
        reads back rank 0's tokens. The workers' ``done`` for this step is collected before the
        next command goes out (the channel holds one command at a time), so under async
        scheduling rank 0 never waits for a worker between launching step n and step n + 1
        (on a GPU a worker answers once its launches are queued)."""
        ranks = self._ranks
        if ranks.failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine is down ({ranks.failure}); "
                                      "create a new LLM")
        if ranks.closed:
            raise TensorParallelError("the tensor-parallel engine was shut down")
        try:
            self._collect_done()
            ranks.channel.send(("execute", encode_step(out)))
            self._workers_busy = True
            with tp_scope(0, self.tp_size, ranks.group):
                handle = ranks.runner.execute_async(out)
        except BaseException as exc:
            self._raise_failure(exc)
        return _RankZeroStep(self, handle)

    def _raise_failure(self, exc: BaseException) -> None:
        """Tear everything down after ``exc``, then raise the worker's failure when one caused
        it (rank 0's own error, e.g. a broken collective, is then only its symptom), else ``exc``.

        A Ctrl-C (or ``SystemExit``) is raised as it is, without waiting for a worker's report:
        a terminal's Ctrl-C reaches the workers too, and kills one still starting, whose death
        is then its symptom. The teardown happens even when a second Ctrl-C cuts the wait short."""
        ranks = self._ranks
        worker_failed = isinstance(exc, TensorParallelError)
        reason = str(exc) if worker_failed else None
        try:
            if not worker_failed and isinstance(exc, Exception):
                reason = ranks.find_failure(_REPORT_GRACE_S)
        finally:
            ranks.failure = reason or f"rank 0 raised {type(exc).__name__}: {exc}"
            self.shutdown()
        if reason is None or worker_failed:
            raise exc
        raise TensorParallelError(reason) from exc

    def kv_shards(self) -> list[dict[str, int]]:
        """One entry per rank: the KV heads it holds and the bytes of its pool shard."""
        return [dict(s) for s in self._shards]

    def shutdown(self) -> None:
        self._finalizer()


class _RankZeroStep:
    """A launched tensor-parallel step: rank 0's tokens, with the executor's failure handling."""

    def __init__(self, executor: TensorParallelExecutor, handle: StepHandle) -> None:
        self._executor, self._handle = executor, handle

    def result(self) -> StepResult:
        try:
            return self._handle.result()
        except BaseException as exc:
            self._executor._raise_failure(exc)
