"""`flashdraft train`: train a DFlash draft for a target, from prompts to a draft folder, in resumable stages.

    prompts   a prompt file and/or a seeded mix of built-in sources, checked against the evaluation sets
    labels    the target writes the responses (regenerate) and/or labels existing ones (teacher-forced)
    features  the target's hidden states of the feature layers, stored once on disk (offline) or skipped (online)
    train     the trainer: checkpoints, resume, evaluation by speculative decoding, best draft, model card

Every stage caches its output in the work folder and continues where it stopped when run again with the same
settings; a finished stage is skipped. Under torchrun / accelerate launch only the train stage runs (every
process trains on its share of each batch); run the data stages first in one process (`--until features`).

The command is `flashdraft.train.run_pipeline`: one option per field of `PipelineConfig`, which keeps the defaults
and the help; the same settings in Python train the same draft.

With --corpus it trains from a committed corpus instead (`flashdraft.train.from_corpus`, how the shipped drafts
are made): the stages are skipped, --init-draft is continued on the corpus's records (all but --heldout-ids and
--exclude-ids) with online features, for --seconds or --max-steps; the output folder receives final/, mean/ and
step-N/ (bfloat16 drafts), float32/ (with the model card) and reached.txt.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields
from pathlib import Path

# Defined below by hand rather than from the config: --device and --dtype are shared with the other model-loading
# commands (flashdraft/commands/options.py), with the same defaults as the config's.
OWN_OPTIONS = ("target", "device", "dtype")
# Old spellings: using one fails in one line that names the new option.
RENAMED = {"--top-k": ("--store-top-k", "how many of the target's probabilities to store; --top-k is a sampling "
                       "filter in `flashdraft generate`")}


class Renamed(argparse.Action):
    """An option that was renamed: it stops the command with one line naming the new spelling (exit 2)."""

    def __call__(self, parser, namespace, values, option_string=None):
        new, why = RENAMED[option_string]
        parser.exit(2, f"{parser.prog}: error: {option_string} is now {new} ({why})\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a DFlash draft for a target (prompts -> target-written data -> features -> training)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from flashdraft.commands.options import add_device_options
    from flashdraft.models import DEFAULT_TARGET
    from flashdraft.train.config import option_groups

    for title, items in option_groups().items():
        group = parser.add_argument_group(title)
        if title == "target and draft":
            group.add_argument("--target", default=DEFAULT_TARGET,
                               help=f"registry name, folder or hub id of the target (default: {DEFAULT_TARGET})")
            add_device_options(group, engine=False)  # under torchrun, auto is each process's own GPU (cuda:LOCAL_RANK)
        for item in items:
            if item.name not in OWN_OPTIONS:
                flags, settings = option_of(item)
                group.add_argument(*flags, **settings)
    corpus = parser.add_argument_group("training from a corpus (instead of the stages)")
    corpus.add_argument("--corpus", type=Path, default=None,
                        help="corpus folder (e.g. corpus/TARGET of the repository): continue --init-draft on its "
                        "records instead of running the stages")
    corpus.add_argument("--heldout-ids", type=Path, default=None,
                        help="file of record ids (one a line) never trained on, e.g. "
                        "corpus/TARGET/draws/heldout-v15.txt")
    corpus.add_argument("--exclude-ids", type=Path, action="append", default=[], metavar="FILE",
                        help="file of record ids not to train on, e.g. corpus/TARGET/draws/*.txt (repeatable)")
    corpus.add_argument("--seconds", type=float, default=None,
                        help="budget from start to the written drafts (or give --max-steps), turned into a step "
                             "count from the probe steps' speed, so that the learning-rate schedule is fixed: a "
                             "machine that gets busier later runs past it")
    corpus.add_argument("--step-seconds", type=float, default=None,
                        help="seconds a step takes (default: timed by a few probe steps)")
    corpus.add_argument("--reserve", type=float, default=30.0, help="seconds kept for writing the drafts (default: 30)")
    corpus.add_argument("--snapshots", default="0.5,0.75",
                        help="fractions of the steps to write step-N drafts at (default: 0.5,0.75)")
    corpus.add_argument("--no-mean", dest="mean", action="store_false",
                        help="skip OUT/mean, the bfloat16 mean of --init-draft and the final draft")
    corpus.add_argument("--progress", action="store_true",
                        help="show the trainer's progress bar (without it, a line each twentieth of the run)")
    for old in RENAMED:
        parser.add_argument(old, nargs="?", action=Renamed, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def option_of(item: Field) -> tuple[list[str], dict]:
    """The flags and add_argument settings of a PipelineConfig field: default and help come from the field."""
    from flashdraft.train.config import default_of, flag, format_setting

    meta, default = item.metadata, default_of(item)
    flags = [*([meta["short"]] if "short" in meta else []), flag(item)]
    settings: dict = {"dest": item.name}
    shown = meta["shown"]
    if shown is None and default is not MISSING and default is not None:
        shown = "{}"
    help = meta["help"] + (f" (default: {shown.format(format_setting(default))})" if shown else "")
    settings["help"] = help.replace("%", "%%")  # argparse formats help with %
    if default is MISSING:
        settings["required"] = True
    else:
        settings["default"] = default
    if isinstance(default, bool):
        # Both spellings whatever the default, so that a command written under another default still runs.
        settings["action"] = argparse.BooleanOptionalAction
        return flags, settings
    settings["type"] = meta.get("type", type(default))
    if meta.get("repeat"):
        settings.update(action="append", default=[])  # a list: argparse copies it before appending
    for key in ("choices", "metavar"):
        if key in meta:
            settings[key] = meta[key]
    return flags, settings


def config_from_args(args: argparse.Namespace):
    """The parsed command line as a PipelineConfig (which parses the text forms and checks the settings)."""
    from flashdraft.train.config import PipelineConfig

    return PipelineConfig(**{item.name: getattr(args, item.name) for item in fields(PipelineConfig)})


# The corpus options with their defaults, in the order the card's command writes them.
CORPUS_OPTIONS = {"corpus": None, "heldout_ids": None, "exclude_ids": [], "seconds": None, "step_seconds": None,
                  "reserve": 30.0, "snapshots": "0.5,0.75", "mean": True, "progress": False}


def corpus_run(args: argparse.Namespace):
    """The corpus options as a `CorpusRun`, with the words that give them (for the model card's command)."""
    from flashdraft.train.from_corpus import CorpusRun

    words = []
    for name, default in CORPUS_OPTIONS.items():
        value = getattr(args, name)
        if value == default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [word for each in (value if isinstance(value, list) else [value]) for word in (flag, str(each))]
    return CorpusRun(**{name: getattr(args, name) for name in CORPUS_OPTIONS}, words=words)


def run(args: argparse.Namespace) -> int:
    if args.corpus is not None:
        from flashdraft.train.from_corpus import train_from_corpus

        train_from_corpus(config_from_args(args), corpus_run(args))
        return 0
    from flashdraft.train.pipeline import run_pipeline

    run_pipeline(config_from_args(args))
    return 0
