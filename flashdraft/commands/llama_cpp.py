"""`flashdraft llama-cpp`: build llama.cpp, the peer `flashdraft bench` runs beside flashdraft, and show the build.

    build   download llama.cpp's sources (the llama-cpp-python sdist on PyPI), build the benchmark's tools with cmake
            and ninja (`flashdraft.llama_cpp.build_llama_cpp`)
    show    where llama.cpp is, which tools are built, and its version
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

LLAMA_CPP_VARIABLE = "FLASHDRAFT_LLAMA_CPP"  # read here, at the command line's edge, and nowhere below


def llama_cpp_folder(given: Path | None) -> Path | None:
    """The llama.cpp folder a command uses: `--llama-cpp`, else $FLASHDRAFT_LLAMA_CPP, else None (the library's
    default, `$FLASHDRAFT_HOME/llama.cpp`)."""
    if given is not None:
        return given
    value = os.environ.get(LLAMA_CPP_VARIABLE)
    return Path(value) if value else None


def add_llama_cpp_option(parser, flag: str = "--llama-cpp") -> None:
    parser.add_argument(flag, type=Path, default=None, metavar="DIR",
                        help=f"llama.cpp folder: its sources with the tools in build/bin (default: "
                        f"${LLAMA_CPP_VARIABLE}, else $FLASHDRAFT_HOME/llama.cpp, where `flashdraft llama-cpp build` "
                        "puts it)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "llama-cpp", help="build llama.cpp (the benchmark's peer) and show where it is",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="download llama.cpp's sources from PyPI and build its benchmark tools",
        description="Download the llama-cpp-python sdist with pip (its vendor/llama.cpp are llama.cpp's sources), "
        "unpack them into DIR and build llama-completion, llama-lookup, llama-speculative-simple and llama-bench with "
        "cmake and ninja, for this machine's CPU (GGML_NATIVE). About 10 minutes on 2 idle cores. Run again to "
        "resume an interrupted build.")
    add_llama_cpp_option(build, "--dir")
    build.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the CPU count)")
    build.add_argument("--sdist", type=Path, default=None,
                       help="a llama-cpp-python sdist (.tar.gz) already downloaded: no pip download")
    build.add_argument("--amx", action="store_true",
                       help="keep ggml's AMX kernels on x86 (left out by default: where the kernel does not grant "
                       "the AMX state they stop with 'Illegal instruction')")
    build.set_defaults(func=_build)
    show = actions.add_parser("show", help="where llama.cpp is, which tools are built, its version",
                              description="Show the llama.cpp folder the benchmark uses, which of its tools are "
                              "built, and the version they report.")
    add_llama_cpp_option(show)
    show.set_defaults(func=_show)


def _build(args: argparse.Namespace) -> int:
    from flashdraft.llama_cpp import build_llama_cpp

    llama = build_llama_cpp(llama_cpp_folder(args.dir), jobs=args.jobs, sdist=args.sdist, amx=args.amx)
    print(f"llama.cpp built in {llama.folder} (tools in {llama.folder / 'build' / 'bin'})")
    return 0


def _show(args: argparse.Namespace) -> int:
    from flashdraft.llama_cpp import TOOLS, find_llama_cpp

    llama = find_llama_cpp(llama_cpp_folder(args.llama_cpp))
    print(f"llama.cpp folder: {llama.folder}")
    missing = []
    for name in TOOLS:
        try:
            print(f"  {name}: {llama.tool(name)}")
        except ValueError:
            missing.append(name)
            print(f"  {name}: not built")
    if missing:
        llama.tool(missing[0])  # the one-line error saying how to build it
    print(f"  version: {llama.describe()['version']}")
    return 0
