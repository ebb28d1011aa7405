"""`flashdraft bench-serve`: throughput and latency of `flashdraft serve` under concurrent clients, batched against
the serial worker in the same run (`flashdraft.bench.serving`)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from flashdraft.commands.options import block_size
from flashdraft.models import DEFAULT_TARGET


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-serve",
        help="load-test `flashdraft serve`: requests/s, output tokens/s, TTFT and TPOT by concurrency",
        description=(
            "Start one `flashdraft serve` per --max-batch-size (1 = the serial worker; above = continuous batching) "
            "on free loopback ports, then send the same greedy streaming chat requests at each --concurrency to every "
            "server in turn, with the official openai client. Prints a Markdown table: requests/s, output tokens/s, "
            "time to first token and time per output token (p50, p95), tau, answers that differ from the first "
            "server's at the first level, errors and the load average. --disconnect-rounds adds rounds of streams "
            "whose clients leave after a few chunks, and the server's resident memory after each. Needs the serve "
            "extra and the openai client."
        ),
    )
    add = parser.add_argument
    add("--target", default=DEFAULT_TARGET, help="registry name or folder (default: %(default)s)")
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument("--draft", default=None, help="draft folder (default: the shipped draft of the default target)")
    drafts.add_argument("--fresh-draft", action="store_true",
                        help="serve an untrained draft (registry targets): the serving stack with chance proposals")
    drafts.add_argument("--no-draft", action="store_true", help="serve without a draft (plain decoding)")
    add("--block-size", type=block_size, default=None,
        help="each server's --block-size (default: serve's, auto; 16 for --fresh-draft)")
    add("--requests", type=int, default=32, help="requests per concurrency level (default: %(default)s)")
    add("--max-tokens", type=int, default=64, help="max_tokens of every request (default: %(default)s)")
    add("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16], metavar="N",
        help="client threads, one level each (default: 1 4 8 16)")
    add("--max-batch-size", type=int, nargs="+", default=[1, 16], metavar="B",
        help="one server per value, compared in the same run; the first answers are the reference (default: 1 16)")
    add("--disconnect-rounds", type=int, default=0,
        help="rounds of --disconnect-streams streams whose clients leave after 3 chunks of text, after the levels; "
        "reports each server's RSS before and after each round (default: 0, none)")
    add("--disconnect-streams", type=int, default=32, help="streams per disconnect round (default: %(default)s)")
    add("--timeout", type=float, default=600, help="seconds one request may take (default: %(default)s)")
    add("--startup-timeout", type=float, default=600,
        help="seconds a server may take to start, kernels and costs measured on first use included "
        "(default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashdraft.bench.serving import (
        ServerSettings,
        check_levels,
        fresh_draft,
        level_row,
        markdown_tables,
        run_serving_benchmark,
    )
    from flashdraft.cli import CommandError

    check_levels(args.max_batch_size, args.concurrency, args.requests, args.max_tokens, args.disconnect_rounds,
                 args.disconnect_streams)
    with tempfile.TemporaryDirectory(prefix="flashdraft-bench-serve-") as scratch:
        draft = args.draft
        if args.fresh_draft:
            draft = fresh_draft(args.target, args.block_size if isinstance(args.block_size, int) else 16, scratch)
        settings = ServerSettings(args.target, draft, args.no_draft, args.block_size, args.startup_timeout)
        try:
            report = run_serving_benchmark(
                settings, args.max_batch_size, args.concurrency, args.requests, args.max_tokens, args.timeout,
                args.disconnect_rounds, args.disconnect_streams,
                progress=lambda level: print(level_row(level), file=sys.stderr, flush=True),
            )
        except RuntimeError as error:  # a server that did not start or did not settle: its own words
            raise CommandError(str(error)) from error
    mode = "no draft" if args.no_draft else ("fresh untrained draft" if args.fresh_draft else
                                             f"draft {args.draft or 'shipped'}")
    print(f"\n{args.target}, {mode}, max_tokens {args.max_tokens}, greedy, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}\n")
    print(markdown_tables(report))
    return 0
