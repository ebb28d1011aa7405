"""The scripts that train a draft on a lent GPU machine, run here on tiny models: `target_pack.py` (the target in
small compressed parts, exact for training) and `train_from_corpus.py` (continue a draft on the corpus within a
time budget, and measure drafts on held-out records)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from flashdraft import DFlashDraftModel
from flashdraft.models import load_target
from flashdraft.train.corpus import export_records
from flashdraft.train.features import extract_features
from flashdraft.train.records import TrainingRecord
from train.test_corpus import write_folder
from train.tiny_training import MASK, next_token, one_thread  # noqa: F401

from tiny import tiny_target, tiny_tokenizer

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CORPUS_TOKENS = range(5, 60)  # the tiny corpus uses these tokens only


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def target_folder(path: Path) -> Path:
    target = tiny_target("llama", num_layers=4)
    target.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def corpus_folder(path: Path, count: int = 24) -> Path:
    records = []
    for i in range(count):
        prompt = [5 + (i * 3 + k) % 20 for k in range(4)]
        response = [25 + i % 30]
        while len(response) < 14:
            response.append(5 + (next_token(response[-1]) - 5) % 55)
        records.append(TrainingRecord(id=f"pattern:{i}", source="pattern", input_ids=prompt + response,
                                      response_start=len(prompt)))
    export_records(write_folder(path.parent / f"{path.name}-work", records), path, target="tiny", command="test")
    return path


def draft_folder(path: Path, vocab=range(40, 70)) -> Path:
    target = tiny_target("llama", num_layers=4)
    torch.manual_seed(3)
    draft = DFlashDraftModel.for_target(target.config, num_layers=1, block_size=4, mask_token_id=MASK,
                                        target_layer_ids=[0, 1])
    draft.set_draft_vocab(list(vocab))
    draft.save_pretrained(path)
    return path


def test_a_packed_target_unpacks_to_the_same_features_and_names_bad_parts(tmp_path, capsys):
    pack = script("target_pack")
    source, corpus = target_folder(tmp_path / "target"), corpus_folder(tmp_path / "corpus")
    draft = draft_folder(tmp_path / "draft")
    parts = tmp_path / "parts"
    run = ["pack", str(parts), "--target", str(source), "--feature-layers", "0,1", "--keep-tokens", str(corpus),
           "--keep-tokens-of", str(draft), "--part-mb", "0.01,0.01,0.01,1", "--preset", "1"]
    sys.argv = ["target_pack.py", *run]
    pack.main()
    manifest = json.loads((parts / "pack.json").read_text())
    assert [p["file"] for p in manifest["parts"]] == ["part-00", "part-01", "part-02", "part-03"]
    assert manifest["layers_kept"] == 2
    sys.argv = ["target_pack.py", "unpack", str(parts), str(tmp_path / "unpacked")]
    pack.main()

    # Loaded as training loads a target on a GPU: in bfloat16.
    original, _ = load_target(str(source), dtype=torch.bfloat16)
    unpacked, _ = load_target(str(tmp_path / "unpacked"), dtype=torch.bfloat16)
    kept = set(CORPUS_TOKENS) | set(range(40, 70)) | {MASK} | set(tiny_tokenizer().all_special_ids)
    embedding, expected = unpacked.model.embed_tokens.weight, original.model.embed_tokens.weight
    for token in range(96):
        assert torch.equal(embedding[token], expected[token] if token in kept else torch.zeros_like(embedding[token]))
    assert torch.equal(unpacked.model.layers[1].mlp.down_proj.weight, original.model.layers[1].mlp.down_proj.weight)
    assert not unpacked.model.layers[2].mlp.down_proj.weight.any()
    sequences = [torch.tensor([5, 9, 30, 31, 44, 59]), torch.tensor([7, 8, 50])]
    assert torch.equal(extract_features(unpacked, sequences, [0, 1]), extract_features(original, sequences, [0, 1]))
    assert not torch.equal(extract_features(unpacked, sequences, [3]), extract_features(original, sequences, [3]))

    damaged = parts / "part-02"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")
    with pytest.raises(SystemExit, match="part-02 does not match its checksum: send it again"):
        pack.main()
    damaged.unlink()
    with pytest.raises(SystemExit, match="part-02 is missing: send every part before unpacking"):
        pack.main()
    sys.argv = ["target_pack.py", "pack", str(tmp_path / "small"), "--target", str(source), "--part-mb", "0.001"]
    with pytest.raises(SystemExit, match=r"the packed weights take .* MB, the parts only 0.0 MB"):
        pack.main()


def test_training_on_the_corpus_fits_the_budget_leaves_the_held_out_records_out_and_writes_snapshots(
        tmp_path, capsys):
    trainer = script("train_from_corpus")
    source, corpus = target_folder(tmp_path / "target"), corpus_folder(tmp_path / "corpus")
    start = draft_folder(tmp_path / "draft")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("pattern:3\npattern:17\npattern:20\npattern:9\n")
    common = ["--target", str(source), "--corpus", str(corpus), "--heldout-ids", str(heldout), "--device", "cpu"]
    trainer.main(["train", str(tmp_path / "out"), *common, "--init-draft", str(start), "--seconds", "60",
                  "--reserve", "0", "--epochs", "2", "--batch-size", "2", "--grad-accum", "2", "--num-anchors", "4",
                  "--lr", "3e-3", "--snapshots", "0.5"])
    printed = capsys.readouterr().out
    # 20 training records in global batches of 4: 5 steps an epoch, and the budget holds both epochs.
    assert "20 training records, 4 held out; global batch 4, 5 steps an epoch; 10 steps (" in printed
    assert "snapshots at [5]" in printed
    card = json.loads((tmp_path / "out" / "float32" / "training.json").read_text())
    assert card["data"] == {"pattern": {"sequences": 20, "tokens": 20 * 14}}
    assert card["summary"]["steps"] == 10 and card["settings"]["global batch (sequences)"] == 4
    assert card["command"].startswith("python scripts/train_from_corpus.py train ")
    final = DFlashDraftModel.from_pretrained(tmp_path / "out" / "final")
    snapshot = DFlashDraftModel.from_pretrained(tmp_path / "out" / "step-5")
    first = DFlashDraftModel.from_pretrained(start)
    assert json.loads((tmp_path / "out" / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(final.draft_vocab_ids, torch.arange(40, 70))
    assert not torch.equal(final.fc.weight, first.fc.weight.to(torch.bfloat16).float())
    assert not torch.equal(final.fc.weight, snapshot.fc.weight)
    mean = DFlashDraftModel.from_pretrained(tmp_path / "out" / "mean")
    exact = (first.fc.weight + DFlashDraftModel.from_pretrained(tmp_path / "out" / "float32").fc.weight) / 2
    assert torch.equal(mean.fc.weight, exact.to(torch.bfloat16).float())
    # Two whole epochs: every training record was reached, none of the held-out ones.
    reached = (tmp_path / "out" / "reached.txt").read_text().splitlines()
    assert reached == sorted(f"pattern:{i}" for i in range(24) if i not in (3, 9, 17, 20))

    trainer.main(["evaluate", *common, "--prompts", "2", "--max-new-tokens", "8", str(start),
                  str(tmp_path / "out" / "final")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{start}: tau ") and "held-out loss" in lines[1]
    losses = [float(line.split("held-out loss ")[1].split(",")[0]) for line in lines]
    assert losses[1] < losses[0]  # training on the pattern lowers the loss on held-out records of the same pattern

    excluded = tmp_path / "seen.txt"
    excluded.write_text("\n".join(f"pattern:{i}" for i in range(10)) + "\n")  # 8 of them training records
    trainer.main(["train", str(tmp_path / "again"), *common, "--init-draft", str(tmp_path / "out" / "final"),
                  "--max-steps", "2", "--seed", "1", "--loss-chunk", "8", "--batch-size", "2", "--grad-accum", "2",
                  "--num-anchors", "4", "--exclude-ids", str(excluded),
                  "--snapshots", ""])
    assert "12 training records, 4 held out; global batch 4, 3 steps an epoch; 2 steps (given); snapshots at []" in (
        capsys.readouterr().out)
    assert json.loads((tmp_path / "again" / "float32" / "training.json").read_text())["summary"]["steps"] == 2
    # 2 steps of 4 of the 12 records left reach 8 of them, sorted, and no excluded or held-out one.
    reached = (tmp_path / "again" / "reached.txt").read_text().splitlines()
    allowed = {f"pattern:{i}" for i in range(10, 24)} - {"pattern:17", "pattern:20"}
    assert len(set(reached)) == 8 and set(reached) <= allowed and reached == sorted(reached)
    with pytest.raises(SystemExit):
        trainer.main(["train", str(tmp_path / "none"), *common, "--init-draft", str(start)])
    assert "train needs --seconds (a time budget) or --max-steps" in capsys.readouterr().err

    heldout.write_text("pattern:99\n")
    with pytest.raises(SystemExit, match="1 held-out ids are not in .*, e.g. pattern:99: the list belongs to another"):
        trainer.main(["evaluate", *common, str(start)])
