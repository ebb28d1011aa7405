"""The draft trainer: optimisation, checkpoints and resume, evaluation by replayed speculative decoding, the output.

One optimizer step takes a global batch of `batch_size * grad_accum * world_size` training sequences (in a
seeded order that changes every epoch), opens `num_anchors` random blocks in each (`blocks.py`), runs the draft
once per micro-batch over all its blocks and back-propagates the weighted block loss (`loss.py`), normalised by
the weight of the whole global batch, so that accumulation and processes do not change the maths. AdamW, linear
warmup then cosine decay, gradient clipping. The target's embeddings and head are frozen (the draft has none).

A checkpoint (every `checkpoint_every` steps and at the end) holds the draft, optimizer, scheduler, RNG states,
the step (which fixes the data position: epoch and batch follow from it) and the evaluation history. A run
restarted on the same run folder continues from its last checkpoint and ends with the same weights as an
uninterrupted run. Each checkpoint has its size and sha256 in a JSON file beside it and is read without unpickling
objects (`weights_only=True`); a damaged one (truncated, changed, non-finite) is set aside and the run resumes from
the newest intact one. A step whose loss or gradient norm is not finite is not applied: the run goes back to its
newest checkpoint and goes on from there; the same step failing again stops it with an error, so no diverged draft
is ever kept or written.

Every `eval_every` steps the draft's tau on a few held-out prompts is measured by replaying the greedy loop's
rounds on the target's answers (`flashdraft.evaluation.replay`, answers and features computed once) and the best draft
so far (by mean tau) is kept; the output folder receives it in the DFlash checkpoint format with a model card.

Around it: `config.py` (the settings), `evaluate.py` (the evaluation and the best draft kept, part of `Trainer`),
`resume.py` (checkpoints and resume, part of `Trainer`), `checkpoints.py` (the files), `drafts.py` (the draft a run
starts from and the folder it writes).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from ..draft import DFlashDraftModel
from ..evaluation.replay import ReplayText
from ..proposals import check_compatible
from ..target import TargetModel
from .blocks import BlockBatch, TrainingSequence, check_training_block_size, make_blocks, sample_anchors
from .checkpoints import (
    CHECKPOINT_DIR,
    read_checkpoint,
)
from .config import TrainConfig
from .distributed import Distributed, all_reduce_sum
from .drafts import (
    TrainSummary,
    ensure_writable,
    init_from_target,
    save_trained_draft,
    seed_everything,
    start_from_draft,
)
from .evaluate import BEST_DIR, Evaluation
from .features import FeatureSource
from .loss import DraftVocabulary, acceptance_weights, block_loss, block_targets, default_gamma, position_weights
from .resume import Resumable

METRICS_FILE = "metrics.jsonl"
RUNNING_STEPS = 20  # steps the running per-position accuracy averages over (exponentially)

# Re-exported: the trainer's callers find the pieces of a run here.
__all__ = ["BEST_DIR", "CHECKPOINT_DIR", "METRICS_FILE", "TrainConfig", "TrainSummary", "Trainer", "ensure_writable",
           "init_from_target", "read_checkpoint", "save_trained_draft", "seed_everything", "start_from_draft"]


def _lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to zero at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class NonFiniteStep(Exception):
    """An optimizer step whose loss or gradient norm is not finite (it was not applied)."""


class Trainer(Evaluation, Resumable):
    """Trains `draft` for `target` on `sequences`; see the module doc."""

    def __init__(
        self,
        draft: DFlashDraftModel,
        target,  # the frozen transformers causal LM
        sequences: Sequence[TrainingSequence],
        features: FeatureSource,
        run_dir: str | Path,
        config: TrainConfig | None = None,
        *,
        vocabulary: DraftVocabulary | None = None,
        heldout: Sequence[TrainingSequence] = (),
        eval_prompts: Mapping[str, Sequence[Sequence[int]]] | None = None,
        stop_token_ids: Sequence[int] = (),
        distributed: Distributed | None = None,
        progress: bool = True,
    ):
        config = config or TrainConfig()
        self.target = TargetModel(target)
        check_compatible(draft, self.target)
        if draft.config.vocab_size != self.target.vocab_size:
            raise ValueError(
                f"draft was made for a vocabulary of {draft.config.vocab_size} tokens, the target has "
                f"{self.target.vocab_size}: make the draft for this target"
            )
        check_training_block_size(draft.block_size)
        self.sequences = [s for s in sequences if len(s.anchor_positions) > 0]
        if not self.sequences:
            raise ValueError("no training sequence has a response of 2 tokens or more: the training set is empty")
        self.config = config
        self.dist = distributed or Distributed(device=self.target.device)
        self.global_batch = config.batch_size * config.grad_accum * self.dist.world_size
        if len(self.sequences) < self.global_batch:
            raise ValueError(
                f"{len(self.sequences)} training sequences cannot fill one global batch of {self.global_batch} "
                "(batch size x gradient accumulation x processes): add data or lower them"
            )
        self.steps_per_epoch = len(self.sequences) // self.global_batch  # the last partial batch is dropped
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        self.warmup_steps = round(config.warmup_ratio * self.total_steps)
        self.features = features
        self.heldout = [s for s in heldout if len(s.anchor_positions) > 0]
        self.eval_prompts = {name: [list(p) for p in prompts] for name, prompts in (eval_prompts or {}).items()}
        self.stop_token_ids = list(stop_token_ids)
        self._eval_texts: dict[str, list[ReplayText]] | None = None  # built at the first evaluation
        self.progress = progress and self.dist.is_main
        self.run_dir = Path(run_dir)

        self.target.freeze()
        self.draft = draft.to(self.dist.device).train()
        self.vocabulary = vocabulary
        if vocabulary is not None:
            draft.set_draft_vocab(vocabulary.ids)
        # The loss runs through the target's head, restricted to the drafting vocabulary's rows when there is one.
        head = self.target.head_rows(vocabulary.ids.to(self.target.device) if vocabulary is not None else None)
        self.head_weight = head.weight.detach()
        self.head_bias = head.bias.detach() if head.bias is not None else None
        self.gamma = config.gamma or default_gamma(draft.block_size)
        self.position_weights = position_weights(draft.block_size, self.gamma)
        # Per-position accuracy over recent steps (an average over RUNNING_STEPS), for loss_weights="acceptance";
        # until the first step has measured it, the decay weights apply.
        self.running_accuracy: list[float] | None = None
        self.model = draft
        if torch.distributed.is_initialized():
            device_ids = [self.dist.device] if self.dist.device.type == "cuda" else None
            self.model = DistributedDataParallel(draft, device_ids=device_ids)
        parameters = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(  # fused: one kernel for all parameters, ~4x faster on a CPU
            parameters, lr=config.learning_rate, weight_decay=config.weight_decay,
            fused=self.dist.device.type in ("cpu", "cuda"),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: _lr_factor(step, self.warmup_steps, self.total_steps)
        )
        self.step = 0
        self.retried: set[int] = set()  # steps that were not finite once and were retried from a checkpoint
        self.elapsed = 0.0  # seconds of training in earlier sessions of this run
        self.evaluations: list[dict] = []
        self.best: dict | None = None
        if self.dist.is_main:
            state_bytes = sum(p.numel() * p.element_size() for p in parameters) * 3  # weights, Adam's two moments
            ensure_writable(self.run_dir, state_bytes * (config.keep_checkpoints + 2), "checkpoints")
        self._resume()

    # ------------------------------------------------------------------ data order

    def _fingerprint(self) -> dict:
        """What fixes the data order, the loss, the optimisation and the draft's shape: a checkpoint from a run with
        other values cannot be resumed (it would continue that run under this one's label)."""
        config = self.draft.config
        return {
            "sequences": [s.id for s in self.sequences],
            "global_batch": self.global_batch,
            "total_steps": self.total_steps,
            "block_size": self.draft.block_size,
            # The rows the loss scores: another drafting vocabulary would train the resumed steps on another task.
            "draft_vocab_ids": None if self.vocabulary is None else self.vocabulary.ids.tolist(),
            # The draft's weights' shapes and what they read.
            "draft": {"layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                      "intermediate_size": config.intermediate_size, "target_layer_ids": self.draft.target_layer_ids,
                      "mask_token_id": self.draft.mask_token_id},
            # Every trainer setting that changes what the steps train (checkpoint cadence, logging and the loss's
            # chunking do not; how the global batch is split into micro-batches and processes does not either).
            **{item.name: getattr(self.config, item.name) for item in fields(TrainConfig)
               if item.metadata.get("result", True) and item.name not in ("batch_size", "grad_accum")},
        }

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.sequences)))
        random.Random(f"{self.config.seed}:order:{epoch}").shuffle(order)
        return order

    def records_reached(self) -> list[str]:
        """Ids of the sequences the steps taken so far trained on, sorted: what a later run on the same corpus can
        leave out (`--exclude-ids`) to see only new records."""
        epochs, index = divmod(self.step, self.steps_per_epoch)
        if epochs:
            return sorted(s.id for s in self.sequences)
        return sorted(self.sequences[i].id for i in self._epoch_order(0)[: index * self.global_batch])

    def micro_batches(self, step: int) -> tuple[int, list[list[TrainingSequence]]]:
        """(epoch, this process's micro-batches) of optimizer step `step`. The global batch is sorted by length,
        so each micro-batch pads little, and dealt out micro-batch by micro-batch to the processes."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)[index * self.global_batch : (index + 1) * self.global_batch]
        ranked = sorted((self.sequences[i] for i in order), key=lambda s: (len(s), s.id))
        size, world = self.config.batch_size, self.dist.world_size
        micro = [ranked[i : i + size] for i in range(0, len(ranked), size)]
        return epoch, micro[self.dist.rank :: world]

    def _blocks(self, sequences: list[TrainingSequence], epoch: int) -> BlockBatch:
        anchors = [sample_anchors(s, self.config.num_anchors, self.config.seed, epoch) for s in sequences]
        return make_blocks(sequences, anchors, self.draft.block_size, self.draft.mask_token_id)

    # ------------------------------------------------------------------ one step

    def _autocast(self):
        """The target's precision, for what runs the target or the decoding loop (the evaluation's answers and
        replay): the draft's weights stay float32; a target in a lower precision sets the precision of the compute."""
        lower = self.target.dtype != torch.float32
        return torch.autocast(self.dist.device.type, dtype=self.target.dtype, enabled=lower)

    def _training_autocast(self):
        """The precision of the draft's teacher-forced passes (training steps and held-out loss): the target's, or
        `compute_dtype` (bfloat16 on a float32 target: the matrix products run in bfloat16, ~1.6x faster on a CPU
        with native bfloat16 instructions, at the same loss)."""
        if self.config.compute_dtype == "auto":
            return self._autocast()
        dtype = getattr(torch, self.config.compute_dtype)
        return torch.autocast(self.dist.device.type, dtype=dtype, enabled=dtype != torch.float32)

    def _forward(self, model, sequences: list[TrainingSequence], batch: BlockBatch, targets):
        device = self.dist.device
        features = self.features(sequences, batch.context_length).to(device)
        with self._training_autocast():
            hidden = model(
                self.target.embed(batch.block_ids.to(device)),
                features,
                batch.position_ids.to(device),
                attention_mask=batch.attention_mask.to(device),
            )
            return block_loss(
                hidden, targets, self.head_weight, self.head_bias, self.vocabulary, self.draft.block_size,
                self.config.loss_chunk,
            )

    def train_step(self) -> dict:
        """One optimizer step at `self.step`; returns its global statistics."""
        began = time.perf_counter()
        epoch, micro = self.micro_batches(self.step)
        prepared, weights = [], self._position_weights()
        for sequences in micro:
            batch = self._blocks(sequences, epoch)
            targets = block_targets(batch, weights, self.vocabulary, self.config.distill_weight)
            prepared.append((sequences, batch, targets))
        # Normalise by the loss weight of the whole global batch (DDP averages gradients over processes, hence the
        # world size): accumulation and the number of processes leave the gradient unchanged.
        weight = all_reduce_sum(torch.tensor([sum(t.weight_sum for _, _, t in prepared)], dtype=torch.float64,
                                             device=self._reduce_device))
        scale = self.dist.world_size / weight.item() if weight.item() > 0 else 0.0
        positions = self.draft.block_size - 1
        stats = torch.zeros(3 + 2 * positions, dtype=torch.float64)  # loss, blocks, tokens, correct, counted
        for number, (sequences, batch, targets) in enumerate(prepared):
            last = number == len(prepared) - 1
            sync = last or not isinstance(self.model, DistributedDataParallel)
            with nullcontext() if sync else self.model.no_sync():
                output = self._forward(self.model, sequences, batch, targets)
                (output.loss * scale).backward()
            stats[0] += output.loss.item()
            stats[1] += int(batch.valid.sum())
            stats[2] += sum(len(s) for s in sequences)
            stats[3 : 3 + positions] += output.correct
            stats[3 + positions :] += output.counted
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.config.max_grad_norm)
        stats = all_reduce_sum(stats.to(self._reduce_device)).cpu()
        # Both are global (the loss summed, the gradients synchronised), so every process takes the same decision;
        # a non-finite step is not applied, so the weights stay those of the last good step.
        for what, value in (("loss", stats[0].item()), ("gradient norm", float(grad_norm))):
            if not math.isfinite(value):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteStep(f"step {self.step + 1}: the {what} is not finite")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._track_accuracy(stats[3 : 3 + positions], stats[3 + positions :])
        return {
            "step": self.step,
            "loss": stats[0].item() / weight.item() if weight.item() > 0 else 0.0,
            "correct": stats[3 : 3 + positions].long().tolist(),
            "counted": stats[3 + positions :].long().tolist(),
            "blocks": int(stats[1]),
            "tokens": int(stats[2]),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "seconds": time.perf_counter() - began,
        }

    def _position_weights(self) -> torch.Tensor:
        if self.config.loss_weights == "acceptance" and self.running_accuracy is not None:
            return acceptance_weights(self.running_accuracy)
        return self.position_weights

    def _track_accuracy(self, correct: torch.Tensor, counted: torch.Tensor) -> None:
        """Fold one step's global per-position accuracy into the running one (every process holds the same)."""
        measured = torch.where(counted > 0, correct / counted.clamp(min=1), torch.nan)
        if self.running_accuracy is None:
            self.running_accuracy = torch.nan_to_num(measured, nan=0.0).tolist()
            return
        keep = 1.0 - 1.0 / RUNNING_STEPS
        self.running_accuracy = [old if math.isnan(new) else keep * old + (1.0 - keep) * new
                                 for old, new in zip(self.running_accuracy, measured.tolist())]

    @property
    def _reduce_device(self) -> torch.device:
        # gloo reduces CPU tensors, NCCL GPU tensors
        on_gpu = self.dist.device.type == "cuda" and torch.distributed.is_initialized()
        return self.dist.device if on_gpu else torch.device("cpu")

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainSummary:
        """Train until `total_steps` (from the last checkpoint when there is one) and return the summary."""
        session_start = time.perf_counter()
        blocks = tokens = 0
        window: list[dict] = []
        bar = tqdm(total=self.total_steps, initial=self.step, desc="training", unit="step", disable=not self.progress)
        last = None
        while self.step < self.total_steps:
            try:
                last = self.train_step()
            except NonFiniteStep as error:
                self._go_back(str(error))
                window, last = [], None
                bar.reset(total=self.total_steps)
                bar.update(self.step)
                continue
            blocks += last["blocks"]
            tokens += last["tokens"]
            window.append(last)
            if self.step % self.config.log_every == 0 or self.step == self.total_steps:
                self._log(window, bar)
                window = []
            bar.update(1)
            evaluate_now = self.config.eval_every and self.step % self.config.eval_every == 0
            if evaluate_now and self.step < self.total_steps:
                self._evaluate_and_keep()
            if self.step % self.config.checkpoint_every == 0 and self.step < self.total_steps:
                self._save_checkpoint(time.perf_counter() - session_start)
        bar.close()
        evaluated = self.evaluations and self.evaluations[-1]["step"] == self.step
        if (self.eval_prompts or self.heldout) and not evaluated:
            self._evaluate_and_keep()
        session = time.perf_counter() - session_start
        self._save_checkpoint(session)
        final = self._summarise(window or ([last] if last else []))
        return TrainSummary(
            steps=self.step,
            epochs=self.step * self.global_batch / len(self.sequences),
            seconds=self.elapsed + session,
            train_sequences=len(self.sequences),
            blocks_per_second=blocks / session if session > 0 else 0.0,
            tokens_per_second=tokens / session if session > 0 else 0.0,
            final_loss=final.get("loss", float("nan")),
            final_accuracy=final.get("accuracy", []),
            evaluations=list(self.evaluations),
            best=self.best,
        )

    @staticmethod
    def _summarise(window: list[dict]) -> dict:
        """Pool the steps of a logging window: loss averaged over steps, accuracy over all counted positions."""
        if not window:
            return {}
        correct = torch.tensor([w["correct"] for w in window]).sum(0)
        counted = torch.tensor([w["counted"] for w in window]).sum(0)
        seconds = sum(w["seconds"] for w in window)
        return {
            "step": window[-1]["step"],
            "loss": sum(w["loss"] for w in window) / len(window),
            "accuracy": (correct / counted.clamp_min(1)).tolist(),
            "positions": int(counted.sum()),
            "blocks_per_second": sum(w["blocks"] for w in window) / seconds,
            "tokens_per_second": sum(w["tokens"] for w in window) / seconds,
            "lr": window[-1]["lr"],
            "grad_norm": window[-1]["grad_norm"],
        }

    def _log(self, window: list[dict], bar) -> None:
        summary = self._summarise(window)
        if not self.dist.is_main or not summary:
            return
        accuracy = summary["accuracy"]
        bar.set_postfix(
            loss=f"{summary['loss']:.3f}",
            acc="/".join(f"{a:.2f}" for a in accuracy[:4]) + f" mean {sum(accuracy) / len(accuracy):.2f}",
            blocks_s=f"{summary['blocks_per_second']:.0f}",
        )
        self._append_metrics(summary)

    def _append_metrics(self, entry: dict) -> None:
        with (self.run_dir / METRICS_FILE).open("a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def kept_draft(self) -> DFlashDraftModel:
        """The draft to ship: the best evaluated one when evaluations were made, else the current weights."""
        best = self.run_dir / BEST_DIR
        if self.best is not None and best.is_dir():
            return DFlashDraftModel.from_pretrained(best).to(self.dist.device)
        return self.draft
