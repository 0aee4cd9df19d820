"""Parallel sampling (``SamplingParams(n=k)``, k > 1), as vLLM V1 does it: the engine runs k
child requests of one prompt and its caller sees one request.

Children are ordinary requests to the scheduler, the block manager and the trace (ids
``f"{index}_{request_id}"``, as vLLM names them); their shared prompt blocks come from the
prefix cache, so the pool view shows the sharing. A seeded parent gives child i the seed
``seed + i``. What the caller gets back is one ``RequestOutput`` under the parent's id whose
``outputs`` hold each child's latest completion, by index: a streamed parent is reported at
every step in which a child progressed, a ``FINAL_ONLY`` one once, when all have finished. A
``DELTA`` parent's output holds only the completions of the children that progressed, each
with what is new since that child's last output (vLLM's streaming parents report only those).
"""
from __future__ import annotations

import dataclasses

from kvscope.outputs import CompletionOutput, RequestOutput
from kvscope.sampling_params import RequestOutputKind, SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The ids of the children of a request with ``n > 1`` (none for ``n == 1``)."""
    return [f"{index}_{request_id}" for index in range(n)] if n > 1 else []


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One child's parameters: ``n=1``, and its own seed when the parent has one."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """The children of one ``n > 1`` request and their latest completions."""

    def __init__(self, request_id: str, n: int, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.child_ids = child_request_ids(request_id, n)
        self.output_kind = output_kind
        self._sent_prompt_logprobs = False  # (DELTA: the first child output that has them carries them)
        self._completions: list[CompletionOutput | None] = [None] * n
        self._unfinished = set(range(n))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def merge(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """Take child ``index``'s output; the parent's output to report now, if any (a ``DELTA``
        one holds that child's completion alone: the engine adds up one step's, see
        :meth:`RequestOutput.add`)."""
        completion = dataclasses.replace(output.outputs[0], index=index)
        if output.finished:
            self._unfinished.discard(index)
        if self.output_kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self._sent_prompt_logprobs else output.prompt_logprobs
            self._sent_prompt_logprobs |= prompt_logprobs is not None
            return dataclasses.replace(output, request_id=self.request_id, finished=self.finished,
                                       outputs=[completion], prompt_logprobs=prompt_logprobs)
        self._completions[index] = completion
        if self.output_kind is RequestOutputKind.FINAL_ONLY and self._unfinished:
            return None
        return dataclasses.replace(
            output, request_id=self.request_id, finished=self.finished,
            outputs=[c for c in self._completions if c is not None],
        )
