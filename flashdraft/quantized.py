"""A GGUF checkpoint's quantized weights as the engine's int8 path reads them (`csrc/block_gemm.c`).

A registry target is prepared into a float32 transformers folder (`models.prepare`); beside it, `BLOCKS_FILE` keeps
the GGUF's weight tensors in their own blocks (raw bytes, one uint8 tensor each, its GGML type and shape in the
metadata). Every type the registry's files hold decodes here into one form:

    w = scale * (code - offset) (+ minimum)      codes unsigned, 4, 5 or 8 bits; one scale per 32 (or 16) weights

    type   bits  block  offset  minimum   (GGML's dequantization, in the same float operations)
    Q4_0    4     32      8      -        d * (q - 8)
    Q4_1    4     32      0      m        d * q + m
    Q5_0    5     32     16      -        d * (q - 16)
    Q5_1    5     32      0      m        d * q + m
    Q8_0    8     32    128      -        d * q                   (q signed: code = q + 128)
    Q4_K    4     32      0     -m1       (d * sc) * q - (dmin * m)
    Q5_K    5     32      0     -m1       the same, a fifth bit a weight
    Q6_K    8     16     32      -        (d * sc) * (q - 32)

`BlockWeight.of` lays the codes out in the kernel's panels. Loading checks every weight against the model's own
float32 tensor (the dequantized GGUF): a block that does not give it back exactly is refused by name, and a type not
in the table leaves that weight on the float32 path with a one-line note.
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCKS_FILE = "gguf-blocks.safetensors"
PANEL = 16  # weight rows interleaved in the kernel's layout
X_BLOCK = 32  # activation values per scale


@dataclass(frozen=True)
class Format:
    bits: int
    block: int
    offset: int
    bytes_per_block: int  # GGUF's bytes per super-block
    weights_per_block: int
    largest_code: int | None = None  # where less than 2^bits - 1 (Q6_K's 6-bit codes in bytes): AVX2 needs no split

    @property
    def code_limit(self) -> int:
        return (1 << self.bits) - 1 if self.largest_code is None else self.largest_code


FORMATS = {
    "Q4_0": Format(4, 32, 8, 18, 32), "Q4_1": Format(4, 32, 0, 20, 32), "Q5_0": Format(5, 32, 16, 22, 32),
    "Q5_1": Format(5, 32, 0, 24, 32), "Q8_0": Format(8, 32, 128, 34, 32), "Q4_K": Format(4, 32, 0, 144, 256),
    "Q5_K": Format(5, 32, 0, 176, 256), "Q6_K": Format(8, 16, 32, 210, 256, 63),
}


@dataclass(frozen=True)
class Codes:
    """A weight decoded from its GGUF blocks: codes [N, K] uint8, scale (and minimum) float32 [N, K / block]."""

    type: str
    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None

    @property
    def format(self) -> Format:
        return FORMATS[self.type]

    def dequantize(self) -> np.ndarray:
        """The float32 weight [N, K], in GGML's float operations."""
        n, k = self.codes.shape
        block = self.format.block
        q = (self.codes.astype(np.int16) - self.format.offset).astype(np.float32).reshape(n, k // block, block)
        w = self.scale[..., None] * q
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(n, k)

    def rows(self, order: np.ndarray) -> Codes:
        return Codes(self.type, self.codes[order], self.scale[order],
                     None if self.minimum is None else self.minimum[order])


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] 4-bit codes: byte i holds code i (low) and code i + 16 (high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums per super-block."""
    low, high = scales[..., :4], scales[..., 4:8]
    tail = scales[..., 8:]
    sc = np.concatenate([low & 63, (tail & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> Codes:
    """The GGUF bytes `raw` (uint8) of a weight of `shape` [N, K] and GGML type `type_name` -> its codes."""
    if type_name not in FORMATS:
        raise ValueError(f"GGML type {type_name} has no int8 kernel (the types with one: {', '.join(FORMATS)})")
    fmt = FORMATS[type_name]
    n, k = shape
    if k % fmt.weights_per_block or raw.size != n * k // fmt.weights_per_block * fmt.bytes_per_block:
        expected = n * k // fmt.weights_per_block * fmt.bytes_per_block
        raise ValueError(f"a {type_name} weight of shape {shape} takes {expected} bytes in blocks of "
                         f"{fmt.weights_per_block}, not {raw.size}")
    blocks = raw.reshape(n, k // fmt.weights_per_block, fmt.bytes_per_block)
    minimum = None
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        scale = _half(blocks[..., 0:2])
        at = 2
        if type_name in ("Q4_1", "Q5_1"):
            minimum, at = _half(blocks[..., 2:4]), 4
        if type_name == "Q8_0":
            codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        elif type_name.startswith("Q5"):
            high = blocks[..., at : at + 4].copy().view(np.uint32)  # [n, blocks, 1]
            fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            codes = _nibbles(blocks[..., at + 4 :]) | (fifth << 4)
        else:
            codes = _nibbles(blocks[..., at:])
        return Codes(type_name, codes.reshape(n, k), scale, minimum)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
        sc, mins = _k_scales(blocks[..., 4:16])
        at = 16
        fifth = None
        if type_name == "Q5_K":
            high = blocks[..., 16:48]  # [n, sb, 32]: bit j of byte l = fifth bit of value l of sub-block j
            fifth = (high[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, sb, 8, 32]
            at = 48
        qs = blocks[..., at:].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if fifth is not None:
            codes = codes | (fifth << 4)
        scale = (d[..., None] * sc).reshape(n, -1)
        minimum = -(dmin[..., None] * mins).reshape(n, -1)
        return Codes(type_name, codes.reshape(n, k), scale, minimum)
    # Q6_K: ql [128], qh [64], scales int8 [16], d float16
    ql, qh = blocks[..., :128].reshape(n, -1, 2, 64), blocks[..., 128:192].reshape(n, -1, 2, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=-1)  # [n, sb, 2, 128]
    two = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)  # [n, sb, 2, 128]
    codes = (low | (two << 4)).reshape(n, k)
    scales = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _half(blocks[..., 208:210])
    return Codes(type_name, codes, (d[..., None] * scales).reshape(n, -1), None)


class _BlockWeightTable(ctypes.Structure):  # csrc/kernels.h: block_weight
    _fields_ = [("bits", ctypes.c_int), ("block", ctypes.c_int), ("offset", ctypes.c_int),
                ("largest_code", ctypes.c_int), ("rows", ctypes.c_long), ("cols", ctypes.c_long),
                ("codes", ctypes.c_void_p), ("high", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("minimum", ctypes.c_void_p)]


@dataclass(frozen=True)
class BlockWeight:
    """A weight in the kernel's panel layout (`csrc/block_gemm.c`), made by `of`."""

    type: str
    shape: tuple[int, int]
    codes: np.ndarray
    high: np.ndarray | None
    scale: np.ndarray
    minimum: np.ndarray | None

    @classmethod
    def of(cls, weight: Codes) -> BlockWeight:
        fmt = weight.format
        n, k = weight.codes.shape
        if n % PANEL or k % X_BLOCK:
            raise ValueError(f"the int8 kernel takes weights of rows a multiple of {PANEL} and columns a multiple of "
                             f"{X_BLOCK}, not {weight.codes.shape}")
        codes, high = weight.codes, None
        if fmt.largest_code is not None and codes.size and int(codes.max()) > fmt.largest_code:
            raise ValueError(f"a {weight.type} weight holds a code above {fmt.largest_code}, which its type cannot "
                             "encode: the blocks are damaged")
        if fmt.bits == 8:
            panels = codes.reshape(n // PANEL, PANEL, k // 4, 4).transpose(0, 2, 1, 3)
        else:
            c = codes.reshape(n // PANEL, PANEL, k // 32, 4, 2, 4)  # [panel, row, block, group, half, j]
            panels = ((c[..., 0, :] & 15) | ((c[..., 1, :] & 15) << 4)).transpose(0, 2, 3, 1, 4)
            if fmt.bits == 5:
                bits = (c >> 4) & 1  # bit 4 r + j of mask [panel, block, group, half]
                bits = bits.transpose(0, 2, 3, 4, 1, 5).reshape(-1, 64)
                high = np.ascontiguousarray(np.packbits(bits, axis=-1, bitorder="little"))
        def layout(values):
            return None if values is None else np.ascontiguousarray(
                values.reshape(n // PANEL, PANEL, -1).transpose(0, 2, 1), dtype=np.float32)
        return cls(weight.type, (n, k), np.ascontiguousarray(panels), high, layout(weight.scale),
                   layout(weight.minimum))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.high, self.scale, self.minimum) if a is not None)

    def table(self) -> _BlockWeightTable:
        fmt = FORMATS[self.type]
        return _BlockWeightTable(fmt.bits, fmt.block, fmt.offset, fmt.code_limit, self.shape[0], self.shape[1],
                                 self.codes.ctypes.data, None if self.high is None else self.high.ctypes.data,
                                 self.scale.ctypes.data, None if self.minimum is None else self.minimum.ctypes.data)


@dataclass
class FusedBlocks:
    """The weights of one input's products side by side (q/k/v, gate/up, or one alone), each in its own type: what
    `block_gemm` and a native layer read (`native.LAYER_FORMATS["blocks"]`)."""

    parts: tuple[BlockWeight, ...]
    tables: ctypes.Array

    @classmethod
    def of(cls, parts: Sequence[BlockWeight]) -> FusedBlocks:
        if len({part.shape[1] for part in parts}) != 1:
            raise ValueError("fused weights take the same input: their columns must agree")
        return cls(tuple(parts), (_BlockWeightTable * len(parts))(*(part.table() for part in parts)))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def format(self) -> str:
        return "blocks"

    @property
    def types(self) -> list[str]:
        return sorted({part.type for part in self.parts})


def block_gemm(x: torch.Tensor, weight: FusedBlocks, parallel: bool = False, portable: bool = False) -> torch.Tensor:
    """`x @ W.T` (x float32 [M, K] on CPU) for the weight `weight` holds, x rounded to int8 codes per 32 values: the
    same result, bit for bit, for a row whatever the other rows, the threads or the instruction set
    (`portable` forces the plain C version, for tests)."""
    from . import native

    library = native.library()
    n, k = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"block_gemm multiplies float32 [M, {k}] on CPU by the weight, not {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n)
    library.block_gemm(ctypes.addressof(weight.tables), len(weight.parts), x.data_ptr(), x.shape[0], k,
                       out.data_ptr(), n, int(parallel), int(portable))
    return out


def kernel_version() -> str:
    """Which version of the int8 kernel this machine runs: avx512-vnni (+amx where the tile products run), avx2 or
    portable."""
    from . import native

    return native.library().block_gemm_version().decode()


def use_tiles(allowed: bool) -> bool:
    """Let the int8 kernel use AMX tile products for 9 rows or more (the default where the CPU and the operating
    system allow them), or not; returns whether it now does. The bits are the same either way."""
    from . import native

    return bool(native.library().block_gemm_use_tiles(int(allowed)))


# ---- the GGUF side: extracting the blocks at preparation, reading them back for the engine ----

def save_blocks(gguf_path: Path, destination: Path) -> int:
    """Write every weight tensor of the GGUF at `gguf_path` with a type in `FORMATS` to `destination` as raw bytes
    (safetensors, uint8), its GGML type and shape [N, K] in the metadata. Returns how many."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name in FORMATS and len(tensor.shape) == 2:
            k, n = (int(v) for v in tensor.shape)  # GGUF lists the fastest axis first
            tensors[tensor.name] = (type_name, (n, k), np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8))
    write_blocks(tensors, destination)
    return len(tensors)


def write_blocks(tensors: dict[str, tuple[str, tuple[int, int], np.ndarray]], destination: Path) -> None:
    """A blocks file: for each GGUF tensor name, its GGML type, shape [N, K] and raw bytes (uint8)."""
    from safetensors.numpy import save_file

    meta = {name: [type_name, *shape] for name, (type_name, shape, _) in tensors.items()}
    save_file({name: raw for name, (_, _, raw) in tensors.items()}, str(destination),
              metadata={"flashdraft": json.dumps(meta)})


class GGUFBlocks:
    """The blocks file of a prepared folder: `get(name)` -> the weight's `Codes`, or None where it has none."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self._file = safe_open(str(path), framework="numpy")
        self.meta = json.loads(self._file.metadata()["flashdraft"])

    def get(self, name: str) -> Codes | None:
        if name not in self.meta:
            return None
        type_name, n, k = self.meta[name]
        return decode(type_name, self._file.get_tensor(name), (n, k))


# ---- the panels cache: a prepared folder's weights in the kernel's layout, kept beside its blocks ----

PANELS_FILE = "int8-panels.safetensors"
PANELS_LAYOUT = 1  # the version of `BlockWeight.of`'s layout: a change makes every cache stale
_PANEL_ARRAYS = ("codes", "high", "scale", "minimum")


def panels_source(folder: Path) -> dict:
    """What a folder's panels cache was made from: the layout's version and the size and modification time of every
    weights file beside it (the blocks, and the model whose weights the blocks were checked against)."""
    files = sorted(path for path in folder.glob("*.safetensors") if path.name != PANELS_FILE)
    return {"layout": PANELS_LAYOUT, "files": {path.name: [path.stat().st_size, path.stat().st_mtime_ns]
                                               for path in files}}


def save_panels(weights: dict[str, BlockWeight], folder: Path) -> None:
    """Keep `weights` (by GGUF tensor name, checked against the model and in its row order) in `folder`'s panels
    cache, written beside its final name and renamed into place, so that a reader never sees half a file."""
    from safetensors.numpy import save_file

    tensors = {f"{name}:{field}": getattr(weight, field) for name, weight in weights.items()
               for field in _PANEL_ARRAYS if getattr(weight, field) is not None}
    shapes = {name: [weight.type, *weight.shape] for name, weight in weights.items()}
    handle, partial = tempfile.mkstemp(dir=folder, prefix=".panels-", suffix=".partial")
    os.close(handle)
    try:
        save_file(tensors, partial, metadata={"flashdraft-panels": json.dumps(shapes),
                                              "source": json.dumps(panels_source(folder))})
        os.chmod(partial, folder.stat().st_mode & 0o666)
        os.replace(partial, folder / PANELS_FILE)
    finally:
        Path(partial).unlink(missing_ok=True)


def load_panels(folder: Path) -> dict[str, BlockWeight] | None:
    """`folder`'s panels cache by GGUF tensor name; None where there is none, or it is stale (made from other files
    or another layout) or unreadable: the caller then unpacks the blocks again."""
    from safetensors import SafetensorError, safe_open

    path = folder / PANELS_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="numpy") as file:
            metadata = file.metadata() or {}
            if json.loads(metadata.get("source", "null")) != panels_source(folder):
                return None
            stored = set(file.keys())
            weights = {}
            for name, (type_name, n, k) in json.loads(metadata["flashdraft-panels"]).items():
                arrays = [file.get_tensor(f"{name}:{field}") if f"{name}:{field}" in stored else None
                          for field in _PANEL_ARRAYS]
                weight = BlockWeight(type_name, (n, k), *arrays)
                fmt = FORMATS[type_name]
                code_bytes = n * k if fmt.bits == 8 else n * k // 2
                if weight.codes.nbytes != code_bytes or weight.scale.size != n * k // fmt.block:
                    return None
                weights[name] = weight
            return weights
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of a Llama/Qwen parameter of transformers, e.g. model.layers.3.mlp.up_proj.weight ->
    blk.3.ffn_up.weight; None for parameters with no GGUF counterpart here."""
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}[hf_name]
    parts = hf_name.split(".")
    if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return None
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    return f"blk.{parts[2]}.{names[parts[4]]}.weight" if parts[4] in names else None


def unpermute_order(rows: int, heads: int) -> np.ndarray:
    """The GGUF row of each transformers row of a Llama q or k projection: llama.cpp's converter interleaves each
    head's two rotary halves, and transformers' GGUF loader undoes it."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def matching_codes(codes: Codes, weight: torch.Tensor, heads: int | None, sample: int | None = None) -> Codes | None:
    """`codes` in the row order of `weight` (float32 [N, K], the model's own), where they dequantize to it exactly;
    a Llama q/k projection may need its rows unpermuted (`heads` given). None where neither order matches. With
    `sample`, only that many rows spread over the weight are compared (for a blocks file a checksum already covers:
    enough to find the order and to catch a file of another model, a fraction of the time)."""
    expected = weight.detach().numpy()
    if codes.codes.shape != expected.shape:
        return None
    n = expected.shape[0]
    rows = np.arange(n) if sample is None or sample >= n else np.linspace(0, n - 1, sample).astype(np.int64)
    orders = [np.arange(n)] + ([unpermute_order(n, heads)] if heads else [])
    for order in orders:
        if np.array_equal(codes.rows(order[rows]).dequantize(), expected[rows]):
            return codes if order is orders[0] else codes.rows(order)
    return None


# The GGUF tensors of a decoder layer's products, in the engine's fused order (`engine.weights._Layer`).
LAYER_TENSORS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                 "down": ("ffn_down",)}


def fused_blocks(blocks: GGUFBlocks, names: Sequence[str], weights: Sequence[torch.Tensor],
                 heads: Sequence[int | None], sample: int | None = None) -> FusedBlocks | str:
    """The GGUF tensors `names` as one fused weight, each checked against the model's own float32 `weights` (all
    rows, or `sample` of them: `matching_codes`; a Llama q/k projection unpermuted with its `heads`); or the reason
    it cannot be (a missing tensor, a type with no kernel, a block that does not dequantize to the model's weight)."""
    parts = []
    for name, weight, count in zip(names, weights, heads):
        if name not in blocks.meta:
            return f"{name} is not in {blocks.path.name}"
        type_name = blocks.meta[name][0]
        if type_name not in FORMATS:
            return f"{name} is {type_name}, which has no int8 kernel"
        codes = matching_codes(blocks.get(name), weight, count, sample)
        if codes is None:
            raise ValueError(f"{name} in {blocks.path} does not give the model's weight back: the blocks file is "
                             f"damaged or belongs to another model; delete it (it is extracted again)")
        parts.append(BlockWeight.of(codes))
    return FusedBlocks.of(parts)


def fits(weight: torch.Tensor) -> bool:
    """Whether a weight [N, K] takes the kernel's layout: N a multiple of 16, K of 32."""
    return weight.dim() == 2 and not weight.shape[0] % PANEL and not weight.shape[1] % X_BLOCK


def q8_blocks(weight: torch.Tensor) -> FusedBlocks:
    """A float weight [N, K] rounded to GGUF's Q8_0 form (8-bit codes, one scale per 32: the largest magnitude to
    127) and laid out for `block_gemm`: an approximation, for a draft's products (its proposals never change what
    is generated, only how much of it a round accepts)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // X_BLOCK, X_BLOCK)
    scale = blocks.abs().amax(-1) / 127
    codes = torch.where(scale[..., None] > 0, blocks / scale[..., None], 0.0).round().clamp(-127, 127)
    codes = (codes.to(torch.int16) + FORMATS["Q8_0"].offset).to(torch.uint8).reshape(n, k)
    return FusedBlocks.of([BlockWeight.of(Codes("Q8_0", codes.numpy(), scale.numpy(), None))])
