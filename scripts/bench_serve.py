"""Load benchmark of `flashdraft serve` on loopback: requests and output tokens per second, time to first token and
time per output token (p50/p95), and errors, at several concurrencies, for one server per --max-batch-size (1: the
serial worker; above: continuous batching), all in the same run, the levels interleaved (each concurrency runs on
every server in turn), and whether every response equals the serial server's answer at concurrency 1.

    python scripts/bench_serve.py --requests 32 --max-tokens 64 --concurrency 1 4 8 16 --max-batch-size 1 16

Starts `flashdraft serve` in a subprocess on a free loopback port (the default target and its shipped draft unless
told otherwise; --fresh-draft serves a freshly initialised, untrained draft saved to a temporary folder), waits for
/health, then for each concurrency sends the same bounded set of greedy streaming chat requests from that many
threads with the official `openai` client. Time to first token runs from sending the request to the first chunk
with text, so under concurrency it includes the wait in the server's queue (decoding is batch size 1); time per
output token is (last chunk - first chunk) / (completion tokens - 1) per request; the last column is the machine's
1-minute load average when the level ended (on a shared machine it explains much of the spread). Prints a Markdown
table; stops the server at the end. Every request is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import openai

from flashdraft.models import DEFAULT_TARGET

PROMPTS = [
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
]


@dataclass
class Outcome:
    seconds_to_first_token: float
    seconds_per_output_token: float | None  # None with a single output token
    tau: float
    tokens: int = 0
    text: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_draft(target: str, block_size: int, folder: str) -> str:
    """An untrained draft for a registry target, saved to `folder`: measures the serving stack with drafting cost
    but chance-level proposals."""
    from transformers import AutoConfig

    from flashdraft import DFlashDraftModel
    from flashdraft.models import prepare, registered_model

    config = AutoConfig.from_pretrained(prepare(target))
    draft = DFlashDraftModel.for_target(
        config, num_layers=2, block_size=block_size, mask_token_id=registered_model(target).mask_token_id
    )
    draft.save_pretrained(folder)
    return folder


def start_server(args, port: int, draft: str | None, max_batch_size: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "flashdraft.cli", "serve", "--target", args.target, "--port", str(port),
               "--max-queue", str(max(args.concurrency)), "--max-batch-size", str(max_batch_size)]
    if args.no_draft:
        command.append("--no-draft")
    elif draft is not None:
        command += ["--draft", draft]
    if args.block_size is not None:
        command += ["--block-size", str(args.block_size)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"flashdraft serve exited with {process.returncode}: run it by hand to see why")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return process
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise SystemExit(f"flashdraft serve did not answer within {args.startup_timeout} s")


def one_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> Outcome:
    sent = time.perf_counter()
    first = last = None
    usage = tau = None
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


def run_level(client, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list, int, float]:
    """Outcomes in the order of `prompts` (None for a failed request), errors, seconds."""
    start = time.perf_counter()
    outcomes, errors = [], 0
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(one_request, client, model, p, max_tokens) for p in prompts]:
            try:
                outcomes.append(future.result())
                continue
            except Exception as error:  # counted and reported: the table's error column
                print(f"  request failed: {error}", file=sys.stderr)
                errors += 1
            outcomes.append(None)
    return outcomes, errors, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="registry name or folder (default: %(default)s)")
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument("--draft", help="draft folder (default: the shipped draft of the default target)")
    drafts.add_argument("--fresh-draft", action="store_true", help="serve an untrained draft (registry targets)")
    drafts.add_argument("--no-draft", action="store_true", help="serve without a draft (plain decoding)")
    parser.add_argument("--block-size", type=int, default=None, help="block size (default: the draft's; 16 fresh)")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="client threads per level")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds the server may take to start")
    parser.add_argument("--max-batch-size", type=int, nargs="+", default=[1, 16],
                        help="one server per value, compared in the same run (default: 1 16)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="flashdraft-bench-serve-") as scratch:
        draft = args.draft
        if args.fresh_draft:
            draft = fresh_draft(args.target, args.block_size or 16, scratch)
        servers, clients = {}, {}
        try:
            for size in args.max_batch_size:  # started one after the other: each measures its costs alone
                port = free_port()
                servers[size] = start_server(args, port, draft, size)
                clients[size] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                              max_retries=0, timeout=args.timeout)
            model = clients[args.max_batch_size[0]].models.list().data[0].id
            for client in clients.values():
                one_request(client, model, PROMPTS[0], 2)  # warm-up, not counted
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
            rows, reference = [], None
            for concurrency in args.concurrency:
                for size, client in clients.items():
                    outcomes, errors, seconds = run_level(client, model, prompts, concurrency, args.max_tokens)
                    texts = [o.text if o else None for o in outcomes]
                    reference = reference or texts  # the first server's answers at the first level
                    differ = sum(text != expected for text, expected in zip(texts, reference))
                    done = [o for o in outcomes if o]
                    if not done:
                        rows.append(f"| {size} | {concurrency} | {len(prompts)} | - | - | - | - | - | - | - | - "
                                    f"| {errors} | - |")
                        continue
                    ttft = np.array([o.seconds_to_first_token for o in done]) * 1000
                    tpot = np.array([o.seconds_per_output_token for o in done if o.seconds_per_output_token]) * 1000
                    tokens = sum(o.tokens for o in done)
                    rows.append(
                        f"| {size} | {concurrency} | {len(prompts)} | {len(done) / seconds:.2f} "
                        f"| {tokens / seconds:.1f} | {np.percentile(ttft, 50):.0f} | {np.percentile(ttft, 95):.0f} "
                        f"| {np.percentile(tpot, 50):.0f} | {np.percentile(tpot, 95):.0f} "
                        f"| {np.mean([o.tau for o in done]):.2f} | {differ} | {errors} | {os.getloadavg()[0]:.1f} |"
                    )
                    print(rows[-1], file=sys.stderr, flush=True)
        finally:
            for server in servers.values():
                server.terminate()
                server.wait(timeout=60)
    mode = "no draft" if args.no_draft else (
        "fresh untrained draft" if args.fresh_draft else f"draft {draft or 'shipped'}"
    )
    print(f"\n{args.target}, {mode}, max_tokens {args.max_tokens}, greedy, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}\n")
    print("| max batch | concurrency | requests | requests/s | output tokens/s | TTFT p50 ms | TTFT p95 ms "
          "| TPOT p50 ms | TPOT p95 ms | tau | differ from serial c=1 | errors | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
