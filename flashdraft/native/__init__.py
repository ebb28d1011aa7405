"""flashdraft's native C kernels (`flashdraft/csrc/`), called through ctypes: the matrix product for the few rows of
a speculative step, on float32 weights or on the same values packed in fewer bytes (bit for bit the same result),
the operators between products, attention over a decoding step's cache, and whole decoder layers and draft passes
in one call.

Compiled once per machine on first use with the system's C compiler and cached under `$FLASHDRAFT_HOME/native/`.
Where no compiler works, or with `FLASHDRAFT_NATIVE=0`, it is simply not offered: the engine's kernel choice then
picks among torch's and numpy's products as before. `unavailable_reason()` says why.

The package, by job: `build` (building, caching, loading; the C signatures), `packing` (packed weights, pure
torch), `products` (the matrix products), `ops` (norms, rotary, SwiGLU, attention), `layers` (a whole layer, a
draft's whole pass). Everything is imported from here: `from flashdraft import native; native.small_gemm(...)`.
"""

from .build import (
    CSRC,
    FLAGS,
    HEADERS,
    OPENMP_FLAG,
    SOURCES,
    available,
    build_identity,
    library,
    unavailable_reason,
)
from .build import _build as _build  # `native._build.cache_clear()` builds anew
from .build import _compiler as _compiler
from .layers import (
    LAYER_FORMATS,
    DecoderLayer,
    DraftWeights,
    decoder_layer,
    draft_block,
    pack_draft,
    pack_layer,
    unchecked_decoder_layer,
    unchecked_draft_block,
)
from .ops import (
    attention_fits,
    causal_attention,
    norm_rotary,
    rms_norm,
    swiglu,
    unchecked_causal_attention,
)
from .packing import BLOCK, FORMATS, LANES_PER_VECTOR, PackedWeight, pack, pack_bfloat16
from .products import bf16_dot_available, bf16_dot_gemm, packed_gemm, small_gemm

__all__ = [
    "BLOCK",
    "CSRC",
    "FLAGS",
    "FORMATS",
    "HEADERS",
    "LANES_PER_VECTOR",
    "LAYER_FORMATS",
    "OPENMP_FLAG",
    "SOURCES",
    "DecoderLayer",
    "DraftWeights",
    "PackedWeight",
    "attention_fits",
    "available",
    "bf16_dot_available",
    "bf16_dot_gemm",
    "build_identity",
    "causal_attention",
    "decoder_layer",
    "draft_block",
    "library",
    "norm_rotary",
    "pack",
    "pack_bfloat16",
    "pack_draft",
    "pack_layer",
    "packed_gemm",
    "rms_norm",
    "small_gemm",
    "swiglu",
    "unavailable_reason",
    "unchecked_causal_attention",
    "unchecked_decoder_layer",
    "unchecked_draft_block",
]
