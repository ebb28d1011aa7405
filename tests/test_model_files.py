"""Damaged model files are named, never decoded: drafts, local targets and prepared registry folders."""

import json

import pytest
import torch

from flashdraft.cli import main
from flashdraft.draft import DFlashDraftModel
from flashdraft.models import COMPLETE_MARKER, REGISTRY, load_draft, load_target, prepare, verify_prepared

from tiny import tiny_draft, tiny_target, tiny_tokenizer

NAME = "smollm2-135m-instruct"


@pytest.fixture
def draft_folder(tmp_path):
    target = tiny_target("qwen3")
    folder = tmp_path / "draft"
    tiny_draft(target, num_layers=2, block_size=4).save_pretrained(folder)
    return folder


@pytest.fixture
def target_folder(tmp_path):
    folder = tmp_path / "target"
    tiny_target("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("cut", [0, 7, 0.5])
def test_a_truncated_draft_file_is_named(draft_folder, cut):
    weights = draft_folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(cut * len(data)) if isinstance(cut, float) else cut])
    with pytest.raises(ValueError, match=r"model.safetensors is damaged .* restore the draft folder or train it"):
        load_draft(str(draft_folder))


def test_a_truncated_draft_config_is_named(draft_folder):
    config = draft_folder / "config.json"
    config.write_text(config.read_text()[:40])
    with pytest.raises(ValueError, match=r"config.json is damaged \(not valid JSON"):
        load_draft(str(draft_folder))


def test_weights_beyond_the_config_are_an_error(draft_folder):
    config = json.loads((draft_folder / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 1, config["layer_types"][:1]
    (draft_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"holds weights its config does not describe: layers\.1\..* says 1 layers"):
        load_draft(str(draft_folder))


def test_non_finite_draft_weights_are_refused(tmp_path):
    draft = tiny_draft(tiny_target("qwen3"), num_layers=1, block_size=4)
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("nan")
    draft.save_pretrained(tmp_path / "nan")
    with pytest.raises(ValueError, match=r"weight fc.weight holds NaN or infinite values"):
        DFlashDraftModel.from_pretrained(tmp_path / "nan")


def test_a_huge_block_size_is_refused_before_anything_runs(draft_folder):
    config = json.loads((draft_folder / "config.json").read_text())
    config["block_size"] = 100_000
    (draft_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"block_size must be in 1\.\.256, got 100000"):
        load_draft(str(draft_folder))


def test_a_damaged_local_target_is_named(target_folder):
    weights = target_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"target folder .* could not be read \(SafetensorError"):
        load_target(str(target_folder))


def test_non_finite_target_weights_are_refused(tmp_path):
    model = tiny_target("qwen2")
    with torch.no_grad():
        model.model.norm.weight[3] = float("inf")
    model.save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match=r"model.norm.weight holds NaN or infinite values: restore the target"):
        load_target(str(tmp_path / "t"))


def fake_prepared(home, monkeypatch):
    """A prepared-looking registry folder (tiny weights) under a private FLASHDRAFT_HOME, recorded as converted."""
    monkeypatch.setenv("FLASHDRAFT_HOME", str(home))
    folder = home / "models" / NAME
    tiny_target("llama").save_pretrained(folder)
    marker = {"name": NAME, "gguf_sha256": REGISTRY[NAME].gguf_sha256}
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
    verify_prepared(folder, NAME)  # a folder from before checksums: they are recorded once
    assert "files" in json.loads((folder / COMPLETE_MARKER).read_text())
    return folder


def test_a_prepared_folder_is_verified_and_hashed_again_only_after_a_change(tmp_path, monkeypatch):
    import flashdraft.preparation as preparation

    folder = fake_prepared(tmp_path, monkeypatch)
    assert prepare(NAME) == folder  # a folder prepared before the GGUF's blocks were kept gets them, once
    hashed = []
    real = preparation.file_sha256
    monkeypatch.setattr(preparation, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    assert prepare(NAME) == folder
    assert prepare(NAME) == folder
    assert hashed == []  # unchanged since the last match: stat only
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5000:-4000] = bytes(1000)  # same size, other bytes, a newer modification time
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model folder .* is damaged: model.safetensors does not match the checksum"):
        prepare(NAME)
    assert hashed == ["model.safetensors"]


def test_a_corrupted_prepared_target_stops_generate_in_one_line(tmp_path, monkeypatch, capsys):
    folder = fake_prepared(tmp_path, monkeypatch)
    (folder / "config.json").write_text("{}")
    assert main(["generate", "hi", "--block-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "config.json does not match the checksum recorded when it was prepared. Delete the folder" in err
    assert f"flashdraft models prepare {NAME}" in err and "Traceback" not in err


def test_a_shipped_draft_is_bfloat16_on_disk_and_float32_when_loaded(draft_folder, tmp_path):
    from safetensors import safe_open

    from flashdraft.train.drafts import ship_draft
    (draft_folder / "README.md").write_text("card\n")
    shipped = ship_draft(draft_folder, tmp_path / "shipped")
    with safe_open(str(shipped / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    assert (shipped / "README.md").read_text() == "card\n"
    original, loaded = load_draft(str(draft_folder)), load_draft(str(shipped))
    assert loaded.dtype == torch.float32
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        expected = a.to(torch.bfloat16).to(a.dtype) if a.is_floating_point() else a
        assert torch.equal(b, expected), name
    with pytest.raises(ValueError, match="is the source folder"):
        ship_draft(shipped, shipped)


def test_the_ship_command_records_the_acceptance_check_on_the_written_folder(tmp_path, capsys):
    target = tiny_target("qwen3")
    (tmp_path / "target").mkdir()
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    source = tmp_path / "trained"
    tiny_draft(target, num_layers=2, block_size=4).save_pretrained(source)
    assert main(["draft", "ship", str(tmp_path / "mistyped"), str(tmp_path / "nowhere")]) == 2
    assert "mistyped is not a draft folder: it has no config.json" in capsys.readouterr().err
    # Without training.json naming the target, and no --target: refused before anything is written.
    assert main(["draft", "ship", str(source), str(tmp_path / "unnamed")]) == 2
    assert "give --target" in capsys.readouterr().err and not (tmp_path / "unnamed").exists()
    (source / "training.json").write_text(json.dumps({"target": str(tmp_path / "target")}) + "\n")
    assert main(["draft", "ship", str(source), str(tmp_path / "shipped")]) == 0
    check = json.loads((tmp_path / "shipped" / "acceptance-check.json").read_text())
    assert f"acceptance check on {tmp_path / 'target'}: tau {check['tau']:.2f}" in capsys.readouterr().out
    assert 1.0 <= check["tau"] <= 4.0 and check["block_size"] == 4 and check["max_new_tokens"] == 48
    assert main(["draft", "ship", str(source), str(tmp_path / "unchecked"), "--no-check"]) == 0
    assert (tmp_path / "unchecked" / "model.safetensors").is_file()
    assert not (tmp_path / "unchecked" / "acceptance-check.json").exists()


def test_a_prepared_targets_weights_are_checked_finite_once_and_a_later_nan_fails_its_checksum(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    import flashdraft.models as models

    folder = fake_prepared(tmp_path, monkeypatch)
    tiny_tokenizer().save_pretrained(folder)
    verify_prepared(folder, NAME)  # the tokenizer's files join the checksums
    (folder / COMPLETE_MARKER).write_text(json.dumps({k: v for k, v in json.loads(
        (folder / COMPLETE_MARKER).read_text()).items() if k != "files"}))
    checked = []
    real = models.check_finite
    monkeypatch.setattr(models, "check_finite", lambda *args: checked.append(1) or real(*args))
    load_target(NAME, engine="transformers")
    load_target(NAME, engine="transformers")
    assert checked == [1]  # the second load trusts the first check: the same checksums
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.safetensors does not match the checksum recorded"):
        load_target(NAME, engine="transformers")
