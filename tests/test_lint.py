"""The code passes the project's ruff configuration (pyproject.toml, [tool.ruff]): CI runs this test."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    process = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "flashdraft", "tests", "benchmarks"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert "No module named ruff" not in process.stderr, "install the test extras: pip install -e '.[test]'"
    assert process.returncode == 0, process.stdout + process.stderr
