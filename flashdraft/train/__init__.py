"""Draft training: prompts, decontamination, target-written data (regeneration or teacher-forced labels), and
the trainer that turns them into a DFlash draft.

Data stages, each cached on disk and resumable:
    prompts.py        the Prompt record, JSONL prompt files, the seeded mix of sources
    sources.py        built-in offline prompt sources (ShareGPT, LeetCode, CodeI/O, math)
    decontaminate.py  the overlap check that keeps the evaluation sets (the benchmark's) out of training data
    regenerate.py     the target answers the prompts (batched greedy or sampled generation)
    labels.py         the target labels existing responses under teacher forcing (one forward, optional top-k)
    records.py        the on-disk training records both write and the trainer reads
"""

from .decontaminate import (
    EvalIndex,
    EvalSet,
    Overlap,
    check_decontaminated,
    find_overlaps,
    load_eval_sets,
    remove_overlaps,
)
from .labels import label_responses
from .prompts import Prompt, PromptFile, mix_prompts, read_prompt_file, write_prompt_file
from .records import RunStats, TrainingRecord, read_meta, read_records
from .regenerate import regenerate
from .sources import DEFAULT_PROPORTIONS, SOURCES, load_source, load_sources

__all__ = [
    "DEFAULT_PROPORTIONS",
    "EvalIndex",
    "EvalSet",
    "Overlap",
    "Prompt",
    "PromptFile",
    "RunStats",
    "SOURCES",
    "TrainingRecord",
    "check_decontaminated",
    "find_overlaps",
    "label_responses",
    "load_eval_sets",
    "load_source",
    "load_sources",
    "mix_prompts",
    "read_meta",
    "read_prompt_file",
    "read_records",
    "regenerate",
    "remove_overlaps",
    "write_prompt_file",
]
