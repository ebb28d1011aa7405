"""The scripts that bring a target to a lent GPU machine, run here on tiny models: `benchmarks/gpu/target_pack.py`
(the target in small compressed parts, exact for training, and a draft to continue along with it, bit for bit) and
`benchmarks/gpu/tree.sh` (the tracked files a call does not need out of the tree it carries, and back). Training
there is `flashdraft train --corpus` (tests/train/test_from_corpus.py)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.models import load_draft, load_target
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


def test_a_packed_target_unpacks_to_the_same_features_and_names_bad_parts(tmp_path, capsys, monkeypatch):
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
    assert manifest["target"]["layers_kept"] == 2 and manifest["draft"] is None
    sys.argv = ["target_pack.py", "unpack", str(parts), str(tmp_path / "unpacked")]
    pack.main()

    # Loaded as training loads a target on a GPU: in bfloat16. The cut folder is not held to the target's text
    # predictions (a cut Qwen2.5-Coder-0.5B was refused: loss 6.30 against 3.73), and says so.
    original, _ = load_target(str(source), dtype=torch.bfloat16)
    marker = (tmp_path / "unpacked" / "flashdraft-training-only.txt").read_text()
    assert marker.startswith("layers after 1 and ") and "embedding rows zeroed" in marker
    import flashdraft.models

    def no_text_check(*args):
        raise AssertionError("the text check ran on a folder packed for training")

    monkeypatch.setattr(flashdraft.models, "text_loss", no_text_check)
    capsys.readouterr()
    unpacked, _ = load_target(str(tmp_path / "unpacked"), dtype=torch.bfloat16)
    assert "was packed for draft training only (layers after 1 and" in capsys.readouterr().err
    monkeypatch.undo()
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
    sys.argv = ["target_pack.py", "pack", str(tmp_path / "none")]
    with pytest.raises(SystemExit, match="nothing to pack: give --target"):
        pack.main()


def test_a_draft_travels_with_the_target_bit_for_bit_and_only_in_bfloat16(tmp_path):
    from safetensors.torch import load_file, save_file

    pack = script("target_pack")
    source, draft = target_folder(tmp_path / "target"), draft_folder(tmp_path / "draft")
    sys.argv = ["target_pack.py", "pack", str(tmp_path / "float"), "--target", str(source), "--draft", str(draft)]
    with pytest.raises(SystemExit, match="are not bfloat16; pack a shipped"):
        pack.main()
    weights = draft / "model.safetensors"
    save_file({name: t.to(torch.bfloat16) for name, t in load_file(weights).items()}, weights, {"format": "pt"})
    parts = tmp_path / "parts"
    sys.argv = ["target_pack.py", "pack", str(parts), "--target", str(source), "--draft", str(draft),
                "--part-mb", "0.02,1", "--preset", "1"]
    pack.main()
    sys.argv = ["target_pack.py", "unpack", str(parts), str(tmp_path / "unpacked")]
    with pytest.raises(SystemExit, match="holds the draft .*: give --draft-out DIR"):
        pack.main()
    sys.argv += ["--draft-out", str(tmp_path / "draft-there")]
    pack.main()
    sent, arrived = load_file(weights), load_file(tmp_path / "draft-there" / "model.safetensors")
    assert sent.keys() == arrived.keys() and all(torch.equal(sent[name], arrived[name]) for name in sent)
    assert sorted(p.name for p in (tmp_path / "draft-there").iterdir()) == sorted(p.name for p in draft.iterdir())
    assert (tmp_path / "draft-there" / "config.json").read_text() == (draft / "config.json").read_text()
    loaded = load_draft(str(tmp_path / "draft-there"))
    assert loaded.draft_vocab_ids.tolist() == list(range(40, 70))
    original, _ = load_target(str(source), dtype=torch.bfloat16)
    unpacked, _ = load_target(str(tmp_path / "unpacked"), dtype=torch.bfloat16)
    assert torch.equal(unpacked.model.layers[3].mlp.down_proj.weight, original.model.layers[3].mlp.down_proj.weight)

    # A draft alone: how a trained draft comes back from the machine (benchmarks/gpu/train.sh).
    sys.argv = ["target_pack.py", "pack", str(tmp_path / "back"), "--draft", str(draft), "--preset", "1"]
    pack.main()
    sys.argv = ["target_pack.py", "unpack", str(tmp_path / "back"), str(tmp_path / "no-target-here"),
                "--draft-out", str(tmp_path / "draft-back")]
    pack.main()
    assert not (tmp_path / "no-target-here").exists()
    back = load_file(tmp_path / "draft-back" / "model.safetensors")
    assert all(torch.equal(sent[name], back[name]) for name in sent)
    sys.argv = ["target_pack.py", "unpack", str(parts), "--draft-out", str(tmp_path / "d")]
    with pytest.raises(SystemExit, match="holds the target .*: give the folder to write it to"):
        pack.main()


def test_tree_sh_takes_tracked_paths_out_of_what_a_call_carries_and_brings_them_back(tmp_path):
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "gpu").mkdir(parents=True)
    shutil.copy(SCRIPTS / "tree.sh", repo / "benchmarks" / "gpu" / "tree.sh")
    (repo / "drafts" / "big").mkdir(parents=True)
    (repo / "drafts" / "big" / "model.safetensors").write_bytes(b"w" * 3_000_000)
    (repo / "code.py").write_text("print(1)\n")

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                              check=True, capture_output=True, text=True).stdout

    def tree(*args):
        return subprocess.run(["bash", "benchmarks/gpu/tree.sh", *args], cwd=repo, capture_output=True, text=True,
                              env={**os.environ, "HOME": str(tmp_path / "home")})

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    assert tree("size").stdout.startswith("3.0 MB travel")
    away = tree("away", "drafts/big/")
    assert away.returncode == 0 and away.stdout.startswith("0.0 MB travel"), away.stderr
    assert not (repo / "drafts" / "big").exists() and "drafts/big" not in git("ls-files")
    assert (tmp_path / "home" / f".flashdraft-tree-away{repo}" / "drafts" / "big" / "model.safetensors").is_file()
    again = tree("away", "code.py")
    assert again.returncode == 1 and "drafts/big are away already: bring them back first" in again.stderr
    assert tree("back").stdout.startswith("3.0 MB travel")
    assert git("status", "--porcelain") == ""
    assert (repo / "drafts" / "big" / "model.safetensors").read_bytes() == b"w" * 3_000_000
    untracked = tree("away", "notes.txt")
    assert untracked.returncode == 1 and "notes.txt is not tracked" in untracked.stderr
    assert tree("back").stdout == "tree.sh: nothing is away\n"


@pytest.mark.parametrize("name", ["train.sh", "tree.sh", "run.sh"])
def test_the_machines_shell_scripts_parse(name):
    """They run only on a lent machine (tree.sh also here): at least each must parse."""
    checked = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
