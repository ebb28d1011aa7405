"""Response bodies and streams of the completion routes: the chat and text completion formats (one JSON body, or
server-sent events in OpenAI's chunk format), the event stream that cancels its job however it ends, and usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    Usage,
)
from .worker import (
    Cancelled,
    Failed,
    Finished,
    Job,
    TextDelta,
)


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


def _usage(prompt_tokens: int, finished: Finished) -> Usage:
    completion = finished.completion_tokens
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=finished.statistics.cached_prompt_tokens))
