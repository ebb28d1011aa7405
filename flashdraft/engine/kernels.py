"""Which kernel computes each product: the candidates (torch, numpy's BLAS, the native kernel), the choice measured
once per machine and model shape (`measure_kernels`, `cached_kernels`), and `KernelLinear`, a draft's projection on
that choice."""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import ThreadpoolController
from torch import nn

from .. import native
from ..files import (
    BUSY_CORES,
    cache_home,
    cached_measurement,
    other_processes_cpu,
    save_measurement,
    shape_key,
)
from .settings import EngineSettings, threading_environment
from .weights import WeightForms, _aligned

KERNEL_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # rows (tokens x sequences) measured; above: torch's own
# numpy's BLAS threads busy-wait between calls and stall badly when another process holds a core (seen here: a
# forward 20x slower); one thread, inside the engine only, never oversubscribes.
_ONE_BLAS_THREAD = ThreadpoolController().select(internal_api="openblas")

ProductFn = Callable[[torch.Tensor, torch.Tensor, WeightForms], torch.Tensor]


def _torch(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    return F.linear(x, weight)


def _torch_transposed(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    # W @ x^T takes MKL's small-N gemm path, several times faster than x @ W^T for 2-8 rows here.
    return (weight @ x.T).T


def _numpy(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    # numpy's OpenBLAS: the fastest single-row product (gemv) on this CPU, by 2-3x.
    return torch.from_numpy(x.numpy() @ forms.array.T)


def _numpy_transposed(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    return torch.from_numpy(forms.array @ x.numpy().T).T


def _native(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms, parallel: bool = False) -> torch.Tensor:
    # flashdraft's own kernel: reads each weight once, so 2 to 4 rows cost what one does (csrc/f32_products.c), and
    # reads the packed form where there is one: the same result in a fraction of the bytes.
    if forms.packed is not None:
        return native.packed_gemm(x, forms.packed, parallel)
    return native.small_gemm(x, weight, parallel)


def _native_parallel(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    # The same on torch's threads: faster where the other cores are free, slower where they are busy.
    return _native(x, weight, forms, parallel=True)


PRODUCTS: dict[str, ProductFn] = {
    "torch": _torch, "torch-t": _torch_transposed, "numpy": _numpy, "numpy-t": _numpy_transposed, "native": _native,
    "native-parallel": _native_parallel,
}


NATIVE_PRODUCTS = (_native, _native_parallel)  # what a layer in one native call (`native.decoder_layer`) runs
LAYER_KINDS = ("qkv", "o", "gate_up", "down")


def available_products() -> dict[str, ProductFn]:
    """The products this machine offers: the native kernel only where it compiles (`native.unavailable_reason`)."""
    return {name: product for name, product in PRODUCTS.items()
            if not name.startswith("native") or native.available()}


def _parallel_bits(kernels: KernelChoice, window: int, rows: int, attention: bool) -> int:
    """`native.decoder_layer`'s `parallel`: which of a layer's products (q/k/v over the `window`, the rest over
    `rows`) the kernel table shares among threads, and the attention where `attention`."""
    shapes = ((1, "qkv", window), (2, "o", rows), (4, "gate_up", rows), (8, "down", rows))
    return sum(bit for bit, kind, count in shapes if kernels.product(kind, count) is _native_parallel) | (
        16 if attention else 0)


class KernelChoice:
    """The fastest product per weight kind and row count, measured on this machine (see `measure_kernels`)."""

    def __init__(self, table: dict[str, dict[int, str]]):
        self.table = table
        # numpy's BLAS runs on one thread inside the engine; limiting it costs ~13 us a call, paid only where used.
        self.uses_numpy = any(name.startswith("numpy") for by_rows in table.values() for name in by_rows.values())
        # Row counts between measured ones take the choice of the next measured count up.
        self.lookup = {
            kind: [PRODUCTS[by_rows[min((r for r in by_rows if r >= m), default=max(by_rows))]] if by_rows
                   else _torch for m in range(max(KERNEL_ROWS) + 1)]
            for kind, by_rows in table.items()
        }

    def product(self, kind: str, rows: int) -> ProductFn:
        choices = self.lookup.get(kind)
        return choices[rows] if choices is not None and rows < len(choices) else _torch


class KernelLinear(nn.Linear):
    """An `nn.Linear` (the same parameters, so the same state dict) whose inference product goes through the
    kernel measured fastest for its kind and row count; with gradients, or off CPU float32, it is `nn.Linear`."""

    kind = "qkv"
    kernels = KernelChoice({})

    @classmethod
    def replacing(cls, linear: nn.Linear, kind: str, kernels: KernelChoice) -> KernelLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        _aligned(linear.weight)
        new.weight, new.bias = linear.weight, linear.bias
        new.kind, new.kernels = kind, kernels
        new._forms, new._forms_of = None, None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != x.dtype:
            return super().forward(x)
        # The weight's forms, made again if it moved or changed in place (a packed copy would be stale).
        if self._forms_of != (weight.data_ptr(), weight._version):
            self._forms, self._forms_of = WeightForms.of(weight), (weight.data_ptr(), weight._version)
        rows = x.numel() // self.in_features
        product = self.kernels.product(self.kind, rows)
        if product in (_numpy, _numpy_transposed):
            with _ONE_BLAS_THREAD.limit(limits=1):
                out = product(x.reshape(rows, self.in_features), weight.detach(), self._forms)
        else:
            out = product(x.reshape(rows, self.in_features), weight.detach(), self._forms)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


# Which role each projection of a draft plays, for the kernel choice (measured on the target's projections).
_DRAFT_KINDS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
                "up_proj": "gate_up", "down_proj": "down", "fc": "down"}

def native_kernels(parallel: bool) -> KernelChoice:
    """Every product on the native kernel, shared among threads or not: int8 arithmetic's choice, which has no
    other kernels to measure against."""
    name = "native-parallel" if parallel else "native"
    return KernelChoice({kind: dict.fromkeys(KERNEL_ROWS, name) for kind in (*LAYER_KINDS, "head")})


def measure_kernels(engine, repeats: int = 3, progress: Callable[[int], None] | None = None) -> KernelChoice:
    """Choose each product's kernel by row count, in two steps. Alone: every kernel on the engine's own weights
    (cycling through all layers, so that weights stream from memory as in a forward), the fastest per weight kind.
    Then in context: whole forwards with that choice against each kernel for every product, the fastest kept;
    BLAS thread pools that spin (torch's OpenMP without OMP_WAIT_POLICY=PASSIVE) can make a kernel that wins alone
    lose between torch's operators, and only a whole forward shows it."""
    weights = {
        "qkv": [layer.qkv for layer in engine.layers], "o": [layer.o for layer in engine.layers],
        "gate_up": [layer.gate_up for layer in engine.layers], "down": [layer.down for layer in engine.layers],
        "head": [engine.head_weight],
    }
    context = 128
    ids = torch.randint(0, engine.embed.shape[0], (1, context + max(KERNEL_ROWS)))
    positions = torch.arange(ids.shape[1])[None]
    cache = engine.new_cache()
    engine.kernels = KernelChoice({})
    engine.forward(ids[:, :context], positions[:, :context], cache, logits_to_keep=1)
    table: dict[str, dict[int, str]] = {kind: {} for kind in weights}
    products = available_products()
    for rows in KERNEL_ROWS:
        if progress:
            progress(rows)
        alone = {}
        for kind, kind_weights in weights.items():
            x = torch.randn(rows, kind_weights[0].shape[1])
            seconds = interleaved_seconds(
                {name: partial(_products, product, x, kind_weights, engine.forms)
                 for name, product in products.items()},
                repeats,
            )
            alone[kind] = min(seconds, key=seconds.__getitem__)
        candidates = [alone] + [dict.fromkeys(weights, name) for name in products]
        window = slice(context, context + rows)
        seconds = interleaved_seconds(
            {i: partial(_forward_with, engine, {kind: {rows: name} for kind, name in candidate.items()},
                        ids[:, window], positions[:, window], cache) for i, candidate in enumerate(candidates)},
            repeats,
        )
        for kind, name in candidates[min(seconds, key=seconds.__getitem__)].items():
            table[kind][rows] = name
    engine.kernels = KernelChoice(table)
    return engine.kernels


def _products(product: ProductFn, x: torch.Tensor, weights: list[torch.Tensor], forms: dict) -> None:
    for weight in weights:
        product(x, weight, forms[id(weight)])


def _forward_with(engine, table: dict, input_ids: torch.Tensor, positions: torch.Tensor,
                  cache) -> None:
    """One forward with the kernels of `table`, rolled back."""
    engine.kernels = KernelChoice(table)
    engine.forward(input_ids, positions, cache)
    cache.crop(-input_ids.shape[1])


def interleaved_seconds(works: dict, repeats: int, summary: Callable[[list[float]], float] = min) -> dict:
    """Seconds of each work, run in turns (a new seeded order each turn, after one warm-up turn) so that a change
    in the machine's load touches them all alike, summarised over the `repeats` turns. The least by default: other
    processes only ever add time, and a choice made once and cached must not follow the load of the moment it was
    measured. The order is shuffled rather than rotated because a rotation keeps each work's predecessor: a work
    that always follows one that evicts its weights from the caches (another model's, say) would always run cold."""
    times: dict = {key: [] for key in works}
    keys, order = list(works), random.Random(0)
    for turn in range(repeats + 1):
        order.shuffle(keys)
        for key in keys:
            began = time.perf_counter()
            works[key]()
            if turn:
                times[key].append(time.perf_counter() - began)
    return {key: summary(spent) for key, spent in times.items()}


def cached_kernels(engine, progress: bool = True) -> KernelChoice:
    """`measure_kernels`, once per model shape, thread count and library versions, then read from disk."""
    identity = json.dumps(
        {
            "model": shape_key(engine.config),
            "threads": torch.get_num_threads(),
            # Whether torch's threads spin between operators decides which kernels win (see measure_kernels).
            "environment": threading_environment(),
            "settings": EngineSettings.from_environment().key(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "native": native.build_identity(),
            # Packed weights change which kernel wins.
            "packed": engine.packed_formats(),
        },
        sort_keys=True,
    )
    path = cache_home() / "kernels" / f"{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"
    saved = cached_measurement(path)
    if saved is not None:
        try:
            table = {kind: {int(m): name for m, name in by_rows.items()} for kind, by_rows in saved.items()}
            if all(name in available_products() for by_rows in table.values() for name in by_rows.values()):
                return KernelChoice(table)
        except (ValueError, AttributeError):
            pass  # a damaged file is measured again and replaced
    from tqdm.auto import tqdm

    busy = other_processes_cpu() >= BUSY_CORES
    with tqdm(total=len(KERNEL_ROWS), desc="measuring this machine's fastest kernels (once per model shape)",
              unit="shape", leave=False, disable=not progress) as bar:
        choice = measure_kernels(engine, progress=lambda rows: bar.update())
    save_measurement(path, choice.table, busy)
    return choice
