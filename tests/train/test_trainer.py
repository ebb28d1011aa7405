"""The trainer on tiny models: it learns, resumes a killed run to the same weights, accumulates exactly, stores
features offline equal to online ones, evaluates by replayed speculative decoding (equal to the real loop), keeps
the best draft, writes the output folder, and stops bad input before any work."""

import json
import math
import random
import re
import shutil
import time
from collections import namedtuple

import pytest
import torch

import flashdraft
from flashdraft import DFlashDraftModel
from flashdraft.draft import check_draft_folder
from flashdraft.evaluation.replay import greedy_answers
from flashdraft.files import file_sha256
from flashdraft.train import evaluate as evaluate_module
from flashdraft.train import features as features_module
from flashdraft.train import trainer as trainer_module
from flashdraft.train.blocks import TrainingSequence
from flashdraft.train.drafts import earlier_runs, lineage
from flashdraft.train.features import FeatureStore, OnlineFeatures, build_feature_store, check_feature_layers
from flashdraft.train.loss import DraftVocabulary, acceptance_weights
from flashdraft.train.records import TrainingRecord
from flashdraft.train.trainer import (
    TrainConfig,
    Trainer,
    _lr_factor,
    init_from_target,
    save_trained_draft,
    start_from_draft,
)
from train.tiny_training import (  # noqa: F401
    FEATURE_LAYERS,
    MASK,
    VOCAB,
    one_thread,
    pattern_sequences,
    target_and_draft,
    tiny_config,
)


def weights(draft):
    return {name: tensor.detach().clone() for name, tensor in draft.state_dict().items()}


def make_trainer(tmp_path, name="run", *, draft_seed=1, sequences=None, config=None, **kwargs):
    target, draft = target_and_draft(draft_seed=draft_seed)
    sequences = sequences if sequences is not None else pattern_sequences(12)
    config = config or tiny_config(num_anchors=4, batch_size=2, epochs=2, checkpoint_every=3, learning_rate=3e-3,
                                   log_every=2)
    return Trainer(draft, target, sequences, OnlineFeatures(target, FEATURE_LAYERS), tmp_path / name, config,
                   progress=False, **kwargs)


def test_learns_a_pattern(tmp_path):
    config = tiny_config(num_anchors=8, batch_size=4, max_steps=60, learning_rate=1e-2, warmup_ratio=0.1,
                         checkpoint_every=100)
    trainer = make_trainer(tmp_path, sequences=pattern_sequences(64), config=config,
                           heldout=pattern_sequences(8, seed=9))
    before = trainer.evaluate()
    summary = trainer.train()
    after = summary.evaluations[-1]
    assert summary.steps == 60
    assert after["heldout_loss"] < 0.4 * before["heldout_loss"]
    assert min(after["heldout_accuracy"]) > 0.5 > 0.1 > max(before["heldout_accuracy"])
    assert summary.final_accuracy[0] > 0.7


class Killed(Exception):
    pass


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    heldout = pattern_sequences(3, seed=5)
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=10, checkpoint_every=3, eval_every=4,
                         learning_rate=3e-3)
    whole = make_trainer(tmp_path, "whole", config=config, heldout=heldout)
    whole_summary = whole.train()

    class KilledTrainer(Trainer):
        def train_step(self):
            if self.step == 7:
                raise Killed  # dies during step 8, after the checkpoint of step 6
            return super().train_step()

    target, draft = target_and_draft(draft_seed=1)
    killed = KilledTrainer(draft, target, pattern_sequences(12), OnlineFeatures(target, FEATURE_LAYERS),
                           tmp_path / "killed", config, heldout=heldout, progress=False)
    with pytest.raises(Killed):
        killed.train()
    # A new process: other random initial weights, which the checkpoint must replace.
    resumed = make_trainer(tmp_path, "killed", draft_seed=99, config=config, heldout=heldout)
    assert resumed.step == 6
    summary = resumed.train()
    assert summary.steps == 10
    expected = weights(whole.draft)
    for name, tensor in weights(resumed.draft).items():
        assert torch.equal(tensor, expected[name]), name
    assert summary.evaluations == whole_summary.evaluations
    assert [e["step"] for e in summary.evaluations] == [4, 8, 10]


def test_resume_with_other_settings_is_refused(tmp_path):
    make_trainer(tmp_path, config=tiny_config(num_anchors=4, batch_size=2, max_steps=3, checkpoint_every=3)).train()
    with pytest.raises(ValueError, match="other settings.*global_batch"):
        make_trainer(tmp_path, config=tiny_config(num_anchors=4, batch_size=3, max_steps=3))


def test_resume_with_another_drafting_vocabulary_is_refused(tmp_path):
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=3, checkpoint_every=3)
    make_trainer(tmp_path, config=config, vocabulary=DraftVocabulary.from_ids(range(40), VOCAB)).train()
    assert make_trainer(tmp_path, config=config, vocabulary=DraftVocabulary.from_ids(range(40), VOCAB)).step == 3
    with pytest.raises(ValueError, match=r"other settings \(differences: draft_vocab_ids\)"):
        make_trainer(tmp_path, config=config, vocabulary=DraftVocabulary.from_ids(range(1, 41), VOCAB))
    with pytest.raises(ValueError, match=r"other settings \(differences: draft_vocab_ids\)"):
        make_trainer(tmp_path, config=config)


def test_checkpoint_of_an_earlier_version_without_the_vocabulary_key_resumes(tmp_path):
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=3, checkpoint_every=3)
    make_trainer(tmp_path, config=config).train()
    (path,) = (tmp_path / "run" / trainer_module.CHECKPOINT_DIR).glob("step-*.pt")
    state = torch.load(path, weights_only=True)
    del state["fingerprint"]["draft_vocab_ids"]
    torch.save(state, path)
    record = path.with_suffix(".json")  # its checksum file, as that version wrote it for these bytes
    record.write_text(json.dumps({**json.loads(record.read_text()), "bytes": path.stat().st_size,
                                  "sha256": file_sha256(path)}))
    assert make_trainer(tmp_path, config=config).step == 3
    with pytest.raises(ValueError, match=r"other settings \(differences: global_batch\)"):
        make_trainer(tmp_path, config=tiny_config(num_anchors=4, batch_size=3, max_steps=3))

def test_acceptance_loss_weights_follow_the_running_accuracy_and_resume(tmp_path):
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=6, checkpoint_every=3, learning_rate=3e-3,
                         loss_weights="acceptance")
    trainer = make_trainer(tmp_path, config=config)
    assert torch.equal(trainer._position_weights(), trainer.position_weights)  # nothing measured yet: the decay
    seen = []
    original = trainer_module.block_targets

    def recording(batch, weights, *args):
        seen.append((weights.clone(), trainer.running_accuracy))
        return original(batch, weights, *args)

    trainer_module.block_targets = recording
    try:
        summary = trainer.train()
    finally:
        trainer_module.block_targets = original
    assert summary.steps == 6 and len(seen) == 6 and len(trainer.running_accuracy) == trainer.draft.block_size - 1
    assert seen[0][1] is None and torch.equal(seen[0][0], trainer.position_weights)
    for weights_used, running in seen[1:]:
        assert torch.equal(weights_used, acceptance_weights(running))
    assert [running for _, running in seen[1:]] != [seen[1][1]] * 5  # the accuracy moves, and the weights with it
    # the running accuracy is part of the checkpoint: a resumed run weighs its next step as the whole one does
    resumed = make_trainer(tmp_path, config=config)
    assert resumed.step == 6 and resumed.running_accuracy == trainer.running_accuracy


def test_decay_loss_weights_never_change(tmp_path):
    trainer = make_trainer(tmp_path, config=tiny_config(num_anchors=4, batch_size=2, max_steps=2))
    trainer.train()
    assert trainer.running_accuracy is not None
    assert torch.equal(trainer._position_weights(), trainer.position_weights)


def test_gradient_accumulation_equals_a_bigger_batch(tmp_path):
    big = make_trainer(tmp_path, "big", config=tiny_config(num_anchors=4, batch_size=4, max_steps=2))
    accumulated = make_trainer(tmp_path, "acc", config=tiny_config(num_anchors=4, batch_size=1, grad_accum=4,
                                                                   max_steps=2))
    big.train()
    accumulated.train()
    expected = weights(big.draft)
    for name, tensor in weights(accumulated.draft).items():
        assert torch.allclose(tensor, expected[name], atol=1e-5), name


def test_each_epoch_sees_every_sequence_once_in_a_new_order(tmp_path):
    trainer = make_trainer(tmp_path, config=tiny_config(num_anchors=4, batch_size=2, epochs=2))
    assert trainer.steps_per_epoch == 6 and trainer.total_steps == 12
    epochs = {0: [], 1: []}
    for step in range(12):
        epoch, micro = trainer.micro_batches(step)
        epochs[epoch] += [s.id for batch in micro for s in batch]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(s.id for s in trainer.sequences)
    assert epochs[0] != epochs[1]


def test_learning_rate_warms_up_then_decays_to_zero():
    assert _lr_factor(0, 4, 100) == 0.25 and _lr_factor(3, 4, 100) == 1.0
    assert math.isclose(_lr_factor(52, 4, 100), 0.5)
    assert _lr_factor(100, 4, 100) == 0.0
    assert _lr_factor(0, 0, 10) == 1.0


@pytest.mark.parametrize("dtype,tolerance", [("float32", 0.0), ("float16", 2e-2), ("bfloat16", 1e-1)])
def test_offline_features_equal_online_ones(tmp_path, dtype, tolerance):
    target, _ = target_and_draft()
    sequences = pattern_sequences(5)
    online = OnlineFeatures(target, FEATURE_LAYERS)
    store = build_feature_store(target, sequences, tmp_path / "features", FEATURE_LAYERS, dtype=dtype, batch_size=2,
                                progress=False)
    for context in (3, 10, 40):
        expected = online(sequences, context)
        stored = store(sequences, context)
        assert stored.shape == expected.shape == (5, context, 64)
        assert (stored - expected).abs().max() <= tolerance + 1e-6


def test_feature_store_resumes_after_a_kill_and_refuses_other_data(tmp_path, monkeypatch):
    target, _ = target_and_draft()
    sequences = pattern_sequences(7)
    real = features_module.extract_features
    calls = []

    def dies_on_third_batch(*args):
        calls.append(1)
        if len(calls) == 3:
            raise Killed
        return real(*args)

    monkeypatch.setattr(features_module, "extract_features", dies_on_third_batch)
    with pytest.raises(Killed):
        build_feature_store(target, sequences, tmp_path / "f", FEATURE_LAYERS, dtype="float32", batch_size=2,
                            progress=False)
    with pytest.raises(ValueError, match="incomplete"):
        FeatureStore(tmp_path / "f")
    monkeypatch.setattr(features_module, "extract_features", real)
    store = build_feature_store(target, sequences, tmp_path / "f", FEATURE_LAYERS, dtype="float32", batch_size=2,
                                progress=False)
    assert torch.allclose(store(sequences, 20), OnlineFeatures(target, FEATURE_LAYERS)(sequences, 20), atol=1e-6)
    with pytest.raises(ValueError, match="other data"):
        build_feature_store(target, pattern_sequences(7, seed=3), tmp_path / "f", FEATURE_LAYERS, dtype="float32",
                            progress=False)


def test_a_new_store_copies_the_sequences_an_older_store_holds_and_computes_only_the_rest(tmp_path, monkeypatch):
    target, _ = target_and_draft()
    old, grown = pattern_sequences(6), pattern_sequences(6) + pattern_sequences(3, seed=5)
    build_feature_store(target, old, tmp_path / "old", FEATURE_LAYERS, dtype="float32", batch_size=2, progress=False)
    build_feature_store(target, pattern_sequences(4, seed=9), tmp_path / "other-data", FEATURE_LAYERS,
                        dtype="float32", progress=False)
    build_feature_store(target, old, tmp_path / "other-dtype", FEATURE_LAYERS, dtype="float16", progress=False)
    real, computed = features_module.extract_features, []

    def counting(model, ids, layers):
        computed.extend(len(row) for row in ids)
        return real(model, ids, layers)

    monkeypatch.setattr(features_module, "extract_features", counting)
    reuse = [tmp_path / "missing", tmp_path / "other-dtype", tmp_path / "other-data", tmp_path / "old"]
    store = build_feature_store(target, grown, tmp_path / "new", FEATURE_LAYERS, dtype="float32", batch_size=2,
                                progress=False, reuse=reuse)
    assert sorted(computed) == sorted(len(s) for s in grown[6:])  # only the three new sequences ran the target
    assert torch.allclose(store(grown, 40), OnlineFeatures(target, FEATURE_LAYERS)(grown, 40), atol=1e-6)
    assert json.loads((tmp_path / "new" / "progress.json").read_text())["seeded"] == sorted(s.id for s in old)

    computed.clear()  # every sequence held by an older store: nothing to compute, and the store is complete
    store = build_feature_store(target, old[:4], tmp_path / "subset", FEATURE_LAYERS, dtype="float32",
                                progress=False, reuse=[tmp_path / "new"])
    assert computed == [] and torch.equal(store(old[:4], 40), FeatureStore(tmp_path / "old")(old[:4], 40))


def test_a_new_store_copies_the_finished_batches_of_an_interrupted_one(tmp_path, monkeypatch):
    target, _ = target_and_draft()
    old = pattern_sequences(7)
    real, computed, kill_after = features_module.extract_features, [], [4]  # two batches of two, then a kill

    def counting(model, ids, layers):
        if len(computed) == kill_after[0]:
            raise Killed
        computed.extend(len(row) for row in ids)
        return real(model, ids, layers)

    monkeypatch.setattr(features_module, "extract_features", counting)
    with pytest.raises(Killed):
        build_feature_store(target, old, tmp_path / "old", FEATURE_LAYERS, dtype="float32", batch_size=2,
                            progress=False)
    written = FeatureStore(tmp_path / "old", partial=True).written
    assert len(written) == 4  # the shortest four: the plan sorts by length
    assert sorted(len(s) for s in old if s.id in written) == sorted(computed)

    computed.clear()
    kill_after[0] = None
    grown = old + pattern_sequences(2, seed=5)
    store = build_feature_store(target, grown, tmp_path / "new", FEATURE_LAYERS, dtype="float32", batch_size=2,
                                progress=False, reuse=[tmp_path / "old"])
    assert sorted(computed) == sorted(len(s) for s in grown if s.id not in written)
    assert torch.allclose(store(grown, 40), OnlineFeatures(target, FEATURE_LAYERS)(grown, 40), atol=1e-6)
    with pytest.raises(ValueError, match="has no features"):  # a partial store never hands out unwritten rows
        FeatureStore(tmp_path / "old", partial=True)([s for s in old if s.id not in written], 10)


def test_the_held_out_records_of_a_grown_corpus_are_never_ones_the_smaller_corpus_trained_on():
    from flashdraft.train.pipeline import split_heldout

    corpus = pattern_sequences(40)
    train, heldout = split_heldout(corpus, 5, seed=0)
    assert len(heldout) == 5 and {s.id for s in train} | {s.id for s in heldout} == {s.id for s in corpus}
    assert [s.id for s in split_heldout(list(reversed(corpus)), 5, seed=0)[1]] == [s.id for s in reversed(heldout)]
    grown = corpus + pattern_sequences(200, seed=1)
    _, grown_heldout = split_heldout(grown, 5, seed=0)
    assert not {s.id for s in grown_heldout} & {s.id for s in train}
    assert {s.id for s in grown_heldout} != {s.id for s in heldout}  # the new records displaced some
    assert {s.id for s in split_heldout(corpus, 5, seed=1)[1]} != {s.id for s in heldout}


def test_a_feature_store_that_another_run_is_building_is_refused(tmp_path, monkeypatch):
    from flashdraft.train.records import exclusive

    monkeypatch.setattr(features_module, "LOCK_WAIT_SECONDS", 0.2)
    target, _ = target_and_draft()
    with exclusive(tmp_path / "store" / ".lock", "held by the test"):
        with pytest.raises(ValueError, match="another run is computing the features in .*store: wait for it"):
            build_feature_store(target, pattern_sequences(4), tmp_path / "store", FEATURE_LAYERS, progress=False)
    assert not (tmp_path / "store" / "meta.json").exists()


def test_a_run_beside_one_that_holds_the_store_briefly_waits_for_it(tmp_path, monkeypatch):
    import threading

    from flashdraft.train.records import exclusive

    monkeypatch.setattr(features_module, "LOCK_WAIT_SECONDS", 10.0)
    target, _ = target_and_draft()
    held, release = threading.Event(), threading.Event()

    def hold():
        with exclusive(tmp_path / "store" / ".lock", "held by the test"):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    threading.Timer(0.5, release.set).start()  # the other run lets go a moment later
    began = time.monotonic()
    store = build_feature_store(target, pattern_sequences(4), tmp_path / "store", FEATURE_LAYERS, progress=False)
    holder.join()
    assert time.monotonic() - began >= 0.4 and len(store.index) == 4  # it waited, then built


def test_trains_from_an_offline_store_like_online(tmp_path):
    target, _ = target_and_draft()
    sequences = pattern_sequences(12)
    store = build_feature_store(target, sequences, tmp_path / "f", FEATURE_LAYERS, dtype="float32", progress=False)
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=3)
    online = make_trainer(tmp_path, "online", config=config)
    target2, draft2 = target_and_draft()
    offline = Trainer(draft2, target2, sequences, store, tmp_path / "offline", config, progress=False)
    online.train()
    offline.train()
    expected = weights(online.draft)
    for name, tensor in weights(offline.draft).items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name


def test_evaluates_by_speculative_decoding_keeps_the_best_and_writes_the_output(tmp_path):
    sequences = pattern_sequences(12)
    vocabulary, coverage = DraftVocabulary.most_frequent(sequences, 40, VOCAB)
    prompts = {"pattern": [s.input_ids[: s.response_start + 1].tolist() for s in pattern_sequences(2, seed=7)]}
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=6, eval_every=2, eval_max_new_tokens=8)
    trainer = make_trainer(tmp_path, sequences=sequences, config=config, vocabulary=vocabulary,
                           eval_prompts=prompts, heldout=pattern_sequences(2, seed=8))
    summary = trainer.train()
    assert [e["step"] for e in summary.evaluations] == [2, 4, 6]
    taus = [e["tau"]["pattern"] for e in summary.evaluations]
    assert all(1.0 <= tau <= 4.0 for tau in taus)
    assert summary.best["tau"]["pattern"] == max(taus)
    kept = trainer.kept_draft()
    assert torch.equal(kept.draft_vocab_ids, vocabulary.ids)
    card = {"target": "tiny-llama", "data": {"pattern": {"sequences": 12, "tokens": 200}},
            "labels": "the target's own responses", "command": "flashdraft train --target tiny"}
    output = save_trained_draft(kept, tmp_path / "out", summary, card)
    check_draft_folder(output)
    loaded = DFlashDraftModel.from_pretrained(output)
    assert torch.equal(loaded.draft_vocab_ids, vocabulary.ids)
    readme = (output / "README.md").read_text()
    for text in ("tiny-llama", "flashdraft train --target tiny", f"pattern: tau {max(taus):.2f}", "steps: 6",
                 "40 most frequent"):
        assert text in readme, text
    # The learning curve: every evaluation, its step, the sequences seen (2 a step) and its figures.
    losses = [e["heldout_loss"] for e in summary.evaluations]
    rows = [f"| {step} | {2 * step} | {tau:.2f} | {loss:.3f} |" for step, tau, loss in zip((2, 4, 6), taus, losses)]
    curve = readme.split("## Learning curve")[1].split("## Reproduce")[0]
    assert "Training on 12 sequences; one step is 2.0 of them." in curve
    assert "| step | sequences seen | tau pattern | held-out loss |" in curve
    assert [line for line in curve.splitlines() if line.startswith("| ") and line[2].isdigit()] == rows
    assert json.loads((output / "training.json").read_text())["summary"]["steps"] == 6


def test_a_continued_draft_keeps_the_runs_behind_the_draft_it_started_from(tmp_path):
    first = {"runs": [{"what": "v1: a new draft", "command": "flashdraft train -o v1"}], "what": "v2: v1 again",
             "command": "flashdraft train -o v2 --init-draft v1", "summary": {"steps": 7, "train_sequences": 30},
             "data": {"chat": {"sequences": 30, "tokens": 900}}, "target": "tiny", "labels": "not a run's own"}
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "training.json").write_text(json.dumps(first))
    runs = lineage(tmp_path / "v2")
    assert runs == [first["runs"][0], {key: first[key] for key in ("what", "command", "summary", "data")}]
    card = earlier_runs(runs)
    assert card[1] == "## Earlier runs"
    assert card[-2:] == ["1. v1: a new draft; `flashdraft train -o v1`",
                         "2. v2: v1 again; 7 steps over 30 sequences: `flashdraft train -o v2 --init-draft v1`"]
    # A run's own record without "what" is named by the folder it was continued from.
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "training.json").write_text(json.dumps({"command": "flashdraft train -o plain"}))
    assert lineage(tmp_path / "plain") == [{"command": "flashdraft train -o plain",
                                            "what": "the draft continued from (plain)"}]
    assert lineage(tmp_path) == [] and earlier_runs([]) == []  # no training.json: a draft made elsewhere
    (tmp_path / "plain" / "training.json").write_text("{not json")
    with pytest.raises(ValueError, match="training.json is not valid JSON .*: fix or remove it"):
        lineage(tmp_path / "plain")


def test_equal_taus_keep_the_draft_with_the_lower_heldout_loss(tmp_path):
    scripted = {2: (2.0, 1.0), 4: (2.0, 0.8), 6: (1.9, 0.5), 8: (2.0, float("nan"))}

    class Scripted(Trainer):
        def evaluate(self):
            tau, loss = scripted[self.step]
            return {"step": self.step, "tau": {"p": tau}, "heldout_loss": loss}

    target, draft = target_and_draft(draft_seed=1)
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=8, eval_every=2, checkpoint_every=100)
    trainer = Scripted(draft, target, pattern_sequences(12), OnlineFeatures(target, FEATURE_LAYERS), tmp_path / "run",
                       config, progress=False)
    assert trainer.train().best["step"] == 4

def test_init_from_target_copies_the_last_layers():
    target, draft = target_and_draft(num_layers=2)
    copied = init_from_target(draft, target)
    assert copied == 2 * 9 + 1  # q k v o, gate up down, two layer norms per layer; the final norm
    assert torch.equal(draft.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    assert torch.equal(draft.layers[0].self_attn.q_proj.weight, target.model.layers[2].self_attn.q_proj.weight)
    assert torch.equal(draft.layers[0].self_attn.q_norm.weight, torch.ones(8))


def test_a_draft_grown_by_a_layer_starts_computing_what_the_smaller_one_did():
    target, small = target_and_draft(num_layers=1)
    _, grown = target_and_draft(num_layers=3, draft_seed=5)
    init_from_target(grown, target)
    assert start_from_draft(grown, small) == 2
    for name, tensor in small.state_dict().items():  # the earlier draft's weights, its layer first
        assert torch.equal(grown.state_dict()[name], tensor), name
    assert torch.equal(grown.layers[2].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    assert not grown.layers[1].self_attn.o_proj.weight.any() and not grown.layers[2].mlp.down_proj.weight.any()
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(1, 4, small.config.hidden_size, generator=generator)
    context = torch.randn(1, 5, len(FEATURE_LAYERS) * small.config.hidden_size, generator=generator)
    positions = torch.arange(9)[None]
    with torch.no_grad():
        assert torch.equal(grown(noise, context, positions), small(noise, context, positions))
    with pytest.raises(ValueError, match="a draft of 3 layers cannot start a draft of 1"):
        start_from_draft(small, grown)


# ---------------------------------------------------------------- bad input, before any work


def test_draft_for_another_target_is_refused(tmp_path):
    target, _ = target_and_draft()
    other = target_and_draft()[1]
    other.config.num_target_layers = 6
    with pytest.raises(ValueError, match="6 layers, target has 4"):
        Trainer(other, target, pattern_sequences(4), OnlineFeatures(target, FEATURE_LAYERS), tmp_path / "r",
                progress=False)
    wide = DFlashDraftModel.for_target(target.config, num_layers=1, block_size=4, mask_token_id=MASK,
                                       target_layer_ids=FEATURE_LAYERS)
    wide.config.vocab_size = 100
    with pytest.raises(ValueError, match="vocabulary of 100"):
        Trainer(wide, target, pattern_sequences(4), OnlineFeatures(target, FEATURE_LAYERS), tmp_path / "r",
                progress=False)


@pytest.mark.parametrize("attn", ["eager", "sliding"])
def test_eager_and_sliding_window_drafts_train(tmp_path, attn):
    """Eager attention gets the block mask as additive scores; a sliding window wider than every sequence cuts
    nothing, so both train to the same weights as the sdpa full-attention draft."""
    trainers = [make_trainer(tmp_path, name) for name in ("sdpa", attn)]
    draft = trainers[1].draft
    if attn == "eager":
        draft.config._attn_implementation = "eager"
    else:
        draft.config.sliding_window = 1000
        draft.config.layer_types = ["sliding_attention"] * len(draft.layers)
        for layer in draft.layers:
            layer.self_attn.sliding_window = 1000
    for trainer in trainers:
        trainer.train()
    expected = weights(trainers[0].draft)
    for name, tensor in weights(trainers[1].draft).items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4)


def test_feature_layers_beyond_the_target_are_refused():
    with pytest.raises(ValueError, match=r"feature layers \[5\] do not exist: the target has 4 layers"):
        check_feature_layers([1, 5], 4)
    with pytest.raises(ValueError, match="repeat"):
        check_feature_layers([1, 1], 4)
    target, _ = target_and_draft()
    with pytest.raises(ValueError, match="do not exist"):
        OnlineFeatures(target, [0, 4])


def test_empty_training_set_is_refused(tmp_path):
    with pytest.raises(ValueError, match="training set is empty"):
        make_trainer(tmp_path, sequences=[])
    too_short = pattern_sequences(4, min_length=2, max_length=2)
    with pytest.raises(ValueError, match="training set is empty"):
        make_trainer(tmp_path, sequences=[s for s in too_short if len(s.anchor_positions) == 0])
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        make_trainer(tmp_path, sequences=pattern_sequences(3), config=tiny_config(batch_size=4))


def test_unwritable_or_full_run_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(ValueError, match="cannot write the checkpoints"):
        make_trainer(tmp_path, "file/run")
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 1000))
    with pytest.raises(ValueError, match="GB free but the checkpoints need"):
        make_trainer(tmp_path)
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 1000))
    target, _ = target_and_draft()
    with pytest.raises(ValueError, match="GB free but the features need"):
        build_feature_store(target, pattern_sequences(3), tmp_path / "f", FEATURE_LAYERS, progress=False)
    assert not (tmp_path / "f" / "meta.json").exists()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--num-anchors must be at least 1, got 0"):
        TrainConfig(num_anchors=0)
    with pytest.raises(ValueError, match="--max-steps must be at least 1, got 0"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match="--lr must be above 0, got 0"):
        TrainConfig(learning_rate=0)
    with pytest.raises(ValueError, match="distill_weight"):
        TrainConfig(distill_weight=1.5)
    with pytest.raises(ValueError, match=re.escape("--warmup-ratio must be in [0, 1), got 1.0")):
        TrainConfig(warmup_ratio=1.0)
    with pytest.raises(ValueError, match="loss_weights must be one of decay, acceptance"):
        TrainConfig(loss_weights="uniform")


def test_cleanup_of_old_checkpoints(tmp_path):
    trainer = make_trainer(tmp_path, config=tiny_config(num_anchors=4, batch_size=2, max_steps=7, checkpoint_every=2,
                                                        keep_checkpoints=2))
    trainer.train()
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept == ["step-00000006.json", "step-00000006.pt", "step-00000007.json", "step-00000007.pt"]


def test_a_bfloat16_target_trains_a_float32_draft_under_autocast(tmp_path):
    target, draft = target_and_draft()
    target = target.to(torch.bfloat16)
    before = weights(draft)
    trainer = Trainer(draft, target, pattern_sequences(8), OnlineFeatures(target, FEATURE_LAYERS), tmp_path / "r",
                      tiny_config(num_anchors=4, batch_size=2, max_steps=2), eval_prompts={"p": [[5, 6, 7, 8]]},
                      progress=False)
    summary = trainer.train()
    assert math.isfinite(summary.final_loss)
    assert summary.evaluations[-1]["tau"]["p"] >= 1.0
    assert all(t.dtype == torch.float32 for t in draft.parameters())
    assert not torch.equal(weights(draft)["fc.weight"], before["fc.weight"])


def test_evaluation_tau_is_the_tau_of_real_decoding(tmp_path):
    target, _ = target_and_draft()
    rng = random.Random(0)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(40)]
    answers = greedy_answers(target, prompts, 24, stop_ids=[], progress=False)
    sequences = [TrainingSequence.from_record(TrainingRecord(id=f"s{i}", source="own", input_ids=p + a,
                                                             response_start=len(p)), max_length=64)
                 for i, (p, a) in enumerate(zip(prompts, answers))]
    config = tiny_config(num_anchors=8, batch_size=4, max_steps=60, learning_rate=1e-2, eval_max_new_tokens=24,
                         checkpoint_every=100)
    trainer = make_trainer(tmp_path, sequences=sequences[:36], config=config, eval_prompts={"own": prompts[36:]})
    trainer.train()
    rounds = []
    for prompt in prompts[36:]:
        rounds += flashdraft.generate(trainer.target, trainer.draft, prompt, max_new_tokens=24,
                                      block_size=trainer.draft.block_size, proposals="dflash").acceptance_lengths
    tau = trainer.evaluate()["tau"]["own"]
    assert tau > 1.2  # a draft that learnt something, so the comparison is not between two runs of ones
    assert tau == pytest.approx(sum(rounds) / len(rounds))


def _record_precisions(monkeypatch):
    """The autocast precision each teacher-forced pass computes its loss under (None: off), and whether autocast was
    on in each replay of the evaluation."""
    seen = {"loss_autocast": set(), "replay_autocast": set()}
    block_loss, replay = trainer_module.block_loss, evaluate_module.replay

    def recording_loss(hidden, *args, **kwargs):
        on = torch.is_autocast_enabled("cpu")
        seen["loss_autocast"].add(torch.get_autocast_dtype("cpu") if on else None)
        return block_loss(hidden, *args, **kwargs)

    def recording_replay(*args, **kwargs):
        seen["replay_autocast"].add(torch.is_autocast_enabled("cpu"))
        return replay(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "block_loss", recording_loss)
    monkeypatch.setattr(evaluate_module, "replay", recording_replay)
    return seen


@pytest.mark.parametrize("compute_dtype", ["auto", "float32", "bfloat16"])
def test_a_float32_targets_draft_trains_in_the_compute_dtype_and_evaluates_in_float32(tmp_path, monkeypatch,
                                                                                    compute_dtype):
    seen = _record_precisions(monkeypatch)
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=3, compute_dtype=compute_dtype)
    trainer = make_trainer(tmp_path, config=config, eval_prompts={"p": [[5, 6, 7, 8]]},
                           heldout=pattern_sequences(2, seed=8))
    summary = trainer.train()
    assert seen["loss_autocast"] == {torch.bfloat16 if compute_dtype == "bfloat16" else None}
    assert seen["replay_autocast"] == {False}  # the decoding loop's precision is the target's
    assert all(t.dtype == torch.float32 for t in trainer.draft.parameters())
    assert math.isfinite(summary.final_loss) and summary.evaluations[-1]["tau"]["p"] >= 1.0


def test_bfloat16_compute_takes_the_steps_float32_takes_up_to_its_rounding(tmp_path):
    runs = {}
    for compute_dtype in ("float32", "bfloat16"):
        config = tiny_config(num_anchors=4, batch_size=2, max_steps=3, compute_dtype=compute_dtype)
        trainer = make_trainer(tmp_path, compute_dtype, config=config)
        before = weights(trainer.draft)
        runs[compute_dtype] = (trainer.train(), before, weights(trainer.draft))
    (exact, start, end), (rounded, _, rounded_end) = runs["float32"], runs["bfloat16"]
    assert rounded.final_loss == pytest.approx(exact.final_loss, rel=0.02)
    assert rounded.final_loss != exact.final_loss  # the passes did run in bfloat16
    for name in ("fc.weight", "layers.0.mlp.down_proj.weight"):
        step, rounded_step = end[name] - start[name], rounded_end[name] - start[name]
        assert torch.nn.functional.cosine_similarity(step.flatten(), rounded_step.flatten(), dim=0) > 0.95, name


def test_an_unknown_compute_dtype_is_refused():
    with pytest.raises(ValueError, match="compute_dtype must be one of auto, float32, bfloat16, not 'float16'"):
        TrainConfig(compute_dtype="float16")
