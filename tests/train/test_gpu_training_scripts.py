"""The script that brings a target to a lent GPU machine, run here on tiny models: `benchmarks/gpu/target_pack.py`
(the target in small compressed parts, exact for training). Training there is `flashdraft train --corpus`
(tests/train/test_from_corpus.py)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.models import load_target
from flashdraft.train.features import extract_features
from train.test_from_corpus import corpus_folder, draft_folder, target_folder
from train.tiny_training import MASK, next_token, one_thread  # noqa: F401

from tiny import tiny_tokenizer

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
CORPUS_TOKENS = range(5, 60)  # the tiny corpus uses these tokens only


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
