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
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from itertools import takewhile

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..sampling import SamplingParams
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
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

# What an unknown path or method is told to use instead.
ENDPOINTS = "GET /v1/models, POST /v1/chat/completions, POST /v1/completions and GET /health"

# OpenAI's default for /v1/completions (chat defaults to the rest of the context); also used for chat when the
# target's config does not say how long its context is.
DEFAULT_COMPLETION_TOKENS = 16

# The largest request body served: far above any context length in tokens (a 128k-token prompt is about 1 MB of
# text or of token ids), far below what would hold up the server to parse.
DEFAULT_MAX_BODY_BYTES = 4 << 20
# A body must have arrived this long after its request began (a client sending a byte now and then holds a
# connection and its buffer: 408). 4 MiB on a slow link of 1 Mbit/s takes about 34 s.
DEFAULT_BODY_SECONDS = 60.0
# After a 413 has been sent, what the client still sends is read and dropped, up to this much and while it keeps
# coming, before the connection is closed: a client that writes its whole body before reading gets to read the
# answer instead of a reset connection.
DRAIN_BYTES = 64 << 20
DRAIN_IDLE_SECONDS = 1.0
# At shutdown, how long the worker's thread is waited for once every request is answered: it may be in the middle of
# a long forward (a prefill of thousands of tokens), which the exit does not wait for (the thread is a daemon).
WORKER_JOIN_SECONDS = 1.0

# Half of a UTF-16 surrogate pair: JSON can escape one alone ("\ud800"), but no UTF-8 text, so no tokenizer, holds it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An error answered in OpenAI's schema with the given HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None):
        # Messages quote what the client sent, which may hold a lone surrogate: escaped, it can be written as UTF-8.
        message = _utf8(message)
        param = None if param is None else _utf8(param)
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=headers)


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


class JSONBodies:
    """ASGI middleware: a POST body is read as JSON whatever its Content-Type says, so `requests.post(data=...)`,
    `curl -d` (form-encoded) or a client that sends no header at all is answered, not refused.

    Except from a browser page (a request with an `Origin` header): there a non-JSON content type is how another
    site's page posts to this server without a CORS preflight, so it keeps FastAPI's strict reading."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])  # ASGI header names are lower case
            if b"origin" not in headers and not _is_json(headers.get(b"content-type", b"").decode("latin-1")):
                others = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
                scope = {**scope, "headers": [*others, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body above `max_bytes` is answered 413 (`request_too_large`) without being kept
    or parsed: at once when its Content-Length says so, else as soon as that many bytes have come; a body that has
    not arrived `seconds` after the request began is answered 408 (`request_timeout`), and one still arriving when
    `stopping` is set 503 (`shutting_down`). A body within the limits is passed on whole."""

    def __init__(self, app, max_bytes: int, seconds: float, stopping: asyncio.Event):
        self.app = app
        self.max_bytes = max_bytes
        self.seconds = seconds
        self.stopping = stopping

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.seconds
        body, received, more = [], 0, True
        while more:
            try:
                message = await _receive_before(receive, deadline, self.stopping)
            except TimeoutError:
                error = APIError(
                    408, f"the request body did not arrive within {self.seconds:g} s: send it at once, or start the "
                    "server with a longer --body-seconds", code="request_timeout",
                )
                await _error_response(error, {"Connection": "close"})(scope, receive, send)
                return
            except ShuttingDown:
                error = APIError(503, f"{SHUTTING_DOWN}: retry with another server or once it is back",
                                 type="server_error", code="shutting_down")
                await _error_response(error, {"Connection": "close"})(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            chunk, more = message.get("body", b""), message.get("more_body", False)
            received += len(chunk)
            if received > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            body.append(chunk)
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _too_large(self, scope, receive, send) -> None:
        """The 413 goes out whole at once; the response ends (and the connection closes) once what the client still
        sends has been read, up to `DRAIN_BYTES`, or nothing came for `DRAIN_IDLE_SECONDS`."""
        error = APIError(
            413, f"the request body is larger than {self.max_bytes} bytes, this server's limit: send a shorter "
            "prompt, or start the server with a larger --max-body-bytes", code="request_too_large",
        )
        body = error.body.model_dump_json().encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        drained, more, loop = 0, True, asyncio.get_running_loop()
        while more and drained <= DRAIN_BYTES and not self.stopping.is_set():
            try:
                message = await _receive_before(receive, loop.time() + DRAIN_IDLE_SECONDS, self.stopping)
            except (TimeoutError, ShuttingDown):
                break
            drained += len(message.get("body", b""))
            more = message["type"] != "http.disconnect" and message.get("more_body", False)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _receive_before(receive, deadline: float, stopping: asyncio.Event):
    """`receive()`, raising TimeoutError once the event loop's clock passes `deadline` and ShuttingDown as soon as
    `stopping` is set (a server shutting down waits for no body)."""
    if stopping.is_set():
        raise ShuttingDown
    receiving, stopped = asyncio.ensure_future(receive()), asyncio.ensure_future(stopping.wait())
    try:
        timeout = max(deadline - asyncio.get_running_loop().time(), 0)
        done, _ = await asyncio.wait((receiving, stopped), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not receiving.done():
            receiving.cancel()
    if receiving in done:
        return receiving.result()
    if stopped in done:
        raise ShuttingDown
    raise TimeoutError


def _replay(body: bytes, receive):
    """An ASGI receive that hands over `body` whole, then what `receive` brings (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again():
        return pending.pop() if pending else await receive()

    return receive_again


def _lone_surrogate(value) -> list | None:
    """The path to the first string or key in a parsed JSON value that holds a lone surrogate, or None. Without
    recursion: an ignored field may be nested as deep as the JSON parser allows."""
    stack = [([], value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):  # a key with one is reported as if it were its value
                stack.append(([*path, key], key if LONE_SURROGATE.search(key) else item))
        elif isinstance(value, list):
            stack.extend(([*path, index], item) for index, item in reversed(list(enumerate(value))))
    return None


def _where(path: list) -> str:
    """A location in the body as a client writes it: `messages[0].role`."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


def _validation_error(error: RequestValidationError) -> APIError:
    """FastAPI's list of validation errors -> one 400 naming the field and what is wrong with it."""
    problems = error.errors()
    paths = [list(problem["loc"][1:]) for problem in problems]  # loc[0] is "body"
    first, path = problems[0], paths[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "malformed JSON")
        position = f" at character {path[0]}" if path else ""
        return APIError(400, f"the request body is not valid JSON ({reason}{position})", code="invalid_json")
    if not path:  # the body as a whole: missing, not a JSON object, or (from a browser page) not sent as JSON
        unread = isinstance(first.get("input"), bytes)  # FastAPI passes the raw bytes of a body it did not parse
        hint = " sent with Content-Type: application/json" if unread else ""
        return APIError(400, f"the request body must be a JSON object{hint}", code="invalid_body")
    param = str(path[0])
    if first["type"] == "missing":
        return APIError(
            400, f"missing required field `{_where(path)}`", param=param, code="missing_required_parameter"
        )
    # A union type reports one error per alternative, each under its own tag in the location: report the field
    # where they part (the common prefix of their paths) and their distinct messages.
    same_field = [(problem, p) for problem, p in zip(problems, paths) if p[:1] == path[:1]]
    common = path
    for _, other in same_field:
        common = [part for part, _ in takewhile(lambda pair: pair[0] == pair[1], zip(common, other))]
    messages = dict.fromkeys(problem["msg"].removeprefix("Value error, ") for problem, _ in same_field)
    return APIError(400, f"invalid `{_where(common)}`: {'; or '.join(messages)}", param=param, code="invalid_value")


def _http_error(request: Request, error: StarletteHTTPException) -> APIError:
    """The framework's own errors: no such path, a method the path does not take, a body it could not read."""
    route = f"{request.method} {request.url.path}"
    if error.status_code == 404:  # `unknown_url`: OpenAI's code for a path it does not serve
        message = f"unknown path {route}: the endpoints are {ENDPOINTS}"
        return APIError(404, message, type="not_found_error", code="unknown_url")
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "another method")
        message = f"{route} is not allowed: {request.url.path} takes {allowed}"
        return APIError(405, message, code="method_not_allowed")
    if error.status_code == 400:  # FastAPI could not decode the body, e.g. bytes that are not UTF-8
        message = f"the request body is not valid JSON ({error.__cause__ or error.detail}): send UTF-8 encoded JSON"
        return APIError(400, message, code="invalid_json")
    return APIError(error.status_code, f"{route}: {error.detail}", code=f"http_{error.status_code}")


def _failure(failed: Failed) -> APIError:
    status = 503 if failed.code == "shutting_down" else 500  # 503: another server, or this one later, will answer
    return APIError(status, failed.message, type="server_error", code=failed.code)


class ChatFormat:
    """Response bodies of /v1/chat/completions."""

    def __init__(self, model: str):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model

    def _chunk(self, choices, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def delta(self, text: str, first: bool) -> ChatCompletionChunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return self._chunk([ChatChunkChoice(delta=delta)])

    def finish(self, finished: Finished) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta={}, finish_reason=finished.finish_reason)
        return self._chunk([choice], flashdraft=finished.statistics)

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage=usage)

    def response(self, text: str, finished: Finished, usage: Usage) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finished.finish_reason)
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage,
            flashdraft=finished.statistics,
        )


class CompletionFormat:
    """Response bodies of /v1/completions; a chunk is a completion without usage."""

    def __init__(self, model: str):
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model

    def _completion(self, choices, **extra) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def delta(self, text: str, first: bool) -> Completion:
        return self._completion([CompletionChoice(text=text)])

    def finish(self, finished: Finished) -> Completion:
        choice = CompletionChoice(text="", finish_reason=finished.finish_reason)
        return self._completion([choice], flashdraft=finished.statistics)

    def usage(self, usage: Usage) -> Completion:
        return self._completion([], usage=usage)

    def response(self, text: str, finished: Finished, usage: Usage) -> Completion:
        choice = CompletionChoice(text=text, finish_reason=finished.finish_reason)
        return self._completion([choice], usage=usage, flashdraft=finished.statistics)


class EventStream(StreamingResponse):
    """Server-sent events of one job. However the response ends (finished, client gone, failed), `on_close` runs:
    the routes cancel the job there, which frees the worker or the job's place in the queue. (A `finally` inside
    the event generator would not run if the client left before the generator started.)"""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(body) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def _events(job: Job) -> AsyncIterator[TextDelta | Finished | Failed | Cancelled]:
    while True:
        event = await job.events.get()
        yield event
        if not isinstance(event, TextDelta):
            return


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


def _usage(prompt_tokens: int, finished: Finished) -> Usage:
    completion = finished.completion_tokens
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=finished.statistics.cached_prompt_tokens))


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
