"""kvscope: a paged-KV LLM inference engine you can watch.

``from kvscope import LLM, SamplingParams`` is a drop-in for vLLM's offline API.
"""
from kvscope.config import EngineConfig
from kvscope.llm import LLM
from kvscope.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvscope.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "EngineConfig",
           "Trace"]
__version__ = "0.1.0"


def dashboard(source: "LLM | Trace | Attached", **kwargs: object) -> "kvscope.widgets.Dashboard":
    """``kvscope.dashboard(llm)`` (live), ``kvscope.dashboard(trace)`` (replay), or
    ``kvscope.dashboard(kvscope.attach(...))`` (a vLLM deployment's prefix caches).

    Imported on first use, so ``import kvscope`` does not pay for the widget stack.
    See :class:`kvscope.widgets.Dashboard` for the options.
    """
    from kvscope.widgets import dashboard as make

    return make(source, **kwargs)


def load_ipython_extension(ipython: "IPython.InteractiveShell") -> None:
    """``%load_ext kvscope`` registers the ``%kvscope`` / ``%%kvscope`` magics."""
    from kvscope.magic import load_ipython_extension as load

    load(ipython)


__all__.append("dashboard")

import kvscope.attach  # noqa: E402  # the package is callable: kvscope.attach(endpoints, ...) (docs/ATTACH.md)

__all__.append("attach")


def __getattr__(name: str) -> object:
    """``kvscope.Trace`` on first use: the trace layer needs pandas (the notebook extra), the
    engine does not."""
    if name == "Trace":
        from kvscope.trace.trace import Trace

        return Trace
    raise AttributeError(f"module 'kvscope' has no attribute {name!r}")
