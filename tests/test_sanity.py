"""The load-time check of a local target folder (`flashdraft.sanity`): a damaged model is refused, naming the folder
and what looked wrong, instead of answering garbage with exit 0; a working one (a random tiny model included)
loads. And files of a saved model are readable as their folder is."""

import json
import math
import random
import shutil

import pytest
import torch

from flashdraft.files import readable_as_folder
from flashdraft.models import REGISTRY, load_target
from flashdraft.sanity import LOSS_MARGIN, UNIFORM_MARGIN, check_target_loss

from tiny import tiny_draft, tiny_target, tiny_tokenizer


def test_a_loss_within_the_bounds_passes():
    check_target_loss(3.6, 49152, "/models/x", ("smollm2-135m-instruct", 3.59))
    check_target_loss(math.log(96) + 0.5, 96, "/models/tiny")  # a random model guesses about uniformly


@pytest.mark.parametrize("loss, reference, words", [
    (float("nan"), None, ["non-finite values (nan)"]),
    (3.59 + LOSS_MARGIN + 0.01, ("smollm2-135m-instruct", 3.59),
     ["architecture of smollm2-135m-instruct", "(loss 5.60 nats per token, smollm2-135m-instruct: 3.59)",
      "rope_theta"]),
    (math.log(96) + UNIFORM_MARGIN + 0.01, None, ["far worse than guessing at random"]),
])
def test_a_loss_beyond_a_bound_is_refused_naming_the_folder_and_what_is_wrong(loss, reference, words):
    with pytest.raises(ValueError) as caught:
        check_target_loss(loss, 96, "/models/x", reference)
    message = str(caught.value)
    assert message.startswith("target /models/x ") and "restore its weights and config.json" in message
    for word in words:
        assert word in message


def save_tiny(folder, scale: float = 1.0):
    model = tiny_target(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_a_random_tiny_folder_loads(tmp_path):
    model, _ = load_target(str(save_tiny(tmp_path / "tiny")))
    assert model.config.vocab_size == 96


def test_a_confidently_wrong_folder_is_refused_at_load(tmp_path):
    folder = save_tiny(tmp_path / "loud", scale=1e4)  # finite weights, logits in the tens of thousands
    with pytest.raises(ValueError, match=f"target {folder} predicts a short built-in English text far worse than "
                                         "guessing at random"):
        load_target(str(folder))


def test_a_saved_model_file_is_readable_as_its_folder(tmp_path):
    from flashdraft.train.drafts import save_draft_atomic

    folder = tmp_path / "draft"
    save_draft_atomic(tiny_draft(tiny_target(), block_size=4), folder)
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == folder.stat().st_mode & 0o666
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights").write_bytes(b"x")
    (tmp_path / "other" / "weights").chmod(0o600)
    (tmp_path / "other").chmod(0o750)
    readable_as_folder(tmp_path / "other")
    assert (tmp_path / "other" / "weights").stat().st_mode & 0o777 == 0o640


# ------------------------------------------------------------------------------ the real default target, damaged


def damage(folder, how: str) -> None:
    """The probe's cases: 64 flipped bytes, a 4 KiB stretch XORed, rope_theta 10 in the config."""
    rng = random.Random(0)
    if how == "rope_theta 10":
        config = json.loads((folder / "config.json").read_text())
        config["rope_theta"] = 10
        if isinstance(config.get("rope_parameters"), dict):
            config["rope_parameters"]["rope_theta"] = 10
        (folder / "config.json").write_text(json.dumps(config))
        return
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header = int.from_bytes(data[:8], "little") + 8  # damage the tensors, not the JSON header
    if how == "64 flipped bytes":
        for _ in range(64):
            data[rng.randrange(header, len(data))] ^= 0xFF
    else:
        start = rng.randrange(header, len(data) - 4096)
        for i in range(start, start + 4096):
            data[i] ^= rng.randrange(1, 256)
    weights.write_bytes(data)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["intact", "64 flipped bytes", "4 KiB XORed", "rope_theta 10"])
def test_a_damaged_copy_of_the_default_target_is_refused(smollm2_folder, tmp_path, how):
    folder = tmp_path / "copy"
    shutil.copytree(smollm2_folder, folder)
    assert REGISTRY["smollm2-135m-instruct"].reference_loss is not None
    if how == "intact":
        load_target(str(folder))
        return
    damage(folder, how)
    with pytest.raises(ValueError, match=f"target {folder}") as caught:
        load_target(str(folder))
    assert "damaged" in str(caught.value)
