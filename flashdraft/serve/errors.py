"""Every error the server answers, in OpenAI's schema `{"error": {"message", "type", "param", "code"}}` with a code a
client can branch on: `APIError`, and the translation of FastAPI's validation errors, the framework's own HTTP
errors and a failed job into one."""

from __future__ import annotations

import re
from itertools import takewhile

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schemas import (
    ErrorBody,
    ErrorResponse,
)
from .worker import (
    Failed,
)

# What an unknown path or method is told to use instead.
ENDPOINTS = "GET /v1/models, POST /v1/chat/completions, POST /v1/completions and GET /health"

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
