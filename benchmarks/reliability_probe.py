"""The server's reliability figures (BENCHMARKS.md, "Reliability"): `flashdraft serve` on the default target and its
shipped draft, probed as a hostile client would.

1. RSS after a warm-up; then a fuzz of `--requests` requests (the malformed ones of tests/serve/test_fuzz.py, one in
   `--valid-every` a valid chat request that generates, three 4 MB prompts, a declared Content-Length of 10^12);
   the statuses by class, the seconds each 4 MB prompt took to be refused, and the RSS once idle again.
2. SIGTERM with a full batch and a queue (`--running` + `--queued` chat requests of max_tokens 3000 at temperature
   0.8, half of them streams): what each client got, the seconds from the signal to the exit, the exit status.

    python benchmarks/reliability_probe.py --requests 3000

Prints one JSON object. RSS is read from /proc (Linux).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "serve"))
from test_fuzz import SEED, malformed  # noqa: E402 (the tests' own generator of malformed requests)

CHAT = {"messages": [{"role": "user", "content": "Write a haiku about rivers."}], "max_tokens": 8, "temperature": 0.8}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc")


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 600) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers={k: v for k, v in (headers or {}).items() if v})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def start(port: int, log: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "serve", "--port", str(port)],
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}: see {log}")
        try:
            if request(port, "GET", "/health", timeout=5)[0] == 200:
                return process
        except OSError:
            time.sleep(0.5)


def fuzz(port: int, count: int, valid_every: int) -> dict:
    rng = random.Random(SEED)
    statuses: Counter = Counter()
    json_headers = {"Content-Type": "application/json"}

    def one(i: int) -> int:
        if i % valid_every == 0:
            return request(port, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(), json_headers)[0]
        method, path, body, headers = malformed(random.Random(rng.random()))
        return request(port, method, path, body, headers)[0]

    with ThreadPoolExecutor(4) as pool:
        for status in pool.map(one, range(count)):
            statuses[f"{status // 100}xx" if status >= 500 else str(status)] += 1
    refusals = []
    for _ in range(3):  # a 4 MB prompt: refused before tokenizing
        body = json.dumps({"prompt": "word " * 799_000, "max_tokens": 1}).encode()  # 4.0 MB, under the limit
        began = time.perf_counter()
        status, _ = request(port, "POST", "/v1/completions", body, json_headers)
        refusals.append((status, round(time.perf_counter() - began, 3)))
        statuses[str(status)] += 1
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:  # a declared 10^12-byte body
        began = time.perf_counter()
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
        declared = (connection.recv(64).split()[1].decode(), round(time.perf_counter() - began, 3))
    return {"statuses": dict(sorted(statuses.items())), "4 MB prompt refusals (status, s)": refusals,
            "declared 10^12 bytes (status, s)": declared}


def sigterm_with_full_batch(process: subprocess.Popen, port: int, running: int, queued: int) -> dict:
    long = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "max_tokens": 3000,
            "temperature": 0.8}
    connections = []
    for i in range(running + queued):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        connection.request("POST", "/v1/chat/completions", body=json.dumps({**long, "stream": i % 2 == 0}).encode(),
                           headers={"Content-Type": "application/json"})
        connections.append(connection)
    while True:
        health = json.loads(request(port, "GET", "/health")[1])
        if health["running"] + health["queued"] == running + queued and health["queued"] <= queued:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    signalled = time.perf_counter()

    def answer(connection) -> str:
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
        if text.startswith("data: "):
            events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
            last = json.loads(events[-2])
            return f"stream ending {last['error']['code'] if 'error' in last else 'finished'}, {events[-1]}"
        try:
            return f"{response.status} {json.loads(text)['error']['code']}"
        except (ValueError, KeyError, TypeError):
            return f"{response.status} {text[:40]!r}"

    with ThreadPoolExecutor(len(connections)) as pool:
        answers = Counter(pool.map(answer, connections))
    process.wait(timeout=120)
    return {"answers": dict(answers), "seconds to exit": round(time.perf_counter() - signalled, 2),
            "exit status": process.returncode, "health before the signal": health}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--valid-every", type=int, default=5)
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--queued", type=int, default=8)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--log", type=Path, default=Path("reliability-server.log"))
    args = parser.parse_args()
    process = start(args.port, args.log)
    try:
        for _ in range(4):  # warm-up: the first requests load kernels and measure costs
            request(args.port, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                    {"Content-Type": "application/json"})
        time.sleep(3)
        report = {"rss MiB after warm-up": round(rss_mib(process.pid))}
        began = time.perf_counter()
        report["fuzz"] = fuzz(args.port, args.requests, args.valid_every)
        report["fuzz seconds"] = round(time.perf_counter() - began)
        report["rss MiB at the end of the fuzz"] = round(rss_mib(process.pid))
        time.sleep(5)
        report["rss MiB idle after the fuzz"] = round(rss_mib(process.pid))
        report["sigterm"] = sigterm_with_full_batch(process, args.port, args.running, args.queued)
        log = args.log.read_text()
        report["log"] = {"Traceback": log.count("Traceback"), "graceful timeout exceeded":
                         log.count("timeout graceful shutdown exceeded")}
    finally:
        if process.poll() is None:
            process.kill()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
