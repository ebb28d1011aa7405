"""The serving load benchmark (`flashdraft bench-serve`): `flashdraft serve` under concurrent streaming clients.

One server per max batch size (1: the serial worker; above: continuous batching), each started in a subprocess on a
free loopback port, one after the other (each measures its costs alone). Then for each concurrency level, on every
server in turn (the levels interleaved, so a change in the machine's load touches them all alike), the same bounded
set of greedy streaming chat requests from that many client threads, with the official `openai` client. Per level:
requests/s and output tokens/s, time to first token (from sending the request to the first chunk with text, so
under concurrency it includes the wait in the server's queue) and time per output token ((last chunk - first chunk)
/ (completion tokens - 1) per request), p50 and p95; the mean tau; how many answers differ from the first server's
at the first level (the serial server at concurrency 1 by default); errors; the machine's 1-minute load average
when the level ended (on a shared machine it explains much of the spread).

`disconnect_rounds`: after the levels, rounds of streams whose clients leave after a few chunks of text, all at once
on every server, each round ending when the server reports nothing running or queued; the server process's resident
memory (RSS) before the first round and after each shows whether departed clients leave memory behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openai

PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map.",
    "What is the capital of France, and what river runs through it?",
    "Write a haiku about the sea.",
    "Give a one-line definition of recursion.",
    "How do I reverse a list in Python?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "What is 17 times 23? Show the steps.",
    "Name two differences between TCP and UDP.",
    "Write a SQL query that counts the rows of a table named users.",
    "Why do we use version control?",
    "Translate 'good morning' into Spanish and German.",
    "What does the acronym CPU stand for?",
    "Suggest a name for a small bakery.",
    "Write a bash command that lists the ten largest files in a folder.",
)


@dataclass(frozen=True)
class ServerSettings:
    """How each server runs: `flashdraft serve`'s target, draft (None: the target's shipped draft; `no_draft`: plain
    decoding) and block size (None: serve's default), and how long it may take to answer /health."""

    target: str
    draft: str | None = None
    no_draft: bool = False
    block_size: int | str | None = None
    startup_timeout: float = 600.0


@dataclass
class Outcome:
    """One streamed request, as its client saw it."""

    seconds_to_first_token: float
    seconds_per_output_token: float | None  # None with a single output token
    tau: float
    tokens: int
    text: str


@dataclass
class Level:
    """One concurrency level on one server."""

    max_batch_size: int
    concurrency: int
    requests: int
    seconds: float
    outcomes: list[Outcome | None]  # in the order of the prompts; None for a failed request
    differ: int  # answers unlike the reference's (the first server's at the first level)
    load_average: float

    @property
    def done(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome is not None]

    @property
    def errors(self) -> int:
        return len(self.outcomes) - len(self.done)

    @property
    def requests_per_second(self) -> float:
        return len(self.done) / self.seconds

    @property
    def output_tokens_per_second(self) -> float:
        return sum(outcome.tokens for outcome in self.done) / self.seconds

    def ttft_ms(self, percentile: float) -> float:
        return float(np.percentile([o.seconds_to_first_token for o in self.done], percentile)) * 1000

    def tpot_ms(self, percentile: float) -> float:
        per_token = [o.seconds_per_output_token for o in self.done if o.seconds_per_output_token is not None]
        return float(np.percentile(per_token, percentile)) * 1000 if per_token else float("nan")

    @property
    def tau(self) -> float:
        return float(np.mean([outcome.tau for outcome in self.done]))


@dataclass
class ServingReport:
    levels: list[Level] = field(default_factory=list)
    memory_mib: dict[int, list[float]] = field(default_factory=dict)  # max batch size -> RSS before, after each round


class Server:
    """`flashdraft serve` in a subprocess on a free loopback port, with an `openai` client for it."""

    def __init__(self, settings: ServerSettings, max_batch_size: int, max_queue: int, timeout: float):
        self.port = _free_port()
        command = [sys.executable, "-m", "flashdraft.cli", "serve", "--target", settings.target, "--port",
                   str(self.port), "--max-queue", str(max_queue), "--max-batch-size", str(max_batch_size)]
        if settings.no_draft:
            command.append("--no-draft")
        elif settings.draft is not None:
            command += ["--draft", settings.draft]
        if settings.block_size is not None:
            command += ["--block-size", str(settings.block_size)]
        self.log = tempfile.TemporaryFile()  # what the server printed, shown if it fails to start
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                                    timeout=timeout)
        deadline = time.monotonic() + settings.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"flashdraft serve exited with {self.process.returncode}:\n{self._log_tail()}")
            try:
                self.health()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"flashdraft serve did not answer within {settings.startup_timeout:g} s:\n"
                                       f"{self._log_tail()}") from None
                time.sleep(0.25)

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
            return json.loads(response.read())

    def rss_mib(self) -> float:
        """The server process's resident memory, from /proc (Linux)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS line in /proc: resident memory is read on Linux only")

    def wait_idle(self, timeout: float) -> None:
        """Until the server reports nothing running or queued."""
        deadline = time.monotonic() + timeout
        while (health := self.health())["running"] or health["queued"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server still runs {health['running']} requests after {timeout:g} s")
            time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> Outcome:
    """One greedy streaming chat request, read to its end."""
    sent = time.perf_counter()
    first = last = usage = tau = None
    pieces = []
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    for chunk in chunks:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            tau = chunk.model_extra["flashdraft"]["tau"]
        if chunk.usage is not None:
            usage = chunk.usage
    if first is None or usage is None:
        raise RuntimeError("the stream ended without text or usage")
    tokens = usage.completion_tokens
    per_token = (last - first) / (tokens - 1) if tokens > 1 else None
    return Outcome(first - sent, per_token, tau, tokens, "".join(pieces))


def leaving_stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, chunks_read: int) -> None:
    """A streaming request whose client leaves after `chunks_read` chunks of text (closing the connection)."""
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True,
    )
    read = 0
    with chunks:  # leaving the block closes the connection: the server sees the client go
        for chunk in chunks:
            read += bool(chunk.choices and chunk.choices[0].delta.content)
            if read >= chunks_read:
                break


def run_level(client: openai.OpenAI, model: str, prompts: list[str], concurrency: int,
              max_tokens: int) -> tuple[list[Outcome | None], float]:
    """Outcomes in the order of `prompts` (None for a failed request, reported on stderr) and the seconds taken."""
    began = time.perf_counter()
    outcomes = []
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(stream_request, client, model, prompt, max_tokens) for prompt in prompts]:
            try:
                outcomes.append(future.result())
            except Exception as error:  # counted and reported: the table's error column
                print(f"  request failed: {error}", file=sys.stderr)
                outcomes.append(None)
    return outcomes, time.perf_counter() - began


def disconnect_round(server: Server, model: str, streams: int, max_tokens: int, chunks_read: int,
                     timeout: float) -> float:
    """`streams` streaming requests at once whose clients all leave after a few chunks; the server's RSS (MiB)
    once it reports nothing running or queued."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        for future in [pool.submit(leaving_stream, server.client, model, prompt, max_tokens, chunks_read)
                       for prompt in prompts]:
            future.result()
    server.wait_idle(timeout)
    return server.rss_mib()


def run_serving_benchmark(
    settings: ServerSettings,
    max_batch_sizes: list[int],
    concurrencies: list[int],
    requests: int,
    max_tokens: int,
    timeout: float = 600.0,
    disconnect_rounds: int = 0,
    disconnect_streams: int = 32,
    progress=None,
) -> ServingReport:
    """Start one server per max batch size, run every level on each in turn, then the disconnect rounds; stop the
    servers. `progress(level)` sees each level as it ends."""
    check_levels(max_batch_sizes, concurrencies, requests, max_tokens, disconnect_rounds, disconnect_streams)
    report = ServingReport()
    servers: dict[int, Server] = {}
    try:
        for size in max_batch_sizes:  # one after the other: each measures its costs alone
            servers[size] = Server(settings, size, max(max(concurrencies), disconnect_streams), timeout)
        model = servers[max_batch_sizes[0]].client.models.list().data[0].id
        for server in servers.values():
            stream_request(server.client, model, PROMPTS[0], 2)  # warm-up, not counted
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
        reference = None
        for concurrency in concurrencies:
            for size, server in servers.items():
                outcomes, seconds = run_level(server.client, model, prompts, concurrency, max_tokens)
                texts = [outcome.text if outcome else None for outcome in outcomes]
                reference = reference or texts
                differ = sum(text != expected for text, expected in zip(texts, reference))
                level = Level(size, concurrency, len(prompts), seconds, outcomes, differ, os.getloadavg()[0])
                report.levels.append(level)
                if progress is not None:
                    progress(level)
        for size, server in servers.items():
            if disconnect_rounds:
                memory = report.memory_mib[size] = [server.rss_mib()]
                for _ in range(disconnect_rounds):
                    memory.append(disconnect_round(server, model, disconnect_streams, max_tokens, 3, timeout))
    finally:
        for server in servers.values():
            server.stop()
    return report


def check_levels(max_batch_sizes, concurrencies, requests, max_tokens, disconnect_rounds, disconnect_streams) -> None:
    """Fail at once, naming the value, on settings that cannot run."""
    for name, values in (("max batch sizes", max_batch_sizes), ("concurrencies", concurrencies)):
        if not values or any(value < 1 for value in values):
            raise ValueError(f"{name} must be integers >= 1, got {values}")
    if len(set(max_batch_sizes)) != len(max_batch_sizes):
        raise ValueError(f"each max batch size once: got {max_batch_sizes}")
    if requests < 1 or max_tokens < 1:
        raise ValueError(f"requests and max tokens must be >= 1, got {requests} and {max_tokens}")
    if disconnect_rounds < 0 or disconnect_streams < 1:
        raise ValueError(f"disconnect rounds must be >= 0 and streams >= 1, got {disconnect_rounds} and "
                         f"{disconnect_streams}")


def markdown_tables(report: ServingReport) -> str:
    """The levels as one Markdown table; the memory rounds as another, when run."""
    lines = [
        "| max batch | concurrency | requests | requests/s | output tokens/s | TTFT p50 ms | TTFT p95 ms "
        "| TPOT p50 ms | TPOT p95 ms | tau | differ from reference | errors | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [level_row(level) for level in report.levels]
    if report.memory_mib:
        rounds = len(next(iter(report.memory_mib.values()))) - 1
        after = " | ".join(f"after round {i + 1}" for i in range(rounds))
        lines += ["", f"| max batch | RSS MiB before | {after} |", "|---|---|" + "---|" * rounds]
        lines += [f"| {size} | " + " | ".join(f"{mib:.0f}" for mib in memory) + " |"
                  for size, memory in report.memory_mib.items()]
    return "\n".join(lines)


def level_row(level: Level) -> str:
    if not level.done:
        return (f"| {level.max_batch_size} | {level.concurrency} | {level.requests} | - | - | - | - | - | - | - | - "
                f"| {level.errors} | {level.load_average:.1f} |")
    return (f"| {level.max_batch_size} | {level.concurrency} | {level.requests} | {level.requests_per_second:.2f} "
            f"| {level.output_tokens_per_second:.1f} | {level.ttft_ms(50):.0f} | {level.ttft_ms(95):.0f} "
            f"| {level.tpot_ms(50):.0f} | {level.tpot_ms(95):.0f} | {level.tau:.2f} | {level.differ} "
            f"| {level.errors} | {level.load_average:.1f} |")


def fresh_draft(target: str, block_size: int, folder: str) -> str:
    """An untrained draft for a registry target, saved to `folder`: measures the serving stack with drafting cost
    but chance-level proposals."""
    from transformers import AutoConfig

    from ..draft import DFlashDraftModel
    from ..models import prepare, registered_model

    config = AutoConfig.from_pretrained(prepare(target))
    draft = DFlashDraftModel.for_target(
        config, num_layers=2, block_size=block_size, mask_token_id=registered_model(target).mask_token_id
    )
    draft.save_pretrained(folder)
    return folder
