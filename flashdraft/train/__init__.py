"""Draft training: prompts, decontamination, target-written data (regeneration or teacher-forced labels), and
the trainer that turns them into a DFlash draft.

Data stages, each cached on disk and resumable:
    prompts.py        the Prompt record, JSONL prompt files, the seeded mix of sources
    sources.py        built-in offline prompt sources (ShareGPT, LeetCode, CodeI/O, math)
    decontaminate.py  the overlap check that keeps the evaluation sets (the benchmark's) out of training data
    regenerate.py     the target answers the prompts (batched greedy or sampled generation)
    labels.py         the target labels existing responses under teacher forcing (one forward, optional top-k)
    records.py        the on-disk training records both write and the trainer reads
    corpus.py         the committed corpus of the target's own answers (shards, manifest, draws)

Training:
    blocks.py         anchors and the block attention mask          loss.py      the weighted block loss
    features.py       target features, stored offline or online     config.py    TrainConfig, PipelineConfig
    trainer.py        the optimisation loop, resume, evaluation     checkpoints.py  checkpoint files
    drafts.py         the draft a run starts from and writes        pipeline.py  prompts -> labels -> features
                                                                                   -> train, cached and resumable
    averaging.py      weight averaging of drafts                    distributed.py  torchrun / accelerate
"""

from ..lazy import lazy_exports

# The public names load on first use (PEP 562): the command line reads the source lists without loading torch.
_EXPORTS = {
    "EvalIndex": "decontaminate",
    "EvalSet": "decontaminate",
    "Overlap": "decontaminate",
    "check_decontaminated": "decontaminate",
    "find_overlaps": "decontaminate",
    "load_eval_sets": "decontaminate",
    "remove_overlaps": "decontaminate",
    "label_responses": "labels",
    "PipelineConfig": "config",
    "TrainConfig": "config",
    "run_pipeline": "pipeline",
    "Prompt": "prompts",
    "PromptFile": "prompts",
    "mix_prompts": "prompts",
    "read_prompt_file": "prompts",
    "write_prompt_file": "prompts",
    "RunStats": "records",
    "TrainingRecord": "records",
    "read_meta": "records",
    "read_records": "records",
    "regenerate": "regenerate",
    "DEFAULT_PROPORTIONS": "sources",
    "SOURCES": "sources",
    "load_source": "sources",
    "load_sources": "sources",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "DEFAULT_PROPORTIONS",
    "EvalIndex",
    "EvalSet",
    "Overlap",
    "PipelineConfig",
    "Prompt",
    "PromptFile",
    "RunStats",
    "SOURCES",
    "TrainConfig",
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
    "run_pipeline",
    "write_prompt_file",
]
