"""`flashdraft draft`: work on draft folders once they are trained.

    average   the weight mean of drafts continued from one another (`flashdraft.train.averaging`), in float32
    ship      a draft folder as the package ships it: bfloat16 weights, model card and training.json carried
    inspect   what a draft folder holds: shape, target layers, block size, drafting vocabulary, how it was trained
    evaluate  tau on held-out records and evaluation sets, held-out loss and per-position accuracy
              (`flashdraft.train.from_corpus`)
    export-gguf  the draft as the GGUF file llama.cpp runs (`--spec-type draft-dflash`), written by llama.cpp's own
              converter (`flashdraft.llama_cpp.export_draft_gguf`)

A new subcommand is a `register` entry here and a function over the library (an export to other formats belongs
beside `ship`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashdraft.commands.options import at_least


def register(subparsers: argparse._SubParsersAction) -> None:
    from flashdraft.commands.llama_cpp import add_llama_cpp_option
    from flashdraft.models import DEFAULT_TARGET

    parser = subparsers.add_parser(
        "draft", help="average, ship, inspect, evaluate and export draft folders",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    average = actions.add_parser("average", help="average the weights of drafts continued from one another",
                                 description="Average the weights of drafts continued from one another into a draft "
                                 "folder (float32: ship it with `flashdraft draft ship`, then measure the shipped "
                                 "folder).")
    average.add_argument("output", type=Path, help="folder to write the averaged draft to")
    average.add_argument("sources", type=Path, nargs="+", help="draft folders or trainer checkpoints (step-*.pt)")
    average.add_argument("--like", type=Path, required=True,
                         help="draft folder whose config and drafting vocabulary the result keeps (one of the "
                         "averaged drafts only when listed among the sources)")
    average.set_defaults(func=_average)

    ship = actions.add_parser("ship", help="write a draft as shipped: bfloat16 weights, model card, training.json",
                              description="Write a trained draft folder as the shipped draft: weights in bfloat16 "
                              "(loaded into float32 on a CPU), README.md and training.json copied as they are, and "
                              "the acceptance check measured on the written folder (acceptance-check.json).")
    ship.add_argument("source", type=Path, help="trained draft folder (flashdraft train's --output)")
    ship.add_argument("destination", type=Path, help="folder to write, e.g. flashdraft/drafts/TARGET")
    ship.add_argument("--target", default=None,
                      help="registry name or model folder the acceptance check runs on (default: the target its "
                      "training.json names)")
    ship.add_argument("--no-check", action="store_true",
                      help="do not record the acceptance check (acceptance-check.json: the tau later runs warn "
                      "against when the draft accepts far less)")
    ship.set_defaults(func=_ship)

    inspect = actions.add_parser("inspect", help="show what a draft folder holds and how it was trained",
                                 description="Show a draft folder's shape, target layers, block size, drafting "
                                 "vocabulary and weights, and the training summary of its training.json.")
    inspect.add_argument("draft", type=Path, help="draft folder")
    inspect.set_defaults(func=_inspect)

    evaluate = actions.add_parser("evaluate", help="tau, held-out loss and accuracy of drafts",
                                  description="Measure drafts on the corpus's held-out records: tau at each draft's "
                                  "block size on the first --prompts records' prompts (replayed on the target's "
                                  "greedy answers), and the teacher-forced loss and per-position accuracy on all "
                                  "of them; with --sets, tau on built-in evaluation sets' prompts too (outside the "
                                  "corpus, what the benchmark runs).")
    evaluate.add_argument("drafts", nargs="+", help="draft folders")
    evaluate.add_argument("--heldout-ids", type=Path, required=True,
                          help="file of record ids (one a line), e.g. corpus/TARGET/draws/heldout-v15.txt")
    evaluate.add_argument("--target", default=DEFAULT_TARGET, help=f"registry name or model folder (default: "
                          f"{DEFAULT_TARGET})")
    evaluate.add_argument("--corpus", type=Path, default=None,
                          help="corpus folder (default: corpus/TARGET under the current folder)")
    evaluate.add_argument("--sets", default="heldout",
                          help="prompt sets to measure tau on, comma separated: heldout (the held-out records' "
                          "prompts), built-in humaneval, gsm8k, mt-bench, alpaca (their last prompts, apart from "
                          "the benchmark's samples), or .jsonl files (default: heldout)")
    evaluate.add_argument("--prompts", type=at_least(1), default=32,
                          help="prompts per set to measure tau on (default: 32)")
    evaluate.add_argument("--max-new-tokens", type=at_least(1), default=128,
                          help="length of the target's answer to each prompt (default: 128)")
    evaluate.add_argument("--max-length", type=at_least(1), default=2048, help="truncate records to this many tokens "
                          "(default: 2048, flashdraft train's)")
    evaluate.add_argument("--device", default="auto", help="torch device (default: auto = cuda when available)")
    evaluate.add_argument("--work-dir", type=Path, default=None,
                          help="folder for the evaluation's caches (default: a temporary one)")
    evaluate.set_defaults(func=_evaluate)

    export = actions.add_parser("export-gguf", help="write a draft as the GGUF file llama.cpp runs",
                                description="Write a DFlash draft folder as the GGUF file llama.cpp loads "
                                "(llama-speculative-simple -md FILE --spec-type draft-dflash), with the converter "
                                "of a llama.cpp folder (convert_hf_to_gguf.py --target-model-dir). The vocabulary and "
                                "tokenizer come from the target; llama.cpp drafts over the whole vocabulary, so a "
                                "drafting vocabulary is not part of the file. Needs sentencepiece "
                                "(pip install 'flashdraft[llama-cpp]').")
    export.add_argument("draft", type=Path, help="draft folder")
    export.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"the draft's target: registry name (prepared on first use) or a transformers folder "
                        f"with its config.json and tokenizer (default: {DEFAULT_TARGET})")
    export.add_argument("-o", "--output", type=Path, required=True, help="GGUF file to write, e.g. draft.gguf")
    export.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16",
                        help="weight type in the file (default: f16)")
    add_llama_cpp_option(export)
    export.set_defaults(func=_export_gguf)


def _average(args: argparse.Namespace) -> int:
    import torch

    from flashdraft.draft import DFlashDraftModel
    from flashdraft.train.averaging import average_drafts

    try:
        draft = average_drafts(DFlashDraftModel.from_pretrained(args.like, dtype=torch.float32), args.sources)
    except OSError as error:  # a source that is no draft folder
        raise ValueError(f"cannot average: {error}") from None
    draft.save_pretrained(args.output)
    print(f"averaged {len(args.sources)} drafts into {args.output} (config and vocabulary of {args.like})")
    return 0


def _ship(args: argparse.Namespace) -> int:
    from flashdraft.draft import check_draft_folder
    from flashdraft.train.drafts import ship_draft

    check_draft_folder(args.source)  # a mistyped source is named as such, not as a draft missing its training.json
    target = None
    if not args.no_check:  # before anything is written: a ship that cannot be checked fails first
        target = args.target or _trained_for(args.source)
    folder = ship_draft(args.source, args.destination)
    size = sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    print(f"shipped {args.source} to {folder} in bfloat16: {size / 1e6:.1f} MB")
    if target is not None:
        from flashdraft.evaluation.check import CHECK_FILE, record_check
        from flashdraft.models import load_draft, load_target

        model, tokenizer = load_target(target)
        tau = record_check(folder, model, tokenizer, load_draft(str(folder)))
        print(f"acceptance check on {target}: tau {tau:.2f} -> {folder / CHECK_FILE}")
    return 0


def _trained_for(source: Path) -> str:
    """The target a draft folder's training.json names; fails with the fix when it names none."""
    try:
        target = json.loads((Path(source) / "training.json").read_text()).get("target")
    except (OSError, ValueError):
        target = None
    if not target:
        raise ValueError(f"{source} has no training.json naming its target: give --target (the registry name or "
                         "model folder of the draft's target) or --no-check")
    return target


def _inspect(args: argparse.Namespace) -> int:
    from flashdraft.draft import check_draft_folder

    check_draft_folder(args.draft)
    config = json.loads((args.draft / "config.json").read_text())
    dflash = config["dflash_config"]
    vocabulary = dflash.get("draft_vocab_size") or len(dflash.get("draft_vocab_ids") or []) or None
    weights = sum(path.stat().st_size for path in args.draft.glob("*.safetensors"))
    print(f"draft {args.draft}")
    dtype = config.get("dtype") or config.get("torch_dtype")
    print(f"  layers {config['num_hidden_layers']}, hidden size {config['hidden_size']}, block size "
          f"{config['block_size']}, weights {dtype} ({weights / 1e6:.1f} MB)")
    print(f"  target: {config['num_target_layers']} layers, vocabulary {config['vocab_size']}; features from layers "
          f"{dflash['target_layer_ids']}; mask token {dflash['mask_token_id']}")
    print(f"  drafting vocabulary: {f'{vocabulary} tokens' if vocabulary else 'the full one'}")
    card = args.draft / "training.json"
    if card.is_file():
        training = json.loads(card.read_text())
        summary = training.get("summary") or {}
        print(f"  trained for {training.get('target', '?')}: {summary.get('steps', '?')} steps"
              + (f", final loss {summary['final_loss']:.3f}" if "final_loss" in summary else ""))
        if training.get("command"):
            print(f"  command: {training['command']}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from flashdraft.train.config import check_prompt_sets

    sets = [name.strip() for name in args.sets.split(",") if name.strip()]
    if not sets:
        raise ValueError("--sets names no prompt set: give e.g. heldout,humaneval")
    check_prompt_sets(sets)  # before torch loads
    from flashdraft.train.from_corpus import evaluate_drafts

    corpus = args.corpus or Path("corpus") / args.target
    for score in evaluate_drafts(args.drafts, target=args.target, corpus=corpus, heldout_ids=args.heldout_ids,
                                 sets=sets, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                 device=args.device, max_length=args.max_length, work_dir=args.work_dir):
        accuracy = " ".join(f"{a:.3f}" for a in score.heldout_accuracy[:4])
        taus = ", ".join(f"{name} {value:.3f}" for name, value in score.tau.items())
        print(f"{score.draft}: tau {taus}; held-out loss {score.heldout_loss:.4f}, accuracy {accuracy}", flush=True)
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    from flashdraft.commands.llama_cpp import llama_cpp_folder
    from flashdraft.draft import check_draft_folder
    from flashdraft.llama_cpp import export_draft_gguf, find_llama_cpp
    from flashdraft.models import REGISTRY, prepare

    check_draft_folder(args.draft)
    llama = find_llama_cpp(llama_cpp_folder(args.llama_cpp))
    llama.converter  # noqa: B018  (fails in one line, before the target is prepared, when there are no sources)
    target = prepare(args.target) if args.target in REGISTRY else Path(args.target)
    output = export_draft_gguf(args.draft, target, args.output, llama, outtype=args.outtype)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB): llama-speculative-simple -m TARGET.gguf -md "
          f"{output} --spec-type draft-dflash")
    return 0
