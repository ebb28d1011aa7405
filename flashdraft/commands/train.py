"""`flashdraft train`: train a DFlash draft for a target, from prompts to a draft folder, in resumable stages.

    prompts   a prompt file and/or a seeded mix of built-in sources, checked against the evaluation sets
    labels    the target writes the responses (regenerate) and/or labels existing ones (teacher-forced)
    features  the target's hidden states of the feature layers, stored once on disk (offline) or skipped (online)
    train     the trainer: checkpoints, resume, evaluation by speculative decoding, best draft, model card

Every stage caches its output in the work folder and continues where it stopped when run again with the same
settings; a finished stage is skipped. Under torchrun / accelerate launch only the train stage runs (every
process trains on its share of each batch); run the data stages first in one process (`--until features`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shlex
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

STAGES = ("prompts", "labels", "features", "train")
PROMPTS_FILE = "prompts.jsonl"
PROMPT_SETTINGS = "prompts.json"  # a work folder holds the data of one prompt set: the one these settings make
PROMPTS_LOCK = ".prompts.lock"
LABEL_KINDS = ("regenerate", "teacher-forced")
HELDOUT_SET = "heldout"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a DFlash draft for a target (prompts -> target-written data -> features -> training)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from flashdraft.evaluation.datasets import DATASETS
    from flashdraft.models import DEFAULT_TARGET
    from flashdraft.train.sources import DEFAULT_PROPORTIONS, SOURCES

    add = parser.add_argument_group("target and draft").add_argument
    add("--target", default=DEFAULT_TARGET,
        help=f"registry name, folder or hub id of the target (default: {DEFAULT_TARGET})")
    add("-o", "--output", required=True, type=Path, help="folder to write the trained draft and its model card into")
    add("--work-dir", type=Path, default=None,
        help="folder for the cached stages and checkpoints (default: $FLASHDRAFT_HOME/train/TARGET); keep it outside "
        "the repository")
    add("--run-name", default="default",
        help="name of the training run inside the work folder; a run resumes from its last checkpoint, so give a new "
        "name to train with other settings (default: default)")
    add("--draft-layers", type=int, default=2, help="decoder layers of the draft (default: 2)")
    add("--block-size", type=int, default=16,
        help="tokens per block, anchor included; train at the block size you decode with (default: 16)")
    add("--feature-layers", default="5",
        help="target layers the draft reads: a comma list (e.g. 1,8,14,20,27) or a count spread evenly from layer 1 "
        "to the fourth-last (default: 5)")
    add("--mask-token-id", type=int, default=None,
        help="token id of the block's mask positions: a special token that never occurs in text (default: the "
        "registry's choice for registry targets, else the tokenizer's mask token)")
    add("--draft-vocab-size", type=int, default=8192,
        help="draft over the N tokens most frequent in the target's outputs (the loss and the drafting head use only "
        "those rows; the ids are saved with the draft); 0 = the full vocabulary (default: 8192, or the full "
        "vocabulary when it is not larger than twice that)")
    add("--init-from-target", action=argparse.BooleanOptionalAction, default=True,
        help="start the draft's layers from the target's last layers where shapes match (default: on)")
    add("--init-draft", type=Path, default=None,
        help="start from the weights of this draft folder instead (e.g. to continue on more data under a new "
        "--run-name); its layers, block size, feature layers and mask token must match the options")
    add("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="target weights' dtype; the draft trains in float32 under autocast when this is lower (default: float32)")
    add("--threads", type=int, default=None,
        help="torch CPU threads (default: torch's choice, one per core); on a CPU shared with other jobs use 1, or "
        "set OMP_WAIT_POLICY=PASSIVE in the environment: spinning threads can make training several times slower")
    add("--until", choices=STAGES, default="train", help="stop after this stage (default: train, the whole pipeline)")

    add = parser.add_argument_group("prompts").add_argument
    add("--prompts", action="append", type=Path, default=[], metavar="FILE",
        help="JSONL prompt file, one {\"messages\": [...]} or {\"prompt\": \"...\"} per line, optionally with a "
        "\"response\"; repeatable. A file that overlaps an evaluation set is refused")
    add("--sources", default=None,
        help=f"built-in prompt sources to mix, comma separated, among {', '.join(SOURCES)}, or 'none' (default: all "
        "of them without --prompts, none with it)")
    add("--proportions", default=",".join(f"{k}={v}" for k, v in DEFAULT_PROPORTIONS.items()),
        help="mix of the built-in sources as name=weight pairs (default: %(default)s)")
    add("--num-prompts", type=int, default=1000, help="prompts drawn from the built-in sources (default: 1000)")
    add("--max-prompt-chars", type=int, default=3000,
        help="cut longer prompt messages (and responses) to this many characters rather than dropping them "
        "(default: 3000)")
    add("--skip-eval-check", action="store_true",
        help="do not check prompts against the evaluation sets (for machines without the evaluation packages; "
        "the benchmark figures of such a draft may be contaminated)")

    add = parser.add_argument_group("target-written data").add_argument
    add("--labels", choices=[*LABEL_KINDS, "both"], default="regenerate",
        help="regenerate: the target answers every prompt (the published recipe); teacher-forced: the target's greedy "
        "prediction at each position of the prompts' existing responses, at the cost of one forward (several times "
        "faster; prompts without a response are skipped); both (default: regenerate)")
    add("--max-new-tokens", type=int, default=256,
        help="longest regenerated or labelled response, in tokens (default: 256)")
    add("--temperature", type=float, default=0.0, help="regeneration temperature; 0 = greedy (default: 0)")
    add("--top-k", type=int, default=0,
        help="also store the target's top-k probabilities at every response position, for --distill-weight "
        "(default: 0)")
    add("--label-minutes", type=float, default=None,
        help="spend at most this many minutes writing labels in this run, then train on the records written so far "
        "(a later run continues the labelling; 0 = train on what exists) (default: no limit)")
    add("--data-batch-size", type=int, default=8, help="prompts per target batch in regeneration, labelling and "
        "feature extraction (default: 8)")

    add = parser.add_argument_group("features").add_argument
    add("--features", choices=["offline", "online"], default="offline",
        help="offline: run the target once over the data and store the features on disk for every epoch; online: run "
        "it in every training step (no disk, for a single epoch or a fast GPU) (default: offline)")
    add("--feature-dtype", choices=["float16", "bfloat16", "float32"], default="float16",
        help="storage dtype of offline features (default: float16, 2 bytes per value)")
    add("--max-length", type=int, default=2048, help="truncate training sequences to this many tokens (default: 2048)")

    add = parser.add_argument_group("training").add_argument
    add("--epochs", type=int, default=3, help="passes over the training sequences (default: 3)")
    add("--max-steps", type=int, default=None, help="optimizer steps, overriding --epochs")
    add("--num-anchors", type=int, default=64, help="random blocks per sequence, redrawn every epoch (default: 64)")
    add("--gamma", type=float, default=None,
        help="loss weight decay over block positions, exp(-(k-1)/gamma) (default: 7 at block 16, 4 at block 8)")
    add("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default: 6e-4)")
    add("--warmup-ratio", type=float, default=0.04, help="share of the steps with a linear warmup (default: 0.04)")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
    add("--batch-size", type=int, default=1, help="sequences per micro-batch in each process (default: 1)")
    add("--grad-accum", type=int, default=4, help="micro-batches per optimizer step (default: 4)")
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (default: 1.0)")
    add("--distill-weight", type=float, default=0.0,
        help="0: hard labels; 1: cross-entropy to the target's stored top-k probabilities (needs --top-k); between: a "
        "mix (default: 0)")
    add("--loss-chunk", type=int, default=1024,
        help="block positions per pass through the output head; bounds the logits' memory (default: 1024)")
    add("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default: 200)")
    add("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept (default: 2)")
    add("--eval-every", type=int, default=500,
        help="steps between evaluations of tau (greedy decoding replayed on the target's answers); 0 = at the "
        "end only (default: 500)")
    add("--eval-sets", default=HELDOUT_SET,
        help=f"prompt sets to measure tau on, comma separated: {HELDOUT_SET} (prompts of held-out records), built-in "
        f"{', '.join(DATASETS)} (their last prompts, apart from the usual benchmark samples), or .jsonl files; the "
        "draft with the best mean tau is kept (default: %(default)s)")
    add("--eval-prompts", type=int, default=16, help="prompts per evaluation set (default: 16)")
    add("--eval-max-new-tokens", type=int, default=128,
        help="length of the target's answer to each evaluation prompt, written once (default: 128)")
    add("--heldout", type=int, default=16,
        help="records kept out of training for held-out loss, accuracy and the heldout prompt set (default: 16)")
    add("--seed", type=int, default=0, help="seed of the prompt mix, anchors and data order (default: 0)")
    parser.set_defaults(func=lambda args: run(args, parser))


# ---------------------------------------------------------------------- helpers


def exact_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command line with every option spelled out, defaults included: it reproduces the run."""
    words = ["flashdraft", "train"]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[-1]
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(action.option_strings[0 if value else 1])  # --flag / --no-flag
        elif isinstance(action, argparse._StoreTrueAction):
            if value:
                words.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                words += [flag, str(item)]
        elif value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _parse_proportions(text: str) -> dict[str, float]:
    proportions = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.partition("=")
        try:
            proportions[name.strip()] = float(weight)
        except ValueError:
            raise ValueError(f"--proportions takes name=weight pairs, got {item!r}") from None
    return proportions


def _resolve_feature_layers(text: str, num_target_layers: int) -> list[int]:
    from flashdraft.draft import default_target_layer_ids
    from flashdraft.train.features import check_feature_layers

    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--feature-layers takes a count or a comma list of layer ids, got {text!r}") from None
    if len(values) == 1 and "," not in text:
        if values[0] < 1:
            raise ValueError(f"--feature-layers count must be at least 1, got {values[0]}")
        values = default_target_layer_ids(num_target_layers, values[0])
    check_feature_layers(values, num_target_layers)
    return values


def _mask_token_id(args, tokenizer, vocab_size: int) -> int:
    from flashdraft.models import REGISTRY

    mask = args.mask_token_id
    if mask is None and args.target in REGISTRY:
        mask = REGISTRY[args.target].mask_token_id
    if mask is None:
        mask = tokenizer.mask_token_id
    if mask is None:
        raise ValueError(
            "the target's tokenizer has no mask token: give --mask-token-id, a special token id that never occurs "
            "in text (e.g. an unused reserved token)"
        )
    if not 0 <= mask < vocab_size:
        raise ValueError(f"--mask-token-id {mask} is outside the target's vocabulary [0, {vocab_size})")
    return mask


def _draft_shape(draft) -> tuple:
    return draft.config.num_hidden_layers, draft.block_size, draft.target_layer_ids, draft.mask_token_id


def _say(message: str) -> None:
    print(f"[flashdraft train] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- stages


def prompt_settings(args) -> dict:
    """What makes the prompt set: the prompt files (by content), the built-in mix and the checks."""
    from flashdraft.train.sources import SOURCES

    sources = args.sources if args.sources is not None else ("none" if args.prompts else ",".join(SOURCES))
    names = [] if sources.strip() == "none" else [s.strip() for s in sources.split(",") if s.strip()]
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"unknown prompt sources {unknown}: choose among {', '.join(SOURCES)}, or 'none'")
    if not names and not args.prompts:
        raise ValueError("no prompts: give --prompts FILE and/or --sources")
    files = [path.expanduser().resolve() for path in args.prompts]
    settings = {
        "files": {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None for p in files},
        "sources": names,
        "proportions": _parse_proportions(args.proportions) if names else {},
        "num_prompts": args.num_prompts if names else 0,
        "max_prompt_chars": args.max_prompt_chars,
        "seed": args.seed,
        "eval_check": not args.skip_eval_check,
    }
    return json.loads(json.dumps(settings))  # as it reads back from prompts.json


def _stored_settings(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def check_work_folder(work: Path, settings: dict) -> None:
    """Refuse, before anything is written, a work folder that holds the data of another prompt set: its records
    and features belong to those prompts, so a run that wrote there would mix two data sets (and leave the other
    run unable to resume)."""
    stored = _stored_settings(work / PROMPT_SETTINGS)
    if stored is not None and stored != settings:
        changed = sorted(k for k in stored.keys() | settings.keys() if stored.get(k) != settings.get(k))
        raise ValueError(
            f"the work folder {work} holds the data of other prompt settings (differences: {', '.join(changed)}; "
            f"see its {PROMPT_SETTINGS}): give this run its own --work-dir, or run it with those settings"
        )


def check_record_folders(args, work: Path, model, tokenizer) -> None:
    """Refuse, before anything is written, record folders made with other label settings."""
    from flashdraft.train.labels import label_settings
    from flashdraft.train.records import settings_differences
    from flashdraft.train.regenerate import regenerate_settings

    for kind in label_kinds(args):
        if kind == "regenerate":
            settings = regenerate_settings(model, tokenizer, max_new_tokens=args.max_new_tokens,
                                           temperature=args.temperature, top_k=args.top_k,
                                           batch_size=args.data_batch_size, seed=args.seed)
        else:
            settings = label_settings(model, tokenizer, max_response_tokens=args.max_new_tokens, top_k=args.top_k,
                                      batch_size=args.data_batch_size)
        changed = settings_differences(work / f"records-{kind}", settings)
        if changed:
            raise ValueError(
                f"{work / f'records-{kind}'} holds records made with other settings (differences: "
                f"{', '.join(changed)}; see its meta.json): give this run its own --work-dir, or run it with those "
                "settings"
            )


def stage_prompts(args, work: Path, settings: dict):
    """The prompt set, mixed and checked once, cached as prompts.jsonl with the settings that made it (written
    last: it marks the stage done). One run at a time builds it (a lock file)."""
    from flashdraft.train.prompts import read_prompt_file
    from flashdraft.train.records import exclusive

    path, settings_path = work / PROMPTS_FILE, work / PROMPT_SETTINGS
    if _stored_settings(settings_path) == settings:
        return read_prompt_file(path).prompts
    with exclusive(work / PROMPTS_LOCK, f"another run is preparing the prompts in {work}: wait for it to finish"):
        check_work_folder(work, settings)  # again: another run may have written its prompts since the first check
        if _stored_settings(settings_path) == settings:
            return read_prompt_file(path).prompts
        return _make_prompts(args, work, settings)


def _make_prompts(args, work: Path, settings: dict):
    from flashdraft.train.decontaminate import EvalIndex, check_decontaminated, load_eval_sets, remove_overlaps
    from flashdraft.train.prompts import mix_prompts, read_prompt_file, truncate_prompt, write_prompt_file
    from flashdraft.train.sources import load_sources

    names = settings["sources"]
    files = [path.expanduser().resolve() for path in args.prompts]
    index = None if args.skip_eval_check else EvalIndex(load_eval_sets())
    prompts = []
    for file in files:
        read = read_prompt_file(file)
        if read.skipped:
            _say(f"{file}: skipped {len(read.skipped)} malformed line(s): "
                 + ", ".join(f"line {n} ({why})" for n, why in read.skipped[:10]))
        file_prompts = [truncate_prompt(p, args.max_prompt_chars) for p in read.prompts]
        if index is not None:
            check_decontaminated(file_prompts, index, name=str(file))
        prompts += file_prompts
    if names:
        pools = load_sources(names)
        if index is not None:
            for name in names:
                pools[name], overlaps = remove_overlaps(pools[name], index)
                if overlaps:
                    _say(f"source {name}: dropped {len(overlaps)} prompt(s) overlapping evaluation sets")
        proportions = {name: weight for name, weight in settings["proportions"].items() if name in names}
        prompts += mix_prompts(pools, proportions, args.num_prompts, seed=args.seed, max_chars=args.max_prompt_chars)
    ids = Counter(p.id for p in prompts)
    repeated = [i for i, count in ids.items() if count > 1]
    if repeated:
        raise ValueError(f"prompt ids repeat across the prompt files: {repeated[:5]}: give each prompt a unique id")
    if not prompts:
        raise ValueError("the prompt set is empty: the prompt files hold no valid prompt")
    path, settings_path = work / PROMPTS_FILE, work / PROMPT_SETTINGS
    write_prompt_file(prompts, path)
    temporary = settings_path.with_name(settings_path.name + ".tmp")
    temporary.write_text(json.dumps(settings, indent=2) + "\n")
    temporary.replace(settings_path)
    counts = Counter(p.source for p in prompts)
    _say(f"prompts: {len(prompts)} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) -> {path}")
    return prompts


def label_kinds(args) -> list[str]:
    return list(LABEL_KINDS) if args.labels == "both" else [args.labels]


def stage_labels(args, work: Path, model, tokenizer, prompts) -> None:
    """Target-written records for every prompt (each kind resumes on its own)."""
    from flashdraft.train.labels import label_responses
    from flashdraft.train.regenerate import regenerate

    deadline = None if args.label_minutes is None else time.monotonic() + 60 * args.label_minutes
    for kind in label_kinds(args):
        folder = work / f"records-{kind}"
        time_limit = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if kind == "regenerate":
            stats = regenerate(model, tokenizer, prompts, folder, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k, batch_size=args.data_batch_size,
                               seed=args.seed, time_limit=time_limit)
        else:
            stats = label_responses(model, tokenizer, prompts, folder, max_response_tokens=args.max_new_tokens,
                                    top_k=args.top_k, batch_size=args.data_batch_size, time_limit=time_limit)
        _say(f"{kind}: {stats.written} new records, {stats.already_done} already done, "
             f"{stats.tokens_per_second:.0f} tokens/s -> {folder}")
        if stats.remaining:
            _say(f"{kind}: --label-minutes ran out with {stats.remaining} prompts left: training on the records so "
                 "far (run again to continue the labelling)")


def load_sequences(args, work: Path, prompts, tokenizer):
    """The records of the label stages for `prompts` as training sequences (ids prefixed by their kind), split
    into training and held-out sequences by a seeded draw. A record is used only when its prompt is the prompt of
    the set with its id, so records that are not of this prompt set (imported, or left by an earlier flashdraft
    that mixed prompt sets) are never trained on."""
    from flashdraft.train.blocks import TrainingSequence
    from flashdraft.train.prompts import encode_prompt
    from flashdraft.train.records import read_records

    by_id = {prompt.id: prompt for prompt in prompts}
    sequences = []
    for kind in label_kinds(args):
        folder, outside = work / f"records-{kind}", 0
        for record in read_records(folder):
            prompt = by_id.get(record.id)
            if prompt is None:
                outside += 1
                continue
            if record.input_ids[: record.response_start] != encode_prompt(tokenizer, prompt):
                raise ValueError(
                    f"{folder} holds a record of prompt {record.id!r} made from another prompt text: the folder "
                    "mixes two prompt sets (an earlier flashdraft let that happen); delete it, or give this run its "
                    "own --work-dir"
                )
            record.id = f"{kind}/{record.id}"
            sequences.append(TrainingSequence.from_record(record, args.max_length))
        if outside:
            _say(f"{kind}: {outside} records of prompts outside this prompt set are left out")
    usable = [s for s in sequences if len(s.anchor_positions) > 0]
    if not usable:
        raise ValueError("no training record has a response of 2 tokens or more: the training set is empty")
    if args.heldout >= len(usable):
        raise ValueError(f"--heldout {args.heldout} leaves no training data out of {len(usable)} usable records")
    heldout_ids = set(random.Random(f"{args.seed}:heldout").sample(sorted(s.id for s in usable), args.heldout))
    return [s for s in usable if s.id not in heldout_ids], [s for s in usable if s.id in heldout_ids]


def data_counts(sequences) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for sequence in sequences:
        entry = counts.setdefault(sequence.source, {"sequences": 0, "tokens": 0})
        entry["sequences"] += 1
        entry["tokens"] += len(sequence) - sequence.response_start
    return dict(sorted(counts.items()))


def eval_prompt_sets(args, tokenizer, heldout) -> dict[str, list[list[int]]]:
    """Token ids of the prompts to measure tau on, per set."""
    from flashdraft.evaluation.datasets import get_dataset
    from flashdraft.text import encode_chat

    sets = {}
    for name in filter(None, (part.strip() for part in args.eval_sets.split(","))):
        if name == HELDOUT_SET:
            sets[name] = [s.input_ids[: s.response_start].tolist() for s in heldout[: args.eval_prompts]]
            continue
        samples = get_dataset(name).read()[-args.eval_prompts :]
        sets[Path(name).stem if name.endswith(".jsonl") else name] = [
            encode_chat(tokenizer, sample.messages([])) for sample in samples
        ]
    return {name: prompts for name, prompts in sets.items() if prompts}


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from flashdraft.models import cache_home
    from flashdraft.train.distributed import setup_distributed
    from flashdraft.train.records import exclusive
    from flashdraft.train.trainer import TrainConfig, ensure_writable

    command = exact_command(args, parser)
    config = TrainConfig(  # first: a bad setting fails before any model is loaded
        num_anchors=args.num_anchors, gamma=args.gamma, learning_rate=args.lr, warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay, epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
        grad_accum=args.grad_accum, max_grad_norm=args.max_grad_norm, distill_weight=args.distill_weight,
        loss_chunk=args.loss_chunk, checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
        eval_every=args.eval_every, eval_max_new_tokens=args.eval_max_new_tokens, seed=args.seed,
    )
    if args.distill_weight > 0 and args.top_k <= 0:
        raise ValueError("--distill-weight needs the target's top-k probabilities: add --top-k K (e.g. 8)")
    if args.label_minutes is not None and args.label_minutes < 0:
        raise ValueError(f"--label-minutes must be >= 0, got {args.label_minutes}")
    if args.block_size < 2 or args.draft_layers < 1:
        raise ValueError("--block-size must be at least 2 and --draft-layers at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dist = setup_distributed(args.device)
    distributed = dist.world_size > 1
    if distributed and args.until != "train":
        raise ValueError("under torchrun / accelerate launch only the train stage runs: run the data stages first "
                         "in one process with --until features")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", args.target).strip("-")
    work = (args.work_dir or cache_home() / "train" / slug).expanduser().resolve()
    output = args.output.expanduser().resolve()
    settings = None if distributed else prompt_settings(args)
    if dist.is_main:
        if output.is_dir() and not (output / "config.json").is_file() and any(output.iterdir()):
            raise ValueError(f"{output} exists and is not a draft folder: choose an empty or new --output")
        if settings is not None:
            check_work_folder(work, settings)  # before anything is written
        ensure_writable(output, 200 << 20, "draft")
        ensure_writable(work, 1 << 30, "work folder")
    run_dir = work / "runs" / args.run_name
    # One command at a time trains a run folder (the data folders have locks of their own).
    lock = (exclusive(run_dir / ".lock", f"another run is training in {run_dir}: wait for it to finish, or give this "
                      "one another --run-name")
            if dist.is_main and args.until == "train" else nullcontext())
    with lock:
        return _pipeline(args, command, config, dist, work, output, run_dir, settings)


def _pipeline(args, command: str, config, dist, work: Path, output: Path, run_dir: Path, settings: dict | None) -> int:
    """The stages, from loading the target to the written draft."""
    import torch

    from flashdraft.draft import DFlashDraftModel
    from flashdraft.models import load_target
    from flashdraft.text import stop_token_ids
    from flashdraft.train.distributed import barrier
    from flashdraft.train.features import FeatureStore, OnlineFeatures, build_feature_store
    from flashdraft.train.loss import DraftVocabulary
    from flashdraft.train.prompts import read_prompt_file
    from flashdraft.train.trainer import Trainer, init_from_target, save_trained_draft, seed_everything

    model, tokenizer = load_target(args.target, device=dist.device, dtype=getattr(torch, args.dtype))
    text_config = model.config.get_text_config()
    layer_ids = _resolve_feature_layers(args.feature_layers, text_config.num_hidden_layers)
    mask_token_id = _mask_token_id(args, tokenizer, model.get_input_embeddings().weight.shape[0])

    distributed = dist.world_size > 1
    if not distributed:
        check_record_folders(args, work, model, tokenizer)  # before anything is written
        prompts = stage_prompts(args, work, settings)
        if args.until == "prompts":
            return 0
        stage_labels(args, work, model, tokenizer, prompts)
        if args.until == "labels":
            return 0
    else:
        if not (work / PROMPT_SETTINGS).is_file():
            raise ValueError(f"{work} holds no prompts: run the data stages first in one process with --until "
                             "features")
        prompts = read_prompt_file(work / PROMPTS_FILE).prompts
    sequences, heldout = load_sequences(args, work, prompts, tokenizer)
    if args.features == "offline":
        key = _digest({"layers": layer_ids, "dtype": args.feature_dtype, "target": args.target,
                       "sequences": sorted((s.id, len(s)) for s in sequences + heldout)})
        folder = work / f"features-{key}"
        if not distributed:
            build_feature_store(model, sequences + heldout, folder, layer_ids, dtype=args.feature_dtype,
                                batch_size=args.data_batch_size)
        features = FeatureStore(folder)
    else:
        features = OnlineFeatures(model, layer_ids)
    if args.until == "features":
        return 0

    seed_everything(args.seed)  # the draft's random initialisation (e.g. fc) is part of a reproducible run
    draft = DFlashDraftModel.for_target(model.config, num_layers=args.draft_layers, block_size=args.block_size,
                                        mask_token_id=mask_token_id, target_layer_ids=layer_ids)
    if args.init_draft:
        start = DFlashDraftModel.from_pretrained(args.init_draft)
        if _draft_shape(start) != _draft_shape(draft):
            raise ValueError(
                f"--init-draft {args.init_draft} has (layers, block size, feature layers, mask token) "
                f"{_draft_shape(start)} but the options ask for {_draft_shape(draft)}: give matching --draft-layers, "
                "--block-size, --feature-layers and --mask-token-id"
            )
        weights = start.state_dict()
        weights.pop("draft_vocab_ids", None)  # the drafting vocabulary is chosen again from this run's data
        draft.load_state_dict(weights)
    elif args.init_from_target:
        init_from_target(draft, model)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    vocabulary = None
    if args.draft_vocab_size and vocab_size > 2 * args.draft_vocab_size:
        vocabulary, coverage = DraftVocabulary.most_frequent(sequences, args.draft_vocab_size, vocab_size)
        _say(f"drafting vocabulary: {len(vocabulary)} tokens cover {coverage:.1%} of the training labels")
    trainer = Trainer(
        draft, model, sequences, features, run_dir, config, vocabulary=vocabulary,
        heldout=heldout, eval_prompts=eval_prompt_sets(args, tokenizer, heldout),
        stop_token_ids=stop_token_ids(model, tokenizer), distributed=dist,
    )
    summary = trainer.train()
    if dist.is_main:
        counts = data_counts(sequences)
        kinds = {"regenerate": "the target's own greedy responses" if args.temperature == 0 else
                 f"the target's own responses sampled at temperature {args.temperature}",
                 "teacher-forced": "the target's greedy predictions over existing responses (teacher forcing)"}
        card = {
            "target": args.target,
            "data": counts,
            "labels": "; ".join(kinds[kind] for kind in label_kinds(args)),
            "settings": {"feature storage": args.features, "anchors per sequence": args.num_anchors,
                         "gamma": trainer.gamma, "distillation weight": args.distill_weight,
                         "global batch (sequences)": trainer.global_batch, "peak learning rate": args.lr},
            "command": command,
        }
        folder = save_trained_draft(trainer.kept_draft(), output, summary, card)
        taus = ", ".join(f"{k} {v:.2f}" for k, v in (summary.best or {}).get("tau", {}).items())
        _say(f"draft written to {folder} (steps {summary.steps}, {summary.seconds / 60:.1f} min"
             + (f", tau {taus})" if taus else ")"))
    barrier()
    return 0
