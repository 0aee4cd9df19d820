"""String-named hook points on every engine decision (TransformerLens style).

The engine asks ``hooks.active(name)`` before it builds a payload, so a hook point with no
listener costs one dict lookup. A hook that raises is reported with its traceback and
detached; the engine goes on. A hook's ``KeyboardInterrupt`` or ``SystemExit`` stops the call
as a Ctrl-C does: the engine finishes the transition, and the call raises it
(:func:`kvscope.interrupts.hold`).

Block events are the busiest hook points (a prefill step of a large batch fires thousands), so
besides hooks they go to *block sinks*: plain lists that receive each event as a
:class:`BlockEvent` with no Python call per event. A sink added with ``columns=True`` (the
recorder's) receives the block manager's batches whole, as one :class:`BlockEvents` each, so
not even a tuple is built per event.
"""
from __future__ import annotations

import contextlib
import itertools
import traceback
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from kvscope.interrupts import hold

BLOCK_EVENTS: tuple[str, ...] = (
    "block.allocated",  # a free block taken (its old cached content, if any, evicted first)
    "block.shared",     # a prefix-cache hit on a live block: ref_count + 1
    "block.reused",     # a prefix-cache hit on a cached free block: back in use
    "block.freed",      # one owner let go: ref_count - 1 (free at 0, cached if hashed)
    "block.evicted",    # a cached block's hash dropped (reallocation or reset_prefix_cache)
    "block.hashed",     # a full, computed block registered in the prefix cache
)


class BlockEvent(NamedTuple):
    event: str
    block_id: int
    request_id: str | None
    ref_count: int          # after the event
    block_hash: int | None  # None while the block has none (an evicted block's is the one it loses)
    engine_step: int        # the engine's step counter when it fired (< the record's step: idle)


NO_HASH = -1  # a block without a hash, in the hash column of :class:`BlockEvents`


class BlockEvents(NamedTuple):
    """Several block events at once, in order, as columns: what a sink added with
    ``columns=True`` receives for each batch the block manager emits (a request's freed blocks,
    a step's newly full blocks, an admission's fresh blocks and prefix hits)."""

    event: str | list[str]             # one kind for every event, or one per event
    block_id: np.ndarray               # int64
    request_id: str | list[str | None]  # one request for every event, or one per event
    ref_count: np.ndarray              # after each event
    block_hash: np.ndarray             # int64; NO_HASH where the block has none
    engine_step: int

    def __len__(self) -> int:  # (the number of events, not of fields)
        return len(self.block_id)

    def expand(self) -> list[BlockEvent]:
        """The events one by one, as a tuple sink receives them."""
        kinds, rids, step = self.event, self.request_id, self.engine_step
        kinds = itertools.repeat(kinds) if isinstance(kinds, str) else kinds
        rids = itertools.repeat(rids) if isinstance(rids, str) else rids
        return [_new_tuple(BlockEvent, (k, b, r, c, None if h == NO_HASH else h, step))
                for k, b, r, c, h in zip(kinds, self.block_id.tolist(), rids, self.ref_count.tolist(),
                                         self.block_hash.tolist())]

    def kinds(self) -> set[str]:
        return {self.event} if isinstance(self.event, str) else set(self.event)


HOOK_POINTS: tuple[str, ...] = (
    "step.scheduled",
    "step.end",
    *BLOCK_EVENTS,
    "request.added",
    "request.preempted",
    "request.finished",
)

Hook = Callable[..., Any]
_SINK = "block sink"  # the HookHandle name of a block sink
_new_tuple = tuple.__new__  # builds a BlockEvent without NamedTuple.__new__'s Python frame


def warn_detached(fn: Hook, where: str) -> None:
    """Report, from inside ``except``, that ``fn`` raised at ``where`` and is being detached."""
    warnings.warn(
        f"kvscope hook {getattr(fn, '__qualname__', fn)!r} on {where!r} raised and was "
        f"detached:\n{traceback.format_exc()}",
        RuntimeWarning,
        stacklevel=3,
    )


class HookHandle:
    """Returned by :meth:`HookRegistry.add`; ``remove()`` detaches the hook (idempotent)."""

    def __init__(self, registry: "HookRegistry", name: str, key: int) -> None:
        self._registry, self.name, self._key = registry, name, key

    def remove(self) -> None:
        self._registry._remove(self.name, self._key)

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class HookRegistry:
    def __init__(self) -> None:
        self._hooks: dict[str, dict[int, Hook]] = {}
        self._tiers: dict[int, int] = {}  # key -> 0 (first), 1 (after_first) or 2: a point's hooks fire by tier
        self._keys = itertools.count()
        self._sinks: dict[int, tuple[list, bool]] = {}  # key -> (sink, columns)
        self.block_sinks: tuple[list, ...] = ()  # every sink; read by the block manager per event
        self._tuple_sinks: tuple[list[BlockEvent], ...] = ()
        self._column_sinks: tuple[list, ...] = ()
        self.block_hook_firing: str | None = None  # the block event whose hooks run now, if any

    def add(self, name: str, fn: Hook, first: bool = False, after_first: bool = False) -> HookHandle:
        """Call ``fn(**payload)`` at hook point ``name``; see ``HOOK_POINTS``. ``first``: before
        the hooks already there (a recorder closes step n's record before a ``step.end`` hook
        that steps the engine again can start step n+1). ``after_first``: after every ``first``
        hook, before the others, in the order added (a recorder's listeners, which may step the
        engine again, so only once every recorder has closed its record of step n)."""
        if name not in HOOK_POINTS:
            raise ValueError(f"unknown hook point {name!r}; known hook points: {', '.join(HOOK_POINTS)}")
        if not callable(fn):
            raise TypeError(f"hook for {name!r} must be callable, got {type(fn).__name__}")
        key = next(self._keys)
        tier = 0 if first else 1 if after_first else 2
        self._tiers[key] = tier
        fns = self._hooks.setdefault(name, {})
        at = 0 if tier == 0 else sum(self._tiers[k] <= tier for k in fns)
        if at == len(fns):  # (the usual case, one atomic store: another thread may be firing)
            fns[key] = fn
        else:  # (reordered in place: a firing under way checks this dict for the hooks removed meanwhile)
            items = list(fns.items())
            items.insert(at, (key, fn))
            fns.clear()
            fns.update(items)
        return HookHandle(self, name, key)

    @contextlib.contextmanager
    def hooks(self, fwd: dict[str, Hook] | list[tuple[str, Hook]]) -> Iterator[list[HookHandle]]:
        """Temporarily attach several hooks: ``with llm.hooks.hooks({"step.end": fn}): ...``."""
        items = fwd.items() if isinstance(fwd, dict) else fwd
        handles = [self.add(n, f) for n, f in items]
        try:
            yield handles
        finally:
            for h in handles:
                h.remove()

    __call__ = hooks

    def add_block_sink(self, sink: list, columns: bool = False) -> HookHandle:
        """Append every block event to ``sink`` (a list) until the handle is removed: each as a
        :class:`BlockEvent`, or with ``columns=True`` each batch as one :class:`BlockEvents`
        (events emitted alone still come as ``BlockEvent``)."""
        if not isinstance(sink, list):
            raise TypeError(f"a block sink must be a list, got {type(sink).__name__}")
        key = next(self._keys)
        self._sinks[key] = (sink, bool(columns))
        self._sinks_changed()
        return HookHandle(self, _SINK, key)

    def _sinks_changed(self) -> None:
        sinks = self._sinks.values()
        self.block_sinks = tuple(s for s, _ in sinks)
        self._tuple_sinks = tuple(s for s, columns in sinks if not columns)
        self._column_sinks = tuple(s for s, columns in sinks if columns)

    def _remove(self, name: str, key: int) -> None:
        if name == _SINK:
            self._sinks.pop(key, None)
            self._sinks_changed()
            return
        self._tiers.pop(key, None)
        fns = self._hooks.get(name)
        if fns is not None:
            fns.pop(key, None)
            if not fns:
                del self._hooks[name]

    def active(self, name: str) -> bool:
        return name in self._hooks

    def has_block_hooks(self) -> bool:
        """Whether a hook (code that may read the pool) is attached to any block event."""
        return any(n.startswith("block.") for n in self._hooks)

    def clear(self) -> None:
        for fns in self._hooks.values():  # (emptied, so a firing under way calls none of them)
            fns.clear()
        self._hooks.clear()
        self._tiers.clear()
        self._sinks.clear()
        self._sinks_changed()

    def emit_block(
        self, event: str, step: int, block_id: int, request_id: str | None, ref_count: int,
        block_hash: int | None,
    ) -> None:
        """One block event: appended to every sink, then passed to the ``event`` hooks."""
        ev = _new_tuple(BlockEvent, (event, block_id, request_id, ref_count, block_hash, step))
        for sink in self.block_sinks:
            sink.append(ev)
        if event in self._hooks:
            self._fire_block(event, step=step, block_id=block_id, request_id=request_id,
                             ref_count=ref_count, block_hash=block_hash)

    def emit_blocks(self, batch: BlockEvents) -> None:
        """Several block events, in order, as :meth:`emit_block` would give them one by one;
        the block manager has applied all of them already."""
        hooked = any(k in self._hooks for k in batch.kinds())
        events = batch.expand() if self._tuple_sinks or hooked else []
        for sink in self._tuple_sinks:
            sink += events
        for sink in self._column_sinks:
            sink.append(batch)
        for e in events if hooked else ():
            self._fire_block(e.event, step=e.engine_step, block_id=e.block_id, request_id=e.request_id,
                             ref_count=e.ref_count, block_hash=e.block_hash)

    def _fire_block(self, event: str, **payload: Any) -> None:
        """A block event's hooks run half-way through the engine's change of its tables: marked,
        so that a check of those tables from such a hook can say so rather than raise a false
        alarm."""
        outer, self.block_hook_firing = self.block_hook_firing, event
        try:
            self.fire(event, **payload)
        finally:
            self.block_hook_firing = outer

    def fire(self, name: str, **payload: Any) -> None:
        fns = self._hooks.get(name)
        if not fns:
            return
        for key, fn in list(fns.items()):
            if key not in fns:  # removed by a hook called before it
                continue
            try:
                fn(**payload)
            except Exception:
                warn_detached(fn, name)
                self._remove(name, key)
            except BaseException as exc:  # (KeyboardInterrupt, SystemExit: a stop, not a fault)
                hold(exc)
