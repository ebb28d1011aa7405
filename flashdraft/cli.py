"""The `flashdraft` command line: one subcommand per module in `flashdraft/commands/`.

Every command is a thin layer over the library; each module defines `register(subparsers)`, which adds its
parser and sets `func` to the function that runs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from .files import choose_thread_waiting

COMMAND_MODULES = (
    "flashdraft.commands.generate",
    "flashdraft.commands.models",
    "flashdraft.commands.serve",
    "flashdraft.commands.bench",
    "flashdraft.commands.bench_serve",
    "flashdraft.commands.train",
    "flashdraft.commands.corpus",
    "flashdraft.commands.draft",
    "flashdraft.commands.llama_cpp",
)


class CommandError(Exception):
    """An error whose message is meant for the user: printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashdraft",
        description="Lossless speculative decoding with DFlash block-diffusion drafts.",
    )
    parser.add_argument("--version", action="version", version=f"flashdraft {__version__}",
                        help="print flashdraft's version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def check_device(name: str) -> None:
    """Fail in one line, naming the devices there are, when `name` is not a usable torch device here."""
    import torch

    available = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        available.append("mps")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CommandError(f"unknown device {name!r}: devices here are {', '.join(available)}") from None
    usable = {
        "cpu": True,
        "cuda": torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": torch.backends.mps.is_available(),
    }.get(device.type, False)
    if not usable:
        raise CommandError(f"device {name!r} is not available here (this torch sees {', '.join(available)}): "
                           "pick one of those")


def _describe(error: Exception) -> str:
    """The error's message; an OS error raised by Python itself ("[Errno 2] No such file or directory: 'x'") as the
    path and the problem, the way the library's own errors read."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror.lower()}"
    return str(error)


def main(argv: list[str] | None = None) -> int:
    # How torch's threads wait: spinning briefly on a quiet machine, sleeping at once beside other work
    # (`choose_thread_waiting`). Set by the command line only (a library leaves its user's environment alone), before
    # torch loads.
    choose_thread_waiting()
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "device", None) not in (None, "auto"):
            check_device(args.device)
        return args.func(args) or 0
    except (CommandError, ValueError, FileNotFoundError) as error:
        # Library errors are written to name the problem and the fix; a traceback would bury that.
        print(f"flashdraft {args.command}: error: {_describe(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`flashdraft ... | head`): nothing more to say, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit would raise again
        return 141


if __name__ == "__main__":
    sys.exit(main())
