"""Request and response bodies of the OpenAI-compatible API, as pydantic models (FastAPI validates with them).

Requests are validated strictly (a string is not a number, a float is not an integer), so a wrongly typed field
is an error rather than a guess. Fields of the OpenAI API that flashdraft does not implement are accepted only at
their neutral value (see `UNSUPPORTED_FIELDS`), so a request that relies on one fails loudly instead of being
answered as if it had been honoured; fields that change no answer are accepted (`IGNORED_FIELDS`); any other field
is refused by name, as OpenAI refuses one ("tempera2ure" must not be sampled at the default temperature).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..sampling import check_seed

# OpenAI request fields flashdraft does not implement, with the values that mean "not used".
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, 0),  # also matches False (chat's boolean form)
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    # vLLM's sampling extensions, which some OpenAI clients send at their neutral values
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
}
# OpenAI request fields that change nothing in an answer of this server: accepted and ignored.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "parallel_tool_calls", "modalities", "prompt_cache_key",
    "safety_identifier", "stream_options", "reasoning_effort", "verbosity",
})


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingRequest(StrictModel):
    """The fields both endpoints share. None means "the default" for every optional field."""

    model: str | None = None  # None: the one model this server serves
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # default 1, as in OpenAI's API; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # an extension (vLLM has it too); 0 = off
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list after validation
    seed: int | None = None  # 64 bits, signed or not (what a torch generator takes)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if "" in stops:
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int | None) -> int | None:
        check_seed(seed)  # here, not in the worker: a 400 naming the range rather than a failed generation
        return seed

    def unsupported_field(self) -> tuple[str, str, str] | None:
        """(field, message, error code) for the first field this server cannot honour or does not know, or None."""
        if self.n is not None and self.n > 1:
            return "n", (
                f"n={self.n} is not supported: flashdraft serve returns one choice per request; "
                "send n separate requests (with different seeds) instead"
            ), "unsupported_parameter"
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS:
                if value not in UNSUPPORTED_FIELDS[name]:
                    message = f"`{name}` is not supported by flashdraft serve: leave it out of the request"
                    return name, message, "unsupported_parameter"
            elif name not in IGNORED_FIELDS:
                known = ", ".join(sorted(type(self).model_fields))
                return name, (f"unrecognized request argument `{name}`: check its spelling; this endpoint takes "
                              f"{known}"), "unknown_parameter"
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins when both are set

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    # One prompt per request: text or token ids (the list forms hold exactly one, as OpenAI's batch forms).
    prompt: str | list[int] | list[str] | list[list[int]]

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


# ---------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V the server had kept from earlier prompts (not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Statistics(BaseModel):
    """flashdraft's own figures for one request, in the extra `flashdraft` field of a response."""

    block_size: int | str  # tokens per verification: the anchor plus block_size - 1 proposals (1 = no draft), or "auto"
    proposals: str | None  # what rounds verify: "hybrid", "dflash" or "lookup"; None: plain decoding
    tokens_by_source: dict[str, int]  # completion tokens by origin: accepted proposals per source, "target" the rest
    rounds: int  # target verifications after the prefill
    tau: float  # mean acceptance length: tokens per round (accepted proposals + the bonus token)
    acceptance_lengths: list[int]  # per round
    queue_seconds: float  # waiting for the worker
    prefill_seconds: float  # prompt forward until the first token
    decode_seconds: float  # every round after that
    cached_prompt_tokens: int  # prompt tokens whose K/V came from a prefix kept from earlier prompts


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    flashdraft: Statistics


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant"} first, then {"content": ...}; {} in the closing chunk
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty in the usage chunk
    usage: Usage | None = None
    flashdraft: Statistics | None = None  # in the chunk that carries finish_reason


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    """A completion, and (with finish_reason None, no usage) each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    flashdraft: Statistics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashdraft"
    max_model_len: int | None  # prompt plus completion tokens, as vLLM reports it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
