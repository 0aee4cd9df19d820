"""String-named hook points on every engine decision (TransformerLens style).

The engine asks ``hooks.active(name)`` before it builds a payload, so a hook point with no
listener costs one dict lookup. A hook that raises is reported with its traceback and
detached; the engine goes on.
"""
from __future__ import annotations

import contextlib
import itertools
import traceback
import warnings
from typing import Any, Callable, Iterator

HOOK_POINTS: tuple[str, ...] = (
    "step.scheduled",
    "step.end",
    "block.allocated",
    "block.shared",
    "block.reused",
    "block.freed",
    "block.evicted",
    "block.hashed",
    "request.added",
    "request.preempted",
    "request.finished",
)

Hook = Callable[..., Any]


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
        self._keys = itertools.count()

    def add(self, name: str, fn: Hook) -> HookHandle:
        """Call ``fn(**payload)`` at hook point ``name``; see ``HOOK_POINTS``."""
        if name not in HOOK_POINTS:
            raise ValueError(f"unknown hook point {name!r}; known hook points: {', '.join(HOOK_POINTS)}")
        if not callable(fn):
            raise TypeError(f"hook for {name!r} must be callable, got {type(fn).__name__}")
        key = next(self._keys)
        self._hooks.setdefault(name, {})[key] = fn
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

    def _remove(self, name: str, key: int) -> None:
        fns = self._hooks.get(name)
        if fns is not None:
            fns.pop(key, None)
            if not fns:
                del self._hooks[name]

    def active(self, name: str) -> bool:
        return name in self._hooks

    def any_active(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self._hooks)

    def clear(self) -> None:
        self._hooks.clear()

    def fire(self, name: str, **payload: Any) -> None:
        fns = self._hooks.get(name)
        if not fns:
            return
        for key, fn in list(fns.items()):
            try:
                fn(**payload)
            except Exception:
                warn_detached(fn, name)
                self._remove(name, key)
