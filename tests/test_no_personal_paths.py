"""No personal absolute path (a path in a home folder, the root user's or one under the home root) in the repository
or in what ships (model cards, a shipped draft's training.json): commands and examples use placeholders (`RUNS/...`,
`$FLASHDRAFT_HOME/...`, `$HOME/...`) that read the same on every machine."""

import re
import subprocess
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
# A path that starts at a home folder (the root user's or one under /home) not preceded by a name character (so
# "RUNS/home/x" and "$HOME/x" pass). Written in two pieces so that this file does not match itself.
PERSONAL = re.compile(r"(?<![\w.~$}-])/(" + "root|home" + r")/")
SKIPPED = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".ruff_cache", ".pytest_cache"}
BINARY = {".npz", ".safetensors", ".gguf", ".png", ".so", ".pt", ".bin", ".gz", ".pyc", ".whl"}


def candidate_files(root: Path):
    """What the repository holds or would add: git's tracked and untracked files less the ignored ones (a user's
    bench-results/ or run folders are theirs), every file where there is no git."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return root.rglob("*")
    return (root / name for name in listed.decode().split("\0") if name)


def text_files(root: Path):
    for path in candidate_files(root):
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


def test_the_check_leaves_out_what_git_ignores(tmp_path):
    personal = "--output " + "/ro" + "ot/runs/v1\n"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("bench-results/\n")
    (tmp_path / "bench-results").mkdir()
    (tmp_path / "bench-results" / "results.json").write_text(personal)  # a user's own output, never committed
    (tmp_path / "notes.md").write_text(personal)  # untracked but not ignored: it would be committed
    assert [line.split(":")[0] for line in personal_paths(tmp_path)] == ["notes.md"]


def test_bench_results_name_the_command_as_typed(monkeypatch):
    import sys

    from flashdraft.commands.bench import invoked_command

    monkeypatch.setattr(sys, "argv", ["/ro" + "ot/.venv/bin/flashdraft", "bench", "--prompt", "a b"])
    assert invoked_command() == "flashdraft bench --prompt 'a b'"
