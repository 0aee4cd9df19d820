"""A small workload that exercises what the dashboard shows: shared prefixes, chunked prefill,
a full KV pool and preemption. Used by ``%kvscope demo``, ``python -m kvscope demo`` and the
notebooks. It builds an engine, so it sits at the API layer, above the widgets."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvscope.arg_checks import check_int

if TYPE_CHECKING:
    from kvscope.widgets.dashboard import Dashboard

# Few blocks and a small token budget, so a handful of requests already fills the pool and
# long prompts are prefilled in chunks.
DEMO_ENGINE_ARGS: dict[str, Any] = dict(block_size=16, num_kv_blocks=40, max_num_batched_tokens=96, max_num_seqs=8)

SYSTEM_PROMPT = (
    "You are a helpful assistant that answers questions about the Python standard library. "
    "Answer briefly and precisely, and give a short example when it helps.\n\n"
)
QUESTIONS = (
    "What does the itertools module provide?",
    "How do I read a file line by line?",
    "What is a dataclass?",
    "How do I sort a list of dictionaries by a key?",
    "What does functools.lru_cache do?",
    "How do I start a thread?",
    "What is the difference between a list and a tuple?",
    "How do I parse JSON?",
)


def demo_prompts(n: int = 8) -> list[str]:
    """``n`` questions behind one shared system prompt (prefix caching shares its blocks)."""
    return [SYSTEM_PROMPT + "Question: " + QUESTIONS[i % len(QUESTIONS)] + "\nAnswer:" for i in range(n)]


def demo(llm: Any = None, num_prompts: int = 8, max_tokens: int = 64, **dashboard_options: Any) -> "Dashboard":
    """A live dashboard on ``llm`` (default: ``LLM()`` on the bundled model with
    :data:`DEMO_ENGINE_ARGS`) running :func:`demo_prompts` in the background."""
    from kvscope import LLM, SamplingParams
    from kvscope.widgets.dashboard import Dashboard

    # Checked before the dashboard attaches: a refusal after it would leave ``llm`` recording.
    prompts = demo_prompts(check_int("num_prompts", num_prompts))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    dash = Dashboard(llm if llm is not None else LLM(**DEMO_ENGINE_ARGS), **dashboard_options)
    dash.generate_async(prompts, params)
    return dash
