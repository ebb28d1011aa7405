"""`flashdraft bench` end to end through the CLI, on tiny models saved to folders and a JSONL prompt file."""

import json

import pytest

from flashdraft.cli import main
from bench.tiny_bench import save_tiny_bench_folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_tiny_bench_folders(tmp_path_factory.mktemp("bench-cli"),
                                   [{"prompt": "w1 w2 w3"}, {"turns": ["w4 w5", "w6 w7"], "id": "two"}])


def test_bench_command_writes_every_output(folders, capsys):
    out = folders / "out"
    code = main([
        "bench", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
        "--datasets", str(folders / "prompts.jsonl"), "--methods", "flashdraft", "prompt-lookup", "reference",
        "transformers-dflash", "--block-sizes", "2", "4", "--max-new-tokens", "6", "--output-dir", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    methods = ["ar", "flashdraft-b2", "flashdraft-b4", "prompt-lookup", "reference-b4", "transformers-dflash-b4"]
    assert results["settings"]["methods"] == methods
    assert results["settings"]["dtype"] == "float32" and results["settings"]["max_new_tokens"] == 6
    assert results["machine"]["device"] == "cpu"
    # 3 prompts (the second sample has two turns) x 6 methods, each answer at most 6 tokens
    assert len(results["records"]) == 18
    assert {r["method"] for r in results["records"]} == set(methods)
    assert all(1 <= len(r["tokens"]) <= 6 for r in results["records"])
    assert [(s["dataset"], s["method"]) for s in results["summary"]] == [("prompts", m) for m in methods]
    # float32 greedy: every method reproduces ar exactly
    assert [s["differs_from_ar"] for s in results["summary"]] == [0] * 6
    table = (out / "results.md").read_text()
    assert table in printed
    assert "| prompts | flashdraft-b4 | 3 |" in table
    assert (out / "speedup.png").stat().st_size > 0 and (out / "acceptance.png").stat().st_size > 0


def test_bench_command_reports_bad_input_without_a_traceback(folders, capsys):
    code = main(["bench", "--target", str(folders / "target"), "--datasets", "nope", "--output-dir",
                 str(folders / "unused")])
    assert code == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    code = main(["bench", "--target", str(folders / "target"), "--datasets", str(folders / "prompts.jsonl"),
                 "--methods", "assisted", "--output-dir", str(folders / "unused")])
    assert code == 2
    assert "pass --assistant" in capsys.readouterr().err
