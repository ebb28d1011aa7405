"""`flashdraft bench` end to end through the CLI, on tiny models saved to folders and a JSONL prompt file."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flashdraft
from bench.tiny_bench import save_tiny_bench_folders
from flashdraft.bench.methods import reference_available
from flashdraft.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_tiny_bench_folders(tmp_path_factory.mktemp("bench-cli"),
                                   [{"prompt": "w1 w2 w3"}, {"turns": ["w4 w5", "w6 w7"], "id": "two"}])


def test_bench_command_writes_every_output(folders, capsys):
    out = folders / "out"
    code = main([
        "bench", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
        "--datasets", str(folders / "prompts.jsonl"), "--methods", "flashdraft", "flashdraft-hybrid", "prompt-lookup",
        "reference", "transformers-dflash", "--block-sizes", "2", "4", "--max-new-tokens", "6",
        "--output-dir", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    methods = ["ar", "flashdraft-b2", "flashdraft-b4", "flashdraft-hybrid", "prompt-lookup", "reference-b4",
               "transformers-dflash-b4"]
    assert results["settings"]["methods"] == methods
    assert results["settings"]["dtype"] == "float32" and results["settings"]["max_new_tokens"] == 6
    assert results["machine"]["device"] == "cpu"
    # 3 prompts (the second sample has two turns) x 7 methods, each answer at most 6 tokens
    assert len(results["records"]) == 21
    assert {r["method"] for r in results["records"]} == set(methods)
    assert all(1 <= len(r["tokens"]) <= 6 for r in results["records"])
    # A dataset with a second turn is summarised per turn.
    assert [(s["dataset"], s["method"]) for s in results["summary"]] == [
        (f"prompts turn {turn}", m) for turn in (1, 2) for m in methods]
    # float32 greedy: every method reproduces ar exactly
    assert [s["differs_from_ar"] for s in results["summary"]] == [0] * 14
    hybrid = next(s for s in results["summary"] if s["method"] == "flashdraft-hybrid")
    assert set(hybrid["token_shares"]) >= {"target"} and sum(hybrid["token_shares"].values()) == pytest.approx(1)
    table = (out / "results.md").read_text()
    assert table in printed
    assert "| prompts turn 1 | flashdraft-b4 | 2 |" in table and "| prompts turn 2 | ar | 1 |" in table
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


def test_default_methods_include_flashdraft_plain_hybrid_and_the_draft_at_the_adaptive_block_size(folders):
    # `flashdraft-hybrid` is what `flashdraft generate` and `serve` run by default: a first benchmark must show it;
    # `flashdraft-plain`, the same engine without proposals, is the second baseline (speculation's own gain).
    out = folders / "out-default"
    code = main(["bench", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
                 "--datasets", str(folders / "prompts.jsonl"), "--max-new-tokens", "4", "--output-dir", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    expected = ["ar", "flashdraft-plain", "flashdraft-b4", "flashdraft-auto", "flashdraft-hybrid", "prompt-lookup",
                "transformers-dflash-b4"]
    assert results["settings"]["methods"] == expected + (["reference-b4"] if reference_available() else [])
    assert all(summary["differs_from_ar"] == 0 for summary in results["summary"])
    assert all(summary["speedup_over_plain"] is not None for summary in results["summary"])
    plain = [summary for summary in results["summary"] if summary["method"] == "flashdraft-plain"]
    assert plain and all(summary["speedup_over_plain"] == 1.0 for summary in plain)


def test_the_methods_are_named_in_help_as_in_the_results(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = re.sub(r"(?<=\w-)\s+", "", capsys.readouterr().out)  # argparse wraps lines after a hyphen
    for name in ("flashdraft-bB", "flashdraft-auto", "flashdraft-hybrid", "flashdraft-plain", "flashdraft-lookup",
                 "reference-bB", "transformers-dflash-bB", "prompt-lookup", "assisted"):
        assert name in help_text, name


def test_importing_the_command_imports_no_torch():
    # The CLI imports every command module to build its parser, so `flashdraft --help` pays for what they import
    # at the top. The package's own __init__ (the library for `import flashdraft`) is bypassed: this checks what
    # the command module itself pulls in.
    code = (
        "import sys, types\n"
        f"package = types.ModuleType('flashdraft'); package.__path__ = [{str(Path(flashdraft.__file__).parent)!r}]\n"
        "sys.modules['flashdraft'] = package\n"
        "import flashdraft.commands.bench\n"
        "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_the_default_output_folder_is_ignored_by_git():
    for path in ("bench-results/results.json", "benchmarks/bench-results/results.md"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path
