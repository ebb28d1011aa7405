"""flashdraft's native matrix product for the few rows of a speculative step (`csrc/small_gemm.c`), on float32
weights or on the same values packed in fewer bytes (`pack`: a weight dequantized from a GGUF checkpoint's Q4_1 or
Q8_0, or a bfloat16 one), bit for bit the same result.

Compiled once per machine on first use with the system's C compiler (`$CC`, else `cc`) for this very CPU
(`-march=native`, with OpenMP where the compiler has it), cached under `$FLASHDRAFT_HOME/native/`, and called
through ctypes. Where no compiler works, or with `FLASHDRAFT_NATIVE=0`, it is simply not offered: the engine's
kernel choice then picks among torch's and numpy's products as before. `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .files import cache_home

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("small_gemm.c", "block_gemm.c"))
HEADERS = (Path(__file__).parent / "csrc" / "kernels.h",)
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")
OPENMP_FLAG = "-fopenmp"  # tried first, for `small_gemm_parallel`; without it that is the serial kernel
COMPILE_SECONDS = 120


def _cpu_description() -> str:
    """The CPU's model and features, so that a library built for one CPU is never loaded on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(library, None, build identity) when it builds and loads, else (None, the reason, None)."""
    if os.environ.get("FLASHDRAFT_NATIVE", "1") == "0":
        return None, "turned off by FLASHDRAFT_NATIVE=0", None
    compiler = _compiler()
    if compiler is None:
        return None, f"no C compiler found ({os.environ.get('CC') or 'cc'}; set CC, or install gcc)", None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the C compiler {compiler} does not run: {error}", None
    identity = hashlib.sha256(
        "\0".join([*(path.read_text() for path in (*SOURCES, *HEADERS)), compiler, version, " ".join(FLAGS),
                   platform.machine(), _cpu_description()])
        .encode()
    ).hexdigest()[:20]
    library = cache_home() / "native" / f"small_gemm-{identity}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed into place: a reader never loads half a library.
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            for flags in ((*FLAGS, OPENMP_FLAG), FLAGS):
                try:
                    result = subprocess.run([compiler, *flags, "-o", str(built), *map(str, SOURCES)],
                                            capture_output=True, text=True, timeout=COMPILE_SECONDS)
                except (OSError, subprocess.SubprocessError) as error:
                    return None, f"compiling the native kernels failed: {error}", None
                if result.returncode == 0:
                    break
            else:
                last = (result.stderr.strip().splitlines() or ["no message"])[-1]
                return None, f"compiling the native kernels with {compiler} failed: {last}", None
            built.replace(library)
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as error:
        return None, f"loading {library} failed: {error}", None
    for function in (loaded.small_gemm, loaded.small_gemm_parallel):
        function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
        function.restype = None
    for function in (loaded.packed_gemm, loaded.packed_gemm_parallel):
        function.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3
        function.restype = None
    for function in (loaded.bf16_dot_gemm, loaded.bf16_dot_gemm_parallel):
        function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
        function.restype = None
    loaded.bf16_dot_available.restype = ctypes.c_int
    loaded.rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                ctypes.c_long, ctypes.c_long, ctypes.c_float]
    loaded.rms_norm.restype = None
    loaded.swiglu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
    loaded.norm_rotary.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_float,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    loaded.norm_rotary.restype = None
    loaded.swiglu.restype = None
    loaded.causal_attention.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_long] * 8 + [ctypes.c_void_p, ctypes.c_float]
                                        + [ctypes.c_int] * 2)
    loaded.causal_attention.restype = None
    loaded.decoder_layer.argtypes = ([ctypes.POINTER(_DecoderLayer)] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 7
                                     + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_float]
                                     + [ctypes.c_int] * 2)
    loaded.decoder_layer.restype = None
    loaded.draft_block.argtypes = ([ctypes.POINTER(_DraftWeights)] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 7
                                   + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_int]
                                   + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 3)
    loaded.draft_block.restype = None
    loaded.block_gemm.argtypes = ([ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 2
                                  + [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_int] * 2)
    loaded.block_gemm.restype = None
    loaded.block_gemm_version.restype = ctypes.c_char_p
    return loaded, None, identity


def library() -> ctypes.CDLL:
    """The loaded native library, or a RuntimeError saying why there is none."""
    loaded = _build()[0]
    if loaded is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    return loaded


def available() -> bool:
    return _build()[0] is not None


def unavailable_reason() -> str | None:
    """Why the native kernel is not offered here, or None when it is."""
    return _build()[1]


def build_identity() -> str | None:
    """What identifies the build in use (source, compiler, flags, CPU), or None when unavailable."""
    return _build()[2]


def small_gemm(x: torch.Tensor, weight: torch.Tensor, parallel: bool = False) -> torch.Tensor:
    """`x @ weight.T` for a float32 CPU `x` [M, K] and a contiguous `weight` [N, K], on the native kernel: on the
    calling thread, or with `parallel` shared among torch's threads (the same result either way)."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    if {x.dtype, weight.dtype} != {torch.float32} or {x.device.type, weight.device.type} != {"cpu"}:
        raise ValueError(f"the native kernel takes float32 CPU tensors, not {x.dtype} on {x.device} and "
                         f"{weight.dtype} on {weight.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"the native kernel multiplies [M, K] by [N, K]^T, not {tuple(x.shape)} by "
                         f"{tuple(weight.shape)}^T")
    if not weight.is_contiguous():
        raise ValueError("the native kernel reads the weight in place: it must be contiguous")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0])
    function = library.small_gemm_parallel if parallel else library.small_gemm
    function(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return out


# Packed weights (csrc/small_gemm.c): the format's code in the kernel, and the block of weights along K that shares
# one scale.
FORMATS = {"bf16": 1, "q8_0": 2, "q4_1": 3}
BLOCK = 32
LANES_PER_VECTOR = 16  # the kernel unpacks whole vectors of 16 weights: K must be a multiple


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight [N, K] held exactly in fewer bytes (see `pack`): what the native kernel reads instead; or,
    for a draft's products only, rounded to bfloat16 (`pack_bfloat16`)."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor  # bf16: int16 [N, K]; q8_0: int8 [N, K]; q4_1: uint8 [N, K / 2]
    scale: torch.Tensor | None = None  # float32 [N, K / 32]
    minimum: torch.Tensor | None = None  # float32 [N, K / 32], q4_1 only

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum) if t is not None)

    def unpack(self) -> torch.Tensor:
        """The float32 weight again (in torch, for tests and checks)."""
        n, k = self.shape
        if self.format == "bf16":
            return self.data.view(torch.bfloat16).float()
        if self.format == "q8_0":
            return torch.mul(self.data.float().view(n, k // BLOCK, BLOCK), self.scale[..., None]).view(n, k)
        low, high = self.data.view(n, k // BLOCK, BLOCK // 2) & 15, self.data.view(n, k // BLOCK, BLOCK // 2) >> 4
        q = torch.cat([low, high], dim=-1).float()
        return torch.add(torch.mul(self.scale[..., None], q), self.minimum[..., None]).view(n, k)


def _float16_neighbours(values: torch.Tensor) -> list[torch.Tensor]:
    """The float16 value nearest each of `values` and the two either side of it, as float32: the candidates for a
    block's scale, which quantizers store in float16."""
    bits = values.half().view(torch.int16)
    return [(bits + step).view(torch.float16).float() for step in (0, 1, -1)]


def _blocks_by_candidates(blocks: torch.Tensor, candidates: list[torch.Tensor], rebuild) -> tuple | None:
    """For each block, the first candidate scale whose quantization `rebuild(scale) -> (q, values)` gives the block's
    values exactly. Returns (scale, q) for all blocks, or None when some block has no such scale."""
    scale = torch.zeros(blocks.shape[:-1] + (1,))
    q_all = torch.zeros(blocks.shape, dtype=torch.int16)
    found = torch.zeros(blocks.shape[:-1] + (1,), dtype=torch.bool)
    for candidate in candidates:
        q, values = rebuild(candidate)
        exact = (values == blocks).all(-1, keepdim=True) & ~found
        scale = torch.where(exact, candidate, scale)
        q_all = torch.where(exact, q, q_all)
        found |= exact
        if bool(found.all()):
            return scale[..., 0], q_all
    return None


def _pack_q4_1(weight: torch.Tensor) -> PackedWeight | None:
    n, k = weight.shape
    blocks = weight.view(n, k // BLOCK, BLOCK)
    minimum = blocks.amin(-1, keepdim=True)
    if not torch.equal(minimum.half().float(), minimum):  # GGUF stores it in float16: not a Q4_1 weight
        return None

    def rebuild(scale):
        q = torch.where(scale > 0, (blocks - minimum) / scale, 0.0).round_().clamp_(0, 15)
        return q.to(torch.int16), torch.add(torch.mul(scale, q), minimum)  # two roundings, as GGUF's dequantization

    found = _blocks_by_candidates(blocks, _float16_neighbours((blocks.amax(-1, keepdim=True) - minimum) / 15), rebuild)
    if found is None:
        return None
    scale, q = found
    data = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).to(torch.uint8).reshape(n, k // 2)
    return PackedWeight("q4_1", (n, k), data, scale.contiguous(), minimum[..., 0].contiguous())


def _pack_q8_0(weight: torch.Tensor) -> PackedWeight | None:
    n, k = weight.shape
    blocks = weight.view(n, k // BLOCK, BLOCK)

    def rebuild(scale):
        q = torch.where(scale > 0, blocks / scale, 0.0).round_().clamp_(-128, 127)
        return q.to(torch.int16), torch.mul(q, scale)

    found = _blocks_by_candidates(blocks, _float16_neighbours(blocks.abs().amax(-1, keepdim=True) / 127), rebuild)
    if found is None:
        return None
    scale, q = found
    return PackedWeight("q8_0", (n, k), q.to(torch.int8).reshape(n, k), scale.contiguous())


def pack_bfloat16(weight: torch.Tensor) -> PackedWeight:
    """`weight` (float32 [N, K]) rounded to bfloat16 (to nearest) and packed so: exact only for a bfloat16 weight
    (`pack` checks that), an approximation for `bf16_dot_gemm` otherwise."""
    return PackedWeight("bf16", tuple(weight.shape), weight.bfloat16().view(torch.int16).contiguous())


def _pack_bf16(weight: torch.Tensor) -> PackedWeight | None:
    packed = pack_bfloat16(weight)
    return packed if torch.equal(packed.unpack(), weight) else None


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` (float32 [N, K]) in the most compact form that holds every one of its values exactly: GGUF's Q4_1
    (0.75 bytes a weight here) or Q8_0 (1.125) for a weight dequantized from those, bfloat16 (2) for a bfloat16 one;
    None when no form does (or the shape does not suit one). Cheap for weights that are none of these: each form
    is first tried on a few rows."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    weight = weight.detach().contiguous()
    n, k = weight.shape
    if k % LANES_PER_VECTOR:
        return None
    packers = ([_pack_q4_1, _pack_q8_0] if k % BLOCK == 0 else []) + [_pack_bf16]
    for packer in packers:
        if packer(weight[:8]) is not None:
            packed = packer(weight)
            if packed is not None:
                return packed
    return None



def packed_gemm(x: torch.Tensor, weight: PackedWeight, parallel: bool = False) -> torch.Tensor:
    """`x @ W.T` for the float32 weight W that `weight` packs, on the native kernel: the same result, bit for bit,
    as `small_gemm(x, W)`, reading a fraction of the bytes."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"the native kernel multiplies float32 [M, {weight.shape[1]}] on CPU by the packed weight, "
                         f"not {x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0])
    function = library.packed_gemm_parallel if parallel else library.packed_gemm
    scale = weight.scale.data_ptr() if weight.scale is not None else None
    minimum = weight.minimum.data_ptr() if weight.minimum is not None else None
    function(FORMATS[weight.format], x.data_ptr(), weight.data.data_ptr(), scale, minimum, out.data_ptr(),
             x.shape[0], weight.shape[0], x.shape[1])
    return out


def bf16_dot_available() -> bool:
    """Whether the kernel was built with bfloat16 dot products (a CPU with AVX512_BF16, e.g. AMD Zen 4, Intel
    Cooper Lake and Sapphire Rapids), for `bf16_dot_gemm`."""
    library = _build()[0]
    return library is not None and bool(library.bf16_dot_available())


def bf16_dot_gemm(x: torch.Tensor, weight: PackedWeight, parallel: bool = False) -> torch.Tensor:
    """`x @ W.T` in bfloat16 arithmetic for a bfloat16-packed W: x rounded to bfloat16 (to nearest), each pair of
    products summed into float32. Not the float32 product (x loses its low bits): for a draft's proposals, never
    for the target's logits. K must be a multiple of 32 (`BLOCK`)."""
    if not bf16_dot_available():
        raise RuntimeError("bfloat16 dot products are unavailable here: the native kernel was not built for a CPU "
                           f"with AVX512_BF16 ({unavailable_reason() or 'this CPU lacks it'})")
    _check_dot_inputs("bf16_dot_gemm", x, weight, "bf16", BLOCK)
    rounded = x.to(torch.bfloat16).contiguous()
    out = torch.empty(x.shape[0], weight.shape[0])
    library = _build()[0]
    function = library.bf16_dot_gemm_parallel if parallel else library.bf16_dot_gemm
    function(rounded.data_ptr(), weight.data.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return out


def _check_dot_inputs(name: str, x: torch.Tensor, weight: PackedWeight, form: str, k_multiple: int) -> None:
    """A draft product's inputs: a `form`-packed weight with K a multiple of `k_multiple`, x float32 [M, K] on CPU."""
    if weight.format != form or weight.shape[1] % k_multiple:
        raise ValueError(f"{name} takes a {form}-packed weight with K a multiple of {k_multiple}, not "
                         f"{weight.format} {weight.shape}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name} multiplies float32 [M, {weight.shape[1]}] on CPU by the packed weight, "
                         f"not {x.dtype} {tuple(x.shape)} on {x.device}")


class _LayerWeight(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int), ("data", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("rows", ctypes.c_long), ("parts", ctypes.c_long)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qk_norm", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("qkv", _LayerWeight), ("o", _LayerWeight),
                ("gate_up", _LayerWeight), ("down", _LayerWeight)]


# a product's weight in `decoder_layer` (csrc: layer_weight)
LAYER_FORMATS = {"float32": 0, **FORMATS, "blocks": 5}


@dataclass
class DecoderLayer:
    """One decoder layer's weights for `decoder_layer` (make it with `pack_layer`): the kernel's table of pointers,
    the tensors they point into (held here, so that they live as long as it) and the layer's shapes."""

    table: _DecoderLayer
    tensors: tuple
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int


def _layer_weight(what: str, weight, expected: tuple[int, int]) -> _LayerWeight:
    """A product's weight as the native layer kernels read it (csrc: layer_weight), checked against its shape."""
    if getattr(weight, "format", None) == "blocks":  # GGUF blocks for int8 arithmetic (`quantized.FusedBlocks`)
        table = _LayerWeight(LAYER_FORMATS["blocks"], ctypes.addressof(weight.tables), None, None, weight.shape[0],
                             len(weight.parts))
        form, shape, usable = "blocks", tuple(weight.shape), True
    elif isinstance(weight, PackedWeight):
        form, shape, usable = weight.format, tuple(weight.shape), True
        table = _LayerWeight(LAYER_FORMATS[form], weight.data.data_ptr(),
                             weight.scale.data_ptr() if weight.scale is not None else None,
                             weight.minimum.data_ptr() if weight.minimum is not None else None, shape[0])
    else:
        form, shape = "float32", tuple(weight.shape)
        usable = weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
        table = _LayerWeight(0, weight.data_ptr(), None, None, shape[0])
    if not usable or shape != expected:
        raise ValueError(f"{what} must be {expected} (float32 and contiguous, packed, or in 8-bit blocks), not "
                         f"{form} {shape}")
    return table


def pack_layer(input_norm: torch.Tensor, post_norm: torch.Tensor, qk_norm: torch.Tensor | None,
               qkv_bias: torch.Tensor | None, qkv: torch.Tensor | PackedWeight, o: torch.Tensor | PackedWeight,
               gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight, heads: int, kv_heads: int,
               head_dim: int) -> DecoderLayer:
    """A Llama/Qwen-style layer (or a DFlash draft's) for `decoder_layer`: its norms (float32 [d]; the q/k norms
    [heads + kv_heads, head_dim] or None), the q/k/v bias or None, and its products, each a float32 weight or a
    packed one (`pack`'s exact forms), or GGUF-style blocks for int8 products (`quantized.FusedBlocks`): q/k/v fused
    [(heads + 2 kv_heads) head_dim, d], o [d, heads head_dim], gate/up fused [2F, d], down [d, F]."""
    if not attention_fits(heads, kv_heads, head_dim):
        raise ValueError(f"a native layer takes heads a multiple of the key/value heads and head_dim 64 or 128, not "
                         f"{heads} heads over {kv_heads} of {head_dim}")
    d, features = input_norm.shape[0], gate_up.shape[0] // 2
    products = {"qkv": qkv, "o": o, "gate_up": gate_up, "down": down}
    expected = {"qkv": ((heads + 2 * kv_heads) * head_dim, d), "o": (d, heads * head_dim),
                "gate_up": (2 * features, d), "down": (d, features)}
    table = {name: _layer_weight(f"a native layer's {name}", weight, expected[name])
             for name, weight in products.items()}
    vectors = {"input_norm": (input_norm, (d,)), "post_norm": (post_norm, (d,)),
               "qk_norm": (qk_norm, (heads + kv_heads, head_dim)),
               "qkv_bias": (qkv_bias, ((heads + 2 * kv_heads) * head_dim,))}
    kept = {}
    for name, (vector, shape) in vectors.items():
        if vector is not None and (vector.dtype != torch.float32 or tuple(vector.shape) != shape):
            raise ValueError(f"a native layer's {name} must be float32 {shape}, not {vector.dtype} "
                             f"{tuple(vector.shape)}")
        kept[name] = vector.contiguous() if vector is not None else None
    pointers = [v.data_ptr() if v is not None else None for v in kept.values()]
    return DecoderLayer(_DecoderLayer(*pointers, *table.values()), (*kept.values(), *products.values()), d, heads,
                        kv_heads, head_dim)


def decoder_layer(layer: DecoderLayer, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                  context: torch.Tensor | None, cos: torch.Tensor, signed_sin: torch.Tensor, start: int, eps: float,
                  causal: bool = True, parallel: int = 0, first_key: torch.Tensor | None = None) -> None:
    """One decoder layer in a single native call, for the few rows of a decoding step: `hidden` [q, d] (updated in
    place) over the window [context ; hidden] (`context` [w, d], already normalized rows that give keys and values
    but no queries: a DFlash draft's new context; None for a target), whose keys and values go to the layer's cache
    `keys`/`values` [kv_heads, capacity, head_dim] at positions start..start+w+q-1; each query attends over the cache
    up to its own position (`causal`) or to the window's end (a draft's block). `cos`/`signed_sin` [w + q, head_dim]
    (`RotaryTables` rows of the window's positions). Bits of `parallel` share among threads: 1 q/k/v, 2 o, 4
    gate/up, 8 down, 16 attention. The same result, bit for bit, as the same kernels called one by one.

    Several sequences at once (a batch, without a context): a cache [b, kv_heads, capacity, head_dim], `hidden`
    [b * q, d] (each sequence's q rows in turn), tables [b * q, head_dim], and `first_key` (int64 [b], or None for
    0) the first cache position each sequence sees, after its left padding: each row's result is the one it gets
    alone."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    d, kv_heads, head_dim = layer.hidden_size, layer.kv_heads, layer.head_dim
    if context is None:
        context = hidden[:0]
    batch = keys.shape[0] if keys.dim() == 4 else 1
    rows, width, capacity = hidden.shape[0], context.shape[0], keys.shape[-2]
    block = rows // batch
    tensors = (keys, values, hidden, context, cos, signed_sin)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or hidden.shape != (batch * block, d) or context.shape != (width, d) or (batch > 1 and width)
            or keys.shape != values.shape or keys.shape[-3:] != (kv_heads, capacity, head_dim)
            or cos.shape != signed_sin.shape or cos.shape != (width + rows, head_dim) or start < 0
            or start + width + block > capacity):
        raise ValueError(f"decoder_layer takes contiguous float32 CPU hidden [q, {d}], context [w, {d}], a cache "
                         f"[{kv_heads}, capacity, {head_dim}] with room for the window at {start}, and tables [w + q, "
                         f"{head_dim}] (or for b sequences without a context, hidden [b * q, {d}], a cache [b, "
                         f"{kv_heads}, capacity, {head_dim}] and tables [b * q, {head_dim}]); not "
                         f"{tuple(hidden.shape)}, {tuple(context.shape)}, {tuple(keys.shape)}, {tuple(cos.shape)}")
    if first_key is not None and (first_key.dtype != torch.int64 or tuple(first_key.shape) != (batch,)
                                  or not first_key.is_contiguous() or bool((first_key < 0).any())
                                  or bool((first_key > start).any())):
        raise ValueError(f"decoder_layer's first_key must be int64 [{batch}], each between 0 and the window's start "
                         f"{start}, not {first_key.dtype} {tuple(first_key.shape)}")
    unchecked_decoder_layer(layer, keys, values, hidden, context, cos, signed_sin, start, eps, causal, parallel,
                            first_key, batch)


def unchecked_decoder_layer(layer: DecoderLayer, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                            context: torch.Tensor | None, cos: torch.Tensor, signed_sin: torch.Tensor, start: int,
                            eps: float, causal: bool = True, parallel: int = 0, first_key: torch.Tensor | None = None,
                            batch: int = 1) -> None:
    """`decoder_layer` without its checks, for a caller that guarantees them: the engine, whose caches and tables
    have that layout by construction."""
    rows = hidden.shape[0]
    width = context.shape[0] if context is not None else 0
    _build()[0].decoder_layer(ctypes.byref(layer.table), keys.data_ptr(), values.data_ptr(), hidden.data_ptr(),
                              context.data_ptr() if context is not None else None, batch, width, rows // batch,
                              layer.hidden_size, layer.heads, layer.kv_heads, layer.head_dim, cos.data_ptr(),
                              signed_sin.data_ptr(), keys.shape[-2], start,
                              first_key.data_ptr() if first_key is not None else None, eps, int(causal), parallel)


class _DraftWeights(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_DecoderLayer)), ("num_layers", ctypes.c_long), ("fc", _LayerWeight),
                ("head", _LayerWeight), ("hidden_norm", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("embedding", ctypes.c_void_p)]


@dataclass
class DraftWeights:
    """A DFlash draft's weights for `draft_block` (make them with `pack_draft`): the kernel's table and what it
    points into, held here so that they live as long as it."""

    table: _DraftWeights
    tensors: tuple
    layers: list[DecoderLayer]
    feature_size: int  # the target features' width the fc reads: (target layers read) x hidden size
    vocab_size: int  # the head's rows
    embedding_rows: int


def pack_draft(layers: list[DecoderLayer], fc: torch.Tensor | PackedWeight, hidden_norm: torch.Tensor,
               norm: torch.Tensor, head: torch.Tensor | PackedWeight, embedding: torch.Tensor) -> DraftWeights:
    """A DFlash draft for `draft_block`: its layers (`pack_layer`), fc [d, k d] and head [V, d] (float32, packed,
    or 8-bit, as a layer's products), its norms (float32 [d]) and the target's input embedding [vocab, d]."""
    first = layers[0]
    d = first.hidden_size
    if any((layer.hidden_size, layer.heads, layer.kv_heads, layer.head_dim)
           != (d, first.heads, first.kv_heads, first.head_dim) for layer in layers):
        raise ValueError("a native draft's layers must all have the same shapes")
    fc_shape, head_shape = tuple(fc.shape), tuple(head.shape)
    fc_table = _layer_weight("a native draft's fc", fc, (d, fc_shape[1]))
    head_table = _layer_weight("a native draft's head", head, (head_shape[0], d))
    for name, vector, shape in (("hidden_norm", hidden_norm, (d,)), ("norm", norm, (d,)),
                                ("embedding", embedding, (embedding.shape[0], d))):
        if vector.dtype != torch.float32 or vector.device.type != "cpu" or tuple(vector.shape) != shape:
            raise ValueError(f"a native draft's {name} must be float32 {shape} on the CPU, not {vector.dtype} "
                             f"{tuple(vector.shape)}")
    hidden_norm, norm, embedding = hidden_norm.contiguous(), norm.contiguous(), embedding.contiguous()
    tables = (_DecoderLayer * len(layers))(*(layer.table for layer in layers))
    table = _DraftWeights(tables, len(layers), fc_table, head_table, hidden_norm.data_ptr(), norm.data_ptr(),
                          embedding.data_ptr())
    return DraftWeights(table, (tables, fc, head, hidden_norm, norm, embedding), layers, fc_shape[1], head_shape[0],
                        embedding.shape[0])


def draft_block(draft: DraftWeights, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                block_ids: Sequence[int], features: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                start: int, eps: float, first: int, rows: int, vocab_ids: torch.Tensor | None = None,
                parallel: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash draft's whole pass for one sequence in a single native call: the block `block_ids` embedded,
    the new context `features` [w, k d] through fc and its norm, every layer (`decoder_layer`, the block seeing
    all of itself; layer i's cache `keys[i]`/`values[i]` [kv_heads, capacity, head_dim] written at start..start+w+q-1),
    the final norm and head for the block's rows first..first+rows-1. Returns their logits [rows, V] and each
    row's first largest (as an id of `vocab_ids` where given). `cos`/`signed_sin` [w + q, head_dim]. Bits of
    `parallel`: the layers' (`decoder_layer`), 32 fc, 64 the head. The same, bit for bit, as those steps one by one."""
    if not available():
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    layer = draft.layers[0]
    block, width = len(block_ids), features.shape[0]
    if len(keys) != len(draft.layers) or len(values) != len(draft.layers):
        raise ValueError(f"draft_block takes a cache for each of the draft's {len(draft.layers)} layers, not "
                         f"{len(keys)} and {len(values)}")
    capacity = keys[0].shape[1]
    cache_shape = (layer.kv_heads, capacity, layer.head_dim)
    tensors = (*keys, *values, features, cos, signed_sin)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or any(tuple(t.shape) != cache_shape for t in (*keys, *values))
            or tuple(features.shape) != (width, draft.feature_size) or cos.shape != signed_sin.shape
            or tuple(cos.shape) != (width + block, layer.head_dim) or start < 0 or start + width + block > capacity
            or not 0 <= first <= first + rows <= block or rows < 1
            or not all(0 <= token < draft.embedding_rows for token in block_ids)):
        raise ValueError(f"draft_block takes contiguous float32 CPU features [w, {draft.feature_size}], caches "
                         f"[{layer.kv_heads}, capacity, {layer.head_dim}] with room for the window at {start}, tables "
                         f"[w + q, {layer.head_dim}], block ids below {draft.embedding_rows} and rows within the "
                         f"block; not {tuple(features.shape)}, {tuple(keys[0].shape)}, {tuple(cos.shape)}, "
                         f"{list(block_ids)}, rows {first}..{first + rows - 1}")
    if vocab_ids is not None and (vocab_ids.dtype != torch.int64 or tuple(vocab_ids.shape) != (draft.vocab_size,)):
        raise ValueError(f"draft_block's vocab_ids must be int64 [{draft.vocab_size}], not {vocab_ids.dtype} "
                         f"{tuple(vocab_ids.shape)}")
    return unchecked_draft_block(draft, keys, values, block_ids, features, cos, signed_sin, start, eps, first, rows,
                                 vocab_ids.contiguous() if vocab_ids is not None else None, parallel)


def unchecked_draft_block(draft: DraftWeights, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                          block_ids: Sequence[int], features: torch.Tensor, cos: torch.Tensor,
                          signed_sin: torch.Tensor, start: int, eps: float, first: int, rows: int,
                          vocab_ids: torch.Tensor | None = None,
                          parallel: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_block` without its checks (a tenth of a millisecond once a target step has evicted what they read),
    for a caller that guarantees them: the engine, whose caches and tables have that layout by construction."""
    layer = draft.layers[0]
    block, width, capacity = len(block_ids), features.shape[0], keys[0].shape[1]
    logits, tokens = torch.empty(rows, draft.vocab_size), torch.empty(rows, dtype=torch.int64)
    pointers = ctypes.c_void_p * len(keys)
    _build()[0].draft_block(ctypes.byref(draft.table), pointers(*(t.data_ptr() for t in keys)),
                            pointers(*(t.data_ptr() for t in values)), (ctypes.c_long * block)(*block_ids),
                            features.data_ptr(), draft.feature_size, width, block, layer.hidden_size, layer.heads,
                            layer.kv_heads, layer.head_dim, cos.data_ptr(), signed_sin.data_ptr(), capacity, start, eps,
                            parallel, first, rows, logits.data_ptr(),
                            vocab_ids.data_ptr() if vocab_ids is not None else None, tokens.data_ptr())
    return logits, tokens


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm(x, weight.shape, weight, eps)` for float32 CPU tensors, on the native kernel: the same within float32
    rounding, in a microsecond where torch's chain of small operators takes ~30 us a call here. `weight` [D] normalizes
    rows of D; `weight` [G, D] normalizes each of the G rows of D of x [..., G, D] with its own weight row (the q and
    k heads of a q/k/v product, which may be a view: each position's G rows contiguous, positions evenly spaced).
    Returns a contiguous tensor of x's shape."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    groups, width = (1, weight.shape[0]) if weight.dim() == 1 else tuple(weight.shape)
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.dim() > 2 \
            or tuple(x.shape[x.dim() - weight.dim():]) != tuple(weight.shape):
        raise ValueError(f"native rms_norm takes float32 CPU x [..., D] and weight [D] (or x [..., G, D] and weight "
                         f"[G, D]), not {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    weight = weight.contiguous()
    stride = _position_stride(x, groups, width)
    if stride is None:
        x = x.contiguous()
        stride = groups * width
    out = torch.empty(x.shape)
    library.rms_norm(x.data_ptr(), stride, weight.data_ptr(), groups, out.data_ptr(), x.numel() // (groups * width),
                     width, eps)
    return out


def _position_stride(x: torch.Tensor, groups: int, width: int) -> int | None:
    """The distance between the positions of x [..., G, D] when each position's G rows of D are contiguous and the
    positions evenly spaced (the q and k heads of a q/k/v product), else None."""
    if x.is_contiguous():
        return groups * width
    if groups == 1 or x.stride(-1) != 1 or x.stride(-2) != width or x.dim() == 2:
        return None
    step = expected = x.stride(-3)
    for size, stride in zip(reversed(x.shape[:-2]), reversed(x.stride()[:-2])):
        if size > 1 and stride != expected:
            return None
        expected *= size
    return step


def norm_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, norm: torch.Tensor | None = None,
                eps: float = 1e-6) -> torch.Tensor:
    """Rotary position embedding of heads x [..., G, D] (a view of a q/k/v product's q and k heads may do: each
    position's G rows contiguous, positions evenly spaced), after their RMSNorm with one weight row per head where
    `norm` [G, D] is given: `x * cos + x.roll(D // 2, -1) * signed_sin` with cos and signed_sin [..., D] per
    position (the sine's first half negated, as `engine.RotaryTables` holds it). One native pass where torch runs
    three or four operators; torch's result within float32 rounding. Returns a contiguous tensor of x's shape."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    groups, width = x.shape[-2], x.shape[-1]
    positions = x.numel() // (groups * width)
    tables = (cos, signed_sin)
    if (x.dim() < 2 or width % 2 or width > 256 or x.dtype != torch.float32 or x.device.type != "cpu"
            or any(t.dtype != torch.float32 or t.numel() != positions * width for t in tables)
            or (norm is not None and (norm.shape != (groups, width) or norm.dtype != torch.float32))):
        raise ValueError(f"native norm_rotary takes float32 CPU heads [..., G, D] (D even, at most 256), tables of "
                         f"[..., D] per position and a norm [G, D]; not {x.dtype} {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {None if norm is None else tuple(norm.shape)}")
    stride = _position_stride(x, groups, width)
    if stride is None:
        x = x.contiguous()
        stride = groups * width
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    norm = norm.contiguous() if norm is not None else None
    out = torch.empty(x.shape)
    library.norm_rotary(x.data_ptr(), stride, norm.data_ptr() if norm is not None else None, groups, eps,
                        cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), positions, width)
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` with gate, up = gate_up.chunk(2, -1) (a fused gate/up projection's output [..., 2F]), on
    the native kernel: one pass where torch runs three operators; torch's result within float32 rounding."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    if gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.shape[-1] % 2:
        raise ValueError(f"native swiglu takes a float32 CPU gate/up [..., 2F], not {gate_up.dtype} "
                         f"{tuple(gate_up.shape)} on {gate_up.device}")
    gate_up = gate_up.contiguous()
    features = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], features)
    library.swiglu(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * features), features)
    return out


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                     parallel: bool = False, causal: bool = True) -> torch.Tensor:
    """Attention of a decoding step's queries over a cache, on the native kernel: `queries` [b * n, H, hd] (rows may
    be strided: q/k/v come out of one product), `keys` and `values` the cache [b, K, capacity, hd] (contiguous; H a
    multiple of K), query i of each row at position `start + i` seeing keys 0..start+i (with `causal` False every key
    up to start+n-1: a DFlash draft's block). Returns [b * n, H * hd]:
    torch's `scaled_dot_product_attention` (causal over the step, grouped-query) within float32 rounding, in a few
    microseconds where torch's takes ~25 a call. hd 64 or 128 (`attention_fits`)."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    rows, heads, head_dim = queries.shape
    batch, kv_heads, capacity, _ = keys.shape
    n = rows // batch
    if (not attention_fits(heads, kv_heads, head_dim) or rows != batch * n or start < 0 or start + n > capacity
            or keys.shape != values.shape or keys.shape[-1] != head_dim or queries.stride()[1:] != (head_dim, 1)
            or not (keys.is_contiguous() and values.is_contiguous())
            or {queries.dtype, keys.dtype, values.dtype} != {torch.float32}
            or {queries.device.type, keys.device.type, values.device.type} != {"cpu"}):
        raise ValueError(f"native attention takes float32 CPU queries [b * n, H, hd] (heads contiguous) and a "
                         f"contiguous cache [b, K, capacity, hd], H a multiple of K, hd 64 or 128, positions within "
                         f"the capacity; not {queries.dtype} {tuple(queries.shape)}, {keys.dtype} "
                         f"{tuple(keys.shape)}, start {start}")
    return unchecked_causal_attention(queries, keys, values, start, parallel, causal)


def unchecked_causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                               parallel: bool = False, causal: bool = True) -> torch.Tensor:
    """`causal_attention` without its checks (~3 us of a ~10 us call), for a caller that guarantees them: the
    engine, whose cache and projections have that layout by construction."""
    rows, heads, head_dim = queries.shape
    batch, kv_heads, capacity, _ = keys.shape
    out = torch.empty(rows, heads * head_dim)
    _build()[0].causal_attention(queries.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), batch,
                                 rows // batch, heads, kv_heads, head_dim, queries.stride(0), capacity, start,
                                 None, head_dim ** -0.5, int(causal), int(parallel))
    return out


def attention_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `causal_attention` takes these shapes."""
    return heads % kv_heads == 0 and head_dim in (64, 128)
