"""The FastAPI application: OpenAI-compatible routes over an already loaded `Engine`.

`create_app(engine)` builds the app and its `Worker`; the worker thread starts and stops with the app's lifespan.
Routes validate a request, turn it into prompt token ids and a `Job`, queue the job (429 when the queue is full)
and answer either with one JSON body or with server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`. Every error, ours or the framework's, leaves in OpenAI's error schema
`{"error": {"message", "type", "param", "code"}}`, always with a code a client can branch on.

Nothing slow runs on the event loop: bodies are limited in size (413 above `max_body_bytes`, at once when the
Content-Length says so) and in time (408 when one does not arrive within `body_seconds`), a prompt longer than the
context could hold is refused before it is tokenized (its characters against the longest token), prompts are
tokenized in a thread, and the model runs in the worker's, so /health and running streams never wait on a request.

Shutting down (`Server`, on SIGTERM or Ctrl-C), every request still open is answered at once, whatever the worker
is computing: waiting and running ones `shutting_down` (a 503, or a stream's last event before `[DONE]`), a body
still arriving a 503 too.

Around the routes: `bodies` (the middleware that reads and limits request bodies), `errors` (OpenAI's error schema),
`responses` (the response bodies and event streams).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..sampling import SamplingParams
from .bodies import DEFAULT_BODY_SECONDS, DEFAULT_MAX_BODY_BYTES, BodyLimit, JSONBodies
from .errors import APIError, _error_response, _failure, _http_error, _lone_surrogate, _validation_error, _where
from .responses import ChatFormat, CompletionFormat, EventStream, _events, _sse, _usage
from .schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
)
from .worker import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_PREFIX_CACHE_TOKENS,
    SHUTTING_DOWN,
    Cancelled,
    Engine,
    Failed,
    Finished,
    Job,
    QueueFull,
    ShuttingDown,
    TextDelta,
    Worker,
)

# OpenAI's default for /v1/completions (chat defaults to the rest of the context); also used for chat when the
# target's config does not say how long its context is.
DEFAULT_COMPLETION_TOKENS = 16

# At shutdown, how long the worker's thread is waited for once every request is answered: it may be in the middle of
# a long forward (a prefill of thousands of tokens), which the exit does not wait for (the thread is a daemon).
WORKER_JOIN_SECONDS = 1.0


def create_app(engine: Engine, *, max_queue: int = 64, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_seconds: float = DEFAULT_BODY_SECONDS,
               prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> FastAPI:
    """The server's FastAPI app over `engine`, with a worker stepping up to `max_batch_size` requests together (1:
    one at a time) whose queue holds up to `max_queue` more, serving request bodies of up to `max_body_bytes` that
    arrive within `body_seconds`; batched, it keeps up to `prefix_cache_tokens` positions of prompt prefixes that
    requests share. `app.state.begin_shutdown()` (called on the event loop) answers every open request at once."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
    if not body_seconds > 0:
        raise ValueError(f"body_seconds must be above 0, got {body_seconds}")
    worker = Worker(engine, max_queue, max_batch_size, prefix_cache_tokens)
    started = int(time.time())
    max_prompt_chars = engine.max_prompt_chars  # computed now (a walk over the vocabulary), not on a request
    stopping = asyncio.Event()
    open_jobs: set[Job] = set()  # submitted, not yet answered: what a shutdown must answer

    def begin_shutdown() -> None:
        """Refuse new requests and bodies still arriving, and answer every open one `shutting_down` now: the worker
        may be in the middle of a long forward, which nobody waits for (see `Worker.stop`)."""
        stopping.set()
        worker.stop(wait=False)
        for job in list(open_jobs):
            job.events.put_nowait(Failed(SHUTTING_DOWN, code="shutting_down"))  # the first last event is the one read

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            begin_shutdown()
            worker.stop(timeout=WORKER_JOIN_SECONDS)

    app = FastAPI(
        title="flashdraft",
        version=__version__,
        description="OpenAI-compatible API over lossless DFlash speculative decoding.",
        lifespan=lifespan,
    )
    app.state.worker = worker
    app.state.begin_shutdown = begin_shutdown
    app.add_middleware(JSONBodies)
    # Added last: the outermost, before anything reads.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, seconds=body_seconds, stopping=stopping)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return _error_response(error, {"Retry-After": "1"} if error.status == 429 else None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return _error_response(_validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return _error_response(_http_error(request, error), error.headers)  # headers: Allow, for a 405

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        return _error_response(APIError(500, f"internal error: {error}", type="server_error", code="internal_error"))

    # ------------------------------------------------------------------------------------------ routes

    @app.get("/health")
    async def health() -> dict:
        """Liveness and load: the running and queued requests and what the worker has done so far."""
        return {
            "status": "ok",
            "model": engine.name,
            "running": worker.running_count,
            "max_batch_size": worker.max_batch_size,
            "queued": worker.queued,
            "max_queue": worker.max_queue,
            "completed": worker.completed,
            "cancelled": worker.cancelled,
            "failed": worker.failed,
        }

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.name, created=started, max_model_len=engine.context_length)])

    @app.post("/v1/chat/completions", response_model=ChatCompletion)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_text(await request.json())  # the body as parsed: FastAPI's, cached
        _check_request(body)
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        _check_length(sum(len(message["content"]) for message in messages), "messages")
        prompt = await _tokenize(engine.chat_prompt, messages, "messages")
        max_tokens = _token_budget(len(prompt), body.token_budget, "messages", default=None)
        return await _respond(request, body, prompt, max_tokens, ChatFormat(engine.name))

    @app.post("/v1/completions", response_model=Completion)
    async def completions(body: CompletionRequest, request: Request):
        _check_text(await request.json())
        _check_request(body)
        prompt_input = body.prompt
        if isinstance(prompt_input, list) and prompt_input and isinstance(prompt_input[0], (str, list)):
            if len(prompt_input) != 1:
                raise APIError(
                    400, f"one prompt per request: got {len(prompt_input)}; send them as separate requests",
                    param="prompt", code="unsupported_parameter",
                )
            prompt_input = prompt_input[0]
        _check_length(len(prompt_input), "prompt")
        prompt = await _tokenize(engine.text_prompt, prompt_input, "prompt")
        max_tokens = _token_budget(len(prompt), body.token_budget, "prompt", default=DEFAULT_COMPLETION_TOKENS)
        return await _respond(request, body, prompt, max_tokens, CompletionFormat(engine.name))

    # ----------------------------------------------------------------------------------------- helpers

    def _check_text(fields: dict) -> None:
        path = _lone_surrogate(fields)
        if path is not None:
            raise APIError(
                400, f"`{_where(path)}` is not valid Unicode text: it holds a lone surrogate (half of a UTF-16 pair, "
                "such as \\ud800, without its other half): send whole characters", param=str(path[0]),
                code="invalid_value",
            )

    def _check_request(body: SamplingRequest) -> None:
        unsupported = body.unsupported_field()
        if unsupported is not None:
            param, message, code = unsupported
            raise APIError(400, message, param=param, code=code)
        if body.model is not None and body.model != engine.name:
            raise APIError(
                404, f"model {body.model!r} is not served here: this server serves {engine.name!r} (see /v1/models)",
                param="model", code="model_not_found",
            )

    def _check_length(length: int, param: str) -> None:
        """Refuse a prompt that cannot fit the context before tokenizing it (a prompt of megabytes takes seconds):
        `length` characters (or token ids) make at least length / `max_prompt_chars` * context tokens."""
        limit = engine.context_length
        if limit is not None and length > max_prompt_chars:
            raise APIError(
                400, f"the {param} are {length} characters long, more than the model's context of {limit} tokens "
                f"can hold (at most {max_prompt_chars} characters with its longest tokens): shorten the prompt",
                param=param, code="context_length_exceeded",
            )

    async def _tokenize(to_ids, prompt_input, param: str) -> list[int]:
        try:  # in a thread: a prompt of megabytes takes seconds, which the event loop must not wait for
            prompt = await asyncio.to_thread(to_ids, prompt_input)
        except ValueError as error:
            raise APIError(400, str(error), param=param, code="invalid_value") from error
        if not prompt:
            raise APIError(
                400, f"the {param} tokenize to nothing: give at least one token", param=param, code="invalid_value"
            )
        return prompt

    def _token_budget(prompt_tokens: int, requested: int | None, prompt_param: str, default: int | None) -> int:
        """max_tokens for the job: the requested number, else the default (None: the rest of the context)."""
        limit = engine.context_length
        if limit is None:
            return requested or default or DEFAULT_COMPLETION_TOKENS
        room = limit - prompt_tokens
        if room < 1:
            raise APIError(
                400, f"the {prompt_param} take {prompt_tokens} tokens, the model's context length is {limit}: "
                "no room is left for the completion; shorten the prompt",
                param=prompt_param, code="context_length_exceeded",
            )
        if requested is None:
            return min(default, room) if default else room
        if requested > room:
            raise APIError(
                400, f"the {prompt_param} ({prompt_tokens} tokens) plus max_tokens ({requested}) exceed the "
                f"model's context length of {limit} tokens: shorten the prompt or lower max_tokens",
                param="max_tokens", code="context_length_exceeded",
            )
        return requested

    async def _respond(request: Request, body: SamplingRequest, prompt: list[int], max_tokens: int, format):
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
        )
        job = Job(prompt, max_tokens, sampling, body.seed, body.stop, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull as error:
            raise APIError(429, str(error), type="rate_limit_error", code="queue_full") from None
        except ShuttingDown as error:
            raise APIError(503, str(error), type="server_error", code="shutting_down") from None
        open_jobs.add(job)

        def release() -> None:  # the request is answered (or its client gone): the worker may drop the job
            open_jobs.discard(job)
            worker.cancel(job)

        if body.stream:
            return EventStream(_stream(job, format, len(prompt), body.include_usage), release)
        return await _collect(request, job, format, len(prompt), release)

    async def _stream(job: Job, format, prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        first = True
        async for event in _events(job):
            if isinstance(event, Cancelled):  # the client is gone: nobody reads on
                return
            if isinstance(event, Failed):
                yield f"data: {_failure(event).body.model_dump_json()}\n\n"
                break
            if isinstance(event, TextDelta) or first:  # the first chunk carries the role, even if empty
                yield _sse(format.delta(event.text if isinstance(event, TextDelta) else "", first))
                first = False
            if isinstance(event, Finished):
                yield _sse(format.finish(event))
                if include_usage:
                    yield _sse(format.usage(_usage(prompt_tokens, event)))
        yield "data: [DONE]\n\n"

    async def _collect(request: Request, job: Job, format, prompt_tokens: int, release):
        # Nothing is written before the end, so a departed client is noticed by listening for its disconnect.
        async def cancel_when_gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            worker.cancel(job)

        watcher = asyncio.create_task(cancel_when_gone())
        try:
            parts = []
            async for event in _events(job):
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Failed):
                    raise _failure(event)
                elif isinstance(event, Cancelled):  # the client is gone; 499 as nginx logs it, though nobody reads it
                    return Response(status_code=499)
                else:
                    return format.response("".join(parts), event, _usage(prompt_tokens, event))
        finally:
            watcher.cancel()
            release()

    return app

class Server(uvicorn.Server):
    """uvicorn's server for an app of `create_app`. On SIGTERM or Ctrl-C uvicorn stops listening, then waits for
    every open request to end, and a request here can take minutes; so every open request is answered first:
    waiting and running ones `shutting_down` (a JSON 503, or a stream's last event and `[DONE]`), a body still
    arriving 503. uvicorn's grace period is then left for clients that do not read their answer, and the server
    exits within seconds whatever its clients do, with status 0: the stop was asked for and went as planned
    (uvicorn itself re-raises the signal, so that its status would say "killed by SIGTERM")."""

    async def shutdown(self, sockets=None) -> None:
        self.config.app.state.begin_shutdown()  # the worker's thread is joined in the app's lifespan, after this
        await super().shutdown(sockets=sockets)

    @contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                if not self.force_exit:  # a second Ctrl-C forced the exit: that one still tells
                    self._captured_signals.clear()
