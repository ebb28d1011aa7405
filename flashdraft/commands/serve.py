"""`flashdraft serve`: load a target and a draft, then serve them over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a target with its draft over an OpenAI-compatible HTTP API",
        description=(
            "Serve a target model with speculative decoding over an OpenAI-compatible API: GET /v1/models, "
            "POST /v1/chat/completions, POST /v1/completions (streaming with \"stream\": true) and GET /health. "
            "Requests wait in a bounded queue and are decoded one at a time."
        ),
    )
    parser.add_argument(
        "--target", default=None,
        help="registry model name, transformers folder or hub id (default: the default target, smollm2-135m-instruct)",
    )
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument(
        "--draft", default=None,
        help="DFlash draft folder or hub id (default: the draft shipped for the default target)",
    )
    drafts.add_argument(
        "--no-draft", action="store_true", help="serve without a draft: plain autoregressive decoding",
    )
    parser.add_argument(
        "--block-size", type=int, default=None,
        help="tokens per verification: the anchor plus block-size - 1 proposals (default: chosen round by round "
        "for the most tokens per second, never above the draft's own block size)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--max-queue", type=int, default=64,
        help="requests that may wait for the model; beyond that the server answers 429 (default: 64)",
    )
    parser.add_argument(
        "--served-model-name", default=None,
        help="the model name clients send and /v1/models lists (default: the --target value)",
    )
    parser.add_argument("--device", default="cpu", help="torch device for the models, e.g. cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype (default: float32)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        import uvicorn

        from flashdraft.serve import Engine, create_app
    except ImportError as error:
        raise ValueError(
            f"flashdraft serve needs the server packages ({error.name} is missing): pip install 'flashdraft[serve]'"
        ) from error
    from flashdraft.models import DEFAULT_TARGET, load_draft, load_target

    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {args.block_size}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    target_name = args.target or DEFAULT_TARGET
    if not args.no_draft and args.draft is None and target_name != DEFAULT_TARGET:
        raise ValueError(
            f"no draft is shipped for {target_name!r}: pass --draft FOLDER (a draft trained for it) or --no-draft"
        )
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_target(target_name, device=args.device, dtype=dtype)
    draft = None if args.no_draft else load_draft(args.draft, device=args.device, dtype=dtype)
    engine = Engine.from_models(
        model, tokenizer, draft, name=args.served_model_name or target_name, block_size=args.block_size
    )
    app = create_app(engine, max_queue=args.max_queue)
    mode = f"draft block size {engine.block_size}" if draft is not None else "no draft"
    print(f"Serving {engine.name!r} ({mode}) at http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
