"""Weight averaging of drafts: the exact mean of the sources' parameters, from folders and trainer checkpoints, the
result's config and vocabulary its template's, and clear errors for drafts that cannot be averaged."""

import re

import pytest
import torch

from flashdraft import DFlashDraftModel
from flashdraft.cli import main
from flashdraft.train.averaging import average_drafts
from flashdraft.train.features import OnlineFeatures
from flashdraft.train.trainer import CHECKPOINT_DIR, Trainer
from train.tiny_training import FEATURE_LAYERS, one_thread, pattern_sequences, target_and_draft, tiny_config  # noqa: F401


def saved(draft, folder):
    draft.save_pretrained(folder)
    return folder


def test_the_mean_of_two_folders_with_the_templates_vocabulary(tmp_path):
    _, a = target_and_draft(draft_seed=1)
    _, b = target_and_draft(draft_seed=2)
    a.set_draft_vocab(list(range(10, 50)))
    b.set_draft_vocab(list(range(20, 60)))
    like = DFlashDraftModel.from_pretrained(saved(b, tmp_path / "b"))
    averaged = average_drafts(like, [saved(a, tmp_path / "a"), tmp_path / "b"])
    assert averaged is like
    parameters_a, parameters_b = dict(a.named_parameters()), dict(b.named_parameters())
    for name, parameter in averaged.named_parameters():
        assert torch.allclose(parameter, (parameters_a[name] + parameters_b[name]) / 2, atol=1e-7), name
    assert torch.equal(averaged.draft_vocab_ids, torch.arange(20, 60))
    for name, buffer in b.named_buffers():
        assert torch.equal(dict(averaged.named_buffers())[name], buffer), name


def test_a_trainer_checkpoint_averages_like_its_draft(tmp_path):
    target, draft = target_and_draft(draft_seed=1)
    config = tiny_config(num_anchors=4, batch_size=2, max_steps=3, checkpoint_every=3, learning_rate=3e-3)
    trainer = Trainer(draft, target, pattern_sequences(12), OnlineFeatures(target, FEATURE_LAYERS), tmp_path / "run",
                      config, progress=False)
    trainer.train()
    (checkpoint,) = (tmp_path / "run" / CHECKPOINT_DIR).glob("step-*.pt")
    _, start = target_and_draft(draft_seed=5)
    folder = saved(start, tmp_path / "start")
    averaged = average_drafts(DFlashDraftModel.from_pretrained(folder), [folder, checkpoint, checkpoint])
    trained, first = dict(draft.named_parameters()), dict(start.named_parameters())
    for name, parameter in averaged.named_parameters():
        assert torch.allclose(parameter, (first[name] + 2 * trained[name]) / 3, atol=1e-6), name
    assert not torch.allclose(trained["fc.weight"], first["fc.weight"])  # the two really differ

    checkpoint.write_bytes(checkpoint.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"step-00000003.pt cannot be averaged: it has \d+ bytes where \d+ were"):
        average_drafts(DFlashDraftModel.from_pretrained(folder), [checkpoint])


def test_drafts_of_another_shape_are_refused(tmp_path):
    _, one_layer = target_and_draft(num_layers=1)
    _, two_layers = target_and_draft(num_layers=2)
    with pytest.raises(ValueError, match="lacks parameters of the draft to average into .layers.1"):
        average_drafts(two_layers, [saved(one_layer, tmp_path / "one")])
    target, _ = target_and_draft()
    wider_target = type(target.config)(**{**target.config.to_dict(), "intermediate_size": 40})
    wider = DFlashDraftModel.for_target(wider_target, num_layers=1, block_size=4, mask_token_id=1,
                                        target_layer_ids=FEATURE_LAYERS)
    with pytest.raises(ValueError, match=r"has layers.0.mlp.gate_proj.weight of shape \(40, 32\), the draft to"):
        average_drafts(one_layer, [saved(wider, tmp_path / "wider")])
    with pytest.raises(ValueError, match="nothing to average"):
        average_drafts(one_layer, [])


def test_the_command_writes_a_loadable_averaged_folder(tmp_path, capsys):
    _, a = target_and_draft(draft_seed=1)
    _, b = target_and_draft(draft_seed=2)
    folders = [saved(a, tmp_path / "a"), saved(b, tmp_path / "b")]
    assert main(["draft", "average", str(tmp_path / "out"), *map(str, folders), "--like", str(folders[0])]) == 0
    assert "averaged 2 drafts into" in capsys.readouterr().out
    out = DFlashDraftModel.from_pretrained(tmp_path / "out")
    expected = (a.fc.weight + b.fc.weight) / 2
    assert torch.allclose(out.fc.weight, expected, atol=1e-7)
    assert main(["draft", "average", str(tmp_path / "bad"), str(tmp_path / "missing"), "--like", str(folders[0])]) == 2
    assert re.search("flashdraft draft: error: .*missing", capsys.readouterr().err)
