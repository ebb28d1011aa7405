"""The app in this process (uvicorn in a thread, over tiny random models), for what the end-to-end tests cannot
reach from outside: bodies sent without a JSON content type, and every error path, the failures inside the
server included, answered with a code."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashdraft.serve import Engine, create_app
from flashdraft.serve import worker as worker_module

from tiny import serve_in_thread, tiny_draft, tiny_target, tiny_tokenizer

CONTEXT = 512
COMPLETION = {"prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def engine() -> Engine:
    target = tiny_target(max_positions=CONTEXT)
    return Engine.from_models(target, tiny_tokenizer(), tiny_draft(target, block_size=4), name="tiny", block_size=4)


@pytest.fixture(scope="module", params=[1, 4], ids=["serial", "batched"])
def address(engine, request):
    """The app with the serial worker, and with the batched one: every route behaves the same."""
    with serve_in_thread(create_app(engine, max_queue=4, max_batch_size=request.param)) as address:
        yield address


def request(address, method: str, path: str, body=None, headers: dict | None = None):
    """(status, headers, body text): raw HTTP, so that the headers are exactly the ones given. A body that is an
    iterator of bytes is sent chunked, without a Content-Length."""
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


@pytest.fixture
def failing_generation(monkeypatch):
    """Decoding fails, in the serial worker's stream and in the batched worker's forwards alike."""
    monkeypatch.setattr(worker_module, "stream", failing_stream)
    monkeypatch.setattr(worker_module.Batch, "prefill", failing_stream)
    monkeypatch.setattr(worker_module.Batch, "decode", failing_stream)


def test_a_failed_generation_is_500_with_a_code(address, failing_generation):
    status, answer = post(address, "/v1/completions", COMPLETION)
    assert status == 500
    assert_error(answer, "generation_failed")
    assert answer["error"]["message"] == "generation failed: out of memory"


def test_a_failed_stream_ends_with_an_error_event_with_a_code(address, failing_generation):
    body = json.dumps({**COMPLETION, "stream": True}).encode()
    status, _, text = request(address, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200  # the stream had begun: the failure is its last event
    events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
    assert events[-1] == "[DONE]"
    assert_error(json.loads(events[-2]), "generation_failed")


def events(text: str) -> list[str]:
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event]


# ------------------------------------------------------------------------------- client faults, not 500s


@pytest.mark.parametrize(
    "path, fields, where",
    [
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "w1 \ud800 w2"}]},
         "messages[0].content"),
        ("/v1/chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
         "messages[0].content[0].text"),
        ("/v1/completions", {**COMPLETION, "prompt": "w1 \ud800w2"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["w1 \udc00"]}, "prompt[0]"),
        ("/v1/completions", {**COMPLETION, "stop": "\ud800"}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": ["w9", "a\ud800b"]}, "stop[1]"),
        ("/v1/completions", {**COMPLETION, "model": "tiny\ud800"}, "model"),
        ("/v1/completions", {**COMPLETION, "user": {"\ud800": 1}}, "user.\\ud800"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(address, path, fields, where):
    # JSON may escape half of a UTF-16 pair ("\ud800") alone; that is no Unicode text any tokenizer can encode.
    status, answer = post(address, path, fields)
    assert status == 400, answer
    assert_error(answer, "invalid_value")
    assert answer["error"]["param"] == where.split(".")[0].split("[")[0]
    assert answer["error"]["message"].startswith(f"`{where}` is not valid Unicode text: it holds a lone surrogate")


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
def test_a_seed_outside_64_bits_is_400_naming_its_range(address, seed):
    status, answer = post(address, "/v1/completions", {**COMPLETION, "temperature": 1.0, "seed": seed})
    assert status == 400, answer
    assert_error(answer, "invalid_value")
    assert answer["error"]["param"] == "seed"
    assert "seed must be a 64-bit integer, in [-2**63, 2**64 - 1]" in answer["error"]["message"]


@pytest.mark.parametrize("seed", [-(2**63), 2**64 - 1])
def test_seeds_at_both_ends_of_the_range_are_served(address, seed):
    status, answer = post(address, "/v1/completions", {**COMPLETION, "temperature": 1.0, "seed": seed})
    assert status == 200, answer


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_a_tiny_temperature_answers_the_argmax_as_greedy(address, temperature):
    # logits / T overflows float32: the limit of sampling as T -> 0, exactly, rather than NaN and an error.
    greedy = post(address, "/v1/completions", COMPLETION)[1]["choices"][0]["text"]
    fields = {**COMPLETION, "temperature": temperature, "seed": 5}
    status, answer = post(address, "/v1/completions", fields)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == greedy
    status, _, text = request(
        address, "POST", "/v1/completions", json.dumps({**fields, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    chunks = [json.loads(event) for event in events(text)[:-1]]
    assert status == 200 and all("error" not in chunk for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == greedy


@pytest.mark.parametrize("path, fields", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_a_misspelled_field_is_400_naming_it_not_sampled_at_the_default(address, path, fields):
    status, answer = post(address, path, {**fields, "tempera2ure": 0})
    assert status == 400
    assert_error(answer, "unknown_parameter")
    assert answer["error"]["param"] == "tempera2ure" and "`tempera2ure`" in answer["error"]["message"]


# ------------------------------------------------------------------------------------------- big bodies

JSON = {"Content-Type": "application/json"}


def big_body(size: int) -> bytes:
    """A valid completion request of about `size` bytes, padded with a field the server ignores (`user`)."""
    return json.dumps({**COMPLETION, "user": "w" * size}).encode()


def test_a_body_above_the_limit_is_413_in_openai_schema(address):
    status, _, text = request(address, "POST", "/v1/completions", big_body(8 << 20), JSON)
    assert status == 413
    answer = json.loads(text)
    assert_error(answer, "request_too_large")
    assert "4194304 bytes" in answer["error"]["message"] and "--max-body-bytes" in answer["error"]["message"]


def test_a_chunked_body_above_the_limit_is_413_too(address):
    body = big_body(8 << 20)
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))  # no Content-Length to trust
    status, _, text = request(address, "POST", "/v1/completions", chunks, JSON)
    assert status == 413
    assert_error(json.loads(text), "request_too_large")


def raw_exchange(address, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send a request head and (part of) a body over a plain socket, then read the answer: (status, JSON body).
    The socket's timeout only turns a server that never answers into a failure."""
    with socket.create_connection(address, timeout=30) as connection:
        connection.sendall(head + body)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head_part, _, text = answer.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(text)


def test_a_declared_length_above_the_limit_is_413_before_any_body_comes(address):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, answer = raw_exchange(address, head + b"Content-Length: 1000000000000\r\n\r\n")
    assert status == 413
    assert_error(answer, "request_too_large")


@pytest.fixture(scope="module")
def impatient(engine):
    """A server that waits half a second for a body."""
    with serve_in_thread(create_app(engine, max_queue=4, max_batch_size=1, body_seconds=0.5)) as address:
        yield address


def test_a_body_that_does_not_arrive_in_time_is_408(impatient):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    status, answer = raw_exchange(impatient, head, b'{"prompt": ')  # and nothing more
    assert status == 408
    assert_error(answer, "request_timeout")
    assert "--body-seconds" in answer["error"]["message"]
    assert post(impatient, "/v1/completions", COMPLETION)[0] == 200  # a body sent at once is served


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {**COMPLETION, "prompt": "w" * (CONTEXT * 12)}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "w" * (CONTEXT * 12)}]}, "messages"),
])
def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(address, engine, monkeypatch, path,
                                                                               fields, param):
    assert engine.max_prompt_chars == CONTEXT * max(map(len, engine.tokenizer.get_vocab()))  # no normalizer
    monkeypatch.setattr(engine, "text_prompt", lambda prompt: pytest.fail("tokenized"))
    monkeypatch.setattr(engine, "chat_prompt", lambda messages: pytest.fail("tokenized"))
    status, answer = post(address, path, fields)
    assert status == 400
    assert_error(answer, "context_length_exceeded")
    assert answer["error"]["param"] == param and "characters" in answer["error"]["message"]


def test_a_prompt_within_the_character_bound_is_counted_exactly(address, engine):
    prompt = "w1 " * CONTEXT  # few characters, more tokens than the context
    assert len(prompt) <= engine.max_prompt_chars
    status, answer = post(address, "/v1/completions", {**COMPLETION, "prompt": prompt})
    assert status == 400
    assert_error(answer, "context_length_exceeded")
    assert "tokens" in answer["error"]["message"]


def test_a_body_below_the_limit_is_served(address):
    status, _, text = request(address, "POST", "/v1/completions", big_body(3 << 20), JSON)
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == 3


def test_a_slow_tokenization_holds_up_no_other_request(address, engine, monkeypatch):
    # A prompt of several MB takes seconds to tokenize; the tokenizer blocks its thread meanwhile, as here.
    tokenizing = threading.Event()
    tokenize = engine.text_prompt

    def slow(prompt):
        tokenizing.set()
        time.sleep(3)
        return tokenize(prompt)

    monkeypatch.setattr(engine, "text_prompt", slow)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, address, "/v1/completions", COMPLETION)
        assert tokenizing.wait(timeout=60)
        began = time.monotonic()
        status, _, _ = request(address, "GET", "/health")
        answered_in = time.monotonic() - began
        assert big.result(timeout=60)[0] == 200
    assert status == 200
    assert answered_in < 1.5  # not after the 3 s tokenization


def test_a_shared_system_prompt_is_reported_as_cached_prompt_tokens(address, engine, request):
    """The batched worker keeps the K/V of a prefix two prompts shared and serves later prompts from it; `usage`
    says how many prompt tokens came from it (OpenAI's `prompt_tokens_details.cached_tokens`). The serial worker
    keeps none. The answers are the same either way."""
    system = {"role": "system", "content": " ".join(f"w{i}" for i in range(10, 40))}
    questions = ["w3 w4", "w5 w6", "w7"]
    answers = [post(address, "/v1/chat/completions", {**CHAT, "messages": [system, {"role": "user", "content": q}]})
               for q in questions]
    assert all(status == 200 for status, _ in answers)
    prompts = [engine.chat_prompt([system, {"role": "user", "content": q}]) for q in questions]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts[1:])) if a != b)
    assert shared > 30
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for _, answer in answers]
    batched = request.node.callspec.params["address"] > 1
    assert cached[2] == (shared if batched else 0)
    for (_, answer), q in zip(answers, questions):
        alone = post(address, "/v1/chat/completions", {**CHAT, "messages": [system, {"role": "user", "content": q}]})
        assert alone[1]["choices"] == answer["choices"]
