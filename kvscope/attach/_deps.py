"""The optional dependencies of ``kvscope.attach``, imported on first use with an error that names the fix."""
from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = 'pip install "kvscope[attach]"'


def require(module: str) -> ModuleType:
    """Import ``module`` (``zmq``, ``msgspec``), or raise an ImportError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"kvscope.attach needs {module!r} (pyzmq and msgspec), which is not installed ({exc}); "
            f"install it with {INSTALL}"
        ) from exc
