"""A target no draft is shipped for still runs (issue 43, item 3): `generate`, `serve` and `bench` fall back to the
context lookup, with no error, and say so in one line with how to get a draft. The tiny targets here have a shape
no shipped draft has."""

import json
import socket
from types import SimpleNamespace

import pytest
from bench.tiny_bench import save_tiny_bench_folders

from flashdraft import models
from flashdraft.cli import main
from flashdraft.models import DEFAULT_TARGET, REGISTRY, shipped_draft
from flashdraft.text import encode_chat

from tiny import greedy_reference, tiny_target, tiny_tokenizer


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-draft") / "target"
    target, tokenizer = tiny_target("qwen3", seed=5), tiny_tokenizer()
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, target, tokenizer


def the_note(err: str) -> str:
    notes = [line for line in err.splitlines() if line.startswith("No draft is shipped for")]
    assert len(notes) == 1, err
    assert "flashdraft train --target" in notes[0] and "`flashdraft corpus`" in notes[0]
    assert notes[0].endswith("and pass --draft DRAFT.")
    return notes[0]


def shape(hidden_size, num_hidden_layers, vocab_size):
    return SimpleNamespace(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, vocab_size=vocab_size)


def test_the_shipped_draft_goes_with_its_target_or_a_copy_of_it():
    default = REGISTRY[DEFAULT_TARGET]
    default_shape = shape(default.hidden_size, default.num_layers, default.vocab_size)
    assert shipped_draft(DEFAULT_TARGET, default_shape) == models._SHIPPED_DRAFTS / DEFAULT_TARGET
    # a folder holding a copy of the default target: found by its shape
    assert shipped_draft("/some/copy", default_shape) == models._SHIPPED_DRAFTS / DEFAULT_TARGET
    qwen = REGISTRY["qwen2.5-coder-0.5b-instruct"]
    qwen_shape = shape(qwen.hidden_size, qwen.num_layers, qwen.vocab_size)
    assert shipped_draft(qwen.name, qwen_shape) == models._SHIPPED_DRAFTS / qwen.name
    assert shipped_draft("/a/qwen/copy", qwen_shape) == models._SHIPPED_DRAFTS / qwen.name
    larger = REGISTRY["qwen2.5-coder-1.5b-instruct"]  # no draft yet
    assert shipped_draft(larger.name, shape(larger.hidden_size, larger.num_layers, larger.vocab_size)) is None
    assert shipped_draft("/some/other", shape(576, 29, 49152)) is None  # one layer fewer: another model


@pytest.mark.parametrize("folder", sorted(p.parent for p in models._SHIPPED_DRAFTS.glob("*/config.json")),
                         ids=lambda folder: folder.name)
def test_every_shipped_draft_is_named_for_its_registry_target_and_carries_its_card_and_check(folder):
    entry = REGISTRY[folder.name]
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_target_layers"], config["vocab_size"]) == (
        entry.hidden_size, entry.num_layers, entry.vocab_size)
    card = json.loads((folder / "training.json").read_text())
    assert card["target"] == folder.name and "command" in card and card["summary"]["steps"] > 0
    assert "## Reproduce" in (folder / "README.md").read_text()
    check = json.loads((folder / "acceptance-check.json").read_text())
    assert check["block_size"] == config["block_size"] and check["tau"] > 1.5


def test_generate_falls_back_to_the_lookup_and_says_so(target_folder, capsys):
    folder, target, tokenizer = target_folder
    assert main(["generate", "w3 w4 w3 w4", "--target", str(folder), "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    ids = encode_chat(tokenizer, [{"role": "user", "content": "w3 w4 w3 w4"}])
    expected = greedy_reference(target, ids, 24, stop_token_ids=[tokenizer.eos_token_id])
    assert out == tokenizer.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False) + "\n"
    assert "context lookup alone" in the_note(err)
    assert "24 tokens (target " in err  # the statistics line counts the sources, the lookup among them


def test_serve_falls_back_to_the_lookup_and_says_so(target_folder, capsys, monkeypatch):
    from flashdraft.serve import app

    folder, _, _ = target_folder
    served = {}

    def run(self, sockets=None):  # in place of serving: what the command built
        served.update(engine=self.config.app.state, log_config=self.config.log_config)

    monkeypatch.setattr(app.Server, "run", run)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--target", str(folder), "--port", str(port)]) == 0
    err = capsys.readouterr().err
    assert "context lookup alone" in the_note(err)
    assert "(lookup proposals, block size auto)" in err
    # uvicorn's access log goes where its start-up messages and ours go, not to stdout
    handlers = served["log_config"]["handlers"]
    assert handlers["access"]["stream"] == handlers["default"]["stream"] == "ext://sys.stderr"


def test_bench_runs_the_lookup_in_the_drafts_place_and_says_so(tmp_path, capsys):
    folders = save_tiny_bench_folders(tmp_path, [{"prompt": "w1 w2 w1 w2"}])
    out = tmp_path / "out"
    assert main(["bench", "--target", str(folders / "target"), "--datasets", str(folders / "prompts.jsonl"),
                 "--max-new-tokens", "4", "--output-dir", str(out)]) == 0
    assert "flashdraft-lookup" in the_note(capsys.readouterr().err)
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["methods"] == ["ar", "flashdraft-plain", "prompt-lookup", "flashdraft-lookup"]
    assert all(summary["differs_from_ar"] == 0 for summary in results["summary"])


@pytest.mark.parametrize("argv", [["--methods", "flashdraft"], ["--replay"]])
def test_bench_methods_that_need_a_draft_say_how_to_get_one(tmp_path, capsys, argv):
    folders = save_tiny_bench_folders(tmp_path, [{"prompt": "w1 w2"}])
    assert main(["bench", "--target", str(folders / "target"), "--datasets", str(folders / "prompts.jsonl"),
                 "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert "need" in err and "a draft, and none is shipped for" in err and "flashdraft train --target" in err
