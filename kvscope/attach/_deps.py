"""The optional dependencies of ``kvscope.attach``, imported on first use with an error that names the fix."""
from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = 'pip install "kvscope[attach]"'
MODULES = ("zmq", "msgspec", "pandas")  # what the extra installs, by import name
_PACKAGES = {"zmq": "pyzmq"}  # an import name that is not its pip package's name


def require(module: str, needed_by: str) -> ModuleType:
    """Import ``module``, or raise an ImportError naming it, ``needed_by`` (the feature or argument
    that asked for it) and the extra to install: the reader must know which piece is missing and why."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = _PACKAGES.get(module)
        named = f"{module} (the {package} package)" if package else module
        raise ImportError(f"{needed_by} needs {named}, which does not import ({exc}); "
                          f"install it with {INSTALL}") from exc
