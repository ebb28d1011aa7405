"""The int8 path's kernel (`csrc/block_gemm.c`) and its weights (`flashdraft/quantized.py`): every GGUF type decodes
to what gguf's own dequantization gives, and every version of the kernel (AVX-512 VNNI, AVX2, portable) gives the
portable version's bits, for each row whatever the other rows and the threads."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from flashdraft import native, quantized
from flashdraft.quantized import FORMATS, BlockWeight, Codes, FusedBlocks, block_gemm, decode

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels do not build here")

# Where each type keeps its float16 scales (bytes of a super-block), so random blocks get finite, modest ones.
HALF_SCALES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random GGUF bytes of a weight of `shape`: random codes, random float16 scales between 2^-9 and 2^-6."""
    fmt = FORMATS[type_name]
    n, k = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // fmt.weights_per_block, fmt.bytes_per_block), dtype=np.uint8)
    for at in HALF_SCALES[type_name]:
        scales = (rng.uniform(2.0**-9, 2.0**-6, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]))
        blocks[..., at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(-1)


def fused(type_name: str, shape: tuple[int, int], seed: int = 0) -> tuple[FusedBlocks, Codes]:
    codes = decode(type_name, random_blocks(type_name, shape, seed), shape)
    return FusedBlocks.of([BlockWeight.of(codes)]), codes


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_each_type_decodes_to_ggufs_own_dequantization(type_name):
    shape = (32, 512)
    raw = random_blocks(type_name, shape, seed=1)
    expected = quants.dequantize(raw.reshape(shape[0], -1), GGMLQuantizationType[type_name])
    codes = decode(type_name, raw, shape)
    assert codes.codes.max() <= FORMATS[type_name].code_limit < 2 ** FORMATS[type_name].bits
    assert np.array_equal(codes.dequantize(), expected.reshape(shape))


def test_a_q6_k_code_past_six_bits_is_refused_as_damaged():
    """AVX2 multiplies Q6_K's codes whole, trusting them to fit 6 bits; a code past that is a damaged weight."""
    codes = decode("Q6_K", random_blocks("Q6_K", (16, 256), seed=2), (16, 256))
    BlockWeight.of(codes)
    damaged = codes.codes.copy()
    damaged[3, 17] = 64
    with pytest.raises(ValueError, match="Q6_K weight holds a code above 63"):
        BlockWeight.of(Codes("Q6_K", damaged, codes.scale, codes.minimum))


def test_decode_refuses_a_type_without_a_kernel_and_a_wrong_size():
    with pytest.raises(ValueError, match="Q2_K has no int8 kernel"):
        decode("Q2_K", np.zeros(84, np.uint8), (1, 256))
    with pytest.raises(ValueError, match="takes 34 bytes in blocks of 32, not 33"):
        decode("Q8_0", np.zeros(33, np.uint8), (1, 32))


def reference(x: torch.Tensor, codes: Codes) -> torch.Tensor:
    """The kernel's definition in numpy: x rounded to int8 per 32 values, integer sums per weight block, then the
    float operations in the kernel's order (float64 here: close to, not equal to, its float32 result)."""
    fmt = codes.format
    xs = x.numpy().astype(np.float64).reshape(x.shape[0], -1, 32)
    largest = np.abs(x.numpy()).reshape(x.shape[0], -1, 32).max(-1, keepdims=True)
    q = np.clip(np.rint(x.numpy().reshape(xs.shape) * np.where(largest > 0, np.float32(127) / largest, 0)), -127, 127)
    dx = (largest / np.float32(127)).astype(np.float64)
    w = (codes.codes.astype(np.int64) - fmt.offset).reshape(codes.codes.shape[0], -1, fmt.block)
    qb = q.reshape(x.shape[0], -1, fmt.block)
    sums = np.einsum("mbk,nbk->mnb", qb, w)  # [M, N, blocks]
    dxb = np.repeat(dx[..., 0], 32 // fmt.block, axis=1)  # the activation scale of each weight block
    out = (sums * codes.scale[None] * dxb[:, None]).sum(-1)
    if codes.minimum is not None:
        out += (codes.minimum[None] * (dxb * qb.sum(-1))[:, None]).sum(-1)
    return torch.from_numpy(out).float()


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_the_product_is_the_int8_definition_and_close_to_float32(type_name):
    weight, codes = fused(type_name, (48, 256))
    x = torch.randn(5, 256)
    y = block_gemm(x, weight)
    assert torch.allclose(y, reference(x, codes), rtol=1e-4, atol=1e-4)
    exact = x @ torch.from_numpy(codes.dequantize()).T
    assert ((y - exact).norm() / exact.norm()) < 0.02  # the rounding of x to 8 bits, nothing more


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_every_row_gets_the_portable_versions_bits_alone_together_and_on_threads(type_name):
    weight, _ = fused(type_name, (64, 768), seed=3)
    x = torch.randn(37, 768) * torch.logspace(-2, 2, 768)  # outliers, as real activations have
    portable = block_gemm(x, weight, portable=True)
    assert torch.equal(block_gemm(x, weight), portable)
    assert torch.equal(block_gemm(x, weight, parallel=True), portable)
    for rows in (slice(0, 1), slice(6, 8), slice(3, 7), slice(5, 13), slice(2, 5), slice(0, 8), slice(4, 20),
                 slice(1, 25)):
        assert torch.equal(block_gemm(x[rows], weight), portable[rows])


@pytest.fixture
def tiles_restored():
    yield
    quantized.use_tiles(True)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_tile_products_give_the_vector_products_bits_at_every_row_count(type_name, tiles_restored):
    """AMX where this CPU and kernel grant it (else both runs are the vector panels, and the check is theirs):
    every row count from 1 to 35, so one group of up to 16 rows, several, and the rows past the last group."""
    weight, _ = fused(type_name, (48, 512), seed=11)
    x = torch.randn(35, 512) * torch.logspace(-2, 2, 512)
    portable = block_gemm(x, weight, portable=True)
    for allowed in (True, False):
        quantized.use_tiles(allowed)
        for rows in range(1, 36):
            assert torch.equal(block_gemm(x[:rows], weight), portable[:rows]), (allowed, rows)
        assert torch.equal(block_gemm(x[3:29], weight, parallel=True), portable[3:29])


def test_the_kernel_version_says_whether_tiles_run(tiles_restored):
    assert not quantized.use_tiles(False)
    assert "+amx" not in quantized.kernel_version()
    running = quantized.use_tiles(True)
    assert ("+amx" in quantized.kernel_version()) == running
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if not {"amx_int8", "amx_tile", "avx512_vnni"} <= flags:
        assert not running  # a CPU without AMX never claims it


def test_fused_parts_of_different_types_fill_their_own_columns():
    parts = [fused(name, (shape, 256), seed=i) for i, (name, shape) in enumerate([("Q5_0", 64), ("Q8_0", 32),
                                                                                  ("Q6_K", 16)])]
    weight = FusedBlocks.of([part.parts[0] for part, _ in parts])
    x = torch.randn(3, 256)
    assert weight.shape == (112, 256) and weight.types == ["Q5_0", "Q6_K", "Q8_0"]
    assert torch.equal(block_gemm(x, weight), torch.cat([block_gemm(x, part) for part, _ in parts], dim=1))


def test_shapes_the_kernel_cannot_take_are_refused():
    codes = decode("Q8_0", random_blocks("Q8_0", (8, 32), 0), (8, 32))
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        BlockWeight.of(codes)
    weight, _ = fused("Q8_0", (16, 64))
    with pytest.raises(ValueError, match=r"multiplies float32 \[M, 64\]"):
        block_gemm(torch.randn(2, 32), weight)


def test_llama_q_and_k_rows_are_matched_through_llamacpps_permutation():
    codes = decode("Q8_0", random_blocks("Q8_0", (32, 64), 5), (32, 64))
    order = quantized.unpermute_order(32, heads=2)
    weight = torch.from_numpy(codes.rows(order).dequantize())
    assert quantized.matching_codes(codes, weight, heads=None) is None
    matched = quantized.matching_codes(codes, weight, heads=2)
    assert matched is not None and np.array_equal(matched.dequantize(), weight.numpy())
    assert sorted(order.tolist()) == list(range(32)) and order[:4].tolist() == [0, 2, 4, 6]


VERSIONS = {"x86-64-v3": "avx2", "x86-64": "portable"}


@pytest.mark.parametrize("arch", sorted(VERSIONS))
def test_the_other_instruction_sets_give_the_same_bits(arch, tmp_path):
    """The kernel built for other CPUs (AVX2 without AVX-512, none at all) where this CPU can run that build."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if compiler is None or (arch == "x86-64-v3" and " avx2 " not in flags) or "x86_64" not in platform.machine():
        pytest.skip("needs a C compiler on an x86-64 CPU (with AVX2 for the AVX2 build)")
    library = tmp_path / "block_gemm.so"
    source = native.CSRC / "block_gemm.c"
    subprocess.run([compiler, "-O3", f"-march={arch}", "-std=gnu11", "-shared", "-fPIC", "-o", str(library),
                    str(source)], check=True, capture_output=True)
    other = ctypes.CDLL(str(library))
    other.block_gemm_version.restype = ctypes.c_char_p
    assert other.block_gemm_version().decode() == VERSIONS[arch]
    for type_name in sorted(FORMATS):
        weight, _ = fused(type_name, (32, 256), seed=7)
        x = torch.randn(7, 256)
        out = torch.empty(7, 32)
        other.block_gemm(ctypes.c_void_p(ctypes.addressof(weight.tables)), ctypes.c_long(1),
                         ctypes.c_void_p(x.data_ptr()), ctypes.c_long(7), ctypes.c_long(256),
                         ctypes.c_void_p(out.data_ptr()), ctypes.c_long(32), ctypes.c_int(0), ctypes.c_int(0))
        assert torch.equal(out, block_gemm(x, weight, portable=True)), type_name


def test_a_sample_of_rows_finds_the_order_and_a_weight_of_another_model():
    codes = decode("Q8_0", random_blocks("Q8_0", (256, 64), 5), (256, 64))
    order = quantized.unpermute_order(256, heads=4)
    weight = torch.from_numpy(codes.rows(order).dequantize())
    matched = quantized.matching_codes(codes, weight, heads=4, sample=16)
    assert matched is not None and np.array_equal(matched.dequantize(), weight.numpy())
    other = torch.from_numpy(decode("Q8_0", random_blocks("Q8_0", (256, 64), 6), (256, 64)).dequantize())
    assert quantized.matching_codes(codes, other, heads=4, sample=16) is None


def test_rounding_ties_zero_blocks_and_huge_values_quantize_as_the_definition():
    """The vector rounding of the activations against the scalar definition where they could part: halves (to
    nearest even), a block of zeros, and values far apart in size."""
    weight, _ = fused("Q8_0", (32, 128), seed=4)
    ties = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])  # scale 1: every other value a tie
    x = torch.stack([torch.cat([ties, torch.zeros(32), -ties, torch.full((32,), 3e38)]),
                     torch.cat([torch.zeros(96), torch.logspace(-30, 30, 32)])])
    assert torch.equal(block_gemm(x, weight), block_gemm(x, weight, portable=True))
