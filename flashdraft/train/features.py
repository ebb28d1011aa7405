"""Target features for training: the hidden states of the draft's target layers, computed online or stored offline.

Online (`OnlineFeatures`), each training batch runs the frozen target over its sequences (no cache, head on one
position only): the natural choice on a GPU or for a single epoch. Offline (`build_feature_store`), the target
runs once over every training sequence and the features go to a memory-mapped file; every epoch after that only
reads them (`FeatureStore`): on a CPU a target forward costs about as much as a training step. Both hand the
trainer [b, C, k*d] float32 features of positions 0..C-1, right-padded with zeros, equal (up to the storage
dtype) to the features the decoding loop collects while generating.

An offline store is a folder:
    meta.json       target identity, layer ids, storage dtype, feature width, and each sequence's id, length, offset
    features.bin    the raw [total positions, k*d] array in the storage dtype (float16 by default)
    progress.json   how many of the planned batches are written: a restarted build continues from there

The corpus only grows, so a new store is seeded from older stores of the same target, layers and dtype (`reuse`):
a sequence with the same id and length there is copied, not recomputed, from a complete store or from the finished
batches of one a kill interrupted. Within one work folder a record's id is its
prompt's and the prompt text is checked against the prompt set (`pipeline.load_sequences`), so id and length name
the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from ..files import write_atomic
from ..target import TargetModel
from .blocks import TrainingSequence
from .records import LOCK_WAIT_SECONDS, exclusive, plan_batches

META_FILE = "meta.json"
DATA_FILE = "features.bin"
PROGRESS_FILE = "progress.json"
# Storage dtypes and the numpy type of the same width that holds their bits (numpy has no bfloat16).
STORAGE_DTYPES = {"float16": (torch.float16, np.float16), "bfloat16": (torch.bfloat16, np.uint16),
                  "float32": (torch.float32, np.float32)}



def check_feature_layers(layer_ids: Sequence[int], num_target_layers: int) -> None:
    """Fail before any work when the feature layers do not exist in the target (or repeat)."""
    if not layer_ids:
        raise ValueError("no feature layers: give at least one target layer for the draft to read")
    too_deep = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if too_deep:
        raise ValueError(
            f"feature layers {too_deep} do not exist: the target has {num_target_layers} layers "
            f"(0..{num_target_layers - 1}); choose layers within it (--feature-layers)"
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(
            f"feature layers {list(layer_ids)} repeat a layer: the target ({num_target_layers} layers) is too shallow "
            "for that many; give distinct --feature-layers"
        )


@torch.no_grad()
def extract_features(model, sequences: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """[b, L, k*d]: the concatenated hidden states of `layer_ids` for token sequences of lengths <= L, run as one
    right-padded batch (`TargetModel.padded_hidden_states`); padding positions are zeros."""
    features, attention_mask = TargetModel(model).padded_hidden_states(sequences, list(layer_ids))
    return features * attention_mask[:, :, None].to(features.dtype)


def engine_features_hint(model) -> str | None:
    """One line for a run whose features would come faster and truer from the engine: a bfloat16 target on a CPU
    whose folder holds GGUF blocks (a registry target), which `--dtype float32` runs in int8 on the engine
    (`TargetModel.padded_hidden_states`); None otherwise."""
    from ..quantized import BLOCKS_FILE

    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return None
    if not (Path(model.config.name_or_path) / BLOCKS_FILE).is_file():
        return None
    return ("the target's features come from transformers' bfloat16 forward; --dtype float32 takes them from "
            "flashdraft's engine (int8 on the target's GGUF blocks): the features decoding gives the draft, and "
            "about 1.8x faster steps on a CPU (docs/training.md, \"Precision\")")


class FeatureSource(Protocol):
    """What the trainer reads features from."""

    def __call__(self, sequences: Sequence[TrainingSequence], context_length: int) -> torch.Tensor:
        """[b, context_length, k*d] float32 features of positions 0..context_length-1 of each sequence."""
        ...


class OnlineFeatures:
    """Features computed by the target for every batch. The target is causal, so the features of positions
    < C need only the first C tokens: the rest of each sequence is not run."""

    def __init__(self, model, layer_ids: Sequence[int]):
        check_feature_layers(layer_ids, model.config.get_text_config().num_hidden_layers)
        self.model = model
        self.layer_ids = list(layer_ids)

    def __call__(self, sequences, context_length):
        prefixes = [s.input_ids[:context_length] for s in sequences]
        features = extract_features(self.model, prefixes, self.layer_ids).float()
        return torch.nn.functional.pad(features, (0, 0, 0, context_length - features.shape[1]))


def _fingerprint(sequences: Sequence[TrainingSequence]) -> str:
    digest = hashlib.sha256()
    for sequence in sequences:
        digest.update(f"{sequence.id}\0{len(sequence)}\0".encode())
        digest.update(sequence.input_ids.numpy().tobytes())
    return digest.hexdigest()


def build_feature_store(
    model,
    sequences: Sequence[TrainingSequence],
    folder: str | Path,
    layer_ids: Sequence[int],
    *,
    dtype: str = "float16",
    batch_size: int = 8,
    progress: bool = True,
    reuse: Sequence[str | Path] = (),
) -> FeatureStore:
    """Compute the features of every sequence once and store them in `folder` (resumable; see the module doc).

    `reuse`: complete stores of the same target, layers and dtype whose sequences of the same id and length are
    copied when the store is created, instead of computed.

    A folder built for other sequences, another target or other layers is refused rather than mixed, and so is one
    that another run is building (a lock file). The disk space is checked before the first forward."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"feature storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
    if not sequences:
        raise ValueError("no training sequences to compute features for")
    check_feature_layers(layer_ids, model.config.get_text_config().num_hidden_layers)
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"cannot create the feature folder {folder} ({error.strerror}): choose a writable folder"
        ) from None
    with exclusive(folder / ".lock", f"another run is computing the features in {folder}: wait for it to finish",
                   wait=LOCK_WAIT_SECONDS):
        return _build_feature_store(model, sequences, folder, layer_ids, dtype, batch_size, progress, reuse)


def _build_feature_store(model, sequences, folder: Path, layer_ids, dtype: str, batch_size: int,
                         progress: bool, reuse: Sequence[str | Path]) -> FeatureStore:
    torch_dtype, numpy_dtype = STORAGE_DTYPES[dtype]
    width = len(layer_ids) * model.config.get_text_config().hidden_size
    offsets = np.cumsum([0] + [len(s) for s in sequences]).tolist()
    meta = {
        **TargetModel(model).identity(),
        "layer_ids": list(layer_ids),
        "dtype": dtype,
        "width": width,
        "sequences": _fingerprint(sequences),
        "index": {s.id: [offsets[i], len(s)] for i, s in enumerate(sequences)},
    }
    meta_path, data_path, progress_path = folder / META_FILE, folder / DATA_FILE, folder / PROGRESS_FILE
    total_bytes = offsets[-1] * width * np.dtype(numpy_dtype).itemsize
    if meta_path.exists():
        stored = json.loads(meta_path.read_text())
        if stored != meta:
            changed = sorted(k for k in stored.keys() | meta.keys() if stored.get(k) != meta.get(k))
            raise ValueError(
                f"{folder} holds features made for other data or settings (differences: {', '.join(changed)}): "
                "delete it or choose another folder"
            )
    else:
        free = shutil.disk_usage(folder).free
        if free < total_bytes:
            raise ValueError(
                f"{folder} has {free / 1e9:.2f} GB free but the features need {total_bytes / 1e9:.2f} GB: free some "
                "space, store them as --feature-dtype float16, or use --features online"
            )
        with data_path.open("wb") as handle:  # a sparse file of the final size; the memory map fills it
            handle.truncate(total_bytes)
        seeded = _copy_reusable(meta, folder, reuse, numpy_dtype, progress)
        # The batch plan is fixed at creation, so a restart with another --batch-size still resumes cleanly.
        progress_path.write_text(json.dumps({"batch_size": batch_size, "batches_done": 0, "seeded": seeded}))
        meta_path.write_text(json.dumps(meta))  # last: a folder with meta.json has its data file

    state = json.loads(progress_path.read_text())
    seeded = set(state.get("seeded", ()))
    todo = [i for i, s in enumerate(sequences) if s.id not in seeded]
    batches = [[todo[j] for j in batch] for batch in
               plan_batches([len(sequences[i]) for i in todo], [sequences[i].id for i in todo], state["batch_size"])]
    done = state["batches_done"]
    if done < len(batches):
        data = np.memmap(data_path, dtype=numpy_dtype, mode="r+", shape=(offsets[-1], width))
        for number in tqdm(range(done, len(batches)), desc="target features", unit="batch", disable=not progress,
                           initial=done, total=len(batches)):
            batch = batches[number]
            features = extract_features(model, [sequences[i].input_ids for i in batch], layer_ids)
            stored = features.to(torch_dtype)
            if not torch.isfinite(stored).all():
                raise ValueError(f"target features overflow {dtype}: store them as --feature-dtype bfloat16 or float32")
            stored = stored.cpu().view(torch.uint16) if dtype == "bfloat16" else stored.cpu()
            for row, i in enumerate(batch):
                data[offsets[i] : offsets[i + 1]] = stored[row, : len(sequences[i])].numpy()
            data.flush()
            state.update(batches_done=number + 1, complete=number + 1 == len(batches))
            write_atomic(progress_path, json.dumps(state))
        del data
    elif not state.get("complete"):  # every sequence was seeded
        state.update(complete=True)
        write_atomic(progress_path, json.dumps(state))
    return FeatureStore(folder)


def _copy_reusable(meta: dict, folder: Path, reuse: Sequence[str | Path], numpy_dtype, progress: bool) -> list[str]:
    """Copy into the new store's data file the sequences that a complete store in `reuse` already holds (same
    target, layers and dtype; same id and length); returns their ids."""
    same = meta.keys() - {"sequences", "index"}  # the target's identity, layers, dtype and width
    wanted = dict(meta["index"])
    total = sum(length for _, length in wanted.values())
    seeded: list[str] = []
    target = None
    for source in map(Path, reuse):
        try:
            store = FeatureStore(source, partial=True)
        except (OSError, ValueError):
            continue  # missing or unreadable: nothing to take from it
        if any(store.meta.get(key) != meta.get(key) for key in same):
            continue
        found = [(store.index[i][0], wanted[i][0], length, i) for i, (_, length) in wanted.items()
                 if i in store.written and store.index[i][1] == length]
        if not found:
            continue
        if target is None:
            target = np.memmap(folder / DATA_FILE, dtype=numpy_dtype, mode="r+", shape=(total, meta["width"]))
        for source_offset, offset, length, sequence_id in tqdm(sorted(found), desc=f"features from {source.name}",
                                                                unit="seq", disable=not progress):
            target[offset : offset + length] = store.data[source_offset : source_offset + length]
            seeded.append(sequence_id)
            del wanted[sequence_id]
    if target is not None:
        target.flush()
    return seeded


def _written_ids(index: dict, state: dict) -> set[str]:
    """The ids a store holds: every one when complete, else the seeded ones and those of the batches done (the
    batch plan is a pure function of the ids, lengths and batch size, as `_build_feature_store` makes it)."""
    if state.get("complete"):
        return set(index)
    seeded = set(state.get("seeded", ()))
    todo = [i for i in index if i not in seeded]
    batches = plan_batches([index[i][1] for i in todo], todo, state["batch_size"])
    return seeded | {todo[j] for batch in batches[: state["batches_done"]] for j in batch}


class FeatureStore:
    """Reads an offline feature folder written by `build_feature_store`; with `partial`, also one whose build was
    interrupted (`written`: the ids whose features it holds, for seeding a new store)."""

    def __init__(self, folder: str | Path, *, partial: bool = False):
        folder = Path(folder)
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{folder} is not a feature store ({META_FILE} is missing): build it first")
        state = json.loads((folder / PROGRESS_FILE).read_text())
        if not state.get("complete") and not partial:
            raise ValueError(f"the feature store {folder} is incomplete: run the features stage again to finish it")
        self.meta = json.loads(meta_path.read_text())
        self.written = _written_ids(self.meta["index"], state)
        self.index = self.meta["index"]
        self.layer_ids = self.meta["layer_ids"]
        self.torch_dtype, numpy_dtype = STORAGE_DTYPES[self.meta["dtype"]]
        total = sum(length for _, length in self.index.values())
        self.data = np.memmap(folder / DATA_FILE, dtype=numpy_dtype, mode="r", shape=(total, self.meta["width"]))
        self.folder = folder

    def __call__(self, sequences, context_length):
        rows = []
        for sequence in sequences:
            if sequence.id not in self.written:
                raise ValueError(f"sequence {sequence.id!r} has no features in {self.folder}: rebuild the store")
            offset, length = self.index[sequence.id]
            take = min(length, context_length)
            row = torch.from_numpy(np.array(self.data[offset : offset + take]))  # a copy: the map is read-only
            row = row.view(self.torch_dtype).float()
            rows.append(torch.nn.functional.pad(row, (0, 0, 0, context_length - take)))
        return torch.stack(rows)
