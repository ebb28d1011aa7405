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
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields

# The options start a new help group at these fields (the options follow PipelineConfig's fields in order).
GROUPS = {"prompts": "prompts", "labels": "target-written data", "features": "features", "epochs": "training"}
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
    from flashdraft.train.pipeline import PipelineConfig

    group = parser.add_argument_group("target and draft")
    add = group.add_argument
    add("--target", default=DEFAULT_TARGET,
        help=f"registry name, folder or hub id of the target (default: {DEFAULT_TARGET})")
    add_device_options(group, engine=False)  # under torchrun, auto is each process's own GPU (cuda:LOCAL_RANK)
    for item in fields(PipelineConfig):
        if item.name in GROUPS:
            add = parser.add_argument_group(GROUPS[item.name]).add_argument
        if item.name not in OWN_OPTIONS:
            flags, settings = option_of(item)
            add(*flags, **settings)
    for old in RENAMED:
        parser.add_argument(old, nargs="?", action=Renamed, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def option_of(item: Field) -> tuple[list[str], dict]:
    """The flags and add_argument settings of a PipelineConfig field: default and help come from the field."""
    from flashdraft.train.pipeline import default_of, format_setting

    meta, default = item.metadata, default_of(item)
    flags = [*([meta["short"]] if "short" in meta else []), "--" + item.name.replace("_", "-")]
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
    from flashdraft.train.pipeline import PipelineConfig

    return PipelineConfig(**{item.name: getattr(args, item.name) for item in fields(PipelineConfig)})


def run(args: argparse.Namespace) -> int:
    from flashdraft.train.pipeline import run_pipeline

    run_pipeline(config_from_args(args))
    return 0
