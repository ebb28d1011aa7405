"""The files flashdraft keeps (caches, manifests, markers, checkpoints): where they live (`cache_home`), written so
that no reader ever sees half of one, checksummed, and weights checked for NaN (`check_finite`).

The bottom layer of the package: it imports no other flashdraft module, so that every other one can use it."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import platformdirs


def cache_home() -> Path:
    """Where flashdraft caches prepared models and machine measurements: $FLASHDRAFT_HOME, else the user's cache
    folder."""
    return Path(os.environ.get("FLASHDRAFT_HOME") or platformdirs.user_cache_dir("flashdraft")).expanduser()


def check_finite(model, where: str, remedy: str) -> None:
    """Refuse weights holding NaN or infinity: such a model decodes garbage without any error of its own."""
    import torch

    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{where}: weight {name} holds NaN or infinite values: {remedy}")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` so that a reader, or a run killed meanwhile, sees the old file or the new one whole:
    written beside it under a name of this process (two writers never share one), then renamed over it."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    if isinstance(data, bytes):
        partial.write_bytes(data)
    else:
        partial.write_text(data, encoding="utf-8")
    partial.replace(path)


def readable_as_folder(folder: Path) -> None:
    """Give every file directly in `folder` the folder's permissions, less execute: a model saved through a
    temporary file (safetensors writes model.safetensors 0600) is then readable by whoever can read its folder, as
    the other files beside it are."""
    mode = folder.stat().st_mode & 0o666
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# Machine measurements (kernel choices, verify costs) are cached once per machine; one taken while other work kept
# this many cores busy is marked so, and measured again by a later start that finds the machine at rest.
BUSY_CORES = 0.5
_BUSY_MARK = "measured_while_busy"
# Work at this niceness or more yields to ours (a nice-10 process gets a tenth of a core beside a nice-0 one) and is
# not load; below it, it competes almost as an equal (at nice 2 it keeps ~3/4 of its share) and counts.
YIELDING_NICE = 10


def other_processes_cpu(seconds: float = 0.2) -> float:
    """How many cores other processes that compete with this one kept busy over the next `seconds`: the CPU time of
    every other process below YIELDING_NICE (Linux's /proc/PID/stat); 0.0 where /proc cannot be read."""
    try:
        before = _competing_ticks()
        time.sleep(seconds)
        after = _competing_ticks()
    except (OSError, ValueError, IndexError):
        return 0.0
    busy = sum(max(ticks - before.get(pid, 0), 0) for pid, ticks in after.items())
    return busy / os.sysconf("SC_CLK_TCK") / seconds


def _competing_ticks() -> dict[int, int]:
    """The CPU ticks so far (its threads together) of each other process whose niceness is below YIELDING_NICE."""
    own, ticks = os.getpid(), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        pid = int(stat.parent.name)
        if pid != own and int(fields[16]) < YIELDING_NICE:  # after the name: state is 0, utime 11, stime 12, nice 16
            ticks[pid] = int(fields[11]) + int(fields[12])
    return ticks


# How long torch's OpenMP threads spin before they sleep when `choose_thread_waiting` lets them: longer than the gaps
# between a step's products, far shorter than a pause between requests. GNU libgomp (torch's Linux wheels) counts
# pause loops (20,000: about half a millisecond here); LLVM's and Intel's runtimes take milliseconds.
SPIN_COUNT = "20000"
SPINNING = {"GOMP_SPINCOUNT": SPIN_COUNT, "KMP_BLOCKTIME": "1"}
WAITING_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def choose_thread_waiting(seconds: float = 0.1) -> dict[str, str]:
    """Decide how torch's OpenMP threads wait between parallel regions, for a process about to load torch (libgomp
    reads it once, when it loads), and set it in `os.environ`; a choice already made there is kept. Where no other
    process that does not yield (`YIELDING_NICE`) computes, they spin a while (`SPINNING`): a sleeping thread takes
    ~50 us to wake on this VM and a one-token step has ~120 parallel products, so spinning makes the step 1.6x faster
    here. Where one does, they sleep at once (OMP_WAIT_POLICY=PASSIVE): a thread that spins while the core it waits
    for runs someone else's work stalls the whole step (1.3x slower with one busy process beside it, 15x with
    libgomp's default spin). BENCHMARKS.md, "How threads wait". Returns the variables it set (none when the choice
    was made)."""
    if any(name in os.environ for name in WAITING_VARIABLES):
        return {}
    chosen = {"OMP_WAIT_POLICY": "PASSIVE"} if other_processes_cpu(seconds) >= BUSY_CORES else dict(SPINNING)
    os.environ.update(chosen)
    return chosen


def cached_measurement(path: Path) -> dict | None:
    """The measurement `save_measurement` wrote at `path`; None when there is none (or it is damaged), and when it
    was taken on a busy machine and this one is at rest now, so that the caller measures again."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    if saved.pop(_BUSY_MARK, False) and other_processes_cpu() < BUSY_CORES:
        print(f"measuring again: {path.parent.name}/{path.name} was measured while other work kept this machine busy, "
              "and it is quiet now", file=sys.stderr)
        return None
    return saved


# Written last inside a prepared registry folder, holding the sha256 of the GGUF it came from and of every file of
# the folder: a folder without it (or with another checksum) is not a prepared model.
COMPLETE_MARKER = ".flashdraft-complete"


def shape_key(config) -> str:
    """A model config as a cache key of what depends on its shape alone (kernels, costs): every field but the ones
    that name a folder or a model, so that a copy of a model in another folder shares its measurements."""
    fields = config.to_dict()
    for name in ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version"):
        fields.pop(name, None)
    return json.dumps(fields, sort_keys=True, default=str)


def save_measurement(path: Path, measurement: dict, busy: bool) -> None:
    """Keep `measurement` at `path`, marked when it was taken while other work kept the machine `busy`
    (`other_processes_cpu() >= BUSY_CORES` just before)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({**measurement, **({_BUSY_MARK: True} if busy else {})}))
