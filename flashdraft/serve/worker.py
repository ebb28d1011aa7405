"""The model side of the server: the loaded models (`Engine`) and the thread that decodes requests (`Worker`).

Requests become `Job`s on a bounded queue. One worker thread takes them in order and runs `flashdraft.stream`
for each, turning every round's tokens into text (`IncrementalText`) and handing the pieces back to the event
loop as events (`TextDelta`, then `Finished` or `Failed`) through `loop.call_soon_threadsafe`. The event loop
never runs a model, so it keeps accepting, validating and rejecting requests while the worker decodes.

A job whose client has gone is cancelled (`Worker.cancel`): a waiting job leaves the queue at once; a running one
is checked after every round and its token stream closed, so the worker is free within one round. Every job ends
its events with exactly one of `Finished`, `Failed` or `Cancelled`, so nothing waits on a job forever.

With `max_batch_size` above 1 (the server's default) the worker steps up to that many jobs together
(`flashdraft.batching.Batch`): waiting jobs join between rounds, prefilled together (their first tokens are sent
as soon as that prefill ends, before the round), each job's tokens are sent after every round, a finished or
cancelled job's row is freed before the next forward. With 1 it runs one job at a time through
`flashdraft.stream` (the serial worker, kept for comparison). The `Job` and event interface is the same for both.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from jinja2.exceptions import TemplateError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..batching import DEFAULT_PREFIX_CACHE_TOKENS, Batch, BatchSequence
from ..decoding import GenerationResult, check_block_size, check_proposals, stream
from ..draft import DFlashDraftModel
from ..proposals import check_compatible
from ..sampling import SamplingParams
from ..target import PromptPrefixes, TargetModel
from ..text import IncrementalText, encode_chat, stop_token_ids
from .schemas import Statistics

logger = logging.getLogger("flashdraft.serve")

def _glibc_trim():
    """glibc's `malloc_trim`, or None elsewhere (musl, macOS): what gives freed heap memory back to the system."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _glibc_trim()


def release_memory() -> None:
    """Give the memory freed since the last call back to the system. glibc keeps what a request freed (a long
    prompt's activations, a batch's caches, a megabyte body's tokenization) in its heaps and arenas, so without this
    the server's resident memory only grows; called when the worker runs out of work."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# Requests stepped together by default. On this 2-core CPU (SmolLM2-135M, BENCHMARKS.md "Continuous batching") output
# tokens/s still grew from 8 to 16 concurrent requests, and a round of 16 rows stays a fraction of a second.
DEFAULT_MAX_BATCH_SIZE = 16


@dataclass
class Engine:
    """What a server serves: a target, its tokenizer, an optional draft, what each round verifies and the name
    clients call it by."""

    target: TargetModel
    tokenizer: PreTrainedTokenizerBase
    draft: DFlashDraftModel | None
    name: str
    block_size: int | str  # tokens per verification; 1 = plain autoregressive decoding; "auto" = adaptive
    stop_token_ids: frozenset[int]  # end of sequence / end of turn: generation stops on any of them
    proposals: str | None = None  # "hybrid", "dflash", "lookup" (`flashdraft.stream`); None: plain decoding

    @classmethod
    def from_models(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        draft: DFlashDraftModel | None,
        *,
        name: str,
        block_size: int | str = "auto",
        proposals: str | None = None,
    ) -> Engine:
        """Check the models and the proposals fit together (at start-up, not on the first request): `proposals`
        as in `flashdraft.stream` (None: "hybrid" with a draft, plain decoding without; "lookup" uses no draft).
        Generation stops on the tokenizer's eos token and the generation config's eos ids (chat models put
        end-of-turn there)."""
        target = TargetModel(model)
        check_proposals(proposals)
        if proposals in ("hybrid", "dflash") and draft is None:
            raise ValueError(f"proposals {proposals!r} needs a draft: pass one, or use 'lookup' (no draft)")
        if proposals == "lookup":
            draft = None
        elif draft is not None:
            check_compatible(draft, target)
            proposals = proposals or "hybrid"
        check_block_size(block_size, has_draft=proposals is not None)
        if proposals is None:
            block_size = 1  # nothing to adapt: plain decoding, and the statistics say so
        return cls(target, tokenizer, draft, name, block_size, frozenset(stop_token_ids(model, tokenizer)), proposals)

    @property
    def context_length(self) -> int | None:
        """Prompt plus completion tokens the target can take, when its config says."""
        return self.target.max_positions

    @cached_property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt that fits the context can have: the context length times the longest token
        of the vocabulary (a token's text is at most its string's length), three times that when the tokenizer
        normalizes text (NFC composes up to three characters into one). None when the context is not known."""
        if self.context_length is None:
            return None
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        normalizes = backend is None or backend.normalizer is not None
        return self.context_length * longest * (3 if normalizes else 1)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template, ready for the assistant's turn."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"model {self.name!r} has no chat template: use /v1/completions with a plain prompt")
        try:
            return encode_chat(self.tokenizer, messages)
        except TemplateError as error:  # templates raise for conversations they do not accept
            raise ValueError(f"the model's chat template rejected the messages: {error}") from error

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt: text is tokenized (with BOS where the tokenizer adds one), token ids
        are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        vocab_size = self.target.vocab_size
        if any(not 0 <= token < vocab_size for token in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), the model's vocabulary")
        return list(prompt)


# Events the worker sends back to a request.


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (a stop token or stop string) or "length" (max_tokens)
    completion_tokens: int  # tokens generated, including a final stop token
    statistics: Statistics


@dataclass(frozen=True)
class Failed:
    message: str
    code: str = "generation_failed"  # the `code` of the error the client gets


@dataclass(frozen=True)
class Cancelled:
    """The job was cancelled (its client is gone). Sent all the same: a request handler may still be waiting."""


@dataclass(eq=False)  # a job is itself: found in and removed from the queue by identity
class Job:
    """One request's generation. Created on the event loop; the worker pushes events back onto it."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # TextDelta*, then Finished, Failed or Cancelled
    cancelled: threading.Event = field(default_factory=threading.Event)  # set by `Worker.cancel`
    submitted: float = field(default_factory=time.perf_counter)

    def push(self, event: TextDelta | Finished | Failed | Cancelled) -> None:
        """Called from the worker thread (or the event loop's own)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


class QueueFull(Exception):
    """The worker's queue holds `max_queue` jobs already."""


class ShuttingDown(Exception):
    """The worker is stopping: it takes no new job."""


SHUTTING_DOWN = "the server is shutting down"


class Worker:
    """One thread decoding queued jobs one at a time (see the module docstring)."""

    def __init__(self, engine: Engine, max_queue: int, max_batch_size: int = 1,
                 prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS):
        if max_queue < 1:
            raise ValueError(f"the queue must hold at least one request, got max_queue={max_queue}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch_size = max_batch_size
        PromptPrefixes(prefix_cache_tokens)  # checks the size now, not in the worker's thread
        self.prefix_cache_tokens = prefix_cache_tokens  # the batched loop's (`flashdraft.batching.Batch`)
        self.batched: dict[BatchSequence, _Running] = {}  # the batched loop's running jobs
        self._waiting: deque[Job] = deque()
        self._changed = threading.Condition()  # guards _waiting, _stopping and the counters
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.running: Job | None = None
        # Counters for /health.
        self.completed = 0
        self.cancelled = 0
        self.failed = 0

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        return len(self.batched) if self.max_batch_size > 1 else int(self.running is not None)

    def start(self) -> None:
        serve = self._serve
        if self.max_batch_size > 1:
            self._batch = self._new_batch()
            if self._batch.costs is not None:  # measured once per machine: before the first request, not during it
                size = 1
                while size < self.max_batch_size:
                    size *= 2
                    self._batch.costs.batch_costs(size)
            serve = self._serve_batched
        self._thread = threading.Thread(target=serve, name="flashdraft-worker", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True, timeout: float | None = None) -> None:
        """Fail what waits, stop what runs after its current forward (both answered `shutting_down`), refuse new
        jobs, and (with `wait`) wait for the thread to end, up to `timeout` seconds: a forward is never interrupted,
        and a long one (a prefill of thousands of tokens) is left to end with the process. Safe to call again."""
        with self._changed:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            self._changed.notify_all()
        for job in waiting:
            job.push(Failed(SHUTTING_DOWN, code="shutting_down"))
        if wait and self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the worker is still in a forward pass after %s s: exiting without waiting for it",
                               timeout)

    def submit(self, job: Job) -> None:
        with self._changed:
            if self._stopping:  # nothing would ever take it off the queue
                raise ShuttingDown(f"{SHUTTING_DOWN}: retry with another server or once it is back")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the server is busy: {self.max_queue} requests are already waiting; retry shortly")
            self._waiting.append(job)
            self._changed.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job leaves the queue at once (freeing its place), a running one stops
        after its current round; either way its last event is `Cancelled`. No effect on a finished job."""
        job.cancelled.set()
        with self._changed:
            waiting = job in self._waiting
            if waiting:
                self._waiting.remove(job)
                self.cancelled += 1
        if waiting:
            job.push(Cancelled())

    def _next(self) -> Job | None:
        with self._changed:
            if not self._waiting and not self._stopping:
                release_memory()  # the last job's memory, before waiting for the next
            self._changed.wait_for(lambda: self._waiting or self._stopping)
            return None if self._stopping else self._waiting.popleft()

    def _count(self, counter: str) -> None:
        with self._changed:
            setattr(self, counter, getattr(self, counter) + 1)

    def _take(self, most: int, wait: bool) -> list[Job] | None:
        """Up to `most` waiting jobs (waiting for one when `wait`, after giving back the memory the last ones
        freed); None once the worker stops."""
        with self._changed:
            if wait:
                if not self._waiting and not self._stopping:
                    self._batch.release_rows()
                    release_memory()
                self._changed.wait_for(lambda: self._waiting or self._stopping)
            if self._stopping:
                return None
            return [self._waiting.popleft() for _ in range(min(most, len(self._waiting)))]

    def _serve_batched(self) -> None:
        running = self.batched
        while (jobs := self._take(self.max_batch_size - len(running), wait=not running)) is not None:
            for job in jobs:
                self._join(self._batch, job)
            # The joiners' first tokens go out as soon as their prefill ends, before the round.
            for phase in (Batch.prefill, Batch.decode):
                try:
                    self._free_departed()  # a gone client's row is freed before the forward (and at once when idle)
                    if not running or self._stopping:
                        break
                    self._send(phase(self._batch))
                except Exception as error:  # a failure fails the running jobs, never the worker
                    logger.exception("generation failed")
                    for entry in running.values():
                        self._count("failed")
                        entry.job.push(Failed(f"generation failed: {error}"))
                    running.clear()
                    self._batch = self._new_batch()
                    break
        for entry in running.values():  # stopping: what runs is answered, as the serial worker does
            entry.job.push(Failed(SHUTTING_DOWN, code="shutting_down"))
        running.clear()

    def _new_batch(self) -> Batch:
        return Batch(self.engine.target, self.engine.draft, block_size=self.engine.block_size,
                     proposals=self.engine.proposals, prefix_cache_tokens=self.prefix_cache_tokens)

    def _free_departed(self) -> None:
        """Jobs whose client is gone leave the batch (their rows freed) and are answered `Cancelled`."""
        for sequence, entry in list(self.batched.items()):
            if entry.job.cancelled.is_set():
                self._batch.cancel(sequence)
                del self.batched[sequence]
                self._count("cancelled")
                entry.job.push(Cancelled())

    def _send(self, emitted: list[tuple[BatchSequence, list[int]]]) -> None:
        """Each job's new text; a finished job's last text and `Finished`."""
        running = self.batched
        for sequence, tokens in emitted:
            entry = running.get(sequence)
            if entry is None:
                continue
            delta, stopped = entry.text.add(tokens)
            if delta:
                entry.job.push(TextDelta(delta))
            if stopped:  # a stop string: the row goes now
                self._batch.cancel(sequence)
                self._finish(running.pop(sequence), "stop", sequence.result)
            elif sequence.result.stop_reason is not None:
                tail = entry.text.finish()
                if tail:
                    entry.job.push(TextDelta(tail))
                self._finish(running.pop(sequence), sequence.result.stop_reason, sequence.result)

    def _join(self, batch: Batch, job: Job) -> None:
        try:
            sequence = batch.add(job.prompt, max_new_tokens=job.max_tokens, temperature=job.sampling.temperature,
                                 top_p=job.sampling.top_p, top_k=job.sampling.top_k,
                                 stop_token_ids=self.engine.stop_token_ids, seed=job.seed)
        except Exception as error:
            self._count("failed")
            job.push(Failed(f"generation failed: {error}"))
            return
        self.batched[sequence] = _Running(job, IncrementalText(self.engine.tokenizer, job.stop),
                                          time.perf_counter() - job.submitted)

    def _finish(self, entry: _Running, finish_reason: str, result: GenerationResult) -> None:
        self._count("completed")
        entry.job.push(Finished(finish_reason, len(result.tokens),
                                statistics(self.engine, result, entry.queue_seconds)))

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            self.running = job
            self._run(job)
            self.running = None

    def _run(self, job: Job) -> None:
        queue_seconds = time.perf_counter() - job.submitted
        engine = self.engine
        finish_reason = None
        try:
            text = IncrementalText(engine.tokenizer, job.stop)
            tokens = stream(
                engine.target,
                engine.draft,
                job.prompt,
                max_new_tokens=job.max_tokens,
                temperature=job.sampling.temperature,
                top_p=job.sampling.top_p,
                top_k=job.sampling.top_k,
                stop_token_ids=engine.stop_token_ids,
                block_size=engine.block_size,
                seed=job.seed,
                proposals=engine.proposals,
            )
            with tokens:  # leaving the block closes the stream: generation stops there
                for new_tokens in tokens:
                    if job.cancelled.is_set():
                        self._count("cancelled")
                        job.push(Cancelled())
                        return
                    if self._stopping:
                        job.push(Failed(SHUTTING_DOWN, code="shutting_down"))
                        return
                    delta, stopped = text.add(new_tokens)
                    if delta:
                        job.push(TextDelta(delta))
                    if stopped:
                        finish_reason = "stop"
                        break
        except Exception as error:  # one request's failure must not end the worker
            logger.exception("generation failed")
            self._count("failed")
            job.push(Failed(f"generation failed: {error}"))
            return
        if finish_reason is None:
            tail = text.finish()
            if tail:
                job.push(TextDelta(tail))
            finish_reason = tokens.result.stop_reason
        result = tokens.result
        self._count("completed")
        job.push(Finished(finish_reason, len(result.tokens), statistics(engine, result, queue_seconds)))


@dataclass
class _Running:
    """A job of the batched loop: its text so far and how long it waited."""

    job: Job
    text: IncrementalText
    queue_seconds: float


def statistics(engine: Engine, result: GenerationResult, queue_seconds: float) -> Statistics:
    """A finished job's statistics, as the response's `flashdraft` field reports them."""
    return Statistics(
        block_size=engine.block_size,
        proposals=engine.proposals,
        tokens_by_source=result.tokens_by_source,
        rounds=len(result.acceptance_lengths),
        tau=result.tau,
        acceptance_lengths=result.acceptance_lengths,
        queue_seconds=queue_seconds,
        prefill_seconds=result.prefill_seconds,
        decode_seconds=result.decode_seconds,
        cached_prompt_tokens=result.cached_prompt_tokens,
    )
