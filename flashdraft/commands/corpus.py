"""`flashdraft corpus`: the target's own answers that drafts train on, kept in `corpus/TARGET/` and grown in the
background, session after session (format and recipe: `flashdraft/train/corpus.py`).

    status        records and response tokens: the corpus folder, and the work folder of its regeneration
    regenerate    import the corpus into the work folder, then answer the rest of the prompt set in the background
                  at low priority (nice 19, one thread unless --threads); resumable: no prompt is ever answered twice
    pause/resume  stop and continue a background regeneration (pause it while timing anything)
    stop          end it (what it wrote is kept; `regenerate` continues from there)
    export        append the answers the corpus lacks as one new shard (then commit corpus/TARGET)
    import        write the corpus's records into the work folder (`regenerate` does this first)
    train-folder  a work folder for `flashdraft train --work-dir DIR --label-minutes 0`: the prompt set and the
                  corpus's records, all or a seeded draw of them

The work folder is `$FLASHDRAFT_HOME/corpus/TARGET/prompts-N` (N the prompt count of the regeneration's step),
outside the repository; the corpus folder is `corpus/TARGET` under the current folder unless --corpus says where.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flashdraft.commands.options import at_least

PID_FILE = "regenerate.pid"
LOG_FILE = "regenerate.log"
STOP_WAIT_SECONDS = 30.0  # a regeneration ends within a second of SIGTERM; past this, `stop` says so


def register(subparsers: argparse._SubParsersAction) -> None:
    from flashdraft.models import DEFAULT_TARGET

    parser = subparsers.add_parser(
        "corpus", help="grow and manage a target's corpus of its own answers (the data drafts train on)",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
        sub.add_argument("--target", default=DEFAULT_TARGET,
                         help=f"registry name of the target whose answers these are (default: {DEFAULT_TARGET})")
        sub.add_argument("--corpus", type=Path, default=None,
                         help="corpus folder (default: corpus/TARGET under the current folder)")
        sub.add_argument("--num-prompts", type=at_least(1), default=None,
                         help="prompt count of the regeneration step, which names the work folder (default: the "
                         "target's current step, flashdraft.train.corpus.PROMPT_STEPS)")
        sub.add_argument("--work-dir", type=Path, default=None,
                         help="regeneration work folder (default: $FLASHDRAFT_HOME/corpus/TARGET/prompts-N)")
        sub.set_defaults(func=run)
        return sub

    action("status", "show the records and response tokens of the corpus and of its regeneration")
    regenerate = action("regenerate", "import the corpus, then regenerate the rest of the prompt set in the background")
    regenerate.add_argument("--foreground", action="store_true",
                            help="run in this terminal, with a progress bar, instead of in the background")
    regenerate.add_argument("--threads", type=int, default=1,
                            help="CPU threads (default: 1, beside other work; all the cores on a machine that is "
                            "the regeneration's alone: it stays at nice 19, so it yields to everything else)")
    action("pause", "pause a background regeneration (SIGSTOP to its process group)")
    action("resume", "resume a paused background regeneration")
    action("stop", "end a background regeneration, paused or not, and wait until it has; what it wrote is kept")
    action("export", "append the answers the corpus lacks as a new shard")
    action("import", "write the corpus's records into the regeneration's work folder")
    folder = action("train-folder", "write a training work folder: the prompt set and the corpus's records")
    folder.add_argument("folder", type=Path, help="the work folder to write")
    folder.add_argument("--records", type=int, default=None,
                        help="a seeded random subset of this many records (default: all)")
    folder.add_argument("--skip", type=int, default=0,
                        help="draw after the first this many records of the same seeded order (default: 0)")
    folder.add_argument("--exclude", type=Path, action="append", default=[], metavar="OLD",
                        help="leave out the records this earlier training folder holds, or that this file lists (one "
                        "id a line, e.g. corpus/TARGET/draws/*.txt); repeatable")


def work_folder(args: argparse.Namespace) -> Path:
    from flashdraft.files import cache_home

    return (args.work_dir or cache_home() / "corpus" / args.target / f"prompts-{num_prompts(args)}").expanduser()


def num_prompts(args: argparse.Namespace) -> int:
    from flashdraft.train.corpus import prompt_step

    return args.num_prompts or prompt_step(args.target)


def run(args: argparse.Namespace) -> int:
    from flashdraft.models import REGISTRY

    if args.target not in REGISTRY:
        raise ValueError(f"unknown target {args.target!r}: a corpus is kept for registry targets, "
                         f"{', '.join(REGISTRY)}")
    corpus = (args.corpus or Path("corpus") / args.target).expanduser()
    work = work_folder(args)
    if args.action in ("pause", "resume"):
        return _signal(work, {"pause": signal.SIGSTOP, "resume": signal.SIGCONT}[args.action])
    if args.action == "stop":
        return _stop(work)
    return {"status": _status, "regenerate": _regenerate, "export": _export, "import": _import,
            "train-folder": _train_folder}[args.action](args, corpus, work)


def _records(work: Path) -> Path:
    return work / "records-regenerate"


def _status(args, corpus: Path, work: Path) -> int:
    from flashdraft.train.corpus import read_manifest
    from flashdraft.train.records import META_FILE, read_records

    totals = read_manifest(corpus).get("totals", {})
    print(f"corpus {corpus}: {totals.get('records', 0)} records, {totals.get('response_tokens', 0)} response tokens, "
          f"{totals.get('bytes', 0) / 1e6:.2f} MB")
    if (_records(work) / META_FILE).is_file():
        done = list(read_records(_records(work)))
        print(f"work {work}: {len(done)} of {num_prompts(args)} prompts answered, "
              f"{sum(len(r.input_ids) - r.response_start for r in done)} response tokens")
    else:
        print(f"work {work}: no regeneration yet (`flashdraft corpus regenerate --target {args.target}`)")
    pid = _running(work)
    print(f"regeneration: running in process group {pid}" if pid else "regeneration: not running")
    return 0


def _import(args, corpus: Path, work: Path) -> int:
    from flashdraft.models import prepare
    from flashdraft.train.corpus import import_records

    imported = import_records(corpus, _records(work), model=str(prepare(args.target)))
    print(f"imported {imported} corpus records into {_records(work)}")
    return 0


def _export(args, corpus: Path, work: Path) -> int:
    from flashdraft.models import REGISTRY
    from flashdraft.train.corpus import export_records

    if not (_records(work)).is_dir():
        raise FileNotFoundError(f"{work} holds no regeneration: run `flashdraft corpus regenerate --target "
                                f"{args.target}` first")
    command = f"flashdraft corpus regenerate --target {args.target} --num-prompts {num_prompts(args)}"
    added = export_records(_records(work), corpus, target=args.target, command=command,
                           target_sha256=REGISTRY[args.target].gguf_sha256)
    print(f"exported {added} new records to {corpus}")
    return 0


def _regenerate(args, corpus: Path, work: Path) -> int:
    from flashdraft.train.corpus import check_follow_up_step, regeneration_arguments, step_proportions

    if args.threads < 1 or args.threads > (os.cpu_count() or 1):
        raise ValueError(f"--threads must be between 1 and the {os.cpu_count()} cores here, got {args.threads}")
    if _running(work):
        raise ValueError(f"a regeneration already runs in {work} (process group {_running(work)}): "
                         f"`flashdraft corpus status --target {args.target}`")
    if (proportions := step_proportions(num_prompts(args))) is not None:
        from flashdraft.train.sources import load_sources

        pools = load_sources(tuple(proportions))
        check_follow_up_step(num_prompts(args), {name: len(prompts) for name, prompts in pools.items()})
    _import(args, corpus, work)
    command = [sys.executable, "-m", "flashdraft.cli", *regeneration_arguments(args.target, work, num_prompts(args),
                                                                            args.threads)]
    # One thread sleeps when idle: the regeneration shares the machine with whatever else runs. More threads wait
    # as the command line chooses when it starts (`choose_thread_waiting`: a short spin on an idle machine; asleep,
    # they would wake ~100 times a step, which cost two threads all they gained). The answers in the corpus's own
    # arithmetic (`regenerate_settings`): float32 where its settings name none. The thread count changes how fast,
    # never what: each answer is what the target gives it alone.
    threads = str(args.threads)
    environment = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                       FLASHDRAFT_ARITHMETIC=corpus_arithmetic(corpus))
    if args.threads == 1:
        environment["OMP_WAIT_POLICY"] = "PASSIVE"
    if args.foreground:
        return subprocess.call(command, env=environment)
    work.mkdir(parents=True, exist_ok=True)
    log = work / LOG_FILE
    with log.open("a") as handle:
        process = subprocess.Popen(["nice", "-n", "19", *command], stdout=handle, stderr=handle, env=environment,
                                   start_new_session=True)
    _lower_session_priority(process.pid)
    (work / PID_FILE).write_text(f"{process.pid}\n")
    print(f"regenerating in the background (process group {process.pid}); log: {log}\n"
          f"pause it while timing anything: flashdraft corpus pause --target {args.target}", file=sys.stderr)
    return 0


def corpus_arithmetic(corpus: Path) -> str:
    """The engine arithmetic a corpus's answers were made in: its settings' (float32 where they name none, as
    before there was a choice); a new corpus takes the engine's default."""
    from flashdraft.train.corpus import read_manifest

    settings = read_manifest(corpus).get("settings")
    return "auto" if settings is None else settings.get("arithmetic", "float32")


def _train_folder(args, corpus: Path, work: Path) -> int:
    from flashdraft.models import prepare
    from flashdraft.train.corpus import make_train_folder

    held = make_train_folder(corpus, work, args.folder.expanduser(), args.records, str(prepare(args.target)),
                             skip=args.skip, exclude=[old.expanduser() for old in args.exclude])
    print(f"{args.folder}: {held} records; train with --target {args.target} --work-dir {args.folder} "
          f"--num-prompts {num_prompts(args)} --label-minutes 0")
    return 0


def _running(work: Path) -> int | None:
    """The process group of the background regeneration of `work`, when one is alive."""
    try:
        pid = int((work / PID_FILE).read_text())
        os.killpg(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def _signal(work: Path, sig: signal.Signals) -> int:
    pid = _running(work)
    if pid is None:
        print(f"no regeneration runs in {work}", file=sys.stderr)
        return 1
    os.killpg(pid, sig)
    print(f"{sig.name} sent to process group {pid}", file=sys.stderr)
    return 0


def _stop(work: Path, wait: float = STOP_WAIT_SECONDS) -> int:
    """End the regeneration (a paused one too: it is continued so that it can end) and wait until it has, so that
    a `regenerate` right after finds none running."""
    pid = _running(work)
    if pid is None:
        print(f"no regeneration runs in {work}", file=sys.stderr)
        return 1
    os.killpg(pid, signal.SIGTERM)
    os.killpg(pid, signal.SIGCONT)
    deadline = time.monotonic() + wait
    while _running(work) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if _running(work) is not None:
        print(f"SIGTERM sent to process group {pid}, which has not ended after {wait:.0f} s: "
              f"`flashdraft corpus status` says when it has", file=sys.stderr)
        return 1
    print(f"stopped process group {pid}; what it wrote is kept", file=sys.stderr)
    return 0


def _lower_session_priority(pid: int) -> None:
    """Under Linux's autogroup scheduling a new session is its own group, and CPU time is shared between groups
    before `nice` counts inside one: a nice-19 job in its own session still takes a whole core from a training run
    in another. Setting the group's nice too makes it yield to the jobs of other groups."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("19")
    except OSError:  # no autogroup (other kernels, other systems): plain nice is what applies there
        pass
