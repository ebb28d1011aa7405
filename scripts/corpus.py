"""Grow the corpus of the default target's own answers (`corpus/TARGET/`, format in `flashdraft.train.corpus`).

    python scripts/corpus.py grow      # import the corpus into the work folder, then regenerate in the background
                                       # at low priority (nice 19, one thread); resumable, never answers twice
    python scripts/corpus.py export    # append what the work folder holds beyond the corpus (then commit corpus/)
    python scripts/corpus.py status    # records, response tokens and bytes: corpus and work folder
    python scripts/corpus.py train-folder DIR [--records N] [--skip K] [--exclude OLD ...]
                                       # a work folder for `flashdraft train --work-dir DIR --num-prompts 20000
                                       # --label-minutes 0`: the regeneration's prompt set and the corpus's records
                                       # (all, or a seeded random N of them, e.g. for a recipe A/B; --skip K: the N
                                       # after the first K of the same seeded order; --exclude OLD: leave out the
                                       # records earlier training folders hold, a fresh draw for the next run)

The work folder (default `$FLASHDRAFT_HOME/corpus/TARGET/prompts-N`, N the prompt count of `REGENERATE`) stays
outside the repository. Pause `grow` while timing
anything (`kill -STOP`/`-CONT` on its process group); export before the session ends.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from flashdraft.models import REGISTRY, cache_home, prepare
from flashdraft.train.corpus import corpus_ids, export_records, import_records, read_manifest
from flashdraft.train.pipeline import PROMPT_SETTINGS, PROMPTS_FILE
from flashdraft.train.records import META_FILE, read_records

REPO = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-instruct"
# The regeneration every corpus shard comes from: decontaminated prompts of the built-in mix (code, math and chat),
# full-length greedy answers of up to 512 tokens. The answers' settings never change (changing them means another
# corpus folder); the prompt set grows in steps, each in its own work folder, which `grow` first fills with the whole
# corpus, so that no prompt is answered twice: 10,000 prompts until 2026-12-02 (shards 0-36), then 20,000, which the
# built-in sources cannot fill: every one of their 19,886 distinct prompts.
NUM_PROMPTS = 20000
REGENERATE = ["--until", "labels", "--num-prompts", str(NUM_PROMPTS), "--labels", "regenerate", "--max-new-tokens",
              "512", "--threads", "1"]


def regenerate_command(work: Path) -> list[str]:
    return ["flashdraft", "train", "--target", TARGET, *REGENERATE, "--work-dir", str(work), "-o", str(work / "out")]


def lower_session_priority(pid: int) -> None:
    """Under Linux's autogroup scheduling a new session is its own group, and CPU time is shared between groups
    before `nice` counts inside one: a nice-19 job in its own session still takes a whole core from a training run
    in another. Setting the group's nice too makes it yield to the jobs of other groups."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("19")
    except OSError:  # no autogroup (other kernels, other systems): plain nice is what applies there
        pass


def make_train_folder(corpus: Path, regeneration: Path, folder: Path, count: int | None, model: str,
                      skip: int = 0, exclude: Sequence[Path] = ()) -> int:
    """Write the regeneration's prompt files and the corpus's records (all, or the `count` with the smallest seeded
    hash of their id after the first `skip` of that order) into `folder`, `model` naming the target's folder on this
    machine; the records held by the training folders or listed in the id files `exclude` are left out first.
    Returns how many records it holds."""
    if skip and count is None:
        raise SystemExit("--skip needs --records: it skips the start of the seeded draw")
    if not (regeneration / PROMPT_SETTINGS).is_file():
        raise SystemExit(f"{regeneration} has no prompt set yet: run `python scripts/corpus.py grow` first")
    used: set[str] = set()
    for old in exclude:
        if old.is_file():  # a list of record ids, one a line: a shipped draft's draw (corpus/TARGET/draws/)
            used |= {line.strip() for line in old.read_text().splitlines() if line.strip()}
            continue
        if not (old / "records-regenerate" / META_FILE).is_file():
            raise SystemExit(f"--exclude {old}: not a training folder (no records-regenerate/{META_FILE}) nor a "
                             "file of record ids")
        used |= {record.id for record in read_records(old / "records-regenerate")}
    folder.mkdir(parents=True, exist_ok=True)
    for name in (PROMPTS_FILE, PROMPT_SETTINGS):
        shutil.copy(regeneration / name, folder / name)
    ids = sorted(set(corpus_ids(corpus)) - used)
    if count is not None:
        # The init A/B drew its 1,324 records with this key from the corpus at 11,205 records (BENCHMARKS.md).
        # Draws of the same order never overlap on the same corpus; a grown corpus slots new records in between,
        # so a draw after an export overlaps the one before it by a little: --exclude its folder instead of --skip.
        ids = sorted(ids, key=lambda i: hashlib.sha256(f"ab:{i}".encode()).digest())[skip : skip + count]
    import_records(corpus, folder / "records-regenerate", model=model, only=set(ids))
    return len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["grow", "export", "status", "train-folder"], help="what to do")
    parser.add_argument("folder", type=Path, nargs="?", help="train-folder: the work folder to write")
    parser.add_argument("--records", type=int, default=None,
                        help="train-folder: a seeded random subset of this many records (default: all)")
    parser.add_argument("--skip", type=int, default=0,
                        help="train-folder: draw after the first this many records of the same seeded order, e.g. "
                             "the records a previous run did not see (default: 0)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], metavar="OLD",
                        help="train-folder: leave out the records this earlier training folder holds, or that this "
                             "file lists (one id a line, e.g. corpus/TARGET/draws/*.txt: the shipped drafts' draws); "
                             "repeatable, so the draw is answers those runs did not see")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="regeneration work folder (default: $FLASHDRAFT_HOME/corpus/TARGET)")
    parser.add_argument("--corpus", type=Path, default=REPO / "corpus" / TARGET, help="corpus folder")
    args = parser.parse_args()
    work = (args.work_dir or cache_home() / "corpus" / TARGET / f"prompts-{NUM_PROMPTS}").expanduser()
    records = work / "records-regenerate"
    manifest = read_manifest(args.corpus)
    print(f"corpus {args.corpus}: {manifest.get('totals', {}).get('records', 0)} records, "
          f"{manifest.get('totals', {}).get('response_tokens', 0)} response tokens, "
          f"{manifest.get('totals', {}).get('bytes', 0) / 1e6:.2f} MB")
    if args.action == "status":
        if (records / META_FILE).is_file():
            done = list(read_records(records))
            print(f"work {records}: {len(done)} records, "
                  f"{sum(len(r.input_ids) - r.response_start for r in done)} response tokens")
        return
    if args.action == "train-folder":
        if args.folder is None:
            parser.error("train-folder needs the folder to write")
        held = make_train_folder(args.corpus, work, args.folder.expanduser(), args.records, str(prepare(TARGET)),
                                 skip=args.skip, exclude=[old.expanduser() for old in args.exclude])
        print(f"{args.folder}: {held} records; train with --work-dir {args.folder} --num-prompts {NUM_PROMPTS} "
              "--label-minutes 0")
        return
    if args.action == "export":
        added = export_records(records, args.corpus, target=TARGET, command=" ".join(regenerate_command(work)),
                               target_sha256=REGISTRY[TARGET].gguf_sha256)
        print(f"exported {added} new records to {args.corpus}")
        return
    imported = import_records(args.corpus, records, model=str(prepare(TARGET)))
    print(f"imported {imported} corpus records into {records}")
    log = work / "regenerate.log"
    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    with log.open("a") as handle:
        process = subprocess.Popen(["nice", "-n", "19", *regenerate_command(work)], stdout=handle, stderr=handle,
                                   env=environment, start_new_session=True)
    lower_session_priority(process.pid)
    print(f"regenerating in the background (process group {process.pid}); log: {log}", file=sys.stderr)


if __name__ == "__main__":
    main()
