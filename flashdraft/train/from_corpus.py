"""Training from the committed corpus: continue a draft on the corpus's records within a time budget, and measure
drafts on held-out corpus records. The work that made the shipped drafts since v15, and the draft work for a lent
GPU machine, where the prompt sets the pipeline builds its data from do not exist but the corpus does (it travels
with the repository).

    flashdraft train --corpus corpus/TARGET -o OUT --init-draft DRAFT --heldout-ids HELDOUT.txt --seconds 420
    flashdraft draft evaluate --heldout-ids HELDOUT.txt [--sets heldout,humaneval,gsm8k,mt-bench] DRAFT [DRAFT ...]

`train_from_corpus` reads every corpus record but those of `heldout_ids` (and of `exclude_ids`), runs the trainer
(`Trainer`, one trainer for both ways in) with online target features, the draft's shape, feature layers and
drafting vocabulary kept from `init_draft` (the vocabulary chosen again from a corpus's answers with
`draft_vocab_corpus`, `draft_vocab_size` tokens), and sizes the run to the budget: the seconds a step takes
(`step_seconds`, else timed by a few probe steps) give as many steps as fit in `seconds` (at most `epochs` over the
records; `max_steps` sets the count instead), with the warmup and cosine decay over exactly those. A continuation
on the same records needs another seed, or it sees the same records first again. It writes OUT/final, OUT/mean
(the mean of the start and the final: weight averaging, unless `mean=False`) and OUT/step-N at each `snapshots`
fraction of the steps, draft folders in bfloat16; OUT/float32 with the model card; and OUT/reached.txt, the ids of
the records the steps trained on (a later run's `exclude_ids`; `corpus/TARGET/draws/` keeps the shipped drafts'
lists). `evaluate_drafts` gives, per draft, tau at its block size on the first held-out records' prompts (replayed
on the target's greedy answers) and the teacher-forced loss and per-position accuracy on all of them: the figures
`flashdraft train` keeps its best draft by; and, with `sets`, tau on built-in evaluation sets' prompts (outside the
corpus: how the draft does on what users ask, where the held-out records share the corpus's sources).
"""

from __future__ import annotations

import copy
import json
import shlex
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..draft import DFlashDraftModel, check_draft_folder
from ..files import write_atomic
from ..models import load_target
from ..rules import resolve_dtype
from ..text import stop_token_ids
from .averaging import average_drafts
from .blocks import TrainingSequence
from .config import HELDOUT_SET, PipelineConfig, TrainConfig, check_prompt_sets, exact_command
from .corpus import check_corpus_folder, read_corpus, response_counts
from .drafts import lineage, save_trained_draft, start_from_draft
from .features import OnlineFeatures, engine_features_hint
from .loss import DraftVocabulary
from .pipeline import data_counts, eval_prompt_sets
from .trainer import Trainer

PROBE_STEPS = 5  # timed after one warm-up step (kernels, allocator)
PLAN_FILE = "steps.json"  # in the work folder: the step count a budgeted run fixed at its first start
REPORTS = 20  # progress lines a run prints (each twentieth of its steps), besides one per snapshot


@dataclass
class CorpusRun:
    """What a run from the corpus needs beyond `PipelineConfig` (whose `init_draft`, trainer settings, target,
    device and `work_dir` it uses; default work folder: OUT/work)."""

    corpus: Path
    heldout_ids: Path | None = None  # file of record ids (one a line) never trained on
    exclude_ids: Sequence[Path] = ()  # files of record ids not to train on (e.g. corpus/TARGET/draws/*.txt)
    seconds: float | None = None  # budget from start to the written draft (or give the config's max_steps)
    step_seconds: float | None = None  # seconds a step takes (default: timed by a few probe steps)
    reserve: float = 30.0  # seconds kept for writing the drafts
    snapshots: str = "0.5,0.75"  # fractions of the steps to write step-N drafts at
    mean: bool = True  # write OUT/mean, the bfloat16 mean of the start and the final draft
    progress: bool = False  # the trainer's progress bar
    words: list[str] = field(default_factory=list)  # the command-line words of these settings, for the card

    def __post_init__(self):
        # Everything that needs no model, so that a mistake fails before the target loads.
        self.corpus = Path(self.corpus)
        check_corpus_folder(self.corpus)
        for option, path in [("--heldout-ids", self.heldout_ids)] + [("--exclude-ids", p) for p in self.exclude_ids]:
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{option} {path}: no such file (a file of record ids, one a line, e.g. "
                                 "corpus/TARGET/draws/heldout-v1.txt)")
        for option, value in (("--seconds", self.seconds), ("--step-seconds", self.step_seconds)):
            if value is not None and not value > 0:
                raise ValueError(f"{option} must be above 0, got {value}")
        if not self.reserve >= 0:
            raise ValueError(f"--reserve must be at least 0, got {self.reserve}")
        self.snapshot_fractions()  # its own check

    def snapshot_fractions(self) -> list[float]:
        """--snapshots as numbers, each in (0, 1)."""
        try:
            fractions = [float(part) for part in self.snapshots.split(",") if part.strip()]
        except ValueError:
            fractions = [-1.0]
        if not all(0 < fraction < 1 for fraction in fractions):
            raise ValueError(f"--snapshots takes fractions of the run between 0 and 1, comma separated (e.g. 0.5,0.75)"
                             f", got {self.snapshots!r}")
        return fractions


def read_ids(path: Path | None) -> set[str]:
    if path is None:
        return set()
    return {line.strip() for line in Path(path).read_text().splitlines() if line.strip()}


def corpus_sequences(corpus: Path, heldout_ids: set[str], max_length: int, exclude: set[str] = frozenset()):
    """(training, held-out) sequences of the corpus, held-out ones in the order of their ids; `exclude` ids are
    left out of training only."""
    training, heldout = [], []
    for record in read_corpus(corpus):
        if record.id in exclude and record.id not in heldout_ids:
            continue
        sequence = TrainingSequence.from_record(record, max_length)
        (heldout if record.id in heldout_ids else training).append(sequence)
    found = {s.id for s in heldout}
    if heldout_ids - found:
        raise ValueError(f"{len(heldout_ids - found)} held-out ids are not in {corpus}, e.g. "
                         f"{sorted(heldout_ids - found)[0]}: the list belongs to another corpus")
    return training, sorted(heldout, key=lambda s: s.id)


def _device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def drafting_vocabulary(draft: DFlashDraftModel, vocab_size: int) -> DraftVocabulary | None:
    ids = draft.config.dflash_config.get("draft_vocab_ids")
    return DraftVocabulary.from_ids(ids, vocab_size) if ids else None


def choose_vocabulary(draft: DFlashDraftModel, corpus: Path, size: int, heldout: set[str]) -> None:
    """Give `draft` a new drafting vocabulary: the `size` tokens most frequent in `corpus`'s answers, less the
    held-out records' (0: the full vocabulary). No weight changes (the drafting head is rows of the target's own),
    so training from there teaches the draft the tokens it could not propose before; and says what that covers."""
    vocab_size = draft.config.vocab_size
    counts = torch.from_numpy(response_counts(corpus, vocab_size, exclude=heldout))
    before = drafting_vocabulary(draft, vocab_size)
    covered = f"{before.coverage(counts):.1%}" if before else "all"
    if size == 0 or size >= vocab_size:
        draft.set_draft_vocab(None)
        print(f"drafting vocabulary: the full one (the start's covered {covered} of {corpus}'s answer tokens)",
              flush=True)
        return
    chosen = DraftVocabulary.from_counts(counts, size)
    draft.set_draft_vocab(chosen.ids)
    print(f"drafting vocabulary: the {size} tokens most frequent in {corpus}'s answers, {chosen.coverage(counts):.1%} "
          f"of their tokens (the start's covered {covered})", flush=True)


def fresh_draft(model, start: DFlashDraftModel) -> DFlashDraftModel:
    draft = DFlashDraftModel.for_target(model.config, num_layers=len(start.layers), block_size=start.block_size,
                                        mask_token_id=start.mask_token_id, target_layer_ids=start.target_layer_ids)
    start_from_draft(draft, start)
    return draft


def drafts_own_shape(config: PipelineConfig, start: DFlashDraftModel) -> PipelineConfig:
    """`config` with the shape `init_draft` gives the run (its layers, block size, feature layers, drafting
    vocabulary), so that the card's command says what was trained rather than the options' defaults."""
    ids = start.config.dflash_config.get("draft_vocab_ids")
    return replace(config, draft_layers=len(start.layers), block_size=start.block_size,
                   feature_layers=tuple(start.target_layer_ids), draft_vocab_size=len(ids) if ids else 0)


def save_bfloat16(draft: DFlashDraftModel, folder: Path) -> Path:
    copy.deepcopy(draft).float().cpu().to(torch.bfloat16).save_pretrained(folder)
    return folder


def probe_step_seconds(model, start, training, features, vocabulary, train_config, folder, device) -> float:
    """Seconds a step takes, timed on a throwaway copy of the draft. On a GPU it overestimates (2x on an H200,
    where the steps grew faster through the run, as if each new sequence length cost a first-time setup), so a
    budgeted run ends early there; give --step-seconds from an earlier run's `seconds a step` line instead."""
    probe = Trainer(fresh_draft(model, start), model, training, features, folder,
                    replace(train_config, max_steps=10**6, keep_checkpoints=1, checkpoint_every=10**6),
                    vocabulary=vocabulary, progress=False)
    probe.train_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    timed = time.perf_counter()
    for _ in range(PROBE_STEPS):
        probe.train_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - timed) / PROBE_STEPS


def _read_plan(path: Path, budget: dict) -> int | None:
    """The step count an earlier start of this run planned for the same budget, else None."""
    try:
        plan = json.loads(path.read_text())
        return int(plan["steps"]) if plan["budget"] == budget else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def progress_line(step: int, steps: int, loss: float, elapsed: float, first_step: tuple[int, float],
                  note: str = "") -> str:
    """One line of a run's progress, for a log that a background run writes (`--progress` draws a bar instead):
    the step, its loss, the time since the start and the time left at this process's pace so far."""
    began_at, began = first_step
    pace = (time.perf_counter() - began) / max(1, step - began_at)
    line = f"step {step}/{steps}: loss {loss:.3f}, {elapsed:.0f} s, about {pace * (steps - step):.0f} s left"
    return f"{line}; {note}" if note else line


def train_from_corpus(config: PipelineConfig, run: CorpusRun) -> None:
    """Continue `config.init_draft` on the corpus within the budget and write OUT (the module doc)."""
    if config.init_draft is None:
        raise ValueError("training from a corpus continues a draft: give --init-draft DRAFT; a target's first draft "
                         "trains from a folder of the corpus's records: flashdraft corpus train-folder DIR --target "
                         "TARGET, then the flashdraft train command it prints")
    if run.seconds is None and config.max_steps is None:
        raise ValueError("training from a corpus needs --seconds (a time budget) or --max-steps")
    began = time.perf_counter()
    check_draft_folder(config.init_draft)  # the start draft, its lineage and the corpus before the target loads
    start = DFlashDraftModel.from_pretrained(config.init_draft, dtype=torch.float32)
    earlier_runs = lineage(config.init_draft)  # read now: a damaged training.json fails before the training
    heldout_ids = read_ids(run.heldout_ids)
    if config.draft_vocab_corpus is not None:
        choose_vocabulary(start, config.draft_vocab_corpus, config.draft_vocab_size, heldout_ids)
    exclude = set().union(*(read_ids(path) for path in run.exclude_ids))
    training, heldout = corpus_sequences(run.corpus, heldout_ids, config.max_length, exclude)
    device = _device(config.device)
    model, _ = load_target(config.target, device=device, dtype=resolve_dtype(config.dtype, device.type))
    if (hint := engine_features_hint(model)) is not None:
        print(hint, flush=True)
    vocabulary = drafting_vocabulary(start, model.get_input_embeddings().weight.shape[0])
    features = OnlineFeatures(model, start.target_layer_ids)
    # No evaluation sets here: the held-out records are measured by `evaluate_drafts`, after the run.
    train_config = replace(config.train_config(), eval_every=0)
    out = config.output
    work = config.work_dir or out / "work"

    global_batch = config.batch_size * config.grad_accum
    epoch_steps = len(training) // global_batch
    # A budget's step count is fixed at the first start and kept in the work folder: the same command run again
    # after a kill resumes the run's checkpoints with the same schedule instead of a new estimate (which the
    # checkpoints would refuse as another run).
    budget = {"seconds": run.seconds, "step_seconds": run.step_seconds, "reserve": run.reserve,
              "max_steps": config.max_steps, "epochs": config.epochs, "records": len(training)}
    plan = _read_plan(work / PLAN_FILE, budget)
    if plan is not None:
        steps, rate = plan, f"planned at the first start, in {work / PLAN_FILE}"
    elif config.max_steps:
        steps, rate = min(config.epochs * epoch_steps, config.max_steps), "given"
    else:
        per_step = run.step_seconds or probe_step_seconds(model, start, training, features, vocabulary, train_config,
                                                          work / "probe", device)
        left = run.seconds - (time.perf_counter() - began) - run.reserve
        steps = max(1, min(config.epochs * epoch_steps, int(left / per_step)))
        rate = f"{per_step:.3f} s a step, {left:.0f} s left"
    if plan is None:
        work.mkdir(parents=True, exist_ok=True)
        write_atomic(work / PLAN_FILE, json.dumps({"budget": budget, "steps": steps}) + "\n")
    marks = sorted({max(1, round(steps * fraction)) for fraction in run.snapshot_fractions()} - {steps})
    print(f"{len(training)} training records, {len(heldout)} held out; global batch {global_batch}, {epoch_steps} "
          f"steps an epoch; {steps} steps ({rate}); snapshots at {marks}", flush=True)

    report_every = max(1, steps // REPORTS) if not run.progress else steps  # the bar replaces the lines

    class SnapshotTrainer(Trainer):  # writes a bfloat16 draft at each mark, for weight averaging later
        def train(self):
            self.first_step = (self.step, time.perf_counter())  # where this process began: a resumed run, later
            return super().train()

        def train_step(self):
            result = super().train_step()
            if self.step in marks:
                save_bfloat16(self.draft, out / f"step-{self.step}")
            if self.step in marks or (self.step % report_every == 0 and self.step < steps):
                print(progress_line(self.step, steps, result["loss"], time.perf_counter() - began, self.first_step,
                                    f"step-{self.step} written" if self.step in marks else ""), flush=True)
            return result

    trainer = SnapshotTrainer(fresh_draft(model, start), model, training, features, work / "run",
                              replace(train_config, max_steps=steps), vocabulary=vocabulary, progress=run.progress)
    summary = trainer.train()
    card = {"target": config.target, "data": data_counts(training),
            "labels": "the target's own greedy responses (the repository's corpus)",
            "settings": {"feature storage": "online", "anchors per sequence": config.num_anchors,
                         "gamma": trainer.gamma, "loss weights": trainer.config.loss_weights,
                         "global batch (sequences)": trainer.global_batch,
                         "peak learning rate": config.learning_rate, "device": str(device)},
            "command": exact_command(drafts_own_shape(config, start)) + " " + shlex.join(run.words)}
    if earlier_runs:
        card["runs"] = earlier_runs
    final = save_trained_draft(trainer.draft, out / "float32", summary, card)
    save_bfloat16(trainer.draft, out / "final")
    for name in ("training.json", "README.md"):
        (out / "final" / name).write_text((final / name).read_text())
    (out / "reached.txt").write_text("".join(f"{record}\n" for record in trainer.records_reached()))
    if run.mean:  # the mean with the start has beaten the run alone in every continuation since v13
        save_bfloat16(average_drafts(start, [config.init_draft, final]), out / "mean")
    print(f"{summary.seconds / summary.steps:.3f} seconds a step", flush=True)
    print(json.dumps({"steps": summary.steps, "epochs": round(summary.epochs, 3), "seconds": round(summary.seconds),
                      "final_loss": summary.final_loss, "final_accuracy": summary.final_accuracy}), flush=True)


@dataclass
class DraftScore:
    """A draft's figures: tau per prompt set, and on the held-out corpus records."""

    draft: str
    tau: dict[str, float]  # at the draft's block size, per prompt set (HELDOUT_SET: the first held-out records')
    heldout_loss: float  # teacher-forced, on all held-out records
    heldout_accuracy: list[float]  # per block position 1..B-1


def evaluate_drafts(drafts: Sequence[str | Path], *, target: str, corpus: Path, heldout_ids: Path,
                    sets: Sequence[str] = (HELDOUT_SET,), prompts: int = 32, max_new_tokens: int = 128,
                    device: str = "auto", max_length: int = 2048, work_dir: Path | None = None) -> list[DraftScore]:
    """Tau of each draft on each prompt set (HELDOUT_SET, or a built-in evaluation set such as humaneval: prompts
    outside the corpus), and its held-out loss and accuracy (the module doc)."""
    check_prompt_sets(sets)  # this, the drafts' folders and the held-out records before the target loads
    for folder in drafts:
        check_draft_folder(Path(folder))
    check_corpus_folder(corpus)
    _, heldout = corpus_sequences(corpus, read_ids(heldout_ids), max_length)
    if not heldout:
        raise ValueError("evaluating drafts needs --heldout-ids: the records to measure on")
    torch_device = _device(device)
    model, tokenizer = load_target(target, device=torch_device, dtype=resolve_dtype("auto", torch_device.type))
    prompt_sets = eval_prompt_sets(sets, prompts, tokenizer, heldout)
    scores = []
    with tempfile.TemporaryDirectory(prefix="flashdraft-evaluate-") as scratch:
        for number, folder in enumerate(drafts):
            draft = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)
            vocabulary = drafting_vocabulary(draft, model.get_input_embeddings().weight.shape[0])
            trainer = Trainer(draft, model, heldout, OnlineFeatures(model, draft.target_layer_ids),
                              Path(work_dir or scratch) / f"{number}-{Path(folder).name}",
                              TrainConfig(batch_size=1, eval_max_new_tokens=max_new_tokens,
                                          max_steps=1, grad_accum=1),
                              vocabulary=vocabulary, heldout=heldout, eval_prompts=prompt_sets,
                              stop_token_ids=stop_token_ids(model, tokenizer), progress=False)
            result = trainer.evaluate()
            scores.append(DraftScore(str(folder), result["tau"], result["heldout_loss"], result["heldout_accuracy"]))
    return scores
