"""Evaluating a draft while it trains (a part of `Trainer`): every `eval_every` steps its tau on a few held-out
prompts, measured by replaying the greedy loop's rounds on the target's answers (`flashdraft.evaluation.replay`,
answers and features computed once), and its teacher-forced loss and accuracy on held-out sequences; the best
draft so far (by mean tau) is kept in the run folder's `BEST_DIR`."""


from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..evaluation.replay import ReplayText, cached_greedy_answers, replay, replay_text
from ..proposals import DFlashProposer
from ..rules import tau
from .distributed import barrier, broadcast_object
from .drafts import (
    save_draft_atomic,
)
from .loss import block_targets

BEST_DIR = "best"
EVAL_BATCH = 8  # evaluation prompts per batch of target answers
HELDOUT_SEED = -1  # the anchors of held-out sequences are drawn once, the same at every evaluation


class Evaluation:
    """The trainer's evaluation, as a part of `Trainer` (it reads the trainer's draft, target, prompts and run
    folder, and its `_blocks`, `_forward`, `_autocast` and `_append_metrics`)."""

    def eval_texts(self) -> dict[str, list[ReplayText]]:
        """The target's greedy answers to the evaluation prompts, with its features over them: computed once, since
        the target is frozen, so every evaluation costs draft forwards only (the answers are cached across runs in
        $FLASHDRAFT_HOME/answers, like `flashdraft bench --replay`'s)."""
        if self._eval_texts is None:
            self._eval_texts = {}
            with self._autocast():
                for name, prompts in self.eval_prompts.items():
                    answers = cached_greedy_answers(self.target, prompts, self.config.eval_max_new_tokens,
                                                    self.stop_token_ids, EVAL_BATCH, progress=False)
                    self._eval_texts[name] = [replay_text(self.target, self.draft.target_layer_ids, prompt, answer)
                                              for prompt, answer in zip(prompts, answers)]
        return self._eval_texts

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Tau of greedy speculative decoding at the draft's block size on each set of evaluation prompts (pooled
        over the rounds of all prompts), replayed on the target's answers (`flashdraft.evaluation.replay`: the rounds
        of real decoding without its verification forwards), and the teacher-forced loss and per-position accuracy
        on the held-out sequences."""
        self.draft.eval()
        result: dict = {"step": self.step, "tau": {}}
        proposer = DFlashProposer(self.draft, self.target)
        for name, texts in self.eval_texts().items():
            rounds = []
            for text in texts:
                with self._autocast():
                    rounds += replay(proposer, text, self.draft.block_size)
            result["tau"][name] = tau(rounds)
        if self.heldout:
            loss = weight = 0.0
            positions = self.draft.block_size - 1
            correct, counted = torch.zeros(positions, dtype=torch.long), torch.zeros(positions, dtype=torch.long)
            for start in range(0, len(self.heldout), self.config.batch_size):
                sequences = self.heldout[start : start + self.config.batch_size]
                batch = self._blocks(sequences, HELDOUT_SEED)
                targets = block_targets(batch, self.position_weights, self.vocabulary, self.config.distill_weight)
                output = self._forward(self.draft, sequences, batch, targets)
                loss += output.loss.item()
                weight += targets.weight_sum
                correct += output.correct
                counted += output.counted
            result["heldout_loss"] = loss / weight if weight > 0 else 0.0
            result["heldout_accuracy"] = (correct / counted.clamp_min(1)).tolist()
        self.draft.train()
        return result

    def _score(self, evaluation: dict) -> tuple[float, float] | None:
        """Higher is better: mean tau over the prompt sets, else minus the held-out loss; equal taus (the same
        round count) are told apart by the held-out loss."""
        loss = evaluation.get("heldout_loss")
        if evaluation["tau"]:
            return sum(evaluation["tau"].values()) / len(evaluation["tau"]), -loss if loss is not None else 0.0
        if loss is not None:
            return -loss, 0.0
        return None

    def _evaluate_and_keep(self) -> None:
        """Evaluate on the main process and keep the draft when it is the best so far; the others wait."""
        if self.dist.is_main:
            evaluation = self.evaluate()
            score = self._score(evaluation)
            self.evaluations.append(evaluation)
            self._append_metrics({"eval": evaluation})
            keep = score is not None and all(map(math.isfinite, score))  # a NaN would win against nothing, then stay
            if keep and (self.best is None or score > self._score(self.best)):
                self.best = evaluation
                save_draft_atomic(self.draft, self.run_dir / BEST_DIR)
            if self.progress:
                taus = ", ".join(f"{k} {v:.2f}" for k, v in evaluation["tau"].items())
                loss = evaluation.get("heldout_loss", 0.0)
                tqdm.write(f"step {self.step}: tau {taus or '-'}; held-out loss {loss:.3f}")
        self.evaluations, self.best = broadcast_object((self.evaluations, self.best))
        barrier()
