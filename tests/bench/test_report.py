"""Benchmark outputs: the results JSON, the Markdown table and the PNG plots hold the measured numbers."""

import importlib.metadata
import json

import matplotlib.image
import torch

from flashdraft.bench.metrics import summarize
from flashdraft.bench.report import markdown_table, write_report
from flashdraft.bench.runner import Record

RECORDS = [
    Record("humaneval", "h0", 0, "ar", 7, [1, 2, 3, 4, 5], 2.5, 0.5, [1, 1, 1, 1]),
    Record("humaneval", "h0", 0, "flashdraft-plain", 7, [1, 2, 3, 4, 5], 1.25, 0.25, [1, 1, 1, 1], {"target": 5}),
    Record("humaneval", "h0", 0, "flashdraft-b4", 7, [1, 2, 3, 4, 5], 0.75, 0.25, [3, 1], {"target": 3, "dflash": 2}),
    Record("gsm8k", "g0", 0, "ar", 9, [6, 7, 8], 1.5, 0.5, [1, 1]),
    Record("gsm8k", "g0", 0, "flashdraft-b4", 9, [6, 7, 9], 0.5, 0.25, [2]),
]


def test_markdown_table_rows():
    table = markdown_table(summarize(RECORDS, greedy=True))
    lines = table.splitlines()
    assert lines[0].startswith("| dataset | method | prompts | output tokens | decode tok/s | speedup over ar | median "
                               "| speedup over flashdraft-plain | median |")
    assert len(lines) == 2 + 5
    # humaneval: ar 4 tokens / 2 s = 2 tok/s, flashdraft-plain 4 / 1 s = 4 tok/s; flashdraft 4 / 0.5 s = 8 tok/s ->
    # 4x over ar, 2x over plain decoding on flashdraft's own engine; tau 2, same output
    assert lines[3] == "| humaneval | flashdraft-plain | 1 | 5.0 | 4.0 | 2.00x | 2.00x | 1.00x | 1.00x | 250 | 1.00 " \
                       "| target 100% | 0 |"
    assert lines[4] == "| humaneval | flashdraft-b4 | 1 | 5.0 | 8.0 | 4.00x | 4.00x | 2.00x | 2.00x | 250 | 2.00 " \
                       "| target 60%, dflash 40% | 0 |"
    # gsm8k: ar 2 / 1 s; flashdraft 2 / 0.25 s -> 4x; no flashdraft-plain ran there; its output differs from ar's
    assert lines[6] == "| gsm8k | flashdraft-b4 | 1 | 3.0 | 8.0 | 4.00x | 4.00x | n/a | n/a | 250 | 2.00 | n/a | 1 |"
    sampled = markdown_table(summarize(RECORDS, greedy=False))
    assert sampled.splitlines()[4].endswith("| n/a (sampling) |")


def test_written_report(tmp_path):
    summaries = summarize(RECORDS, greedy=True)
    settings = {"max_new_tokens": 5, "temperature": 0.0}
    paths = write_report(tmp_path / "out", summaries, RECORDS, settings, torch.device("cpu"), "flashdraft bench -x")

    results = json.loads(paths["json"].read_text())
    assert results["command"] == "flashdraft bench -x"
    assert results["settings"] == settings
    assert results["machine"]["device"] == "cpu" and results["machine"]["torch_threads"] >= 1
    assert results["versions"]["torch"] == importlib.metadata.version("torch")
    assert results["versions"]["transformers"] == importlib.metadata.version("transformers")
    assert len(results["records"]) == 5
    assert results["records"][4] == {
        "dataset": "gsm8k", "sample_id": "g0", "turn": 0, "method": "flashdraft-b4", "prompt_tokens": 9,
        "tokens": [6, 7, 9], "seconds": 0.5, "time_to_first_token": 0.25, "acceptance_lengths": [2],
        "tokens_by_source": {}, "text": "", "tokens_from_text": False, "decode_tokens": None, "drafted": None,
        "accepted": None, "ended": False,
    }
    first = results["summary"][2]
    assert (first["dataset"], first["method"]) == ("humaneval", "flashdraft-b4")
    assert (first["speedup"], first["speedup_over_plain"], first["tau"]) == (4.0, 2.0, 2.0)
    assert first["acceptance_histogram"] == {"1": 1, "3": 1}
    assert first["token_shares"] == {"target": 0.6, "dflash": 0.4}

    assert paths["markdown"].read_text() == markdown_table(summaries)
    for kind in ("speedup", "acceptance"):
        assert paths[kind].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(paths[kind])
        assert image.shape[0] > 100 and image.shape[1] > 100
    # One acceptance panel per dataset: the figure grows with the number of datasets.
    single = write_report(tmp_path / "one", summarize(RECORDS[:3], greedy=True), RECORDS[:3], settings,
                          torch.device("cpu"), "x")
    assert matplotlib.image.imread(single["acceptance"]).shape[0] < image.shape[0]
