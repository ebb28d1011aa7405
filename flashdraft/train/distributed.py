"""Multi-process training on torch.distributed: the same trainer under `torchrun` or `accelerate launch`.

Both launchers start one process per device and set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
`setup_distributed` reads them and joins the process group (NCCL on GPUs, gloo on CPUs). The trainer then wraps
the draft in DistributedDataParallel, gives each process its own slice of every global batch, and normalises
the loss by the weight of the whole global batch, so that one step of N processes equals one step of a single
process on the same global batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job, and the device it trains on."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str | None = None) -> Distributed:
    """Join the process group when launched by torchrun / accelerate launch (WORLD_SIZE > 1), else run alone.

    `device` None picks the process's GPU (cuda:LOCAL_RANK) when there is one, else the CPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return Distributed(dist.get_rank(), dist.get_world_size(), device)
    return Distributed(device=device)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over all processes (itself when running alone). Works in place and returns it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(value):
    """Rank 0's `value` on every process (itself when running alone)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
