"""Training records on disk, and the resumable batch loop that regeneration and teacher-forced labelling share.

A record folder holds `meta.json` (the settings that made the records) and append-only shards
`shard-00000.jsonl`, `shard-00001.jsonl`, ... of at most `records_per_shard` lines, one record per line:

    {"id": "sharegpt:QWJhYvA_0", "source": "sharegpt",
     "input_ids": [1, 2, ...],          # prompt ids (chat template applied) followed by response ids
     "response_start": 57,              # index of the first response token: the loss covers [response_start, len)
     "labels": [...],                   # optional: the target's token for each response position (teacher forcing);
                                        #   absent when the response is the target's own (regeneration)
     "topk_ids": [[...], ...],          # optional, one list of k ids per response position ...
     "topk_probs": [[...], ...]}        # ... and the target's probabilities for them (temperature 1)

A restart skips the ids already written, so a killed run loses at most the batch in flight. Batches are planned
over the whole prompt set (sorted by length) before skipping, so an interrupted and resumed run writes the same
records in the same order as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

META_FILE = "meta.json"
SHARD_GLOB = "shard-*.jsonl"
DEFAULT_RECORDS_PER_SHARD = 1000


@dataclass
class TrainingRecord:
    """One training sequence: token ids, where the response starts, and what the target predicts there."""

    id: str
    source: str
    input_ids: list[int]
    response_start: int
    labels: list[int] | None = None
    topk_ids: list[list[int]] | None = None
    topk_probs: list[list[float]] | None = None

    @property
    def response_labels(self) -> list[int]:
        """The target's token for each position in [response_start, len(input_ids))."""
        return self.labels if self.labels is not None else self.input_ids[self.response_start :]

    def to_json(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass
class RunStats:
    """What one call of a resumable stage did."""

    written: int  # records written by this call
    already_done: int  # prompts found done by an earlier run and skipped
    tokens: int  # response tokens produced (generated or labelled) by this call
    prompt_tokens: int  # prompt tokens the target read to produce them
    seconds: float
    remaining: int = 0  # prompts left undone because the time limit ran out

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def shard_paths(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob(SHARD_GLOB))


def read_meta(folder: str | Path) -> dict:
    path = Path(folder).expanduser() / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} holds no training records ({META_FILE} is missing): regenerate or label first"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def read_records(folder: str | Path) -> Iterator[TrainingRecord]:
    """The records of a folder, shard by shard, in the order they were written. A line cut off by a killed run
    (only ever the last one) is ignored."""
    read_meta(folder)
    for path in shard_paths(Path(folder).expanduser()):
        with path.open(encoding="utf-8") as handle:
            for line in handle:
                if line.endswith("\n"):
                    yield TrainingRecord(**json.loads(line))


# Two runs started together on one work folder (an A/B) both open its record folders and its feature store: the first
# holds each lock only seconds when there is nothing left to write, so the second waits that long before it
# concludes that another run is writing there.
LOCK_WAIT_SECONDS = 60.0


@contextmanager
def exclusive(lock_path: str | Path, busy: str, wait: float = 0.0) -> Iterator[None]:
    """Hold the lock file `lock_path` (made if need be) while the block runs, so that two runs never write the same
    files at once; when another run holds it for more than `wait` seconds, fail with the message `busy` rather than
    wait longer."""
    lock_path = Path(lock_path)
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path))
        lock.acquire(timeout=wait)
    except Timeout:
        raise ValueError(busy) from None
    except OSError as error:  # not writable, or a file in the way
        raise ValueError(f"cannot write to {lock_path.parent} ({error.strerror}): choose a writable folder") from None
    try:
        yield
    finally:
        lock.release()


def settings_differences(folder: str | Path, settings: dict) -> list[str]:
    """The settings in which the records of `folder` differ from `settings` (none when it holds no records yet)."""
    meta_path = Path(folder).expanduser() / META_FILE
    if not meta_path.exists():
        return []
    stored = json.loads(meta_path.read_text(encoding="utf-8"))
    settings = json.loads(json.dumps(settings))  # as it reads back from JSON (tuples become lists)
    return sorted(k for k in stored.keys() | settings.keys() if stored.get(k) != settings.get(k))


def ensure_free_space(folder: Path, needed_bytes: int, what: str = "records") -> None:
    """Fail before the work, not hours into it, when the disk cannot hold the output."""
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise ValueError(
            f"{folder} has {free / 1e9:.2f} GB free but the {what} need about {needed_bytes / 1e9:.2f} GB: "
            "free some space or choose another folder"
        )


class ShardWriter:
    """Appends records to the shards of a folder; on opening, repairs a cut-off last line and collects done ids.

    Holds a lock file so that two runs never write to the same folder, and refuses a folder whose records were
    made with other settings.
    """

    def __init__(self, folder: str | Path, settings: dict, records_per_shard: int = DEFAULT_RECORDS_PER_SHARD):
        self.folder = Path(folder).expanduser()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.lock = FileLock(str(self.folder / ".lock"))
            self.lock.acquire(timeout=LOCK_WAIT_SECONDS)
        except Timeout:
            raise ValueError(f"another run is writing to {self.folder}: wait for it or choose another folder") from None
        except OSError as error:  # not writable, or a file in the way
            raise ValueError(f"cannot write to {self.folder} ({error.strerror}): choose a writable folder") from None
        self.records_per_shard = records_per_shard
        meta_path = self.folder / META_FILE
        changed = settings_differences(self.folder, settings)
        if changed:
            self.lock.release()
            raise ValueError(
                f"{self.folder} holds records made with other settings (differences: {', '.join(changed)}): "
                "resume with the same settings or choose another folder"
            )
        if not meta_path.exists():
            meta_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")

        self.done_ids: set[str] = set()
        self.lines_in_last_shard = 0
        paths = shard_paths(self.folder)
        for path in paths:
            with path.open("rb+") as handle:
                data = handle.read()
                if data and not data.endswith(b"\n"):  # a line cut off by a kill: drop it
                    handle.truncate(data.rfind(b"\n") + 1)
                    data = data[: data.rfind(b"\n") + 1]
            lines = data.splitlines()
            self.done_ids.update(json.loads(line)["id"] for line in lines)
            self.lines_in_last_shard = len(lines)
        self.shard_index = max(len(paths) - 1, 0)
        self.handle = None

    def write(self, records: Sequence[TrainingRecord]) -> None:
        """Append records and flush them to disk before returning."""
        for record in records:
            if self.lines_in_last_shard >= self.records_per_shard:
                self._close_shard()
                self.shard_index += 1
                self.lines_in_last_shard = 0
            if self.handle is None:
                self.handle = (self.folder / f"shard-{self.shard_index:05d}.jsonl").open("a", encoding="utf-8")
            self.handle.write(json.dumps(record.to_json()) + "\n")
            self.lines_in_last_shard += 1
            self.done_ids.add(record.id)
        if self.handle is not None:
            self.handle.flush()
            os.fsync(self.handle.fileno())

    def _close_shard(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def close(self) -> None:
        self._close_shard()
        self.lock.release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def plan_batches(lengths: Sequence[int], ids: Sequence[str], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (sorted by length, then id), so padding stays small."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    order = sorted(range(len(ids)), key=lambda i: (lengths[i], ids[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def run_resumable(
    ids: Sequence[str],
    lengths: Sequence[int],
    folder: str | Path,
    settings: dict,
    process_batch: Callable[[int, list[int]], list[TrainingRecord]],
    batch_size: int,
    bytes_per_record: int,
    description: str,
    records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
    progress: bool = True,
    time_limit: float | None = None,
) -> RunStats:
    """Run `process_batch(batch_number, indices)` over the planned batches not yet done and append its records.

    A batch is skipped when all its ids are done; a batch a kill left half-written is redone for its missing ids.
    `batch_number` (the batch's place in the plan) lets a stage seed its randomness so a resumed run matches.
    With `time_limit` (seconds), no batch starts once it has passed: the records so far are kept and a later call
    continues (`RunStats.remaining` counts what is left).
    """
    if not ids:
        raise ValueError("no prompts to process: the prompt set is empty")
    if len(set(ids)) != len(ids):
        raise ValueError("prompt ids must be unique: they are how an interrupted run knows what is done")
    start_time = time.perf_counter()
    with ShardWriter(folder, settings, records_per_shard) as writer:
        pending = [i for i in range(len(ids)) if ids[i] not in writer.done_ids]
        ensure_free_space(writer.folder, len(pending) * bytes_per_record)
        stats = RunStats(written=0, already_done=len(ids) - len(pending), tokens=0, prompt_tokens=0, seconds=0.0)
        bar = tqdm(total=len(pending), desc=description, unit="prompt", disable=not progress)
        for batch_number, batch in enumerate(plan_batches(lengths, ids, batch_size)):
            batch = [i for i in batch if ids[i] not in writer.done_ids]
            if not batch:
                continue
            if time_limit is not None and time.perf_counter() - start_time >= time_limit:
                stats.remaining = len(pending) - stats.written
                break
            records = process_batch(batch_number, batch)
            writer.write(records)
            stats.written += len(records)
            stats.tokens += sum(len(record.input_ids) - record.response_start for record in records)
            stats.prompt_tokens += sum(record.response_start for record in records)
            stats.seconds = time.perf_counter() - start_time
            bar.update(len(batch))
            bar.set_postfix(tokens_per_s=f"{stats.tokens_per_second:.1f}")
        bar.close()
    stats.seconds = time.perf_counter() - start_time
    return stats
