"""llama.cpp as a peer: where its build lives, how to build it, our drafts in its GGUF form, the target's GGUF file.

llama.cpp reads the same GGUF files as flashdraft's registry and, since 2026, runs DFlash drafts
(`llama-speculative-simple --spec-type draft-dflash`). Its sources come from the llama-cpp-python sdist on PyPI
(`vendor/llama.cpp`), so it builds without internet beyond PyPI; only the tools a benchmark runs are compiled.

A llama.cpp folder is a llama.cpp source tree with its tools in `build/bin/` (what `build_llama_cpp` makes, and what
a user's own checkout built with cmake looks like): `$FLASHDRAFT_HOME/llama.cpp` unless the caller names another.
Nothing here reads the environment: the command line resolves the folder (`--llama-cpp`, `FLASHDRAFT_LLAMA_CPP`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .files import cache_home, file_sha256, write_atomic

SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"  # vendors a llama.cpp recent enough to run DFlash drafts
TOOLS = ("llama-completion", "llama-lookup", "llama-speculative-simple", "llama-bench")
# GGML_NATIVE compiles for this machine's CPU (AVX-512, AVX2, ... as it has them): the fastest llama.cpp here, which
# is the peer a benchmark should face; a binary built on one machine may stop with "Illegal instruction" on another.
CMAKE_OPTIONS = (
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# ggml's AMX kernels (Intel Xeon 4th gen and later) need the kernel to grant the AMX tile state; where it is not granted
# (seen in sandboxed VMs whose CPU flags list AMX) the first matrix product stops with "Illegal instruction". So x86
# builds leave AMX out unless asked (`amx=True`); decoding one token at a time does not use it.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_MARKER = ".flashdraft-build.json"  # what `build_llama_cpp` built, from which sources, with which options
BUILD_COMMAND = "flashdraft llama-cpp build"
CONVERTER = "convert_hf_to_gguf.py"
CONVERTER_REQUIREMENTS = "pip install 'flashdraft[llama-cpp]' (sentencepiece, which llama.cpp's converter imports)"


def default_folder() -> Path:
    """Where `flashdraft llama-cpp build` puts llama.cpp by default, and where the benchmark looks for it."""
    return cache_home() / "llama.cpp"


def _how_to_build(folder: Path) -> str:
    option = "" if folder == default_folder() else f" --dir {folder}"
    return (f"build it with `{BUILD_COMMAND}{option}` (about 10 minutes on 2 cores; needs cmake, ninja and a C++ "
            "compiler), or point --llama-cpp (or FLASHDRAFT_LLAMA_CPP) at a llama.cpp source folder whose build/bin "
            "holds the tools")


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp folder: its sources (the converter, gguf-py) and its built tools."""

    folder: Path

    def tool(self, name: str) -> Path:
        """The built tool `name` (e.g. "llama-completion"), or a one-line ValueError saying how to build it."""
        for candidate in (self.folder / "build" / "bin" / name, self.folder / "bin" / name):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        if not self.folder.is_dir():
            raise ValueError(f"llama.cpp is not built: {self.folder} does not exist; {_how_to_build(self.folder)}")
        raise ValueError(f"llama.cpp's {name} is not built in {self.folder}/build/bin: {_how_to_build(self.folder)}")

    @property
    def converter(self) -> Path:
        """llama.cpp's `convert_hf_to_gguf.py` (it imports the `gguf` package from the `gguf-py` beside it)."""
        path = self.folder / CONVERTER
        if not path.is_file() or not (self.folder / "gguf-py").is_dir():
            raise ValueError(f"{self.folder} holds no llama.cpp sources ({CONVERTER} and gguf-py): "
                             f"{_how_to_build(self.folder)}")
        return path

    def describe(self) -> dict:
        """What this build is, for a benchmark's results: the folder, the tools' version line, and the sources and
        options `build_llama_cpp` recorded (absent for a folder built otherwise)."""
        info: dict = {"folder": str(self.folder)}
        try:
            run = subprocess.run([str(self.tool("llama-completion")), "--version"], capture_output=True, text=True,
                                 timeout=60, stdin=subprocess.DEVNULL)
            info["version"] = " ".join((run.stdout + run.stderr).split())
        except (ValueError, OSError, subprocess.TimeoutExpired) as error:
            info["version"] = f"unknown ({error})"
        marker = self.folder / BUILD_MARKER
        if marker.is_file():
            info["build"] = json.loads(marker.read_text())
        return info


def find_llama_cpp(folder: Path | None = None, tools: tuple[str, ...] = ()) -> LlamaCpp:
    """The llama.cpp folder `folder` (default: `default_folder()`), checked to hold each of `tools`: a missing one is a
    one-line ValueError naming it and the command that builds it."""
    llama = LlamaCpp(Path(folder).expanduser().resolve() if folder is not None else default_folder())
    for name in tools:
        llama.tool(name)
    return llama


def _run_step(command: list[str], what: str, cwd: Path | None = None) -> None:
    print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
    try:
        subprocess.run(command, cwd=cwd, check=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ValueError(f"{what} needs `{command[0]}`, which is not installed: install it (e.g. `pip install "
                         f"{command[0]}` or your system's package) and run `{BUILD_COMMAND}` again") from None
    except subprocess.CalledProcessError as error:
        raise ValueError(f"{what} failed (exit status {error.returncode}; its output is above): fix the cause and "
                         f"run `{BUILD_COMMAND}` again") from None


def cmake_options(amx: bool = False) -> list[str]:
    """The cmake configuration options of `build_llama_cpp`: `CMAKE_OPTIONS`, plus AMX left out on x86 unless
    `amx`."""
    options = list(CMAKE_OPTIONS)
    if not amx and platform.machine().lower() in ("x86_64", "amd64"):
        options += [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
    return options


def build_llama_cpp(
    folder: Path | None = None, *, jobs: int | None = None, sdist: Path | None = None, amx: bool = False
) -> LlamaCpp:
    """Download llama.cpp's sources (the llama-cpp-python sdist, `SDIST_REQUIREMENT`, through pip), unpack them into
    `folder` (default: `default_folder()`) and build the benchmark's tools with cmake and ninja.

    `sdist`: an sdist archive already downloaded (no pip call). A folder that already holds the sources is built
    in place (an interrupted build resumes where it stopped); its tools are rebuilt only where they are out of date.
    """
    llama = LlamaCpp(Path(folder).expanduser().resolve() if folder is not None else default_folder())
    if not (llama.folder / CONVERTER).is_file():
        if llama.folder.exists() and any(llama.folder.iterdir()):
            raise ValueError(f"{llama.folder} is not empty and holds no llama.cpp sources: give an empty or new "
                             "folder (--dir), or remove it")
        _unpack_sources(llama.folder, sdist)
    build = llama.folder / "build"
    options = cmake_options(amx)
    _run_step(["cmake", "-S", str(llama.folder), "-B", str(build), *options], "configuring llama.cpp")
    _run_step(["cmake", "--build", str(build), "-j", str(jobs or os.cpu_count() or 1), "--target", *TOOLS],
              "building llama.cpp")
    for name in TOOLS:
        llama.tool(name)
    write_atomic(llama.folder / BUILD_MARKER, json.dumps(
        {"sources": SDIST_REQUIREMENT if sdist is None else str(sdist), "cmake_options": options,
         "tools": list(TOOLS)}, indent=1) + "\n")
    return llama


def _unpack_sources(destination: Path, sdist: Path | None) -> None:
    """The sdist's `vendor/llama.cpp` folder, moved to `destination` once whole (an interrupted unpack leaves no
    half folder behind)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".llama.cpp-sources-", dir=destination.parent) as work:
        work = Path(work)
        if sdist is None:
            _run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                       SDIST_REQUIREMENT, "-d", str(work)], "downloading llama.cpp's sources")
            archives = sorted(work.glob("llama_cpp_python-*.tar.gz"))
            if not archives:
                raise ValueError(f"pip downloaded no sdist of {SDIST_REQUIREMENT}: check that PyPI is reachable")
            sdist = archives[0]
        print(f"Unpacking {sdist.name} ...", file=sys.stderr, flush=True)
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in f"{m.name}/"]
            if not members:
                raise ValueError(f"{sdist} holds no vendor/llama.cpp folder: give the {SDIST_REQUIREMENT} sdist")
            archive.extractall(work / "unpacked", members=members, filter="data")
        (source,) = (work / "unpacked").glob("*/vendor/llama.cpp")
        source.rename(destination)


def export_draft_gguf(
    draft_folder: Path, target_folder: Path, output: Path, llama: LlamaCpp, *, outtype: str = "f16"
) -> Path:
    """Write the DFlash draft in `draft_folder` as the GGUF file llama.cpp loads (`--spec-type draft-dflash`), with
    llama.cpp's own converter (`convert_hf_to_gguf.py --target-model-dir`): it takes the vocabulary and tokenizer from
    `target_folder` (a transformers folder of the draft's target, e.g. `flashdraft.models.prepare(name)`).

    llama.cpp drafts over the whole vocabulary with the target's head: a drafting vocabulary (`draft_vocab_ids`) is
    not part of the file.
    """
    for folder, what in ((draft_folder, "draft"), (target_folder, "target")):
        if not (Path(folder) / "config.json").is_file():
            raise ValueError(f"{folder} is no {what} folder (no config.json)")
    try:
        import sentencepiece  # noqa: F401  (the converter imports it for Llama-family vocabularies)
    except ImportError:
        raise ValueError(f"converting a draft for llama.cpp needs sentencepiece: {CONVERTER_REQUIREMENTS}") from None
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f"{output.name}.{os.getpid()}.partial")
    command = [sys.executable, str(llama.converter), str(draft_folder), "--target-model-dir", str(target_folder),
               "--outfile", str(partial), "--outtype", outtype]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(llama.folder / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run(command, capture_output=True, text=True, env=environment, stdin=subprocess.DEVNULL)
    if run.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"llama.cpp's converter failed on {draft_folder} (exit status {run.returncode}): {last}")
    partial.replace(output)
    return output


def cached_draft_gguf(draft_folder: Path, target_folder: Path, llama: LlamaCpp) -> Path:
    """`export_draft_gguf` once per draft content: cached as `$FLASHDRAFT_HOME/gguf/drafts/NAME-KEY.gguf`, the key
    a checksum of the draft's config and weights."""
    files = [Path(draft_folder) / "config.json", *sorted(Path(draft_folder).glob("*.safetensors"))]
    key = file_sha256_of_many(files)[:16]
    output = cache_home() / "gguf" / "drafts" / f"{Path(draft_folder).resolve().name}-{key}.gguf"
    return output if output.is_file() else export_draft_gguf(draft_folder, target_folder, output, llama)


def file_sha256_of_many(files: list[Path]) -> str:
    """One checksum over several files' checksums, in order."""
    return hashlib.sha256("".join(file_sha256(path) for path in files).encode()).hexdigest()


def target_gguf(name: str) -> Path:
    """The GGUF file of registry target `name`, as llama.cpp reads it: the package's file itself when it is one
    part, else the parts concatenated once into `$FLASHDRAFT_HOME/gguf/NAME.gguf`, checked against the sha256 the
    registry pins."""
    from .models import _assemble, locate_files, registered_model

    entry = registered_model(name)
    files = locate_files(entry)
    if len(files) == 1:
        return files[0]
    path = cache_home() / "gguf" / f"{name}.gguf"
    if path.is_file() and path.stat().st_size == entry.gguf_size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        digest = _assemble(files, partial)
        if digest != entry.gguf_sha256:
            raise ValueError(f"the parts of {name}'s GGUF concatenate to sha256 {digest}, not the pinned "
                             f"{entry.gguf_sha256}: reinstall them with `{entry.install_command}`")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path

