"""`flashdraft serve` end to end: the real command in a subprocess on a free loopback port, over a tiny random
target (with its tokenizer and chat template) and draft saved to folders, driven by the official `openai` client;
raw HTTP only for what that client cannot send (malformed JSON, a missing field)."""

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import flashdraft
from flashdraft.models import load_draft, load_target
from flashdraft.text import encode_chat, stop_token_ids

from tiny import tiny_draft, tiny_target, tiny_tokenizer

MODEL = "tiny"
MAX_QUEUE = 16
CONTEXT = 4096
BLOCK_SIZE = 8  # fixed, so statistics and seeded samples compare with `generate`'s (the default adapts per process)
# Greedy continuations of the tiny target, fixed by its seed: this chat is answered in 17 tokens ending with the
# end-of-turn token; this one runs past 2000 tokens without it.
ENDS_ITS_TURN = "w42 w45 w48"
RUNS_LONG = "w0 w2"


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    target = tiny_target(max_positions=CONTEXT)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    tiny_draft(target, block_size=8).save_pretrained(root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def models(folders):
    """The same folders loaded in this process, for references through `flashdraft.generate`."""
    target, tokenizer = load_target(str(folders[0]))
    draft = load_draft(str(folders[1]))
    return target, tokenizer, draft, stop_token_ids(target, tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(base: str, path: str) -> tuple[int, dict]:
    return raw(base, "GET", path)


def raw(base: str, method: str, path: str, body: bytes | None = None, content_type="application/json"):
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {"Content-Type": content_type} if body and content_type else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def start_server(folders, log_path, max_batch_size: int = 1) -> tuple[subprocess.Popen, str]:
    """`flashdraft serve` on the saved tiny models, answering on a free loopback port: (process, base URL). One
    request at a time unless asked: the queue's tests count one running request (batched: test_worker.py)."""
    port = free_port()
    command = [
        sys.executable, "-m", "flashdraft.cli", "serve", "--target", str(folders[0]), "--draft", str(folders[1]),
        "--block-size", str(BLOCK_SIZE),
        "--host", "127.0.0.1", "--port", str(port), "--max-queue", str(MAX_QUEUE), "--served-model-name", MODEL,
        "--max-batch-size", str(max_batch_size),
    ]
    # One thread: the tiny model gains nothing from more, and the machine is shared.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if process.poll() is not None:
            pytest.fail(f"flashdraft serve exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if get(url, "/health")[0] == 200:
                return process, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"flashdraft serve did not answer within 180 s:\n{log_path.read_text()}")
        time.sleep(0.25)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def base(folders, tmp_path_factory):
    process, url = start_server(folders, tmp_path_factory.mktemp("server-log") / "server.log")
    try:
        yield url
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="not-checked", max_retries=0, timeout=120)


def reference(models, prompt: list[int], max_tokens: int, **sampling):
    """(text, result) of `flashdraft.generate` on the served models, as the server should answer."""
    target, tokenizer, draft, stops = models
    result = flashdraft.generate(
        target, draft, prompt, max_new_tokens=max_tokens, stop_token_ids=stops, block_size=BLOCK_SIZE, **sampling
    )
    return tokenizer.decode(result.tokens, skip_special_tokens=True), result


def chat_reference(models, content: str, max_tokens: int, **sampling):
    return reference(models, encode_chat(models[1], user(content)), max_tokens, **sampling)


# ---------------------------------------------------------------------------------------------- answers


def test_models_and_health(client, base):
    assert [model.id for model in client.models.list()] == [MODEL]
    status, health = get(base, "/health")
    assert status == 200
    assert health["status"] == "ok" and health["model"] == MODEL and health["max_queue"] == MAX_QUEUE


def test_chat_greedy_equals_generate(client, models):
    text, result = chat_reference(models, "w3 w4 w5", 24)
    response = client.chat.completions.create(model=MODEL, messages=user("w3 w4 w5"), max_tokens=24, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == "length"
    prompt_tokens = len(encode_chat(models[1], user("w3 w4 w5")))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 24)
    assert response.usage.total_tokens == prompt_tokens + 24
    statistics = response.model_extra["flashdraft"]
    assert statistics["acceptance_lengths"] == result.acceptance_lengths
    assert statistics["rounds"] == len(result.acceptance_lengths)
    assert statistics["tau"] == pytest.approx(result.tau)
    assert statistics["block_size"] == BLOCK_SIZE
    assert statistics["proposals"] == "hybrid" and statistics["tokens_by_source"] == result.tokens_by_source


def test_chat_stops_at_the_end_of_turn(client, models):
    text, result = chat_reference(models, ENDS_ITS_TURN, 64)
    response = client.chat.completions.create(
        model=MODEL, messages=user(ENDS_ITS_TURN), max_completion_tokens=64, temperature=0
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == text
    assert response.usage.completion_tokens == len(result.tokens) == 17  # the end-of-turn token included


def test_completion_greedy_equals_generate_for_text_and_token_prompts(client, models):
    tokenizer = models[1]
    prompt_ids = tokenizer("w10 w20 w30")["input_ids"]
    text, _ = reference(models, prompt_ids, 12)
    for prompt in ("w10 w20 w30", prompt_ids):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert response.choices[0].text == text
        assert response.choices[0].finish_reason == "length"
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 12)
        assert "acceptance_lengths" in response.model_extra["flashdraft"]


def test_completion_defaults_to_sixteen_tokens(client):
    response = client.completions.create(model=MODEL, prompt="w1 w2", temperature=0)
    assert response.usage.completion_tokens == 16


def test_seeded_sampling_equals_generate_with_the_same_seed(client, models):
    text, _ = chat_reference(models, "w6 w7", 20, temperature=1.0, top_p=0.9, seed=1234)
    for _ in range(2):
        response = client.chat.completions.create(
            model=MODEL, messages=user("w6 w7"), max_tokens=20, temperature=1.0, top_p=0.9, seed=1234
        )
        assert response.choices[0].message.content == text


def test_chat_stream_matches_the_full_answer(client, models):
    text, result = chat_reference(models, "w3 w4 w5", 24)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=user("w3 w4 w5"), max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert len({chunk.id for chunk in chunks}) == 1
    finish = chunks[-2]
    assert finish.choices[0].finish_reason == "length"
    assert finish.model_extra["flashdraft"]["acceptance_lengths"] == result.acceptance_lengths
    assert chunks[-1].choices == []  # the usage chunk
    assert chunks[-1].usage.completion_tokens == 24
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_completion_stream_without_usage(client, models):
    prompt_ids = models[1]("w10 w20 w30")["input_ids"]
    text, _ = reference(models, prompt_ids, 12)
    chunks = list(client.completions.create(
        model=MODEL, prompt="w10 w20 w30", max_tokens=12, temperature=0, stream=True
    ))
    assert "".join(chunk.choices[0].text for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks)


def test_stream_ends_with_done(base):
    body = json.dumps({"prompt": "w1", "max_tokens": 3, "stream": True}).encode()
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    events = response.read().decode().split("\n\n")
    connection.close()
    assert response.getheader("content-type").startswith("text/event-stream")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_answer_before_it(client, models, stream):
    full, _ = chat_reference(models, "w3 w4 w5", 24)
    words = full.split()
    stop = words[3]  # a word of the greedy answer: the answer must end right before its first occurrence
    expected = full[: full.index(stop)]
    response = client.chat.completions.create(
        model=MODEL, messages=user("w3 w4 w5"), max_tokens=24, temperature=0, stop=[stop, "never-said"],
        stream=stream,
    )
    if stream:
        chunks = list(response)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        text, finish_reason = response.choices[0].message.content, response.choices[0].finish_reason
    assert text == expected and stop not in text
    assert finish_reason == "stop"


# ----------------------------------------------------------------------------------------------- errors


def assert_openai_error(error: openai.APIStatusError, status: int, param, code=None) -> None:
    assert error.status_code == status
    assert set(error.body) == {"message", "type", "param", "code"}
    assert error.body["message"]
    assert error.param == param
    if code is not None:
        assert error.code == code


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": -5}, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        ({"max_tokens": "10"}, "max_tokens", "invalid_value"),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"temperature": -0.1}, "temperature", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_value"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"top_p": 1.5}, "top_p", "invalid_value"),
        ({"stop": ""}, "stop", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_value"),
        ({"messages": [{"role": "robot", "content": "w1"}]}, "messages", "invalid_value"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"n": 2}, "n", "unsupported_parameter"),
        ({"logprobs": True}, "logprobs", "unsupported_parameter"),
        ({"max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded"),
    ],
)
def test_invalid_chat_requests_are_400(client, fields, param, code):
    request = {"model": MODEL, "messages": user("w1"), **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    assert_openai_error(caught.value, 400, param, code)


def test_n_above_one_says_it_is_not_supported(client):
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
        client.chat.completions.create(model=MODEL, messages=user("w1"), n=3)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=user("w1"))
    assert_openai_error(caught.value, 404, "model", "model_not_found")
    assert "tiny" in caught.value.message


def test_long_prompt_beyond_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[5] * CONTEXT, max_tokens=1)
    assert_openai_error(caught.value, 400, "prompt", "context_length_exceeded")


def test_several_prompts_in_one_request_are_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=["w1", "w2"], max_tokens=1)
    assert_openai_error(caught.value, 400, "prompt", "unsupported_parameter")


@pytest.mark.parametrize(
    "path, body, content_type, param, code",
    [
        ("/v1/chat/completions", b'{"messages": [', "application/json", None, "invalid_json"),
        ("/v1/chat/completions", b'{"model": "tiny"}', "application/json", "messages", "missing_required_parameter"),
        ("/v1/completions", b'{"max_tokens": 3}', "application/json", "prompt", "missing_required_parameter"),
        ("/v1/completions", b'["w1"]', "application/json", None, "invalid_body"),
        ("/v1/chat/completions", b'{"messages": [{"content": "w1"}]}', "text/plain", "messages",
         "missing_required_parameter"),
    ],
)
def test_malformed_bodies_are_400_in_openai_schema(base, path, body, content_type, param, code):
    status, answer = raw(base, "POST", path, body, content_type)
    assert status == 400
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert (answer["error"]["param"], answer["error"]["code"]) == (param, code)


def test_unknown_route_is_404_in_openai_schema(base):
    status, answer = get(base, "/v1/engines")
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    assert answer["error"]["code"] == "unknown_url"


def test_a_body_without_content_type_is_read_as_json(base):
    body = json.dumps({"prompt": "w1 w2", "max_tokens": 2, "temperature": 0}).encode()
    status, answer = raw(base, "POST", "/v1/completions", body, content_type=None)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------------------- load


def test_sixteen_concurrent_streams_are_all_correct_while_bad_requests_come_in(client, base, models):
    contents = [f"w{i} w{i + 30}" for i in range(16)]
    expected = [chat_reference(models, content, 16)[0] for content in contents]

    def streamed(content: str) -> str:
        chunks = client.chat.completions.create(
            model=MODEL, messages=user(content), max_tokens=16, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks)

    def bad(index: int) -> int:
        if index % 2:
            return raw(base, "POST", "/v1/chat/completions", b'{"messages": ')[0]
        try:
            client.chat.completions.create(model=MODEL, messages=user("w1"), max_tokens=0)
        except openai.BadRequestError as error:
            return error.status_code
        return 200

    with ThreadPoolExecutor(24) as pool:
        streams = [pool.submit(streamed, content) for content in contents]
        bad_requests = [pool.submit(bad, i) for i in range(8)]
        texts = [future.result(timeout=300) for future in streams]
        statuses = [future.result(timeout=300) for future in bad_requests]
    assert texts == expected
    assert statuses == [400] * 8


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def test_full_queue_is_429_and_a_departed_client_frees_the_worker(client, base):
    before = get(base, "/health")[1]
    # A long stream keeps the worker busy: 2000 tokens (RUNS_LONG never ends its turn).
    long = client.chat.completions.create(
        model=MODEL, messages=user(RUNS_LONG), max_tokens=2000, temperature=0, stream=True
    )
    chunks = iter(long)
    next(chunks), next(chunks)
    # A waiting stream whose client leaves gives its place back at once.
    leaving = client.chat.completions.create(model=MODEL, messages=user("w5"), max_tokens=2, stream=True)
    wait_until(lambda: get(base, "/health")[1]["queued"] == 1)
    leaving.close()
    wait_until(lambda: get(base, "/health")[1]["queued"] == 0)

    with ThreadPoolExecutor(MAX_QUEUE) as pool:
        waiting = [
            pool.submit(client.chat.completions.create, model=MODEL, messages=user(f"w{i}"), max_tokens=2,
                        temperature=0)
            for i in range(MAX_QUEUE)
        ]
        wait_until(lambda: get(base, "/health")[1]["queued"] == MAX_QUEUE)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, messages=user("w1"), max_tokens=2)
        assert_openai_error(caught.value, 429, None, "queue_full")
        assert caught.value.response.headers["retry-after"] == "1"
        health = get(base, "/health")[1]
        assert health["running"] == 1  # still the long stream

        long.close()
        closed = time.monotonic()
        answers = [future.result(timeout=120) for future in waiting]
        served_in = time.monotonic() - closed
    assert [answer.usage.completion_tokens for answer in answers] == [2] * MAX_QUEUE
    wait_until(lambda: get(base, "/health")[1]["running"] == 0)  # the worker may still be leaving the last job
    after = get(base, "/health")[1]
    assert after["cancelled"] - before["cancelled"] == 2  # the one that left the queue and the long stream
    assert after["completed"] - before["completed"] == MAX_QUEUE
    assert after["queued"] == 0
    # Served promptly: far sooner than the ~1900 tokens the long stream had left would have taken.
    # Each short answer took one round after its prefill (max_tokens 2): its decode_seconds is one round's time.
    seconds_per_round = statistics.median(a.model_extra["flashdraft"]["decode_seconds"] for a in answers)
    assert served_in < 1000 * seconds_per_round


# ------------------------------------------------------------------------------------------- shutdown


def send(base: str, path: str, fields: dict) -> http.client.HTTPConnection:
    """A request sent and not yet read: the connection, to read from or to drop."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", path, body=json.dumps(fields).encode(), headers={"Content-Type": "application/json"})
    return connection


def answer(connection: http.client.HTTPConnection) -> tuple[int, str]:
    response = connection.getresponse()
    try:
        return response.status, response.read().decode()
    finally:
        connection.close()


def stream_ending(text: str) -> tuple[str, str]:
    """The last two events of a stream: ([DONE], the error's code or "finished")."""
    events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
    last = json.loads(events[-2])
    return events[-1], last["error"]["code"] if "error" in last else "finished"


def half_sent_body(base: str):
    """A connection whose request announced 1000 bytes of body and sent 12."""
    host, port = base.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=60)
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000\r\n\r\n{\"prompt\": \"w")
    return connection


def read_raw(connection: socket.socket) -> tuple[int, str]:
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    connection.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


LONG = {"messages": user(RUNS_LONG), "max_tokens": 4000, "temperature": 0}  # seconds of decoding


def prepare_state(state: str, url: str) -> tuple[list, list]:
    """Bring the server into `state`: (open HTTP requests as connections, half-sent bodies as sockets)."""
    health = lambda: get(url, "/health")[1]  # noqa: E731
    if state == "idle":
        return [], []
    if state == "streaming":
        connections = [send(url, "/v1/chat/completions", {**LONG, "stream": True})]
        wait_until(lambda: health()["running"] == 1)
        return connections, []
    if state == "full batch and queue":  # 4 running (2 streams), 4 waiting (2 streams)
        connections = [send(url, "/v1/chat/completions", {**LONG, "stream": i % 2 == 0}) for i in range(8)]
        wait_until(lambda: health()["running"] == 4 and health()["queued"] == 4)
        return connections, []
    if state == "dropped clients":  # a running request and a waiting one whose clients left, one running stays
        dropped = [send(url, "/v1/chat/completions", LONG) for _ in range(5)]
        wait_until(lambda: health()["queued"] == 1)
        dropped[0].close()
        dropped[-1].close()
        wait_until(lambda: health()["cancelled"] == 2)
        return dropped[1:-1], []
    if state == "after a fuzz run":  # malformed requests, oversized bodies, streams dropped after a chunk
        for body in [b'{"messages": [', b"[]", b'{"prompt": "w1", "tempera2ure": 0}', b"\xff",
                     json.dumps({"prompt": "w" * (5 << 20)}).encode()] * 4:
            status, _ = raw(url, "POST", "/v1/completions", body)
            assert 400 <= status < 500
        for _ in range(4):
            dropped = send(url, "/v1/chat/completions", {**LONG, "stream": True})
            dropped.getresponse().read(64)
            dropped.close()
        wait_until(lambda: health()["running"] == 0)
        connections = [send(url, "/v1/chat/completions", {**LONG, "stream": i == 0}) for i in range(2)]
        wait_until(lambda: health()["running"] == 2)
        return connections, []
    if state == "half-sent body":
        connections = [send(url, "/v1/chat/completions", LONG)]
        wait_until(lambda: health()["running"] == 1)
        return connections, [half_sent_body(url)]
    raise ValueError(state)


SIGTERM_STATES = ["idle", "streaming", "full batch and queue", "dropped clients", "after a fuzz run",
                  "half-sent body"]


QUICK_STATES = ("full batch and queue", "half-sent body")  # the others are marked slow


@pytest.mark.parametrize("state, signal_number", [
    *(pytest.param(state, signal.SIGTERM, marks=[] if state in QUICK_STATES else [pytest.mark.slow],
                   id=f"{state}-SIGTERM") for state in SIGTERM_STATES),
    pytest.param("full batch and queue", signal.SIGINT, id="full batch and queue-SIGINT"),  # Ctrl-C: the same stop
])
def test_a_stop_signal_answers_every_client_and_exits_0(folders, tmp_path, state, signal_number):
    """Whatever the clients are doing, the stop answers each of them at once, `shutting_down` in OpenAI's schema
    (a stream in its last event before [DONE], any other request as a 503: never uvicorn's plain-text 500), nothing
    waits out uvicorn's grace period, and the process exits 0."""
    process, url = start_server(folders, tmp_path / "server.log", max_batch_size=4)
    try:
        connections, half_sent = prepare_state(state, url)
        process.send_signal(signal_number)
        with ThreadPoolExecutor(max(1, len(connections) + len(half_sent))) as pool:
            answers = [pool.submit(answer, connection) for connection in connections]
            raw_answers = [pool.submit(read_raw, connection) for connection in half_sent]
            answers = [future.result(timeout=30) for future in answers]
            raw_answers = [future.result(timeout=30) for future in raw_answers]
        process.wait(timeout=30)
    finally:
        stop_server(process)
    log = (tmp_path / "server.log").read_text()
    assert process.returncode == 0, log
    assert "Application shutdown complete" in log, log
    assert "timeout graceful shutdown exceeded" not in log and "Traceback" not in log, log
    for status, text in answers + raw_answers:
        assert status in (200, 503), text
        if text.startswith("data: "):
            assert stream_ending(text) == ("[DONE]", "shutting_down"), text
        else:
            assert json.loads(text)["error"]["code"] == "shutting_down", text
