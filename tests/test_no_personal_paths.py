"""No personal absolute path (a path in a home folder, the root user's or one under the home root) in the repository
or in what ships (model cards, a shipped draft's training.json): commands and examples use placeholders (`RUNS/...`,
`$FLASHDRAFT_HOME/...`, `$HOME/...`) that read the same on every machine."""

import re
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
# A path that starts at a home folder (the root user's or one under /home) not preceded by a name character (so
# "RUNS/home/x" and "$HOME/x" pass). Written in two pieces so that this file does not match itself.
PERSONAL = re.compile(r"(?<![\w.~$}-])/(" + "root|home" + r")/")
SKIPPED = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".ruff_cache", ".pytest_cache"}
BINARY = {".npz", ".safetensors", ".gguf", ".png", ".so", ".pt", ".bin", ".gz", ".pyc", ".whl"}


def text_files(root: Path):
    for path in root.rglob("*"):
        parts = set(path.relative_to(root).parts)
        if path.is_file() and not parts & SKIPPED and not any(p.endswith(".egg-info") for p in parts) \
                and path.suffix not in BINARY:
            yield path


def personal_paths(root: Path) -> list[str]:
    found = []
    for path in text_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if PERSONAL.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:100]}")
    return found


def test_the_repository_holds_no_personal_absolute_path():
    found = personal_paths(REPOSITORY)
    assert found == [], f"{len(found)} personal absolute path(s): use RUNS/... or $FLASHDRAFT_HOME/...:\n" + "\n".join(
        found[:20])


def test_the_check_finds_a_home_folder_and_passes_placeholders(tmp_path):
    (tmp_path / "card.md").write_text("python train.py --output " + "/ro" + "ot/runs/v1\n")
    (tmp_path / "fine.md").write_text("--output RUNS/v1 --work-dir $FLASHDRAFT_HOME/train $HOME/x a/home/b\n")
    assert [line.split(":")[0] for line in personal_paths(tmp_path)] == ["card.md"]
