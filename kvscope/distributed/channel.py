"""The control channel between rank 0 and its local workers: shared memory plus one doorbell each.

Rank 0 pickles a command into a named shared-memory segment and rings every worker's doorbell;
each worker wakes, reads the command, runs it, and answers on its own pipe (see
``executor.py``). Only one command is in flight: rank 0 writes the next one after every worker
has answered the last, so one segment is enough and needs no locking.

The doorbell is a semaphore, not a ``multiprocessing.Event``: an Event is a Condition
underneath, whose ``notify`` waits for each sleeper to acknowledge, so setting it blocks forever
once a worker has been killed while waiting. Posting a semaphore never blocks.

Unlike a fixed buffer, the segment grows: a command that does not fit is written to a new,
larger segment (``<base>_<generation>``), and the old segment's header is updated to point
workers at it. Rank 0 unlinks a retired segment once every worker has answered the command that
moved them off it. Names carry the creating pid and a random token, so any number of engines
can share a host. Only stdlib imports here: the channel costs workers nothing to import.

Segment layout: ``generation`` (u64), ``length`` (u64), then ``length`` bytes of pickle.
"""
from __future__ import annotations

import os
import pickle
import secrets
import struct
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore
from typing import Any

NAME_PREFIX = "kvscope_tp_"
_HEADER = struct.Struct("<QQ")
_MIN_SIZE = 1 << 20


def _segment_name(base: str, generation: int) -> str:
    return f"{base}_{generation}"


class ChannelWriter:
    """Rank 0's end: owns (creates, grows, unlinks) the segments and rings the workers' doorbells."""

    def __init__(self, doorbells: list[Semaphore], size: int = _MIN_SIZE) -> None:
        self.doorbells = doorbells
        self.base = f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        self.generation = 0
        self.shm = SharedMemory(_segment_name(self.base, 0), create=True, size=max(size, _HEADER.size))
        _HEADER.pack_into(self.shm.buf, 0, 0, 0)
        self._retired: list[SharedMemory] = []

    @property
    def name(self) -> str:
        """The name of the first segment: what a reader attaches to."""
        return _segment_name(self.base, 0)

    def send(self, command: Any) -> int:
        """Publish ``command`` to every worker; returns its pickled size in bytes.

        Call only after every worker has answered the previous command.
        """
        self._unlink_retired()
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        need = _HEADER.size + len(data)
        if need > self.shm.size:
            self._grow(need)
        _HEADER.pack_into(self.shm.buf, 0, self.generation, len(data))
        self.shm.buf[_HEADER.size:need] = data
        for bell in self.doorbells:
            bell.release()
        return len(data)

    def _grow(self, need: int) -> None:
        size = self.shm.size
        while size < need:
            size *= 2
        old = self.shm
        self.generation += 1
        self.shm = SharedMemory(_segment_name(self.base, self.generation), create=True, size=size)
        _HEADER.pack_into(old.buf, 0, self.generation, 0)  # readers of `old` follow to the new one
        self._retired.append(old)

    def _unlink_retired(self) -> None:
        for shm in self._retired:
            shm.close()
            shm.unlink()
        self._retired.clear()

    def close(self) -> None:
        """Unlink every segment this writer made; idempotent."""
        if self.shm is None:
            return
        self._retired.append(self.shm)
        self._unlink_retired()
        self.shm = None


class ChannelReader:
    """A worker's end: waits on its doorbell and reads the command, following the segment as it grows."""

    def __init__(self, name: str, doorbell: Semaphore) -> None:
        self.base, _, generation = name.rpartition("_")
        self.generation = int(generation)
        self.doorbell = doorbell
        self.shm = SharedMemory(name)

    def receive(self, timeout: float) -> tuple[bool, Any]:
        """``(True, command)``, or ``(False, None)`` when nothing came within ``timeout`` seconds."""
        if not self.doorbell.acquire(timeout=timeout):
            return False, None
        generation, length = _HEADER.unpack_from(self.shm.buf, 0)
        while generation != self.generation:
            self.shm.close()
            self.generation = generation
            self.shm = SharedMemory(_segment_name(self.base, generation))
            generation, length = _HEADER.unpack_from(self.shm.buf, 0)
        view = self.shm.buf[_HEADER.size:_HEADER.size + length]
        try:
            return True, pickle.loads(view)
        finally:
            view.release()  # an exported view would keep the segment from closing

    def close(self) -> None:
        self.shm.close()
