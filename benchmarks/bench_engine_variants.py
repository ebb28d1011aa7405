"""One engine operator in two forms, inside whole forwards of the default target: T(n) after a cached context, the
two forms in alternating turns (40 each), least and median.

    python benchmarks/bench_engine_variants.py rms-norm      # the native RMSNorm against torch's F.rms_norm
    python benchmarks/bench_engine_variants.py attention --contexts 200 1000 --tokens 1 4 8 16
                                                          # native attention against torch's fused kernel
    python benchmarks/bench_engine_variants.py rotary        # native norm + rotary against torch's operators
    python benchmarks/bench_engine_variants.py layers        # each layer one native call against its operators

The operator variants run each layer operator by operator (`Engine.use_native_layers` off), where they apply.

Like the CLI, it chooses how torch's threads wait before torch loads. Pause background work first: it times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from flashdraft.files import choose_thread_waiting  # noqa: E402

choose_thread_waiting()  # as the CLI does, before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashdraft.engine import forward as engine_module  # noqa: E402
from flashdraft.models import load_target  # noqa: E402
from flashdraft.target import TargetModel  # noqa: E402

TURNS = 40


def norm_forms(engine) -> dict[str, Callable[[], None]]:
    native = engine_module.rms_norm

    def use(norm):
        return lambda: setattr(engine_module, "rms_norm", norm)

    return {"native": use(native), "torch": use(lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps))}


def attention_forms(engine) -> dict[str, Callable[[], None]]:
    return {"native": lambda: setattr(engine, "native_attention", True),
            "torch": lambda: setattr(engine, "native_attention", False)}


def rotary_forms(engine) -> dict[str, Callable[[], None]]:
    native = engine_module.norm_rotary

    def torch_rotary(x, cos, signed_sin, norm, eps):
        if norm is not None:
            x = F.rms_norm(x, x.shape[-1:], None, eps) * norm
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)

    return {"native": lambda: setattr(engine_module, "norm_rotary", native),
            "torch": lambda: setattr(engine_module, "norm_rotary", torch_rotary)}


def layer_forms(engine) -> dict[str, Callable[[], None]]:
    return {"native": lambda: setattr(engine, "use_native_layers", True),
            "operators": lambda: setattr(engine, "use_native_layers", False)}


VARIANTS = {"rms-norm": norm_forms, "attention": attention_forms, "rotary": rotary_forms, "layers": layer_forms}


def step(engine, cache, context: int, n: int) -> None:
    """One forward of n tokens after `context` cached ones, then back to the context."""
    engine.forward(torch.arange(n)[None] + 5, torch.arange(context, context + n)[None], cache)
    cache.crop(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("--contexts", type=int, nargs="+", default=[200], help="cached tokens before the step")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="tokens in the step")
    args = parser.parse_args()
    engine = TargetModel(load_target("smollm2-135m-instruct")[0]).engine
    forms = VARIANTS[args.variant](engine)
    engine.use_native_layers = args.variant == "layers"  # an operator's forms show only operator by operator
    restore = forms["native"]
    try:
        for context in args.contexts:
            cache = engine.new_cache()
            engine.forward(torch.arange(context)[None] % 1000, torch.arange(context)[None], cache)

            for n in args.tokens:
                for _ in range(5):
                    step(engine, cache, context, n)
                times: dict[str, list[float]] = {name: [] for name in forms}
                for _ in range(TURNS):
                    for name, use in forms.items():
                        use()
                        began = time.perf_counter()
                        step(engine, cache, context, n)
                        times[name].append(time.perf_counter() - began)
                figures = [f"{name} {min(spent) * 1e3:.2f} ms least, {statistics.median(spent) * 1e3:.2f} median"
                           for name, spent in times.items()]
                print(f"{args.variant}, context {context}, T({n}): " + "; ".join(figures))
    finally:
        restore()


if __name__ == "__main__":
    main()
