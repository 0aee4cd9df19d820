"""A request inside the engine: its tokens, how many have KV in the cache, and its pages.

vLLM V1 calls this ``Request``; the scheduler owns every change of its ``status``."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvscope.engine.detokenizer import IncrementalDetokenizer
from kvscope.engine.scheduler_output import TokenHistory
from kvscope.outputs import RequestMetrics
from kvscope.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request's state. ``token_ids`` is prompt + generated tokens.

    ``num_computed_tokens`` counts tokens whose K/V are in the pool or being written by a
    scheduled step; the block table covers exactly those. ``prefill_len`` is the token count
    at the last admission: positions below it are prefill, later ones decode (a preempted
    request recomputes its outputs as prefill). ``num_pending`` counts tokens already sampled
    on the device but not yet appended to ``token_ids``: under async scheduling the next step
    is scheduled before the last one's tokens come back.
    """

    seq_id: int
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 0
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    prefill_len: int = 0
    block_table: list[int] = field(default_factory=list)
    num_sent_blocks: int = 0  # block_table entries the runner already holds (SchedulerOutput deltas)
    resumed: bool = False     # its next scheduled row starts a new block table (after preemption or rollback)
    block_hashes: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # set when the request failed alone inside a step
    final_only: bool = False  # report it only when it finishes (LLM.generate's requests)
    stop_strings: list[str] = field(init=False, default_factory=list)  # params'; read per token
    # EOS and ``stop_token_ids`` together: one set lookup per token finds every token-level stop.
    stop_token_set: frozenset[int] = field(init=False, default=frozenset())
    output_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""  # the final text, set when the request finishes
    detokenizer: IncrementalDetokenizer | None = None  # streaming text, made on first use
    history: TokenHistory | None = field(init=False, default=None)  # what penalties and prompt logprobs read
    prompt_logprobs: list[dict[int, float] | None] | None = field(init=False, default=None)  # when asked

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.stop_strings = self.params.stop_strings
        self.stop_token_set = self.eos_token_ids.union(self.params.stop_token_ids)
        if self.params.logprobs is not None:
            self.output_logprobs = []
        k = self.params.prompt_logprobs
        if k is not None:
            self.prompt_logprobs = [None]  # (the first token has none: nothing comes before it)
        if self.params.penalizes or self.params.bad_words or k is not None:
            self.history = TokenHistory(self.token_ids, self.num_prompt_tokens, k)

    @property
    def num_prompt_logits(self) -> int:
        """How many prompt positions still owe the log-prob of the token after them."""
        return 0 if self.prompt_logprobs is None else self.num_prompt_tokens - len(self.prompt_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens including the ones still in flight: the length the scheduler plans with."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def streamed_text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
