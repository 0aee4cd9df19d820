"""kvscope: a paged-KV LLM inference engine you can watch.

``from kvscope import LLM, SamplingParams`` is a drop-in for vLLM's offline API.
"""
from kvscope.config import EngineConfig
from kvscope.llm import LLM
from kvscope.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvscope.sampling_params import SamplingParams
from kvscope.trace.trace import Trace

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineConfig", "Trace"]
__version__ = "0.1.0"
