"""Fuzzing the server with malformed requests, generated from a fixed seed (the same requests on every run):
wrong types, missing fields, huge and negative numbers, NaN and Infinity literals, lone surrogates, nested garbage,
unknown fields, invalid JSON, empty and non-object bodies, oversized bodies, wrong methods and paths. Every one
must be answered with a 4xx in OpenAI's error schema, with a code and no traceback, and leave the server serving.

The app runs in this process (uvicorn in a thread, loopback only) over tiny random models."""

import http.client
import json
import random
import string
import time

import pytest

from flashdraft.serve import Engine, create_app

from tiny import serve_in_thread, tiny_draft, tiny_target, tiny_tokenizer

SEED = 20240611
REQUESTS = 150  # generated, plus the fixed cases below
DEADLINE_SECONDS = 180
CONTEXT = 512
NAN, INF = float("nan"), float("inf")  # json.dumps writes them as the literals NaN and Infinity
CHAT = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"prompt": "w1 w2", "max_tokens": 2, "temperature": 0}
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}
GET_PATHS = ("/health", "/v1/models")

# Values each field must refuse (validation is strict: a string is no number, a float no integer).
INVALID = {
    "max_tokens": ["10", 1.5, True, [], {}, 0, -1, -(10**30), 10**30, 10**400, NAN, INF, -INF],
    "temperature": ["hot", True, [], {}, -0.1, -1e-300, 2.0001, 1e300, NAN, INF, -INF],
    "top_p": ["1", False, 0, -0.5, 1.0000001, 1e308, NAN, INF, -INF],
    "top_k": ["5", 2.5, -1, -(2**70), True, [3], NAN],
    "n": [2, 10**30, 0, -1, "1", 1.0, NAN],
    "stop": [1, {"a": 1}, [1], ["w1", None], "", [""], [[]], NAN],
    "seed": [2**64, -(2**63) - 1, 10**100, -(10**100), 1.5, "7", True, [1], NAN, INF],
    "stream": ["yes", 1, 0, None, [], NAN],
    "stream_options": ["usage", [], {"include_usage": "yes"}, 1],
    "model": [1, [], {}, "gpt-4o", "", NAN],
    "logprobs": [True, 5],
    "top_logprobs": [3],
    "tools": [[{"type": "function", "function": {"name": "f"}}]],
    "response_format": [{"type": "json_object"}],
    "logit_bias": [{"5": 100}],
    "best_of": [3],
    "frequency_penalty": [0.5, -2],
    "presence_penalty": [1.0],
    "echo": [True],
}
INVALID_FOR = {
    "/v1/chat/completions": {
        "max_completion_tokens": [0, -7, 2.0, "3", 10**19, INF],  # chat only: an unknown field of a completion
        "messages": [
            [], "w1", {}, None, [None], [1], ["w1"], [[]], NAN, [{"role": "robot", "content": "w1"}],
            [{"content": "w1"}], [{"role": "user", "content": 5}], [{"role": "user", "content": {"text": "w1"}}],
            [{"role": "user", "content": [{"type": "image_url", "text": "w1"}]}],
            [{"role": "user", "content": [{"text": "w1"}]}], [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": 1, "content": "w1"}], [{"role": None, "content": "w1"}],
        ],
    },
    "/v1/completions": {
        "prompt": [
            None, 5, {}, "", [], [[]], [-1], [10**6], [2**64], [1.5], ["w1", "w2"], [[1], [2]], [True], [None],
            [[1, "w"]], [["w1"]], NAN, INF,
        ],
    },
}
TEXT_FIELDS = {  # where a client's text goes: (endpoint, how to put a text there)
    "/v1/chat/completions": [
        lambda body, text: body["messages"][0].update(content=text),
        lambda body, text: body["messages"][0].update(content=[{"type": "text", "text": text}]),
        lambda body, text: body.update(stop=text),
        lambda body, text: body.update(stop=["w9", text]),
        lambda body, text: body.update(model=text),
        lambda body, text: body.update(user=text),
        lambda body, text: body.update({text: 1}),
    ],
    "/v1/completions": [
        lambda body, text: body.update(prompt=text),
        lambda body, text: body.update(prompt=[text]),
        lambda body, text: body.update(stop=text),
        lambda body, text: body.update(suffix=text),
    ],
}
SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff", "\udc80\ud800"]  # lone halves, or a pair in the wrong order
BROKEN_JSON = [
    b"{", b"}", b'{"prompt": "w1",}', b"{'prompt': 'w1'}", b'{"prompt": "w1"} x', b'{"prompt" "w1"}',
    b'{"prompt": w1}', b'{"prompt": "w1\x01"}', b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"[" * 100_000,
    b'{"a":' * 50_000, b'{"prompt": "\\ud800"', b'{"prompt": "\\x41"}', b"\x00", b"nul", b"--",
]
NOT_OBJECTS = [b"[]", b"1", b"-0.5", b"null", b"true", b'"w1"', b"[{}]", b'["w1"]', b"NaN", b"Infinity", b"1e999"]
OTHER_METHODS = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]


def garbage(rng: random.Random, depth: int = 0):
    """Any JSON value, nested up to 4 deep; no surrogates (those are a case of their own)."""
    scalars = [
        lambda: rng.choice([0, -1, 1, 2**63, -(2**64), 10 ** rng.randint(1, 400)]),
        lambda: rng.choice([0.5, -1e308, 1e-320, NAN, INF, -INF]),
        lambda: rng.choice(["", "w1", "é", "💥", "\x00", "a" * rng.randint(1, 64), "<eot>", "{{ raise }}"]),
        lambda: rng.choice([True, False, None]),
    ]
    nested = [
        lambda: [garbage(rng, depth + 1) for _ in range(rng.randint(0, 4))],
        lambda: {name(rng): garbage(rng, depth + 1) for _ in range(rng.randint(0, 4))},
    ]
    return rng.choice(scalars + (nested if depth < 4 else []))()


def name(rng: random.Random) -> str:
    """An unknown field: refused by name (400 unknown_parameter), but only after every check the fault below meets
    first, so it never decides the answer."""
    return "x_" + "".join(rng.choices(string.ascii_letters + string.digits + "_-. ", k=rng.randint(1, 12)))


def encode(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate leaves as the escape "\ud800"


def malformed(rng: random.Random) -> tuple[str, str, bytes | None, dict]:
    """One malformed request: (method, path, body, headers)."""
    path = rng.choice(list(ENDPOINTS))
    body = json.loads(json.dumps(ENDPOINTS[path]))  # a fresh deep copy
    headers = {"Content-Type": rng.choice(["application/json", "application/json", "text/plain", None])}
    kind = rng.choice([
        "field", "field", "field", "field", "missing", "surrogate", "surrogate", "garbage", "broken", "broken",
        "not_object", "empty", "method", "path",
    ])
    if kind == "field":
        fields = {**INVALID, **INVALID_FOR[path]}
        field = rng.choice(sorted(fields))
        body[field] = rng.choice(fields[field])
    elif kind == "missing":
        if path == "/v1/chat/completions" and rng.random() < 0.5:
            del body["messages"][0]["role"]
        else:
            del body["messages" if path == "/v1/chat/completions" else "prompt"]
    elif kind == "surrogate":
        # Each followed by a space: a high half right before a low one would be a whole character.
        text = "".join(rng.choice(["w1 ", "é", ""]) + rng.choice(SURROGATES) + " " for _ in range(rng.randint(1, 3)))
        rng.choice(TEXT_FIELDS[path])(body, text)
    elif kind == "garbage":  # a required field replaced by a nested structure of the wrong shape
        key = "messages" if path == "/v1/chat/completions" else "prompt"
        body[key] = {name(rng): garbage(rng)} if rng.random() < 0.5 else [[garbage(rng)], {"role": garbage(rng)}]
    elif kind == "broken":
        if rng.random() < 0.5:
            raw = rng.choice(BROKEN_JSON)
        else:  # a valid body cut short
            raw = encode(body)
            raw = raw[: rng.randint(1, len(raw) - 1)]
        return "POST", path, raw, headers
    elif kind == "not_object":
        return "POST", path, rng.choice(NOT_OBJECTS), headers
    elif kind == "empty":
        return "POST", path, b"", headers
    elif kind == "method":
        if rng.random() < 0.5:
            return rng.choice(OTHER_METHODS), path, rng.choice([None, encode(body)]), headers
        return rng.choice(["POST", "PUT", "DELETE"]), rng.choice(GET_PATHS), encode(body), headers
    else:  # no such path (never one ending in "/": those are redirected to the path without it)
        junk = "".join(rng.choices(string.ascii_letters + "%._-~" + string.digits, k=rng.randint(1, 20)))
        path = rng.choice(["/v1/", "/", "/v2/", "/v1/chat/", "/v1/models/x/"]) + junk.strip("/")
        return rng.choice(["GET", "POST"]), path, encode(body), headers
    for _ in range(rng.randint(0, 3)):  # unknown fields beside the fault
        body[name(rng)] = garbage(rng)
    return "POST", path, encode(body), headers


FIXED = [  # the faults the fuzzing found first, and bodies above the size limit
    ("POST", "/v1/completions", encode({**COMPLETION, "temperature": 1.0, "seed": 2**64}), {}),
    ("POST", "/v1/chat/completions", encode({**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}), {}),
    ("POST", "/v1/completions", encode({**COMPLETION, "padding": "w" * (8 << 20)}), {}),
    ("POST", "/v1/completions", encode({**COMPLETION, "prompt": "w1 " * (2 << 20)}), {}),
]


@pytest.fixture(scope="module")
def address():
    target = tiny_target(max_positions=CONTEXT)
    engine = Engine.from_models(target, tiny_tokenizer(), tiny_draft(target, block_size=4), name="tiny", block_size=4)
    with serve_in_thread(create_app(engine, max_queue=4)) as address:
        yield address


def send(address, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, str]:
    connection = http.client.HTTPConnection(*address, timeout=30)
    try:
        headers = {key: value for key, value in headers.items() if value is not None}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def problem(status: int, text: str) -> str | None:
    """What is wrong with the answer to a malformed request, or None."""
    if not 400 <= status < 500:
        return f"status {status}"
    if "Traceback" in text or 'File "' in text:
        return "a traceback in the body"
    try:
        answer = json.loads(text)
    except ValueError:
        return "a body that is not JSON"
    if not (isinstance(answer, dict) and set(answer) == {"error"} and isinstance(answer["error"], dict)):
        return "not OpenAI's error schema"
    error = answer["error"]
    if set(error) != {"message", "type", "param", "code"}:
        return f"error fields {sorted(error)}"
    if not all(isinstance(error[key], str) and error[key] for key in ("code", "message")):
        return "no code or no message"
    return None


@pytest.mark.parametrize("requests", [REQUESTS, pytest.param(3000, marks=pytest.mark.slow)])
def test_malformed_requests_are_4xx_in_openai_schema_and_the_server_keeps_serving(address, requests):
    rng = random.Random(SEED)
    cases = FIXED + [malformed(rng) for _ in range(requests)]
    began = time.monotonic()
    failures = []
    for method, path, body, headers in cases:
        assert time.monotonic() - began < DEADLINE_SECONDS * requests / REQUESTS, "the fuzzing took too long"
        status, text = send(address, method, path, body, headers)
        if (wrong := problem(status, text)) is not None:
            shown = body if body is None or len(body) < 300 else body[:300] + b"..."
            failures.append(f"{method} {path} {shown!r} {headers}: {wrong}: {text[:300]}")
    assert not failures, f"{len(failures)} of {len(cases)} malformed requests answered wrongly:\n" + "\n".join(
        failures[:20]
    )
    # Still serving, and nothing reached the model to fail there.
    status, text = send(address, "POST", "/v1/completions", encode(COMPLETION), {"Content-Type": "application/json"})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    health = json.loads(send(address, "GET", "/health", None, {})[1])
    assert health["failed"] == 0 and health["queued"] == 0
