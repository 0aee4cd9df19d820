"""Argument checks shared by every public boundary (engine config, sampling parameters, the
recorder, the attach and dashboard options), so each refuses bad input with the same words:
the argument's name, the limit, and the value it got."""
from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """An integer, but not a bool (``True`` would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_index(value: Any) -> bool:
    """An integer, numpy's too, but not a bool: what may index an array."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def is_finite_number(value: Any) -> bool:
    """An int or float, not a bool, neither NaN nor infinite (NaN fails every comparison, so a
    range check alone lets it through), nor an int past float's range (``math.isfinite`` raises
    OverflowError on it, naming no argument, and the engine computes in floats)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def plain_number(value: Any) -> Any:
    """``value`` as an exact ``int`` or ``float`` when it is another type's integer or real number:
    numpy's (vLLM takes them) or a subclass of int or float, whose own comparisons and hash would
    otherwise run at the checks and inside the engine's steps. A bool, or anything else, comes back
    as it is, for the checks to refuse by name."""
    if type(value) in (int, float) or isinstance(value, bool):
        return value
    if isinstance(value, (int, np.integer)):
        return operator.index(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value


def check_text(name: str, value: str) -> None:
    """A str the tokenizer can read: one UTF-8 can encode. (A lone surrogate made the tokenizer
    raise a TypeError about its own input types, naming nothing of the caller's.)"""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode text: {exc.reason} at index {exc.start}") from None


def check_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` if it is an integer >= ``minimum`` (and <= ``maximum``); else a ValueError naming ``name``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an integer in {minimum}..{maximum}, got {value!r}")
    return value


def check_seed(name: str, value: Any) -> int:
    """``value`` if it is an integer torch's generator takes, [-2**63, 2**64); else a ValueError
    naming ``name`` (the engine's seed and a request's share this range)."""
    if not is_int(value) or not -(2**63) <= value < 2**64:
        raise ValueError(f"{name} must be an integer in [-2**63, 2**64) (torch's generator range), got {value!r}")
    return value


MAX_SECONDS = 86400.0  # a day: a longer wait is a typo, and threads refuse timeouts past TIMEOUT_MAX
MAX_PORT = 65535  # the largest tcp port (ZMQ takes more without a word, modulo 65536)
MAX_HWM = 2**31 - 1  # ZMQ takes the high-water mark as a C int


def tcp_port(address: str) -> int | None:
    """The port of a ``tcp://host:port`` address, or None without a host or a decimal port
    (``*``, ZMQ's any port, too): what the KV-event config, the publisher and ``attach`` check."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    return int(port) if host and port.isdecimal() else None


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule: rank r publishes on the endpoint's port + r (``inproc://x`` gets ``_dp<r>``).

    The sum must stay a port: ZMQ takes 65536 and up without a word, modulo 65536."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    port = tcp_port(endpoint) if endpoint.startswith("tcp://") else None
    if port is None:
        raise ValueError(
            f"endpoint {endpoint!r} needs a numeric tcp port to offset by data_parallel_rank={data_parallel_rank}"
        )
    offset = port + data_parallel_rank
    if offset > MAX_PORT:
        raise ValueError(f"endpoint {endpoint!r} offset by data_parallel_rank={data_parallel_rank} is port {offset}, "
                         f"past {MAX_PORT}")
    return f"{endpoint.rpartition(':')[0]}:{offset}"


def check_seconds(name: str, value: Any, minimum: float | None = None) -> None:
    """A wait in seconds: finite, at most ``MAX_SECONDS``, and ``>= minimum`` (without one, any
    positive value); else a ValueError naming ``name``."""
    if is_finite_number(value) and value <= MAX_SECONDS and (value > 0 if minimum is None else value >= minimum):
        return
    low = "> 0" if minimum is None else f">= {minimum:g}"
    raise ValueError(f"{name} must be a finite number of seconds {low} and <= {MAX_SECONDS:g}, got {value!r}")


def check_inert(name: str, value: Any, why: str, default: Any = None) -> None:
    """A vLLM parameter kvscope takes only at vLLM's default (``None``, or ``False`` for a flag),
    so that a ported call runs; any other value is refused by name, as it would be ignored here."""
    if value is not default:
        raise ValueError(f"{name} must be {default!r}: {why}, got {value!r}")
