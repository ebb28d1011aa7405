"""`flashdraft generate`: answer one prompt with speculative decoding, streaming the text as it is accepted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashdraft.commands.options import (
    add_block_size_option,
    add_device_options,
    add_proposals_option,
    at_least,
    device_and_dtype,
    draft_or_lookup,
    status,
    temperature,
    text_argument,
    top_p,
)
from flashdraft.models import DEFAULT_TARGET, DEMO_MAX_NEW_TOKENS, DEMO_PROMPT
from flashdraft.rules import tau


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        description="Generate an answer to PROMPT with the target model, drafted by a DFlash draft. The output is "
        "exactly the target's own (greedy at temperature 0, the target's sampling distribution above it). "
        f"Without --target/--draft: the default target ({DEFAULT_TARGET}, a 135M demonstration model) with the draft "
        "shipped in the package; a target no draft is shipped for runs with the context lookup alone. "
        f"Try: flashdraft generate --max-new-tokens {DEMO_MAX_NEW_TOKENS} \"{DEMO_PROMPT}\"",
    )
    parser.add_argument("prompt", type=text_argument("prompt"),
                        help="the prompt text (a user message when the tokenizer has a chat template)")
    parser.add_argument("--target", default=None, help="registry name, local folder or hub id of the target "
                        f"(default: {DEFAULT_TARGET}; see `flashdraft models list`)")
    parser.add_argument("--draft", default=None, help="DFlash draft folder or hub id (default: the draft shipped "
                        "for the target, if any; without one, the context lookup alone)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=256,
                        help="most tokens to generate (default: 256)")
    parser.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    parser.add_argument("--top-k", type=at_least(0), default=0,
                        help="sample among the k most likely tokens; 0 = all (default)")
    add_block_size_option(parser)
    add_proposals_option(parser)
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--system", type=text_argument("system message"), default=None,
                        help="optional system message for the chat template")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompt text as it is")
    add_device_options(parser)
    parser.add_argument("--verbose", action="store_true",
                        help="also print every round's block size and the tokens it yielded")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashdraft.models import check_source

    # Everything that can be checked without torch is, so that a mistake is answered in a second, not after loading.
    target_name = args.target or DEFAULT_TARGET
    check_source(target_name)
    if args.draft is not None:
        check_source(args.draft, "draft")
    status(f"Loading {target_name} ...")
    from flashdraft.decoding import stream
    from flashdraft.evaluation.check import warn_if_weak
    from flashdraft.models import load_draft, load_target
    from flashdraft.text import IncrementalText, encode_chat, stop_token_ids

    device, dtype = device_and_dtype(args)
    target, tokenizer = load_target(target_name, device=device, dtype=dtype, engine=args.engine,
                                      arithmetic=args.arithmetic)
    # Plain decoding needs no draft; anything else uses the given or the shipped one, or the lookup without one.
    proposals, draft = args.proposals, None
    if not (args.block_size == 1 and args.draft is None):
        draft_path, proposals = draft_or_lookup(args.draft, proposals, target_name, target.config)
        draft = None if draft_path is None else load_draft(draft_path, device=device, dtype=dtype)
        if draft is not None:  # a draft that accepts far less than its folder records says so (lossless either way)
            warn_if_weak(Path(draft_path), target, tokenizer, draft)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    chat_template = not args.no_chat_template and bool(tokenizer.chat_template)
    input_ids = encode_chat(tokenizer, messages, chat_template=chat_template)
    tokens = stream(
        target, draft, input_ids,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        stop_token_ids=stop_token_ids(target, tokenizer), block_size=args.block_size, seed=args.seed,
        proposals=proposals,
    )
    text = IncrementalText(tokenizer)
    with tokens:
        for round_tokens in tokens:
            delta, _ = text.add(round_tokens)
            sys.stdout.write(delta)
            sys.stdout.flush()
    sys.stdout.write(text.finish() + "\n")
    result = tokens.result
    if args.verbose:
        rounds = " ".join(f"{size}:{length}" for size, length in zip(result.block_sizes, result.acceptance_lengths))
        print(f"[rounds, block size:tokens yielded: {rounds}]", file=sys.stderr)
    speculating = (draft is not None or proposals == "lookup") and args.block_size != 1
    print(statistics_line(result, speculating), file=sys.stderr)
    return 0


def statistics_line(result, speculating: bool) -> str:
    """The line after the answer, with the tokens each source gave. When the adaptive block size kept speculation
    off, it says so and why, rather than showing a tau of 1 that reads as a broken draft."""
    drafted = [length for size, length in zip(result.block_sizes, result.acceptance_lengths) if size > 1]
    rounds = len(result.block_sizes)
    if not speculating:
        acceptance = "no speculation (block size 1)"
    elif rounds and len(drafted) < rounds / 2:
        drafted_tau = f"tau {tau(drafted):.2f} in the {len(drafted)}" if drafted else "no"
        acceptance = (f"speculation off in {rounds - len(drafted)} of {rounds} rounds, where no proposal was "
                      f"expected to pay on this machine ({drafted_tau} rounds that speculated)")
    else:
        acceptance = f"tau {result.tau:.2f}"
    sources = ", ".join(f"{source} {count}" for source, count in result.tokens_by_source.items())
    tokens = f"{len(result.tokens)} token{'s' * (len(result.tokens) != 1)}"
    tokens += f" ({sources})" if speculating else ""
    # Without a round after the prefill (one token, or a stop at the first) there is no tau or speed to show.
    speed = f"{acceptance} | {result.tokens_per_second:.1f} tokens/s" if rounds else "no round after the first token"
    return (f"[{tokens} | {speed} | first token {result.time_to_first_token * 1000:.0f} ms | "
            f"stop: {result.stop_reason}]")
