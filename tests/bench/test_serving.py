"""`flashdraft bench-serve` (`flashdraft.bench.serving`): its arguments, and a tiny run end to end (two servers over
a tiny random target and draft, every level and a disconnect round)."""

import sys

import pytest

from flashdraft.bench.serving import Level, Outcome, ServingReport, markdown_tables
from flashdraft.cli import build_parser, main

from tiny import tiny_draft, tiny_target, tiny_tokenizer


def test_defaults_are_the_issue_s_levels():
    args = build_parser().parse_args(["bench-serve"])
    assert (args.concurrency, args.max_batch_size, args.requests, args.max_tokens) == ([1, 4, 8, 16], [1, 16], 32, 64)
    assert args.disconnect_rounds == 0 and args.disconnect_streams == 32 and args.block_size is None
    assert build_parser().parse_args(["bench-serve", "--block-size", "auto"]).block_size == "auto"


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "concurrencies must be integers >= 1"),
    (["--max-batch-size", "4", "4"], "each max batch size once"),
    (["--requests", "0"], "requests and max tokens must be >= 1"),
    (["--disconnect-rounds", "-1"], "disconnect rounds must be >= 0"),
])
def test_bad_settings_fail_before_any_server_starts(argv, message, capsys):
    assert main(["bench-serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_flags_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["bench-serve", "--draft", "x", "--no-draft"])
    with pytest.raises(SystemExit):
        main(["bench-serve", "--block-size", "0"])


def test_the_table_reports_every_level_and_the_memory_rounds():
    outcomes = [Outcome(0.1, 0.02, 1.5, 8, "a"), Outcome(0.3, 0.04, 2.5, 4, "b"), None]
    report = ServingReport([Level(16, 4, 3, 2.0, outcomes, 1, 0.5)], {1: [500.0, 510.2, 509.8]})
    level = report.levels[0]
    assert (level.errors, level.requests_per_second, level.output_tokens_per_second, level.tau) == (1, 1.0, 6.0, 2.0)
    assert level.ttft_ms(50) == pytest.approx(200)
    table = markdown_tables(report)
    assert "| 16 | 4 | 3 | 1.00 | 6.0 | 200 | 290 | 30 | 39 | 2.00 | 1 | 1 | 0.5 |" in table
    assert "| max batch | RSS MiB before | after round 1 | after round 2 |" in table
    assert "| 1 | 500 | 510 | 510 |" in table


def test_a_tiny_run_end_to_end(tmp_path, monkeypatch, capsys):
    target = tiny_target(max_positions=1024)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    tiny_draft(target, block_size=4).save_pretrained(tmp_path / "draft")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the servers' threads: the tiny model gains nothing from more
    argv = ["bench-serve", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--requests",
            "3", "--max-tokens", "8", "--concurrency", "1", "2", "--max-batch-size", "1", "4",
            "--disconnect-rounds", "1", "--disconnect-streams", "3", "--startup-timeout", "120", "--timeout", "60"]
    assert main(argv) == 0, capsys.readouterr().err
    table = capsys.readouterr().out
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| 1 | ", "| 4 | "))]
    levels = [row for row in rows if len(row) == 13]
    assert [(row[0], row[1]) for row in levels] == [("| 1", "1"), ("| 4", "1"), ("| 1", "2"), ("| 4", "2")]
    assert all(row[10] == "0" and row[11] == "0" for row in levels)  # every answer the reference's, no error
    memory = [row for row in rows if len(row) == 3]
    assert len(memory) == 2 and sys.platform == "linux"
