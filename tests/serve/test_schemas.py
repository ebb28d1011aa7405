"""Request models and the translation of validation errors into one OpenAI-style error, exactly."""

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from flashdraft.serve.app import _validation_error
from flashdraft.serve.schemas import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_stop_becomes_a_list():
    assert ChatCompletionRequest(messages=MESSAGES).stop == []
    assert ChatCompletionRequest(messages=MESSAGES, stop="x").stop == ["x"]
    assert ChatCompletionRequest(messages=MESSAGES, stop=["x", "y"]).stop == ["x", "y"]


def test_max_completion_tokens_wins_over_max_tokens():
    assert ChatCompletionRequest(messages=MESSAGES, max_tokens=5).token_budget == 5
    assert ChatCompletionRequest(messages=MESSAGES, max_tokens=5, max_completion_tokens=7).token_budget == 7
    assert CompletionRequest(prompt="a").token_budget is None


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": parts}])
    assert request.messages[0].text() == "a\nb"


@pytest.mark.parametrize("fields", [{"max_tokens": 1.0}, {"max_tokens": True}, {"temperature": "0.5"}, {"seed": "1"}])
def test_types_are_strict(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=MESSAGES, **fields)


@pytest.mark.parametrize(
    "fields, unsupported",
    [
        ({}, None),
        ({"n": 1, "logprobs": False, "presence_penalty": 0, "tool_choice": "none", "user": "x"}, None),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"repetition_penalty": 1.0, "metadata": {"a": "b"}, "store": False}, None),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ],
)
def test_unsupported_fields_only_at_a_non_neutral_value(fields, unsupported):
    problem = ChatCompletionRequest(messages=MESSAGES, **fields).unsupported_field()
    assert (problem[0] if problem else None) == unsupported
    assert problem is None or problem[2] == "unsupported_parameter"


@pytest.mark.parametrize("request_type, fields", [
    (ChatCompletionRequest, {"messages": MESSAGES, "tempera2ure": 0}),
    (ChatCompletionRequest, {"messages": MESSAGES, "prompt": "w1"}),  # a field of the other endpoint
    (CompletionRequest, {"prompt": "w1", "max_completion_tokens": 3}),
])
def test_an_unknown_field_is_refused_by_name(request_type, fields):
    unknown = next(name for name in fields if name not in request_type.model_fields)
    name, message, code = request_type(**fields).unsupported_field()
    assert (name, code) == (unknown, "unknown_parameter")
    assert f"`{unknown}`" in message and "temperature" in message  # the fields it takes, to spot a misspelling


def test_union_errors_name_the_field_where_the_alternatives_part():
    error = RequestValidationError([
        {"type": "string_type", "loc": ("body", "messages", 0, "content", "str"),
         "msg": "Input should be a valid string"},
        {"type": "list_type", "loc": ("body", "messages", 0, "content", "list[TextPart]"),
         "msg": "Input should be a valid list"},
        {"type": "float_type", "loc": ("body", "temperature"), "msg": "Input should be a valid number"},
    ])
    body = _validation_error(error).body.error
    assert body.param == "messages"
    assert body.message == (
        "invalid `messages[0].content`: Input should be a valid string; or Input should be a valid list"
    )


def test_validator_messages_lose_pydantics_prefix():
    error = RequestValidationError([
        {"type": "value_error", "loc": ("body", "stop"), "msg": "Value error, stop strings must not be empty"}
    ])
    assert _validation_error(error).body.error.message == "invalid `stop`: stop strings must not be empty"


def test_a_missing_field_is_named_by_its_whole_path():
    error = RequestValidationError([
        {"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "Field required"}
    ])
    body = _validation_error(error).body.error
    assert (body.message, body.param, body.code) == (
        "missing required field `messages[0].role`", "messages", "missing_required_parameter"
    )
