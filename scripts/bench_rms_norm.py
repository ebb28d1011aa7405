"""The engine's RMSNorm on the native kernel against torch's `F.rms_norm`, inside whole forwards of the default
target: T(1) and T(4) after 200 cached tokens, the two norms in alternating turns (40 each), least and median.

    python scripts/bench_rms_norm.py

Like the CLI, it chooses how torch's threads wait before torch loads. Pause background work first: it times.
"""

from __future__ import annotations

import statistics
import time

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashdraft import engine as engine_module  # noqa: E402
from flashdraft.models import load_target  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402

CONTEXT, TURNS = 200, 40


def main() -> None:
    engine = TargetModel(load_target("smollm2-135m-instruct")[0]).engine
    cache = engine.new_cache()
    engine.forward(torch.arange(CONTEXT)[None], torch.arange(CONTEXT)[None], cache)
    norms = {"native": engine_module.rms_norm, "torch": lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps)}

    def step(n: int) -> None:
        engine.forward(torch.arange(n)[None] + 5, torch.arange(CONTEXT, CONTEXT + n)[None], cache)
        cache.crop(CONTEXT)

    try:
        for n in (1, 4):
            for _ in range(5):
                step(n)
            times: dict[str, list[float]] = {name: [] for name in norms}
            for _ in range(TURNS):
                for name, norm in norms.items():
                    engine_module.rms_norm = norm
                    began = time.perf_counter()
                    step(n)
                    times[name].append(time.perf_counter() - began)
            figures = [f"{name} norm {min(spent) * 1e3:.2f} ms least, {statistics.median(spent) * 1e3:.2f} median"
                       for name, spent in times.items()]
            print(f"T({n}): " + "; ".join(figures))
    finally:
        engine_module.rms_norm = norms["native"]


if __name__ == "__main__":
    main()
