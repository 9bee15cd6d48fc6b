"""Constrained decoding in the engine core: grammars compiled off the busy loop, one matcher per
constrained request, and the token bitmask of each step.

The flow of one constrained request:
1. `add_request` submits its grammar to a compile thread and parks it in WAITING_FOR_GRAMMAR;
   the scheduler steps around it, so other requests go on.
2. `update` (at the start of every step, on the busy loop) turns finished compiles into
   matchers (`ready`) or failures; only here does `ready` change, so a scheduling pass sees
   one consistent answer.
3. For each step, `grammar_bitmask` writes the allowed next tokens of the sampling rows (a
   GrammarBitmask step message); the executor asks for it once the forward pass is on its way,
   so the CPU fills masks while the GPU works.
4. The scheduler hands each sampled token to `GrammarState.accept_tokens`, which queues it;
   the matcher advances at the next mask fill, again while the GPU works.

With speculative decoding a request's verify step needs a mask at each draft position: the
matcher steps over the drafts to fill them (row i: the allowed tokens after drafts[:i]) and
rolls back at once, so it only ever advances over the tokens verification keeps. Rows after a
draft the grammar forbids are left all ones: verification rejects that draft at its own
(masked) row and never reads the rows after it.

With a reasoning parser configured the constraint starts only after the reasoning's end tag
(in the prompt, when the chat template closed the reasoning, or in the output).
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from folio.config import StructuredOutputsConfig
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import ScheduledStep
from folio.core.step_messages import GrammarBitmask
from folio.reasoning import get_reasoning_format
from folio.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _last_index_of(seq: list[int], sub: list[int]) -> int:
    """Start index of the last occurrence of sub in seq, or -1."""
    n = len(sub)
    if n == 0:
        return -1
    for start in range(len(seq) - n, -1, -1):
        if seq[start:start + n] == sub:
            return start
    return -1


class ReasoningGate:
    """Tracks whether a request is still reasoning: the constraint waits for the end tag."""

    def __init__(self, start_ids: list[int], end_ids: list[int], prompt_ids: list[int],
                 prompt_opens: bool = False) -> None:
        self.end_ids = end_ids
        last_end = _last_index_of(prompt_ids, end_ids)
        last_start = _last_index_of(prompt_ids, start_ids)
        if prompt_opens:
            # Reasoning only when the prompt leaves a block open (DeepSeek-V3.1 thinking
            # ends the prompt with <think>; its other mode, and V3's template, do not).
            self.ended = last_start <= last_end
        else:
            # Ended in the prompt: the template already closed a reasoning block it opened
            # last (e.g. Qwen3 with enable_thinking=False writes an empty <think></think>).
            self.ended = last_end >= 0 and last_end > last_start
        self._tail: list[int] = []

    def feed(self, token_ids: list[int]) -> list[int]:
        """Consume output tokens; returns those that come after the reasoning ended."""
        if self.ended:
            return token_ids
        for i, token in enumerate(token_ids):
            self._tail = (self._tail + [token])[-len(self.end_ids):]
            if self._tail == self.end_ids:
                self.ended = True
                return token_ids[i + 1:]
        return []

    def clone(self) -> "ReasoningGate":
        """A copy to feed draft tokens to without changing this one."""
        other = ReasoningGate.__new__(ReasoningGate)
        other.end_ids, other.ended, other._tail = self.end_ids, self.ended, list(self._tail)
        return other


class RequestGrammar:
    """The GrammarState of one constrained request (see folio.core.request.GrammarState)."""

    def __init__(self, request_id: str, future: Future, gate: ReasoningGate | None) -> None:
        self.request_id = request_id
        self.future = future
        self.gate = gate
        self.ready = False
        self.error: str | None = None
        self.matcher: Any = None
        self._pending: list[int] = []

    @property
    def active(self) -> bool:
        """The mask applies to this request's next token (after `flush`)."""
        return self.matcher is not None and (self.gate is None or self.gate.ended)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Queue sampled tokens; the matcher advances in `flush`, which the next step's mask
        fill calls while the GPU runs that step's forward pass — so a batch's matcher updates
        (tens of µs per row) stay off the critical path. Always True: a rejection (a bug,
        since the mask allowed only grammar tokens) is logged when flushed."""
        if self.matcher is not None:
            self._pending.extend(token_ids)
        return True

    def fill_rows(self, bitmask: "torch.Tensor", first: int, drafts: list[int]) -> list[int]:
        """Write rows first .. first + len(drafts) of `bitmask`: the allowed tokens at the
        request's next position and after each prefix of its drafts. Returns the rows that
        carry a constraint (the others are all ones). The matcher ends where it began."""
        gate = self.gate.clone() if self.gate is not None and not self.gate.ended else None
        constrained: list[int] = []
        advanced = 0
        live = True
        for i in range(len(drafts) + 1):
            row = first + i
            if live and gate is None:
                self.matcher.fill_bitmask(bitmask, row)
                constrained.append(row)
            else:
                bitmask[row].fill_(-1)
            if i == len(drafts) or not live:
                continue
            if gate is not None:
                gate.feed([drafts[i]])
                if gate.ended:
                    gate = None       # the constraint starts after the end tag
            elif self.matcher.accept_token(drafts[i]):
                advanced += 1
            else:
                live = False          # rejected at row `row`; later rows are never read
        self.matcher.rollback(advanced)
        return constrained

    def flush(self) -> bool:
        """Advance the matcher by the queued tokens; False if the grammar rejected one."""
        if not self._pending:
            return True
        token_ids, self._pending = self._pending, []
        if self.gate is not None:
            token_ids = self.gate.feed(token_ids)
        for token in token_ids:
            if not self.matcher.accept_token(token):
                logger.warning("request %s: grammar rejected sampled token %d",
                               self.request_id, token)
                return False
        return True


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, tokenizer_factory: Callable[[], Any],
                 vocab_size: int, max_num_seqs: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: Any = None
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        # The tokenizer is loaded on first use, from the busy loop (reasoning tags) or the
        # compile thread, whichever comes first: one load, never two at once.
        self._tokenizer_lock = threading.Lock()
        self._reasoning_tags: tuple[list[int], list[int], bool] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Request] = []
        self._bitmask: torch.Tensor | None = None

    # ---- compile, off the busy loop ------------------------------------------------------

    def _get_compiler(self, eos_token_ids: tuple[int, ...]) -> Any:
        # Built on first use (in the compile thread): a server that never sees a constrained
        # request never loads grammar libraries or a second tokenizer copy.
        with self._compiler_lock:
            if self._compiler is None:
                from folio.structured_output.compilers import StructuredOutputCompiler
                # xgrammar compiles a grammar's token tables on several threads: half the
                # cores (up to 8) shortens a first request's wait without starving the busy
                # loop; on a 2-core machine that is one thread.
                threads = max(1, min(8, (os.cpu_count() or 2) // 2))
                self._compiler = StructuredOutputCompiler(
                    self._get_tokenizer(), self.vocab_size, self.config.backend,
                    stop_token_ids=list(eos_token_ids) or None, max_threads=threads)
            return self._compiler

    def _get_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_factory()
            return self._tokenizer

    def _compile(self, params: StructuredOutputsParams, eos_token_ids: tuple[int, ...]) -> Any:
        compiler = self._get_compiler(eos_token_ids)
        return compiler.new_matcher(compiler.compile(params))

    def _reasoning_gate(self, request: Request) -> ReasoningGate | None:
        if self.config.reasoning_parser is None:
            return None
        if self._reasoning_tags is None:
            fmt = get_reasoning_format(self.config.reasoning_parser)
            tokenizer = self._get_tokenizer()
            self._reasoning_tags = (
                list(tokenizer.encode(fmt.start_tag, add_special_tokens=False)),
                list(tokenizer.encode(fmt.end_tag, add_special_tokens=False)),
                fmt.prompt_opens)
        start_ids, end_ids, prompt_opens = self._reasoning_tags
        return ReasoningGate(start_ids, end_ids, request.prompt_token_ids, prompt_opens)

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-grammar")
        future = self._pool.submit(self._compile, params, request.eos_token_ids)
        request.structured_output = RequestGrammar(request.request_id, future,
                                                   self._reasoning_gate(request))
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._pending.append(request)

    def update(self) -> list[tuple[Request, str]]:
        """Settle finished compiles. Returns (request, error) for grammars that failed."""
        failed: list[tuple[Request, str]] = []
        still: list[Request] = []
        for request in self._pending:
            grammar: RequestGrammar = request.structured_output  # type: ignore[assignment]
            if request.is_finished:
                continue  # aborted while compiling
            if not grammar.future.done():
                still.append(request)
                continue
            try:
                grammar.matcher = grammar.future.result()
            except Exception as exc:  # ValueError for a bad grammar; anything else is a bug
                grammar.error = str(exc) if isinstance(exc, ValueError) else \
                    f"{type(exc).__name__}: {exc}"
                failed.append((request, grammar.error))
            grammar.ready = True
        self._pending = still
        return failed

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait_for_pending(self, timeout: float) -> None:
        """Block until some compile finishes (or timeout): for an engine with nothing else to do."""
        from concurrent.futures import FIRST_COMPLETED, wait
        futures = [r.structured_output.future for r in self._pending]  # type: ignore[union-attr]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- the mask of one step ------------------------------------------------------------

    def grammar_bitmask(self, step: ScheduledStep) -> GrammarBitmask | None:
        """The step's bitmask message: 1 + (its drafts) rows per sampling request, in the
        order of the step's `sampling_req_ids`, all ones but for the constrained rows; None
        when no row is constrained (every grammar still reasoning, say)."""
        items = [item for item in step.scheduled if item.samples]
        num_rows = sum(1 + len(item.spec_token_ids) for item in items)
        from folio.structured_output.backend import allocate_bitmask
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = allocate_bitmask(max(self.max_num_seqs, num_rows), self.vocab_size)
        bitmask = self._bitmask[:num_rows]
        # unconstrained rows allow everything: the GPU masks all rows at once
        bitmask.fill_(-1)
        rows: list[int] = []
        first = 0
        for item in items:
            grammar = item.request.structured_output
            if grammar is not None:
                grammar.flush()  # the previous step's tokens, while the GPU runs this one
                if grammar.matcher is not None and (grammar.active or item.spec_token_ids):
                    rows += grammar.fill_rows(bitmask, first, item.spec_token_ids)
            first += 1 + len(item.spec_token_ids)
        if not rows:
            return None
        # A view of this buffer, valid until the next step's fill: the worker copies it (in
        # process) or it is encoded at once (to worker processes).
        return GrammarBitmask([item.request.request_id for item in items], rows,
                              bitmask.shape[1], memoryview(bitmask.numpy()).cast("B"))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
