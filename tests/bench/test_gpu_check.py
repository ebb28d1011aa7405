"""The GPU check (benchmarks/gpu/check.py) runs every stage in its CPU smoke mode and reports what it measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "check.py"


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    process = run_check("--smoke", "--out", str(out))
    assert process.returncode == 0, process.stdout + process.stderr
    return json.loads((out / "gpu-check.json").read_text()), (out / "gpu-check.md").read_text()


def test_every_stage_runs_and_succeeds(smoke):
    results, _ = smoke
    stages = results["stages"]
    expected = {"greedy-float32", "speed-tiny-llama", "speed-tiny-qwen3", "training", "greedy-bfloat16", "sampling"}
    assert set(stages) == expected
    assert {name: stage["status"] for name, stage in stages.items()} == dict.fromkeys(expected, "ok")


def test_greedy_cases_all_run_and_match(smoke):
    greedy = smoke[0]["stages"]["greedy-float32"]["result"]
    assert greedy["cases"] == greedy["planned"]
    assert greedy["mismatches"] == 0


def test_speed_compares_every_method_at_both_acceptances(smoke):
    speed = smoke[0]["stages"]["speed-tiny-qwen3"]["result"]
    methods = ["ar", "flashdraft-b1", "flashdraft-b16", "reference-b16", "transformers-dflash-b16"]
    for mode in ("none", "full"):
        rows = speed["modes"][mode]
        assert list(rows) == methods
        assert all(row["decode_tokens_per_s"] > 0 and row["same_as_ar"] for row in rows.values())
    full = speed["modes"]["full"]
    # Zeroed final norms make every proposal right: all but the last round accept the whole block of 16.
    assert all(full[m]["tau"] > 11 for m in ("flashdraft-b16", "reference-b16", "transformers-dflash-b16"))
    assert full["ar"]["tau"] == 1.0
    assert set(speed["verify_ratio"]) == {str(n) for n in range(1, 9)}
    assert speed["verify_ratio"]["1"] == 1.0


def test_sampling_negative_control_is_rejected(smoke):
    sampling = smoke[0]["stages"]["sampling"]["result"]
    assert sampling["p_value"] > 1e-4
    assert sampling["biased_p_value"] < 1e-3


def test_training_reports_throughput_and_epoch_time(smoke):
    training = smoke[0]["stages"]["training"]["result"]
    assert training["blocks_per_s"] > 0
    assert training["epoch_hours_800k"] == pytest.approx(800_000 / training["sequences_per_s"] / 3600)


def test_markdown_summary_names_every_stage(smoke):
    results, markdown = smoke
    for name in results["stages"]:
        assert f"## {name}: ok" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_the_full_run_says_what_to_do(tmp_path):
    process = run_check("--out", str(tmp_path))
    assert process.returncode == 2
    assert "no CUDA device here" in process.stderr and "--smoke" in process.stderr


def test_unknown_stage_is_named(tmp_path):
    process = run_check("--smoke", "--out", str(tmp_path), "--stages", "greedy-float32,nosuch")
    assert process.returncode == 2
    assert "unknown stage(s) nosuch" in process.stderr
