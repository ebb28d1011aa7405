"""Data-parallel training: two CPU processes (gloo) take the same optimizer steps as one process on the same
global batch, with and without gradient accumulation."""

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft.train.distributed import Distributed, setup_distributed
from flashdraft.train.features import OnlineFeatures
from flashdraft.train.trainer import METRICS_FILE, TrainConfig, Trainer
from train.tiny_training import FEATURE_LAYERS, one_thread, pattern_sequences, target_and_draft  # noqa: F401

RUNS = {  # name: (per-process batch size, gradient accumulation, steps), for 2 processes
    "one-step": (2, 1, 1),
    "accumulated": (1, 2, 2),
}


def train_run(run_dir, batch_size, grad_accum, steps, distributed=None):
    target, draft = target_and_draft()
    config = TrainConfig(num_anchors=4, batch_size=batch_size, grad_accum=grad_accum, max_steps=steps,
                         learning_rate=1e-2, warmup_ratio=0.0, log_every=1)
    trainer = Trainer(draft, target, pattern_sequences(8), OnlineFeatures(target, FEATURE_LAYERS), run_dir, config,
                      distributed=distributed, progress=False)
    trainer.train()
    return trainer.draft.state_dict()


def logged_steps(run_dir):
    """(loss, gradient norm before clipping) of every step: both change with any error in the normalisation,
    where Adam's update alone would not show a uniform scale."""
    lines = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return [(line["loss"], line["grad_norm"]) for line in lines if "loss" in line]


def worker(rank, world_size, folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    try:
        for name, (batch_size, grad_accum, steps) in RUNS.items():
            state = train_run(f"{folder}/{name}", batch_size, grad_accum, steps, Distributed(rank, world_size))
            torch.save(state, f"{folder}/{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_take_the_same_steps_as_one(tmp_path):
    # fork: the children inherit the imported modules (spawning re-imports torch and transformers: ~20 s here)
    mp.start_processes(worker, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    for name, (batch_size, grad_accum, steps) in RUNS.items():
        single = train_run(tmp_path / f"{name}-single", batch_size * 2, grad_accum, steps)
        initial = target_and_draft()[1].state_dict()
        ranks = [torch.load(tmp_path / f"{name}-rank{rank}.pt") for rank in range(2)]
        assert torch.allclose(torch.tensor(logged_steps(tmp_path / name)),
                              torch.tensor(logged_steps(tmp_path / f"{name}-single")), rtol=1e-5)
        for key, expected in single.items():
            assert not torch.equal(expected, initial[key]) or "norm" in key, f"{name}: {key} did not train"
            for rank, state in enumerate(ranks):
                assert torch.allclose(state[key], expected, atol=1e-5), f"{name}, rank {rank}: {key}"


def test_setup_without_a_launcher_runs_alone(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    context = setup_distributed("cpu")
    assert (context.rank, context.world_size, context.is_main) == (0, 1, True)
    assert not dist.is_initialized()
    assert os.environ.get("WORLD_SIZE") is None
