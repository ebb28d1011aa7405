"""The corpus: the target's own answers, kept compact in the repository and grown across sessions.

Regeneration (`flashdraft train --until labels`) writes JSON records into a work folder outside the repository
(about 8 bytes per token). The corpus keeps the same records at about 2 bytes per token in the repository, outside
the Python package, so that what a session regenerated outlives the machine it ran on:

    corpus/TARGET/manifest.json        target and its GGUF checksum, the regeneration settings, the command, and
                                       per shard: file, sha256, records, tokens, response tokens, prompt sources
    corpus/TARGET/shard-00000.npz      numpy arrays, deflate-compressed, no pickles: `tokens` (uint16 when the
                                       vocabulary fits, else uint32) of every record's prompt + response ids, back to
                                       back; `offsets` [n + 1]; `response_starts` [n]; `ids` and `sources` [n] (text)

Only ever appended to: `export_records` adds one shard with the records the corpus lacks; `import_records` writes
the corpus's records into a work folder, so the next regeneration run counts them as done and no prompt is
answered twice. `make_train_folder` writes the corpus (or a seeded draw of it) into a work folder for
`flashdraft train`. The command line over all this is `flashdraft corpus` (`flashdraft/commands/corpus.py`).

Every target's corpus comes from one regeneration recipe (`regeneration_arguments`): decontaminated prompts of the
built-in mix (code, math and chat), full-length greedy answers of up to 512 tokens, one thread. Only the number of
prompts differs, and it grows in steps (`PROMPT_STEPS`), each step in its own work folder, which is first filled with
the whole corpus so that no prompt is answered twice.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import numpy as np

from ..files import write_atomic
from .prompts import PROMPT_SETTINGS, PROMPTS_FILE
from .records import META_FILE, ShardWriter, TrainingRecord, read_meta, read_records
from .sources import DEFAULT_PROPORTIONS

MANIFEST = "manifest.json"
# The prompt set each target's regeneration is at now. The default target's went 10,000 (shards 0-36), then 20,000:
# every one of the built-in sources' 19,886 distinct prompts. A new target starts with a step that one machine
# finishes in a few sessions, so its first draft trains on the whole mix rather than on its shortest prompts (the
# regeneration answers prompts shortest first).
# The Qwen corpus answered its first 2,000 prompts on 2026-12-06, then went 5,000, 10,000, 20,000 and (2026-12-07,
# at 17,898 records) 28,000: the default mix and ShareGPT's second turns (`FOLLOW_UP_PROPORTIONS`); then (at
# 20,328 records, nearly every code prompt of those answered) 30,000, with HumanEval-shaped code
# (`CODE_FUNCTIONS_PROPORTIONS`).
PROMPT_STEPS: dict[str, int] = {"smollm2-135m-instruct": 20000, "qwen2.5-coder-0.5b-instruct": 30000}
FIRST_PROMPT_STEP = 2000
# Steps up to 20,000 draw from the default mix. Its 19,886 distinct prompts are all in the step of 20,000, so larger
# steps add ShareGPT's 7,137 second user turns (MT-Bench's turn-2 shape: a first exchange as context). Such a step
# must be larger than all the pools together, so that every pool is taken whole and its prompt set holds each
# earlier step's (no answered prompt falls out; `check_follow_up_step`).
DEFAULT_MIX_STEP = 20000
FOLLOW_UP_PROPORTIONS: dict[str, float] = {**DEFAULT_PROPORTIONS, "sharegpt-turn2": 0.35}
# Steps from 30,000 on add the documented functions of algorithm and utility packages (`pyfunctions`, 1,286 prompts),
# as code and in words: by 28,000 every LeetCode and nearly every CodeI/O prompt was answered, and the draft's
# acceptance on code (HumanEval) moved with the share of code in what it trained on.
CODE_FUNCTIONS_STEP = 30000
CODE_FUNCTIONS_PROPORTIONS: dict[str, float] = {**FOLLOW_UP_PROPORTIONS, "pyfunctions": 0.2}
REGENERATION_MAX_NEW_TOKENS = 512
FORMAT = 1
MACHINE_SETTINGS = ("model",)  # settings that name a place on one machine: not compared between machines


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return {"format": FORMAT, "shards": []}
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} has corpus format {manifest.get('format')}, this flashdraft reads {FORMAT}")
    return manifest


def check_corpus_folder(folder: str | Path, option: str = "--corpus") -> None:
    """Refuse a folder that holds no corpus (a mistyped path, or corpus/TARGET read outside the repository)."""
    if not (Path(folder) / MANIFEST).is_file():
        raise ValueError(f"{option} {folder} holds no corpus (no {MANIFEST}): give a corpus folder, e.g. corpus/TARGET "
                         "of the repository (a relative path is read from the current folder)")


def read_corpus(folder: str | Path) -> Iterator[TrainingRecord]:
    """Every record of the corpus, shard by shard, each shard's checksum verified first."""
    folder = Path(folder)
    for shard in read_manifest(folder)["shards"]:
        path = folder / shard["file"]
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != shard["sha256"]:
            raise ValueError(f"{path} does not match its checksum in {MANIFEST}: the corpus is damaged; restore the "
                             "file from version control")
        arrays = np.load(io.BytesIO(data), allow_pickle=False)
        tokens, offsets = arrays["tokens"], arrays["offsets"]
        for i, (record_id, source) in enumerate(zip(arrays["ids"].tolist(), arrays["sources"].tolist())):
            yield TrainingRecord(id=record_id, source=source, input_ids=tokens[offsets[i] : offsets[i + 1]].tolist(),
                                 response_start=int(arrays["response_starts"][i]))


def response_counts(folder: str | Path, vocab_size: int, *, exclude: Collection[str] = ()) -> np.ndarray:
    """[vocab_size] how often each token occurs in the corpus's responses, leaving out the records in `exclude` (e.g.
    a run's held-out records, so that nothing about them steers its training)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if not manifest["shards"]:
        raise ValueError(f"{folder} holds no corpus ({MANIFEST} lists no shards): give the folder of a corpus, e.g. "
                         "corpus/TARGET of the repository")
    made_for = manifest["settings"].get("vocab_size")
    if made_for != vocab_size:
        raise ValueError(f"the corpus in {folder} was made with a vocabulary of {made_for} tokens, the target has "
                         f"{vocab_size}: give a corpus of this target's answers")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for record in read_corpus(folder):
        if record.id not in exclude:
            counts += np.bincount(record.input_ids[record.response_start :], minlength=vocab_size)
    return counts


def corpus_ids(folder: str | Path) -> set[str]:
    return {record.id for record in read_corpus(folder)}


def prompt_step(target: str) -> int:
    """The number of prompts the regeneration of `target`'s corpus is at now."""
    return PROMPT_STEPS.get(target, FIRST_PROMPT_STEP)


def regeneration_arguments(target: str, work: Path, num_prompts: int, threads: int = 1) -> list[str]:
    """The `flashdraft train` arguments of one corpus regeneration on `threads` CPU threads: its records go to
    `work`/records-regenerate."""
    return ["train", "--target", target, "--until", "labels", "--num-prompts", str(num_prompts),
            *prompt_mix_arguments(num_prompts),
            "--labels", "regenerate", "--max-new-tokens", str(REGENERATION_MAX_NEW_TOKENS), "--threads", str(threads),
            "--work-dir", str(work), "-o", str(work / "out")]


def step_proportions(num_prompts: int) -> dict[str, float] | None:
    """The sources and proportions of a step past the default mix (None up to `DEFAULT_MIX_STEP`): the follow-up
    mix, and from `CODE_FUNCTIONS_STEP` on the function prompts too. Each such step takes every pool whole."""
    if num_prompts <= DEFAULT_MIX_STEP:
        return None
    return FOLLOW_UP_PROPORTIONS if num_prompts < CODE_FUNCTIONS_STEP else CODE_FUNCTIONS_PROPORTIONS


def prompt_mix_arguments(num_prompts: int) -> list[str]:
    """The sources and proportions of a step's prompt set: the default mix's (no arguments, so that the settings
    of the steps made before there was a choice stay the same) up to `DEFAULT_MIX_STEP`, then `step_proportions`."""
    proportions = step_proportions(num_prompts)
    if proportions is None:
        return []
    return ["--sources", ",".join(proportions),
            "--proportions", ",".join(f"{name}={weight}" for name, weight in proportions.items())]


def check_follow_up_step(num_prompts: int, pool_sizes: dict[str, int]) -> None:
    """Refuse a step past the default mix that would not take every pool whole (its prompt set would then leave out
    prompts of earlier steps): `pool_sizes` the distinct prompts of each source."""
    proportions = step_proportions(num_prompts)
    if proportions is None:
        return
    total = sum(pool_sizes[name] for name in proportions)
    if num_prompts < total:
        raise ValueError(f"a corpus step past {DEFAULT_MIX_STEP} prompts takes every source whole, {total} prompts: "
                         f"{num_prompts} would leave out prompts of the earlier steps; give --num-prompts {total} "
                         "or more")


def make_train_folder(corpus: Path, regeneration: Path, folder: Path, count: int | None, model: str,
                      skip: int = 0, exclude: Sequence[Path] = ()) -> int:
    """Write the regeneration's prompt files and the corpus's records (all, or the `count` with the smallest seeded
    hash of their id after the first `skip` of that order) into `folder`, `model` naming the target's folder on this
    machine; the records held by the training folders or listed in the id files `exclude` are left out first.
    Returns how many records it holds."""
    if skip and count is None:
        raise ValueError("--skip needs --records: it skips the start of the seeded draw")
    if not (regeneration / PROMPT_SETTINGS).is_file():
        raise ValueError(f"{regeneration} has no prompt set yet: run `flashdraft corpus regenerate` first")
    used: set[str] = set()
    for old in exclude:
        if old.is_file():  # a list of record ids, one a line: a shipped draft's draw (corpus/TARGET/draws/)
            used |= {line.strip() for line in old.read_text().splitlines() if line.strip()}
            continue
        if not (old / "records-regenerate" / META_FILE).is_file():
            raise ValueError(f"--exclude {old}: not a training folder (no records-regenerate/{META_FILE}) nor a "
                             "file of record ids")
        used |= {record.id for record in read_records(old / "records-regenerate")}
    folder.mkdir(parents=True, exist_ok=True)
    for name in (PROMPTS_FILE, PROMPT_SETTINGS):
        shutil.copy(regeneration / name, folder / name)
    ids = sorted(corpus_ids(corpus) - used)
    if count is not None:
        # The init A/B drew its 1,324 records with this key from the corpus at 11,205 records (BENCHMARKS.md).
        # Draws of the same order never overlap on the same corpus; a grown corpus slots new records in between,
        # so a draw after an export overlaps the one before it by a little: --exclude its folder instead of --skip.
        ids = sorted(ids, key=lambda i: hashlib.sha256(f"ab:{i}".encode()).digest())[skip : skip + count]
    import_records(corpus, folder / "records-regenerate", model=model, only=set(ids))
    return len(ids)


def _comparable(settings: dict) -> dict:
    return {key: value for key, value in settings.items() if key not in MACHINE_SETTINGS}


def _check_settings(corpus_settings: dict | None, settings: dict, what: str) -> None:
    if corpus_settings is None:
        return
    a, b = _comparable(corpus_settings), _comparable(settings)
    if a != b:
        changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        raise ValueError(f"{what} were made with other settings than the corpus (differences: {', '.join(changed)}): "
                         "regenerate with the corpus's settings or start another corpus folder")


def _write_shard(path: Path, records: Sequence[TrainingRecord], vocab_size: int) -> bytes:
    if any(record.labels is not None or record.topk_ids is not None for record in records):
        raise ValueError("the corpus keeps regenerated answers only (no teacher-forced labels or top-k)")
    lengths = [len(record.input_ids) for record in records]
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        tokens=np.fromiter((t for r in records for t in r.input_ids), count=sum(lengths),
                           dtype=np.uint16 if vocab_size <= 2**16 else np.uint32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        response_starts=np.array([record.response_start for record in records], dtype=np.int32),
        ids=np.array([record.id for record in records], dtype=str),
        sources=np.array([record.source for record in records], dtype=str),
    )
    data = buffer.getvalue()
    write_atomic(path, data)
    return data


def export_records(records_folder: str | Path, corpus_folder: str | Path, *, target: str, command: str,
                   target_sha256: str | None = None) -> int:
    """Append the records of a regeneration folder that the corpus lacks, as one new shard. Returns how many."""
    corpus = Path(corpus_folder)
    manifest = read_manifest(corpus)
    settings = read_meta(records_folder)
    if settings.get("stage") != "regenerate":
        raise ValueError(f"{records_folder} does not hold regenerated records (stage {settings.get('stage')!r})")
    _check_settings(manifest.get("settings"), settings, f"the records in {records_folder}")
    known = corpus_ids(corpus)
    new = [record for record in read_records(records_folder) if record.id not in known]
    if not new:
        return 0
    corpus.mkdir(parents=True, exist_ok=True)
    name = f"shard-{len(manifest['shards']):05d}.npz"
    data = _write_shard(corpus / name, new, settings["vocab_size"])
    response_tokens = sum(len(r.input_ids) - r.response_start for r in new)
    manifest["shards"].append({
        "file": name, "sha256": hashlib.sha256(data).hexdigest(), "records": len(new),
        "tokens": sum(len(r.input_ids) for r in new), "response_tokens": response_tokens,
        "sources": dict(sorted(Counter(r.source for r in new).items())),
    })
    manifest.update(target=target, target_sha256=target_sha256, settings=_comparable(settings), command=command)
    shards = manifest["shards"]
    manifest["totals"] = {
        "records": sum(s["records"] for s in shards), "response_tokens": sum(s["response_tokens"] for s in shards),
        "bytes": sum((corpus / s["file"]).stat().st_size for s in shards),
        "sources": dict(sorted(sum((Counter(s["sources"]) for s in shards), Counter()).items())),
    }
    manifest = {key: manifest[key] for key in ("format", "target", "target_sha256", "command", "settings", "totals",
                                               "shards")}
    write_atomic(corpus / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return len(new)


def import_records(corpus_folder: str | Path, records_folder: str | Path, *, model: str,
                   only: Collection[str] | None = None) -> int:
    """Write the corpus's records (those with ids in `only`, when given) into a regeneration folder (made with the
    corpus's settings, `model` naming the target's folder on this machine) so that a regeneration run there skips
    them. Returns how many were added."""
    manifest = read_manifest(corpus_folder)
    if not manifest["shards"]:
        return 0
    settings = dict(manifest["settings"], model=model)
    if (Path(records_folder) / META_FILE).is_file():
        _check_settings(manifest["settings"], read_meta(records_folder), f"the records in {records_folder}")
        settings = read_meta(records_folder)
    with ShardWriter(records_folder, settings) as writer:
        new = [record for record in read_corpus(corpus_folder)
               if record.id not in writer.done_ids and (only is None or record.id in only)]
        writer.write(new)
    return len(new)
