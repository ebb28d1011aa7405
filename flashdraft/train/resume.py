"""Checkpoints and resume of a training run (a part of `Trainer`): the full training state written atomically with
its checksum every `checkpoint_every` steps, a run resumed from its newest intact checkpoint (damaged ones set
aside, a run with other settings refused), and the way back to it after a step whose loss or gradient norm is not
finite. The checkpoint files themselves are `checkpoints.py`."""


from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoints import (
    CHECKPOINT_DIR,
    CHECKPOINT_FORMAT,
    DamagedCheckpoint,
    checkpoint_step,
    checksum_path,
    python_rng_state,
    read_checkpoint,
    set_python_rng_state,
    write_checkpoint,
)
from .distributed import barrier


def _shown(value) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


class Resumable:
    """The trainer's checkpoints and resume, as a part of `Trainer` (it reads and restores the trainer's draft,
    optimizer, scheduler, step, evaluations and RNG states)."""

    def _save_checkpoint(self, session_seconds: float) -> None:
        """Write the full training state atomically with its checksum file, keep the newest `keep_checkpoints`."""
        if self.dist.is_main:
            state = {
                "format": CHECKPOINT_FORMAT,
                "draft": self.draft.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "step": self.step,
                "elapsed": self.elapsed + session_seconds,
                "rng": {"python": python_rng_state(), "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                "evaluations": self.evaluations,
                "best": self.best,
                "fingerprint": self._fingerprint(),
                "running_accuracy": self.running_accuracy,
            }
            write_checkpoint(state, self.run_dir / CHECKPOINT_DIR, self.step, self.config.keep_checkpoints)
        barrier()

    def _newest_intact(self) -> tuple[dict | None, list[tuple[Path, str]]]:
        """The state of the newest checkpoint that reads back intact (None when the run has none), and the newer
        damaged ones with what is wrong with them. A run whose checkpoints are all damaged is refused."""
        damaged = []
        for path in sorted((self.run_dir / CHECKPOINT_DIR).glob("step-*.pt"), reverse=True):
            try:
                return read_checkpoint(path), damaged
            except DamagedCheckpoint as error:
                damaged.append((path, str(error)))
        if damaged:
            listed = "; ".join(f"{path.name}: {reason}" for path, reason in damaged)
            raise ValueError(
                f"{self.run_dir} has no intact checkpoint to resume from ({listed}): delete "
                f"{self.run_dir / CHECKPOINT_DIR} to train this run from the start, or choose another run folder"
            )
        return None, []

    def _restore(self) -> int | None:
        """Load the newest intact checkpoint (every process reads the same file) and set aside the damaged ones
        after it, so they are neither read again nor counted among the kept checkpoints. Returns its step, None
        when the run has no checkpoint."""
        state, damaged = self._newest_intact()
        if state is None:
            return None
        fingerprint, stored = self._fingerprint(), state["fingerprint"]
        # A key absent from the checkpoint was not recorded by the flashdraft version that wrote it: not a difference.
        changed = sorted(k for k in fingerprint if stored.get(k, fingerprint[k]) != fingerprint[k])
        if changed:
            shown = [f"{key} {_shown(stored[key])} there, {_shown(fingerprint[key])} now" for key in changed
                     if key not in ("sequences", "draft_vocab_ids")]  # lists of thousands: named only
            raise ValueError(
                f"{self.run_dir} holds a run with other settings (differences: {', '.join(changed)})"
                + (f": {'; '.join(shown)}" if shown else "")
                + ". Train this one in another run folder, or resume that run with its own data and settings"
            )
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.elapsed = state["elapsed"]
        self.evaluations = state["evaluations"]
        self.best = state["best"]
        self.running_accuracy = state.get("running_accuracy")  # absent in checkpoints of earlier versions
        set_python_rng_state(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        barrier()  # every process has read before the main one moves files
        for path, reason in damaged:
            aside = path.with_name(path.name + ".damaged")
            self._warn(f"checkpoint step {checkpoint_step(path)} is damaged ({path}: {reason}): resuming from step "
                       f"{self.step}; the damaged file is kept as {aside.name}")
            if self.dist.is_main:
                os.replace(path, aside)
                checksum_path(path).unlink(missing_ok=True)
        return self.step

    def _resume(self) -> None:
        """Continue from the newest intact checkpoint of the run folder, if any."""
        if self._restore() is not None and self.progress:
            tqdm.write(f"resuming {self.run_dir} from step {self.step} of {self.total_steps}")

    def _go_back(self, failure: str) -> None:
        """After a non-finite step: back to the newest intact checkpoint, and on from there. A passing fault does
        not come back; a step that fails a second time (the data or the settings make it diverge) stops the run."""
        failed = self.step + 1
        fix = ("lower the learning rate or the gradient clipping norm, train with a float32 target, or check the "
               "training data and features")
        if self._restore() is None:
            raise ValueError(f"{failure}, and the run has no checkpoint to go back to: {fix}")
        if failed in self.retried:
            raise ValueError(f"{failure} again after resuming from checkpoint step {self.step}: {fix} (the run folder "
                             f"keeps checkpoint step {self.step})")
        self.retried.add(failed)
        self._warn(f"{failure}; resumed from checkpoint step {self.step}")

    def _warn(self, message: str) -> None:
        """What the user must know whether or not progress is shown (once, from the main process)."""
        if self.dist.is_main:
            tqdm.write(message, file=sys.stderr)
