"""Continue a draft on the whole corpus within a time budget, or measure drafts on held-out corpus records: the
draft work for a lent GPU machine, where the prompt sets `flashdraft train` builds its data from do not exist
(no evaluation packages, 64 MiB a call) but the corpus does (it travels with the repository).

    python scripts/train_from_corpus.py train OUT --init-draft flashdraft/drafts/smollm2-135m-instruct \\
        --heldout-ids HELDOUT.txt --seconds 420 --snapshots 0.5,0.75
    python scripts/train_from_corpus.py evaluate --heldout-ids HELDOUT.txt DRAFT [DRAFT ...]

`train` reads every corpus record but those of `--heldout-ids` (and of `--exclude-ids`), runs the trainer with
online target features (`flashdraft.train.Trainer`; the draft's shape, feature layers and drafting vocabulary kept
from `--init-draft`),
and sizes the run to the budget: the seconds a step takes (`--step-seconds`, else timed by a few probe steps)
give as many steps as fit in `--seconds` (at most `--epochs` over the records; `--max-steps` sets the count
instead), with the warmup and cosine decay over exactly those. A continuation on the same records needs another
`--seed`, or it sees the same records first again. It writes OUT/final, OUT/mean (the mean of the start and the
final: weight averaging, unless `--no-mean`) and OUT/step-N at each `--snapshots` fraction of the steps, draft
folders in bfloat16, and OUT/reached.txt, the ids of the records the steps trained on (a later run's
`--exclude-ids`; `corpus/TARGET/draws/` keeps the shipped drafts' lists). `evaluate` prints, per draft, tau at its
block size on the first `--prompts` held-out records' prompts (replayed on the target's greedy answers) and the
teacher-forced loss and per-position accuracy on all of them: the figures `flashdraft train` keeps its best draft by.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from flashdraft.draft import DFlashDraftModel
from flashdraft.models import load_target
from flashdraft.text import stop_token_ids
from flashdraft.train.averaging import average_drafts
from flashdraft.train.blocks import TrainingSequence
from flashdraft.train.corpus import read_corpus
from flashdraft.train.features import OnlineFeatures
from flashdraft.train.loss import DraftVocabulary
from flashdraft.train.pipeline import HELDOUT_SET, PipelineConfig, data_counts
from flashdraft.train.trainer import TrainConfig, Trainer, save_trained_draft, start_from_draft

REPO = Path(__file__).resolve().parents[1]
PROBE_STEPS = 5  # timed after one warm-up step (kernels, allocator)


def read_ids(path: Path | None) -> set[str]:
    if path is None:
        return set()
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


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
        raise SystemExit(f"{len(heldout_ids - found)} held-out ids are not in {corpus}, e.g. "
                         f"{sorted(heldout_ids - found)[0]}: the list belongs to another corpus")
    return training, sorted(heldout, key=lambda s: s.id)


def device_and_dtype(device: str) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def drafting_vocabulary(draft: DFlashDraftModel, vocab_size: int) -> DraftVocabulary | None:
    ids = draft.config.dflash_config.get("draft_vocab_ids")
    return DraftVocabulary.from_ids(ids, vocab_size) if ids else None


def fresh_draft(model, start: DFlashDraftModel) -> DFlashDraftModel:
    draft = DFlashDraftModel.for_target(model.config, num_layers=len(start.layers), block_size=start.block_size,
                                        mask_token_id=start.mask_token_id, target_layer_ids=start.target_layer_ids)
    start_from_draft(draft, start)
    return draft


def save_bfloat16(draft: DFlashDraftModel, folder: Path) -> Path:
    copy.deepcopy(draft).float().cpu().to(torch.bfloat16).save_pretrained(folder)
    return folder


def probe_step_seconds(model, start, training, features, vocabulary, settings, folder, device) -> float:
    """Seconds a step takes, timed on a throwaway copy of the draft. On a GPU it overestimates (2x on an H200,
    where the steps grew faster through the run, as if each new sequence length cost a first-time setup), so a
    budgeted run ends early there; give --step-seconds from an earlier run's `seconds a step` line instead."""
    probe = Trainer(fresh_draft(model, start), model, training, features, folder,
                    TrainConfig(**settings, max_steps=10**6, keep_checkpoints=1, checkpoint_every=10**6),
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


def train(args) -> None:
    began = time.perf_counter()
    device, dtype = device_and_dtype(args.device)
    model, _ = load_target(args.target, device=device, dtype=dtype)
    start = DFlashDraftModel.from_pretrained(args.init_draft, dtype=torch.float32)
    vocabulary = drafting_vocabulary(start, model.get_input_embeddings().weight.shape[0])
    exclude = set().union(*(read_ids(path) for path in args.exclude_ids))
    training, heldout = corpus_sequences(args.corpus, read_ids(args.heldout_ids), args.max_length, exclude)
    features = OnlineFeatures(model, start.target_layer_ids)
    settings = dict(learning_rate=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
                    warmup_ratio=args.warmup_ratio, num_anchors=args.num_anchors, eval_every=0,
                    loss_weights=args.loss_weights, seed=args.seed, loss_chunk=args.loss_chunk,
                    compute_dtype=args.compute_dtype)
    out, work = Path(args.output), Path(args.work_dir or Path(args.output) / "work")

    epoch_steps = len(training) // (args.batch_size * args.grad_accum)
    if args.max_steps:
        steps, rate = min(args.epochs * epoch_steps, args.max_steps), "given"
    else:
        per_step = args.step_seconds or probe_step_seconds(model, start, training, features, vocabulary, settings,
                                                           work / "probe", device)
        left = args.seconds - (time.perf_counter() - began) - args.reserve
        steps = max(1, min(args.epochs * epoch_steps, int(left / per_step)))
        rate = f"{per_step:.3f} s a step, {left:.0f} s left"
    marks = sorted({max(1, round(steps * float(f))) for f in args.snapshots.split(",") if f} - {steps})
    print(f"{len(training)} training records, {len(heldout)} held out; global batch "
          f"{args.batch_size * args.grad_accum}, {epoch_steps} steps an epoch; {steps} steps ({rate}); snapshots at "
          f"{marks}", flush=True)

    class SnapshotTrainer(Trainer):  # writes a bfloat16 draft at each mark, for weight averaging later
        def train_step(self):
            result = super().train_step()
            if self.step in marks:
                save_bfloat16(self.draft, out / f"step-{self.step}")
                print(f"step {self.step}: loss {result['loss']:.3f}, {time.perf_counter() - began:.0f} s", flush=True)
            return result

    trainer = SnapshotTrainer(fresh_draft(model, start), model, training, features, work / "run",
                              TrainConfig(**settings, max_steps=steps, keep_checkpoints=1,
                                          checkpoint_every=args.checkpoint_every),
                              vocabulary=vocabulary, progress=args.progress)
    summary = trainer.train()
    card = {"target": args.target, "data": data_counts(training),
            "labels": "the target's own greedy responses (the repository's corpus)",
            "settings": {"feature storage": "online", "anchors per sequence": args.num_anchors,
                         "gamma": trainer.gamma, "loss weights": trainer.config.loss_weights,
                         "global batch (sequences)": trainer.global_batch, "peak learning rate": args.lr,
                         "device": str(device)},
            "command": "python scripts/train_from_corpus.py " + " ".join(args.argv)}
    final = save_trained_draft(trainer.draft, out / "float32", summary, card)
    save_bfloat16(trainer.draft, out / "final")
    for name in ("training.json", "README.md"):
        (out / "final" / name).write_text((final / name).read_text())
    (out / "reached.txt").write_text("".join(f"{record}\n" for record in trainer.records_reached()))
    if args.mean:  # the mean with the start has beaten the run alone in every continuation since v13
        save_bfloat16(average_drafts(start, [args.init_draft, final]), out / "mean")
    print(f"{summary.seconds / summary.steps:.3f} seconds a step", flush=True)
    print(json.dumps({"steps": summary.steps, "epochs": round(summary.epochs, 3), "seconds": round(summary.seconds),
                      "final_loss": summary.final_loss, "final_accuracy": summary.final_accuracy}), flush=True)


def evaluate(args) -> None:
    device, dtype = device_and_dtype(args.device)
    model, tokenizer = load_target(args.target, device=device, dtype=dtype)
    _, heldout = corpus_sequences(args.corpus, read_ids(args.heldout_ids), args.max_length)
    if not heldout:
        raise SystemExit("evaluate needs --heldout-ids: the records to measure on")
    prompts = {HELDOUT_SET: [s.input_ids[: s.response_start].tolist() for s in heldout[: args.prompts]]}
    for number, folder in enumerate(args.drafts):
        draft = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)
        vocabulary = drafting_vocabulary(draft, model.get_input_embeddings().weight.shape[0])
        trainer = Trainer(draft, model, heldout, OnlineFeatures(model, draft.target_layer_ids),
                          Path(args.work_dir or "/tmp/flashdraft-evaluate") / f"{number}-{Path(folder).name}",
                          TrainConfig(batch_size=1, eval_max_new_tokens=args.max_new_tokens, max_steps=1,
                                      grad_accum=1),
                          vocabulary=vocabulary, heldout=heldout, eval_prompts=prompts,
                          stop_token_ids=stop_token_ids(model, tokenizer), progress=False)
        result = trainer.evaluate()
        accuracy = " ".join(f"{a:.3f}" for a in result["heldout_accuracy"][:4])
        print(f"{folder}: tau {result['tau'][HELDOUT_SET]:.3f}, held-out loss {result['heldout_loss']:.4f}, "
              f"accuracy {accuracy}", flush=True)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="smollm2-135m-instruct", help="registry name or model folder")
    common.add_argument("--corpus", type=Path, default=REPO / "corpus" / "smollm2-135m-instruct")
    common.add_argument("--heldout-ids", type=Path, help="file of record ids (one a line) never trained on")
    common.add_argument("--device", default="auto", help="torch device (auto: cuda when available)")
    common.add_argument("--max-length", type=int, default=PipelineConfig.max_length)
    common.add_argument("--work-dir", help="checkpoints and caches (default: OUT/work)")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", parents=[common], help="continue a draft on the corpus within a time budget")
    t.add_argument("output", help="folder for final/, mean/ and step-N/ (bfloat16 drafts), float32/ (with the card) "
                   "and reached.txt")
    t.add_argument("--init-draft", required=True, help="draft folder to continue")
    t.add_argument("--exclude-ids", type=Path, action="append", default=[],
                   help="file of record ids not to train on, e.g. corpus/TARGET/draws/*.txt (repeatable)")
    t.add_argument("--seconds", type=float, help="budget from start to the written draft (or give --max-steps)")
    t.add_argument("--step-seconds", type=float, help="seconds a step takes (default: timed by a few probe steps)")
    t.add_argument("--max-steps", type=int, help="train this many steps (at most --epochs), whatever the time")
    t.add_argument("--seed", type=int, default=0, help="data order and anchors: give a new one when continuing a "
                   "run on the same records, or it sees the same records first again")
    t.add_argument("--reserve", type=float, default=30.0, help="seconds kept for writing the drafts")
    t.add_argument("--epochs", type=int, default=4, help="at most this many passes over the records")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    t.add_argument("--grad-accum", type=int, default=2)
    t.add_argument("--num-anchors", type=int, default=128, help="blocks per sequence (the shipped drafts' recipe)")
    t.add_argument("--loss-weights", choices=("decay", "acceptance"), default="acceptance")
    t.add_argument("--loss-chunk", type=int, default=PipelineConfig.loss_chunk,
                   help="positions per pass through the output head (larger is fewer passes; try 16384 on a GPU)")
    t.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="bfloat16",
                   help="the draft's training passes (bfloat16: the shipped drafts' recipe, on a CPU as on a GPU)")
    t.add_argument("--checkpoint-every", type=int, default=10**6, help="trainer checkpoints (default: at the end)")
    t.add_argument("--snapshots", default="0.5,0.75", help="fractions of the steps to write step-N drafts at")
    t.add_argument("--progress", action="store_true", help="show the trainer's progress bar")
    t.add_argument("--no-mean", dest="mean", action="store_false",
                   help="skip OUT/mean, the bfloat16 mean of --init-draft and the final draft")
    t.set_defaults(run=train)
    e = sub.add_parser("evaluate", parents=[common], help="held-out tau, loss and accuracy of drafts")
    e.add_argument("drafts", nargs="+", help="draft folders")
    e.add_argument("--prompts", type=int, default=32, help="held-out prompts to measure tau on")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.set_defaults(run=evaluate)
    args = parser.parse_args(argv)
    if args.command == "train" and not (args.seconds or args.max_steps):
        parser.error("train needs --seconds (a time budget) or --max-steps")
    args.argv = argv
    args.run(args)


if __name__ == "__main__":
    main()
