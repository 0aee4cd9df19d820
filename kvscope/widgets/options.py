"""The dashboards' options, checked where users pass them: a bad one would otherwise surface
later, in the update thread, where it stops live updates with nothing said in the notebook."""
from __future__ import annotations

from typing import Any

from kvscope.arg_checks import check_seconds, is_finite_number


def view_names(views: Any) -> list[str]:
    """``views`` as a list of names: a list (or any iterable) of str, or one str of names
    separated by commas, as ``%kvscope --views`` takes them."""
    if isinstance(views, str):
        names = [v.strip() for v in views.split(",") if v.strip()]
    else:
        try:
            names = list(views)
        except TypeError:
            raise TypeError(f"views must be view names (a list of str, or one str separated by commas), "
                            f"got {type(views).__name__}") from None
        if not all(isinstance(v, str) for v in names):
            raise TypeError(f"views must be view names (str), got {names!r}")
    if not names:
        raise ValueError("views must name at least one view")
    return names


def check_interval(interval: Any) -> float:
    """Seconds between two browser updates: a finite number in [0, ``MAX_SECONDS``]."""
    check_seconds("interval", interval, minimum=0)
    return float(interval)


def check_max_load(max_load: Any) -> float:
    """The largest share of the wall time live updates may take: in (0, 1]."""
    if not is_finite_number(max_load) or not 0 < max_load <= 1:
        raise ValueError(f"max_load must be a share of the wall time in (0, 1], got {max_load!r}")
    return float(max_load)
