"""`flashdraft serve`: load a target and a draft, then serve them over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import copy
import errno
import socket
import sys
from pathlib import Path

from flashdraft.commands.options import (
    add_block_size_option,
    add_device_options,
    add_proposals_option,
    device_and_dtype,
    draft_or_lookup,
    status,
)

DEFAULT_MAX_BODY_BYTES = 4 << 20  # as flashdraft.serve.app's (not imported here: `flashdraft --help` needs no FastAPI)
DEFAULT_BODY_SECONDS = 60.0  # as flashdraft.serve.app's (the same test checks)
DEFAULT_MAX_BATCH_SIZE = 16  # as flashdraft.serve.worker's (tests/serve/test_cli.py checks they agree)
DEFAULT_PREFIX_CACHE_TOKENS = 1024  # as flashdraft.batching's (the same test checks)
# After SIGTERM every open request is answered at once; this bounds what is left (a client that does not read its
# answer) before uvicorn cancels it. With the second the worker's thread is given, the exit takes at most ~5 s.
SHUTDOWN_SECONDS = 3


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a target with its draft over an OpenAI-compatible HTTP API",
        description=(
            "Serve a target model with speculative decoding over an OpenAI-compatible API: GET /v1/models, "
            "POST /v1/chat/completions, POST /v1/completions (streaming with \"stream\": true) and GET /health. "
            "Requests wait in a bounded queue; up to --max-batch-size of them are decoded together, round by round."
        ),
    )
    parser.add_argument(
        "--target", default=None,
        help="registry model name, transformers folder or hub id (default: the default target, smollm2-135m-instruct)",
    )
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument(
        "--draft", default=None,
        help="DFlash draft folder or hub id (default: the draft shipped for the target, if any; without one, the "
        "context lookup alone)",
    )
    drafts.add_argument(
        "--no-draft", action="store_true",
        help="serve without a draft: plain autoregressive decoding (or the lookup alone, with --proposals lookup)",
    )
    add_block_size_option(parser)
    add_proposals_option(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--max-queue", type=int, default=64,
        help="requests that may wait for the model; beyond that the server answers 429 (default: 64)",
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
        help="requests decoded together, stepped round by round; 1 decodes one at a time (default: %(default)s, "
             "measured on a 2-core CPU)",
    )
    parser.add_argument(
        "--prefix-cache-tokens", type=int, default=DEFAULT_PREFIX_CACHE_TOKENS,
        help="with batching, prompt positions whose K/V are kept for later prompts that begin the same way (a chat "
             "template's opening, a system prompt), so those are prefilled from where the shared part ends; 0 keeps "
             "none (default: %(default)s)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body served; a larger one is answered 413 (default: 4194304, 4 MiB)",
    )
    parser.add_argument(
        "--body-seconds", type=float, default=DEFAULT_BODY_SECONDS,
        help="seconds a request body may take to arrive; a slower one is answered 408 (default: %(default)s)",
    )
    parser.add_argument(
        "--served-model-name", default=None,
        help="the model name clients send and /v1/models lists (default: the --target value)",
    )
    add_device_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashdraft.models import DEFAULT_TARGET, check_source, load_draft, load_target

    # Everything that can be checked without torch is, before the server's modules load it.
    if args.no_draft and args.proposals in ("hybrid", "dflash"):
        raise ValueError(f"--proposals {args.proposals} needs a draft: drop --no-draft, or use --proposals lookup")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    if args.prefix_cache_tokens < 0:
        raise ValueError(f"--prefix-cache-tokens must be 0 or more, got {args.prefix_cache_tokens}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be at least 1, got {args.max_body_bytes}")
    if not args.body_seconds > 0:  # NaN too
        raise ValueError(f"--body-seconds must be above 0, got {args.body_seconds}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    target_name = args.target or DEFAULT_TARGET
    check_source(target_name)
    if args.draft is not None:
        check_source(args.draft, "draft")
    listening = bind(args.host, args.port)
    try:
        status(f"Loading {target_name} ...")
        try:
            import uvicorn

            from flashdraft.serve import Engine, create_app
            from flashdraft.serve.app import Server
        except ImportError as error:
            raise ValueError(f"flashdraft serve needs the server packages ({error.name} is missing): pip install "
                             "'flashdraft[serve]'") from error
        device, dtype = device_and_dtype(args)
        model, tokenizer = load_target(target_name, device=device, dtype=dtype, engine=args.engine,
                                      arithmetic=args.arithmetic)
        proposals, draft = args.proposals, None
        if not args.no_draft:
            draft_path, proposals = draft_or_lookup(args.draft, proposals, target_name, model.config)
            draft = None if draft_path is None else load_draft(draft_path, device=device, dtype=dtype)
            if draft is not None:  # a draft that accepts far less than its folder records says so
                from flashdraft.evaluation.check import warn_if_weak  # torch: loaded by now

                warn_if_weak(Path(draft_path), model, tokenizer, draft)
        engine = Engine.from_models(
            model, tokenizer, draft, name=args.served_model_name or target_name, block_size=args.block_size,
            proposals=proposals,
        )
        app = create_app(engine, max_queue=args.max_queue, max_batch_size=args.max_batch_size,
                         max_body_bytes=args.max_body_bytes, body_seconds=args.body_seconds,
                         prefix_cache_tokens=args.prefix_cache_tokens)
        mode = f"{engine.proposals} proposals, block size {engine.block_size}" if engine.proposals else "no draft"
        print(f"Serving {engine.name!r} ({mode}) at http://{args.host}:{args.port}/v1", file=sys.stderr)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level="info", log_config=log_config(),
            timeout_graceful_shutdown=SHUTDOWN_SECONDS,
        )
        Server(config).run(sockets=listening)
    finally:
        for sock in listening:
            sock.close()
    return 0


def log_config() -> dict:
    """uvicorn's own logging configuration, with its access log on stderr beside its start-up, shutdown and error
    messages and flashdraft's: uvicorn writes access lines to stdout by default, which split one server's log
    across two streams (`2>server.log` kept the start-up and lost every request)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to host:port, one per address the host resolves to, as uvicorn (asyncio) binds them.

    Bound before the models load (which takes a while) so that a port in use fails at once, in one line, and
    handed to uvicorn so that nothing can take the port in between."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(
            f"--host {host!r} does not resolve ({error.strerror}): pass an address such as 127.0.0.1 or 0.0.0.0"
        ) from None
    sockets = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, protocol)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio: a port in TIME_WAIT is free
            if family == socket.AF_INET6:  # as asyncio: the IPv4 address of the same host gets its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as error:
        for sock in sockets:
            sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use: stop the other server or pass --port N") from None
        raise ValueError(
            f"cannot listen on {host} port {port} ({error.strerror}): pass another --host or --port"
        ) from None
    return sockets
