"""``kvscope.attach``: watch a vLLM deployment's prefix caches live, from its KV events (docs/ATTACH.md).

``kvscope.attach(endpoints, ...)`` subscribes to vLLM's ZMQ KV-event publishers and returns an
:class:`~kvscope.attach.attached.Attached` (DataFrames of events, held blocks, metrics, faults,
and cross-instance overlap). ``LLM(kv_events_config={...})`` publishes kvscope's own events in
the same format (:mod:`kvscope.attach.publisher`). This package is the function too
(``kvscope.attach(...)`` calls :func:`attach`), and imports pyzmq, msgspec and pandas only when
used: ``pip install "kvscope[attach]"``.
"""
from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Mapping, Sequence, Union

from kvscope.arg_checks import MAX_HWM, MAX_PORT, check_int, check_seconds, offset_endpoint, tcp_port
from kvscope.attach._deps import MODULES, require
from kvscope.attach.subscriber import DEFAULT_MAX_MESSAGE_BYTES
from kvscope.attach.wire import INT64_MAX

if TYPE_CHECKING:
    from kvscope.attach.attached import Attached

Endpoints = Union[str, Sequence[str], Mapping[str, str]]
_SCHEMES = ("tcp://", "ipc://", "inproc://")
_URL_SCHEMES = ("http://", "https://")
MIN_MESSAGE_BYTES = 1024  # a smaller limit could refuse even an empty batch under a long topic
MIN_METRICS_INTERVAL = 0.1  # seconds: a shorter interval polls /metrics back to back, a dead URL in a busy loop


def attach(
    endpoints: Endpoints,
    topic: str = "kv-events",
    replay_endpoints: Endpoints | None = None,
    metrics_urls: Endpoints | None = None,
    *,
    data_parallel_size: int = 1,
    metrics_interval: float = 1.0,
    hwm: int = 100_000,
    max_events: int = 1_000_000,
    replay_timeout: float = 2.0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> "Attached":
    """Subscribe to vLLM KV-event publishers; returns the live :class:`Attached`.

    ``endpoints``: one address (``"tcp://host:5557"``), a list (one per instance), or a dict
    ``{name: address}``. ``replay_endpoints`` and ``metrics_urls`` (each instance's Prometheus
    ``/metrics``) follow the same shape, matched to ``endpoints`` by position or by name.
    With ``data_parallel_size=n`` each address stands for ranks 0..n-1 on port + r, as vLLM binds them.
    ``max_message_bytes`` bounds each message frame: ZMQ refuses a larger one at its header, unread.
    """
    for module in MODULES:  # before attached imports pandas: a missing one is named with the extra
        require(module, "kvscope.attach")
    from kvscope.attach.attached import Attached
    from kvscope.attach.subscriber import Stream

    for arg, value, low, limit in (
        ("data_parallel_size", data_parallel_size, 1, MAX_PORT), ("hwm", hwm, 1, MAX_HWM),
        ("max_events", max_events, 1, sys.maxsize),  # (a deque's maxlen is a C ssize_t)
        ("max_message_bytes", max_message_bytes, MIN_MESSAGE_BYTES, INT64_MAX),  # (ZMQ's MAXMSGSIZE is an int64)
    ):
        check_int(arg, value, low)
        if value > limit:
            raise ValueError(f"{arg} must be an integer in {low}..{limit}, got {value!r}")
    check_seconds("metrics_interval", metrics_interval, MIN_METRICS_INTERVAL)
    check_seconds("replay_timeout", replay_timeout)
    named = _by_name(endpoints, "endpoints")
    replays = _matched(replay_endpoints, named, "replay_endpoints")
    urls = _matched(metrics_urls, named, "metrics_urls")
    for arg, addresses in (("endpoints", named), ("replay_endpoints", replays)):
        for name, address in addresses.items():
            _check_address(f"{arg}[{name!r}]", address, data_parallel_size)
    for name, url in urls.items():
        if not (isinstance(url, str) and url.startswith(_URL_SCHEMES)):
            raise ValueError(f"metrics_urls[{name!r}] must be a URL starting with {' or '.join(_URL_SCHEMES)}, "
                             f"got {url!r}")
    if not isinstance(topic, str):
        raise TypeError(f"topic must be a str, got {type(topic).__name__}")
    streams = [
        Stream(instance=name, data_parallel_rank=r, endpoint=offset_endpoint(address, r),
               replay_endpoint=offset_endpoint(replays.get(name), r),
               name=name if data_parallel_size == 1 else f"{name}/dp{r}")
        for name, address in named.items() for r in range(data_parallel_size)
    ]
    return Attached(streams, topic, urls or None, metrics_interval=metrics_interval, hwm=hwm,
                    max_events=max_events, replay_timeout=replay_timeout, max_message_bytes=max_message_bytes)


def _by_name(value: Endpoints, arg: str) -> dict[str, str]:
    """``value`` as ``{name: address}``; names are strings, since tables and views show them."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        out = dict(value)
    elif _is_list(value) and value and all(isinstance(v, str) for v in value):
        out = {}
        for v in value:
            if _short(v) in out:
                if out[_short(v)] == v:
                    raise ValueError(f"{arg} lists the same address twice: {list(value)}")
                raise ValueError(f"{arg} gives {out[_short(v)]!r} and {v!r} the same default name {_short(v)!r}; "
                                 "name them: a dict name -> address")
            out[_short(v)] = v
    else:
        raise ValueError(f"{arg} must be an address, a non-empty list of them, or a dict name -> address; got {value!r}")
    if not out or not all(isinstance(k, str) and isinstance(v, str) for k, v in out.items()):
        raise ValueError(f"{arg} must map names (strings) to address strings, got {value!r}")
    return out


def _is_list(value: object) -> bool:
    """A list or tuple of entries; bytes are a Sequence too, of ints, and would pass for one."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _check_address(arg: str, address: object, data_parallel_size: int) -> None:
    """A ZMQ address to connect to; a tcp one needs a host and a port that, offset by each
    data-parallel rank, stays a port (ZMQ connects to a bad one without a word, forever)."""
    if not (isinstance(address, str) and address.startswith(_SCHEMES)):
        raise ValueError(f"{arg} must start with one of {', '.join(_SCHEMES)}, got {address!r}")
    if not address.startswith("tcp://"):
        return
    port = tcp_port(address)
    last = MAX_PORT - data_parallel_size + 1
    if port is None or not 1 <= port <= last:
        raise ValueError(f"{arg} must be tcp://host:port with a port in 1..{last} "
                         f"(data_parallel_size={data_parallel_size} ranks from it), got {address!r}")


def _matched(value: Endpoints | None, named: dict[str, str], arg: str) -> dict[str, str]:
    """``value`` keyed by the instance names of ``endpoints`` (by position for a list)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, Mapping) or _is_list(value)):
        raise ValueError(f"{arg} must be an address, a list of them or a dict name -> address; got {value!r}")
    if isinstance(value, Mapping):
        unknown = set(value) - set(named)
        if unknown:
            raise ValueError(f"{arg} names unknown instances {sorted(unknown)}; instances: {list(named)}")
        return dict(value)
    if len(value) != len(named):
        raise ValueError(f"{arg} has {len(value)} entries for {len(named)} endpoints; give one per endpoint")
    return dict(zip(named, value))


def _short(address: str) -> str:
    """``tcp://host:5557`` -> ``host:5557``: the instance's default name."""
    return address.split("://", 1)[-1]


class _CallableModule(types.ModuleType):
    """Lets ``kvscope.attach`` be both this package and the function (``kvscope.attach(...)``)."""

    def __call__(self, *args: object, **kwargs: object) -> "Attached":
        return attach(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__all__ = ["attach"]
