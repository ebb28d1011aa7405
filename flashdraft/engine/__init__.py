"""The fast exact forward of a Llama-family target on CPU: what `TargetModel` runs instead of transformers' forward.

The same arithmetic as transformers' Llama, Qwen2 and Qwen3 (float32, same weights), organised for what a
speculative step costs on a CPU (BENCHMARKS.md, "CPU engine"): a third of a transformers one-token forward is
framework overhead, and MKL's matrix products for 2 to 16 rows (exactly a verification's shape) are its slow path.
So the engine
- runs each layer as a handful of operators: fused q/k/v and gate/up projections (the model's own weights become
  views of the fused ones, so nothing is stored twice), one rotary pass over queries and keys together, grouped
  query attention without copies (a decoding step's on the native kernel), RMSNorm and SwiGLU in one native pass;
- keeps the KV cache in preallocated tensors where rolling back a rejected block is a length (`EngineCache`);
- computes every projection through the kernel measured fastest for its weight and number of rows on this
  machine (`KernelChoice`: torch's `F.linear`, the same product transposed, numpy's BLAS, or flashdraft's own
  native kernel where a C compiler builds it, `flashdraft.native`), measured once and cached on disk like the verify
  costs;
- lets the native kernel read each weight in the fewest bytes that hold its float32 values exactly
  (`WeightForms`): a target dequantized from a GGUF checkpoint is read in its Q4_1 / Q8_0 blocks (a fifth of the
  bytes), a bfloat16 draft in bfloat16. A step of a few tokens is bound by those bytes, so this halves it; the
  products are the float32 ones, bit for bit (`FLASHDRAFT_PACKED=0` turns it off).
Every path is exact up to float32 rounding: logits match transformers' within float32 tolerance and greedy outputs
are the same (tests/test_engine.py).

A DFlash draft's pass runs here too (`DraftEngine`), in the same form on the same kernels; a bfloat16 draft's
products in 8-bit integers (AVX512_VNNI) or bfloat16 arithmetic (AVX512_BF16) where the CPU has them (proposals
never change the output, only how much of it a round accepts).

The package, by job: `settings` (every setting, read from the environment in one place), `weights` (the weights'
forms), `kernels` (the product kernels and their choice, measured once per machine), `ops` (norms, rotary, SwiGLU,
where attention runs natively), `cache` (`EngineCache`), `forward` (`Engine`, the target's forward), `draft_pass`
(`DraftEngine`). The int8 kernels and GGUF blocks are `flashdraft.quantized`; the C kernels `flashdraft.native`.
"""

from .cache import EngineCache
from .draft_pass import DraftEngine
from .forward import STATIC_ROPE_TYPES, SUPPORTED_MODEL_TYPES, Engine, unsupported_reason
from .kernels import (
    KERNEL_ROWS,
    PRODUCTS,
    KernelChoice,
    KernelLinear,
    available_products,
    cached_kernels,
    interleaved_seconds,
    measure_kernels,
    native_kernels,
)
from .ops import NATIVE_ATTENTION_QUERIES, RotaryTables, norm_rotary, rms_norm, swiglu
from .settings import ARITHMETICS, THREADING_VARIABLES, EngineSettings, arithmetic_setting
from .weights import WeightForms

__all__ = [
    "ARITHMETICS",
    "DraftEngine",
    "Engine",
    "EngineCache",
    "EngineSettings",
    "KERNEL_ROWS",
    "KernelChoice",
    "KernelLinear",
    "NATIVE_ATTENTION_QUERIES",
    "PRODUCTS",
    "RotaryTables",
    "STATIC_ROPE_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "THREADING_VARIABLES",
    "WeightForms",
    "arithmetic_setting",
    "available_products",
    "cached_kernels",
    "interleaved_seconds",
    "measure_kernels",
    "native_kernels",
    "norm_rotary",
    "rms_norm",
    "swiglu",
    "unsupported_reason",
]
