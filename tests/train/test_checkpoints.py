"""Checkpoints that cannot be trusted and steps that diverge, on tiny models: a damaged checkpoint (truncated, empty,
changed, non-finite) is set aside with a message naming it and the run resumes from the intact one before it, to the
weights of an undamaged run; checkpoints are read without unpickling objects, and those of the previous format are
refused with a clear message; a step whose loss is not finite goes back to the last checkpoint once, then stops;
a draft with non-finite weights is never kept nor written."""

import hashlib
import json
import math
import random

import pytest
import torch

from flashdraft import DFlashDraftModel
from flashdraft.train.features import OnlineFeatures
from flashdraft.train.trainer import BEST_DIR, Trainer, TrainSummary, read_checkpoint, save_trained_draft
from train.test_trainer import make_trainer, weights
from train.tiny_training import FEATURE_LAYERS, one_thread, pattern_sequences, target_and_draft, tiny_config  # noqa: F401

CONFIG = dict(num_anchors=4, batch_size=2, max_steps=6, checkpoint_every=3, learning_rate=3e-3)


def checkpoint(tmp_path, step: int, name: str = "run"):
    return tmp_path / name / "checkpoints" / f"step-{step:08d}.pt"


def rewrite_checksum(path) -> None:
    """What a writer that is not the trainer could do: a checksum file that matches whatever the file holds."""
    data = path.read_bytes()
    record = {"format": 2, "step": int(path.stem.split("-")[1]), "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}
    path.with_suffix(".json").write_text(json.dumps(record))


def with_nan_weight(path) -> None:
    state = torch.load(path, weights_only=True)
    state["draft"]["fc.weight"][0, 0] = float("nan")
    torch.save(state, path)


def truncated(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flipped(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def nan_with_checksum(path):
    with_nan_weight(path)
    rewrite_checksum(path)


DAMAGE = {
    "truncated": (truncated, "bytes where"),
    "empty": (lambda path: path.write_bytes(b""), "it has 0 bytes"),
    "a changed byte": (flipped, "sha256 differs"),
    "NaN weights": (with_nan_weight, "sha256 differs"),
    "NaN weights, checksum rewritten": (nan_with_checksum, "non-finite values (fc.weight)"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(tmp_path, capsys, damage):
    whole = make_trainer(tmp_path, config=tiny_config(**CONFIG))
    whole.train()  # checkpoints at steps 3 and 6
    damage_file, reason = DAMAGE[damage]
    damage_file(checkpoint(tmp_path, 6))
    capsys.readouterr()

    resumed = make_trainer(tmp_path, draft_seed=99, config=tiny_config(**CONFIG))
    err = capsys.readouterr().err
    assert resumed.step == 3
    assert f"checkpoint step 6 is damaged ({checkpoint(tmp_path, 6)}: " in err and reason in err
    assert "resuming from step 3; the damaged file is kept as step-00000006.pt.damaged" in err
    assert checkpoint(tmp_path, 6).with_name("step-00000006.pt.damaged").is_file()
    assert resumed.train().steps == 6
    expected = weights(whole.draft)
    for name, tensor in weights(resumed.draft).items():
        assert torch.equal(tensor, expected[name]), name
    assert read_checkpoint(checkpoint(tmp_path, 6))["step"] == 6  # written again, intact


def test_a_run_without_an_intact_checkpoint_is_refused_and_left_as_it_is(tmp_path):
    make_trainer(tmp_path, config=tiny_config(**CONFIG)).train()
    checkpoint(tmp_path, 6).write_bytes(b"")
    truncated(checkpoint(tmp_path, 3))
    folder = checkpoint(tmp_path, 3).parent
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(ValueError, match=r"no intact checkpoint to resume from \(step-00000006.pt: it has 0 bytes .*"
                                         r"step-00000003.pt: .*\): delete .*checkpoints to train this run from the"):
        make_trainer(tmp_path, config=tiny_config(**CONFIG))
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_a_checkpoint_of_the_previous_format_is_refused_with_a_clear_message(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    # The previous format: pickled with weights_only=False in mind (a tuple RNG state), no checksum file.
    torch.save({"draft": {}, "step": 3, "rng": {"python": random.getstate()}}, folder / "step-00000003.pt")
    with pytest.raises(ValueError, match="step-00000003.pt: it has no checksum file step-00000003.json "
                                         r"\(written by an older flashdraft"):
        make_trainer(tmp_path, config=tiny_config(**CONFIG))


unpickled = []


class Payload:
    """An object whose unpickling runs code: it must never be loaded."""

    def __reduce__(self):
        return unpickled.append, ("code ran",)


def test_checkpoints_are_read_without_unpickling_objects(tmp_path, capsys):
    make_trainer(tmp_path, config=tiny_config(**CONFIG)).train()
    path = checkpoint(tmp_path, 6)
    state = torch.load(path, weights_only=True)
    state["best"] = Payload()
    torch.save(state, path)
    rewrite_checksum(path)  # the checksum cannot tell: the loader must refuse the object itself
    resumed = make_trainer(tmp_path, config=tiny_config(**CONFIG))
    assert unpickled == []
    assert resumed.step == 3
    assert "checkpoint step 6 is damaged" in capsys.readouterr().err


class PoisonedFeatures:
    """Online features that are NaN in the training steps `at` (1-based), the first `times` times each step runs:
    a fault that passes (times=1) or one in the data that comes back (times large)."""

    def __init__(self, target, at, times):
        self.online = OnlineFeatures(target, FEATURE_LAYERS)
        self.left = {step: times for step in at}
        self.trainer = None

    def __call__(self, sequences, context_length):
        features = self.online(sequences, context_length)
        step = self.trainer.step + 1
        if self.trainer.draft.training and self.left.get(step, 0) > 0:
            self.left[step] -= 1
            return features * float("nan")
        return features


def poisoned_trainer(tmp_path, at, times, config):
    target, draft = target_and_draft(draft_seed=1)
    features = PoisonedFeatures(target, at, times)
    trainer = Trainer(draft, target, pattern_sequences(12), features, tmp_path / "run", config,
                      heldout=pattern_sequences(3, seed=5), progress=False)
    features.trainer = trainer
    return trainer


def all_finite(draft) -> bool:
    return all(torch.isfinite(t).all() for t in draft.state_dict().values() if t.is_floating_point())


NAN_CONFIG = dict(CONFIG, max_steps=8, eval_every=2)


def test_a_passing_non_finite_loss_resumes_from_the_last_checkpoint(tmp_path, capsys):
    clean = make_trainer(tmp_path, "clean", config=tiny_config(**NAN_CONFIG), heldout=pattern_sequences(3, seed=5))
    clean_summary = clean.train()
    trainer = poisoned_trainer(tmp_path, at={5}, times=1, config=tiny_config(**NAN_CONFIG))
    summary = trainer.train()
    assert "step 5: the loss is not finite; resumed from checkpoint step 3" in capsys.readouterr().err
    assert summary.steps == 8 and math.isfinite(summary.final_loss)
    expected = weights(clean.draft)
    for name, tensor in weights(trainer.draft).items():
        assert torch.equal(tensor, expected[name]), name
    assert summary.evaluations == clean_summary.evaluations


def test_a_non_finite_loss_that_comes_back_stops_the_run_at_the_last_checkpoint(tmp_path, capsys):
    trainer = poisoned_trainer(tmp_path, at={5}, times=100, config=tiny_config(**NAN_CONFIG))
    with pytest.raises(ValueError, match="step 5: the loss is not finite again after resuming from checkpoint step "
                                         r"3: lower the learning rate.*\(the run folder keeps checkpoint step 3\)"):
        trainer.train()
    assert "step 5: the loss is not finite; resumed from checkpoint step 3" in capsys.readouterr().err
    assert trainer.step == 3 and all_finite(trainer.draft)
    assert read_checkpoint(checkpoint(tmp_path, 3))["step"] == 3
    assert all_finite(DFlashDraftModel.from_pretrained(tmp_path / "run" / BEST_DIR))  # kept at step 2 or 4


def test_a_non_finite_loss_before_the_first_checkpoint_stops_the_run(tmp_path):
    trainer = poisoned_trainer(tmp_path, at={2}, times=1, config=tiny_config(**NAN_CONFIG))
    with pytest.raises(ValueError, match="step 2: the loss is not finite, and the run has no checkpoint to go back"):
        trainer.train()
    assert all_finite(trainer.draft)


def test_a_draft_with_non_finite_weights_is_never_written(tmp_path):
    _, draft = target_and_draft()
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("nan")
    summary = TrainSummary(steps=1, epochs=0.1, seconds=1.0, train_sequences=12, blocks_per_second=0.0,
                           tokens_per_second=0.0, final_loss=float("nan"), final_accuracy=[])
    with pytest.raises(ValueError, match=r"the draft has non-finite weights \(fc.weight\): it is not written"):
        save_trained_draft(draft, tmp_path / "out", summary, {})
    assert not (tmp_path / "out").exists()
