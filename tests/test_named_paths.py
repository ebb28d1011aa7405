"""Every repository file the docs and the code name exists: a moved or removed script, module or guide leaves no
reference behind (the history in docs/history/ records what was, and is not checked)."""

import re
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
# A relative path into one of the repository's folders, ending in a file type it holds; not part of a longer path
# (so "RUNS/docs/x.md" or "$HOME/benchmarks/x.py" are not read as the repository's).
NAMED = re.compile(r"(?<![\w/.$~-])((?:scripts|benchmarks|flashdraft|tests|corpus|docs|requirements|\.ci)/"
                   r"[\w./*-]+?\.(?:py|sh|md|txt|json|c|h|toml))\b")
PLACEHOLDERS = ("*", "NN", "TARGET")  # patterns and placeholders name no one file


def documents() -> list[Path]:
    patterns = ("*.md", "docs/*.md", "corpus/**/README.md", "flashdraft/**/*.md", "benchmarks/**/*.md",
                "flashdraft/**/*.py", "flashdraft/csrc/*", "benchmarks/**/*.py", "benchmarks/**/*.sh", ".ci/*")
    return sorted({path for pattern in patterns for path in REPOSITORY.glob(pattern) if path.is_file()})


def missing_paths(root: Path, files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for match in NAMED.finditer(path.read_text(encoding="utf-8")):
            named = match.group(1)
            if not any(mark in named for mark in PLACEHOLDERS) and not (root / named).exists():
                found.append(f"{path.relative_to(root)}: {named}")
    return found


def test_every_repository_path_named_in_the_docs_and_the_code_exists():
    found = missing_paths(REPOSITORY, documents())
    assert found == [], f"{len(found)} named path(s) that do not exist:\n" + "\n".join(found[:20])


def test_a_missing_path_is_found_and_placeholders_and_longer_paths_are_not(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    guide = tmp_path / "guide.md"
    guide.write_text("see `docs/here.md`, `scripts/gone.py`, corpus/TARGET/README.md, draws/vNN.txt, "
                     "corpus/x/draws/*.txt and RUNS/docs/elsewhere.md\n")
    assert missing_paths(tmp_path, [guide]) == ["guide.md: scripts/gone.py"]
