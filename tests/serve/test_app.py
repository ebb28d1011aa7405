"""The app in this process (uvicorn in a thread, over tiny random models), for what the end-to-end tests cannot
reach from outside: bodies sent without a JSON content type, and every error path, the failures inside the
server included, answered with a code."""

import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn

from flashdraft.serve import Engine, create_app
from flashdraft.serve import worker as worker_module
from tiny import tiny_draft, tiny_target, tiny_tokenizer

CONTEXT = 512
COMPLETION = {"prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def engine() -> Engine:
    target = tiny_target(max_positions=CONTEXT)
    return Engine.from_models(target, tiny_tokenizer(), tiny_draft(target, block_size=4), name="tiny", block_size=4)


@pytest.fixture(scope="module")
def address(engine):
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, max_queue=4), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield listening.getsockname()
    server.should_exit = True
    thread.join(timeout=30)


def request(address, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body text): raw HTTP, so that the headers are exactly the ones given."""
    connection = http.client.HTTPConnection(*address, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read().decode()
    finally:
        connection.close()


def post(address, path: str, fields: dict, content_type: str | None = "application/json", **headers):
    if content_type is not None:
        headers["Content-Type"] = content_type
    status, _, text = request(address, "POST", path, json.dumps(fields).encode(), headers)
    return status, json.loads(text)


def assert_error(answer: dict, code: str) -> None:
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert isinstance(answer["error"]["code"], str) and answer["error"]["code"]
    assert answer["error"]["code"] == code


# ---------------------------------------------------------------------------------------- content types


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
@pytest.mark.parametrize("path, fields", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_a_json_body_is_read_whatever_its_content_type(address, path, fields, content_type):
    status, answer = post(address, path, fields, content_type)
    assert status == 200, answer
    assert post(address, path, fields)[1]["choices"] == answer["choices"]
    assert answer["usage"]["completion_tokens"] == 3


def test_a_body_that_is_not_json_is_still_invalid_json_without_a_content_type(address):
    status, _, text = request(address, "POST", "/v1/completions", b"prompt=w1", {})
    assert status == 400
    assert_error(json.loads(text), "invalid_json")


def test_a_browser_page_must_still_send_json_as_json(address):
    # A text/plain POST from another site's page needs no CORS preflight: it must not be served.
    status, answer = post(address, "/v1/completions", COMPLETION, "text/plain", Origin="https://elsewhere.example")
    assert status == 400
    assert_error(answer, "invalid_body")
    assert "Content-Type: application/json" in answer["error"]["message"]


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "method, path, body, status, code",
    [
        ("POST", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
        ("POST", "/v1/completions", b'{"prompt": "w1 \xff"}', 400, "invalid_json"),  # not UTF-8
        ("POST", "/v1/completions", b"", 400, "invalid_body"),
        ("POST", "/v1/completions", b'["w1"]', 400, "invalid_body"),
        ("POST", "/v1/completions", b'{"max_tokens": 3}', 400, "missing_required_parameter"),
        ("POST", "/v1/chat/completions", b'{"messages": [{"content": "w1"}]}', 400, "missing_required_parameter"),
        ("POST", "/v1/completions", b'{"prompt": "w1", "max_tokens": 0}', 400, "invalid_value"),
        ("POST", "/v1/completions", b'{"prompt": ""}', 400, "invalid_value"),  # tokenizes to nothing
        ("POST", "/v1/completions", b'{"prompt": [1000000]}', 400, "invalid_value"),  # outside the vocabulary
        ("POST", "/v1/completions", b'{"prompt": "w1", "n": 2}', 400, "unsupported_parameter"),
        ("POST", "/v1/completions", b'{"prompt": "w1", "max_tokens": 512}', 400, "context_length_exceeded"),
        ("POST", "/v1/completions", b'{"prompt": "w1", "model": "gpt-4o"}', 404, "model_not_found"),
        ("GET", "/v1/engines", None, 404, "unknown_url"),
        ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
        ("POST", "/health", b"{}", 405, "method_not_allowed"),
    ],
)
def test_every_error_has_a_code(address, method, path, body, status, code):
    answer_status, _, text = request(address, method, path, body, {"Content-Type": "application/json"})
    assert answer_status == status, text
    assert_error(json.loads(text), code)


def test_unknown_paths_and_methods_say_what_to_use(address):
    answer = json.loads(request(address, "GET", "/v1/engines")[2])["error"]
    assert answer["type"] == "not_found_error"
    assert answer["message"].startswith("unknown path GET /v1/engines: the endpoints are GET /v1/models")
    status, headers, text = request(address, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    assert json.loads(text)["error"]["message"] == "GET /v1/completions is not allowed: /v1/completions takes POST"


def test_a_missing_field_inside_a_message_is_named_by_its_path(address):
    status, answer = post(address, "/v1/chat/completions", {"messages": [CHAT["messages"][0], {"content": "w2"}]})
    assert status == 400
    assert answer["error"]["message"] == "missing required field `messages[1].role`"
    assert answer["error"]["param"] == "messages"


def test_an_internal_error_is_500_with_a_code(address, engine, monkeypatch):
    def broken(messages):
        raise RuntimeError("the template engine broke")

    monkeypatch.setattr(engine, "chat_prompt", broken)
    status, answer = post(address, "/v1/chat/completions", CHAT)
    assert status == 500
    assert_error(answer, "internal_error")
    assert answer["error"]["type"] == "server_error" and "template engine broke" in answer["error"]["message"]


def failing_stream(*args, **kwargs):
    raise RuntimeError("out of memory")


def test_a_failed_generation_is_500_with_a_code(address, monkeypatch):
    monkeypatch.setattr(worker_module, "stream", failing_stream)
    status, answer = post(address, "/v1/completions", COMPLETION)
    assert status == 500
    assert_error(answer, "generation_failed")
    assert answer["error"]["message"] == "generation failed: out of memory"


def test_a_failed_stream_ends_with_an_error_event_with_a_code(address, monkeypatch):
    monkeypatch.setattr(worker_module, "stream", failing_stream)
    body = json.dumps({**COMPLETION, "stream": True}).encode()
    status, _, text = request(address, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200  # the stream had begun: the failure is its last event
    events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
    assert events[-1] == "[DONE]"
    assert_error(json.loads(events[-2]), "generation_failed")
