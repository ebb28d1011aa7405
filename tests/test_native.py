"""flashdraft's native matrix product (flashdraft/native/, csrc/f32_products.c): exact, row-independent, and
absent cleanly where it cannot be built."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashdraft import native, quantized
from flashdraft.engine import Engine, KernelChoice, KernelLinear, available_products
from flashdraft.native import build

requires_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")


@pytest.fixture
def rebuilt(monkeypatch):
    """native's build forgotten before and after the test, so that environment changes take effect and leave no
    trace."""
    native._build.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    native._build.cache_clear()


def test_it_builds_wherever_a_c_compiler_is_installed():
    # The engine's speed on CPU rests on it: where cc exists (CI, a developer's machine) it must build, not be
    # quietly skipped by every test below.
    if native._compiler() is None:
        assert "no C compiler" in native.unavailable_reason()
    else:
        assert native.available(), native.unavailable_reason()


@requires_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16, 33])
@pytest.mark.parametrize("outputs, inputs", [(64, 576), (7, 19), (13, 48), (4, 5)])
def test_matches_torch_for_every_shape(rows, outputs, inputs):
    generator = torch.Generator().manual_seed(rows * 1000 + outputs + inputs)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator)
    expected = F.linear(x.double(), weight.double())
    got = native.small_gemm(x, weight)
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * inputs ** 0.5)


@requires_native
def test_a_rows_result_does_not_depend_on_the_other_rows():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 100, generator=generator)
    x = torch.randn(9, 100, generator=generator)
    together = native.small_gemm(x, weight)
    for row in range(9):
        assert torch.equal(native.small_gemm(x[row : row + 1], weight)[0], together[row])
    assert torch.equal(native.small_gemm(x[3:7], weight), together[3:7])


@requires_native
@pytest.mark.parametrize("outputs", [4096, 37, 3])
def test_shared_among_threads_the_result_is_the_same_to_the_bit(outputs):
    generator = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, 200, generator=generator)
    for rows in (1, 4, 11):
        x = torch.randn(rows, 200, generator=generator)
        assert torch.equal(native.small_gemm(x, weight, parallel=True), native.small_gemm(x, weight))


@requires_native
def test_weights_anywhere_in_memory_give_the_same_result():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 64, generator=generator)
    shifted = torch.empty(40 * 64 + 3)[3:].view(40, 64)  # rows off every 64-byte boundary
    shifted.copy_(weight)
    x = torch.randn(4, 64, generator=generator)
    assert shifted.data_ptr() % 64
    assert torch.equal(native.small_gemm(x, shifted), native.small_gemm(x, weight))
    assert torch.equal(native.small_gemm(x.t().contiguous().t(), weight), native.small_gemm(x, weight))


@requires_native
def test_bad_inputs_are_refused_with_the_reason():
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="float32"):
        native.small_gemm(x.double(), weight)
    with pytest.raises(ValueError, match=r"\[M, K\] by \[N, K\]\^T, not \(2, 8\) by \(4, 9\)"):
        native.small_gemm(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="contiguous"):
        native.small_gemm(x, torch.randn(8, 4).t())


@requires_native
def test_the_library_is_built_once_per_machine_and_reused(rebuilt, tmp_path):
    rebuilt.setenv("FLASHDRAFT_HOME", str(tmp_path))
    assert native.available()
    built = list((tmp_path / "native").glob("kernels-*.so"))
    assert len(built) == 1 and built[0].name == f"kernels-{native.build_identity()}.so"
    stamp = built[0].stat().st_mtime_ns
    native._build.cache_clear()
    assert native.available() and built[0].stat().st_mtime_ns == stamp
    assert list((tmp_path / "native").iterdir()) == built  # no scratch left behind


def test_every_kernel_file_is_compiled_and_a_change_to_any_builds_anew(monkeypatch, tmp_path):
    assert set(native.SOURCES) == set(native.CSRC.glob("*.c")) and len(native.SOURCES) >= 5
    assert set(native.HEADERS) == set(native.CSRC.glob("*.h"))
    first = build._identity("cc", "1")
    for changed in (*native.SOURCES, *native.HEADERS):
        copy = tmp_path / changed.name
        copy.write_text(changed.read_text() + "\n/* changed */\n")
        monkeypatch.setattr(build, "SOURCES", tuple(copy if p == changed else p for p in native.SOURCES))
        monkeypatch.setattr(build, "HEADERS", tuple(copy if p == changed else p for p in native.HEADERS))
        assert build._identity("cc", "1") != first, changed.name
    monkeypatch.undo()
    assert build._identity("cc", "1") == first


def test_turned_off_or_without_a_compiler_it_is_not_offered(rebuilt, tmp_path):
    rebuilt.setenv("FLASHDRAFT_HOME", str(tmp_path))
    rebuilt.setenv("FLASHDRAFT_NATIVE", "0")
    assert not native.available() and "FLASHDRAFT_NATIVE=0" in native.unavailable_reason()
    assert "native" not in available_products() and "torch" in available_products()
    with pytest.raises(RuntimeError, match="unavailable: turned off"):
        native.small_gemm(torch.randn(1, 4), torch.randn(2, 4))
    native._build.cache_clear()
    rebuilt.delenv("FLASHDRAFT_NATIVE")
    rebuilt.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert not native.available() and "no C compiler found" in native.unavailable_reason()
    assert native.build_identity() is None


def test_a_failing_compiler_is_reported_not_raised(rebuilt, tmp_path):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'broken-cc 1.0'\n[ \"$1\" = --version ] && exit 0\n"
                        "echo 'error: no way' >&2\nexit 1\n")
    compiler.chmod(0o755)
    rebuilt.setenv("FLASHDRAFT_HOME", str(tmp_path / "home"))
    rebuilt.setenv("CC", str(compiler))
    assert not native.available()
    assert native.unavailable_reason() == f"compiling the native kernels with {compiler} failed: error: no way"
    assert not list((tmp_path / "home" / "native").glob("*.so"))


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_the_engine_moves_misaligned_weights_to_cache_lines_without_changing_the_model():
    model = _tiny_llama()
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        expected = model(ids).logits
        for parameter in (model.model.layers[0].mlp.down_proj.weight, model.lm_head.weight):
            shifted = torch.empty(parameter.numel() + 1)[1:].view_as(parameter)
            shifted.copy_(parameter)
            parameter.data = shifted
    assert model.lm_head.weight.data_ptr() % 64
    engine = Engine(model)
    assert engine.head_weight.data_ptr() % 64 == 0 and engine.layers[0].down.data_ptr() % 64 == 0
    assert model.get_input_embeddings().weight is model.lm_head.weight  # still tied
    assert engine.matches(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


@requires_native
def test_a_draft_projection_on_the_native_kernel_equals_nn_linear():
    torch.manual_seed(0)
    linear = nn.Linear(48, 20, bias=True)
    choice = KernelChoice({"down": {1: "native", 4: "native", 8: "native"}})
    accelerated = KernelLinear.replacing(linear, "down", choice)
    x = torch.randn(2, 3, 48)
    with torch.no_grad():
        torch.testing.assert_close(accelerated(x), linear(x), rtol=1e-5, atol=1e-5)
    assert accelerated.kernels.product("down", 6).__name__ == "_native"


# Packed weights: float32 values that a GGUF checkpoint (Q4_1, Q8_0) or a bfloat16 one held, in their fewer bytes.


def as_gguf_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` quantized as llama.cpp's Q4_1 and dequantized as gguf-py does: float16 d and m per 32 weights,
    (d * q) + m rounded twice."""
    blocks = weight.view(weight.shape[0], -1, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    scale = ((high - low) / 15).half().float()
    q = ((blocks - low) / scale).round().clamp(0, 15)
    return torch.add(torch.mul(scale, q), low.half().float()).view(weight.shape)


def as_gguf_q8_0(weight: torch.Tensor) -> torch.Tensor:
    blocks = weight.view(weight.shape[0], -1, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    return torch.mul((blocks / scale).round().clamp(-128, 127), scale).view(weight.shape)


FORMS = {"q4_1": as_gguf_q4_1, "q8_0": as_gguf_q8_0, "bf16": lambda w: w.bfloat16().float()}


@requires_native
@pytest.mark.parametrize("form", list(FORMS))
def test_each_weight_is_packed_in_the_fewest_bytes_that_hold_it_exactly(form):
    weight = FORMS[form](torch.randn(40, 96, generator=torch.Generator().manual_seed(3)))
    packed = native.pack(weight)
    assert packed is not None and packed.format == form and packed.shape == (40, 96)
    assert torch.equal(packed.unpack(), weight)
    bytes_per_weight = {"q4_1": 0.75, "q8_0": 1.125, "bf16": 2.0}[form]
    assert packed.nbytes == bytes_per_weight * weight.numel()


@requires_native
def test_weights_that_no_form_holds_stay_float32():
    generator = torch.Generator().manual_seed(4)
    assert native.pack(torch.randn(40, 96, generator=generator)) is None
    nearly = as_gguf_q4_1(torch.randn(40, 96, generator=generator))
    nearly[17, 50] = torch.nextafter(nearly[17, 50], torch.tensor(1.0))  # one value off by one float32 step
    assert native.pack(nearly) is None
    assert native.pack(torch.randn(8, 20, generator=generator).bfloat16().float()) is None  # K not whole vectors
    assert native.pack(as_gguf_q4_1(torch.randn(8, 64, generator=generator)).double()) is None
    assert native.pack(torch.zeros(3, 32, 32)) is None
    # K a multiple of 16 but not of 32: no GGUF block fits, bfloat16 still does
    assert native.pack(torch.randn(8, 48, generator=generator).bfloat16().float()).format == "bf16"


@requires_native
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("outputs", [64, 37, 3])
def test_a_packed_product_is_the_float32_product_to_the_bit(form, outputs):
    generator = torch.Generator().manual_seed(outputs)
    weight = FORMS[form](torch.randn(outputs, 128, generator=generator))
    packed = native.pack(weight)
    for rows in (1, 2, 3, 4, 5, 8, 16, 33):
        x = torch.randn(rows, 128, generator=generator)
        expected = native.small_gemm(x, weight)
        assert torch.equal(native.packed_gemm(x, packed), expected)
        assert torch.equal(native.packed_gemm(x, packed, parallel=True), expected)


@requires_native
def test_a_packed_product_refuses_a_wrong_input():
    packed = native.pack(torch.randn(8, 64).bfloat16().float())
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        native.packed_gemm(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="float32"):
        native.packed_gemm(torch.randn(2, 64).double(), packed)


@requires_native
def test_a_kernel_linear_never_reads_a_stale_packed_copy():
    linear = nn.Linear(64, 24, bias=False)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.bfloat16().float())
    layer = KernelLinear.replacing(linear, "qkv", KernelChoice({"qkv": {rows: "native" for rows in (1, 4, 8)}}))
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), native.small_gemm(x, linear.weight.detach()))
        assert layer._forms.packed.format == "bf16"
        linear.weight.mul_(1.0001)  # changed in place: no longer bfloat16 values
        assert torch.equal(layer(x), native.small_gemm(x, linear.weight.detach()))
        assert layer._forms.packed is None


def cpu_has(flag: str) -> bool:
    try:
        return flag in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


def test_bfloat16_dot_products_are_offered_exactly_where_the_cpu_has_them():
    assert native.bf16_dot_available() == (native.available() and cpu_has("avx512_bf16"))


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 16])
@pytest.mark.parametrize("outputs, inputs", [(64, 576), (13, 64), (5, 2880)])
def test_bfloat16_dot_products_are_the_products_of_the_rounded_inputs(rows, outputs, inputs):
    generator = torch.Generator().manual_seed(rows * 100 + outputs)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator).bfloat16().float()
    packed = native.pack(weight)
    if not native.bf16_dot_available():
        with pytest.raises(RuntimeError, match="bfloat16 dot products are unavailable"):
            native.bf16_dot_gemm(x, packed)
        return
    exact = x.bfloat16().double() @ weight.double().T  # what the instruction computes, up to float32 sums
    for parallel in (False, True):
        out = native.bf16_dot_gemm(x, packed, parallel)
        assert out.dtype == torch.float32 and out.shape == (rows, outputs)
        assert (out.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    assert torch.equal(native.bf16_dot_gemm(x, packed, False), native.bf16_dot_gemm(x, packed, True))
    # not the float32 product: the inputs lost their low bits
    assert (native.bf16_dot_gemm(x, packed) - x @ weight.T).abs().max() > 1e-4


@pytest.mark.skipif(not native.bf16_dot_available(), reason="needs AVX512_BF16 (the test above checks the refusal)")
def test_bfloat16_dot_products_refuse_what_they_cannot_compute():
    weight = torch.randn(8, 64).bfloat16().float()
    narrow = native.pack(torch.randn(8, 48).bfloat16().float())  # bfloat16, but K not a multiple of 32
    assert narrow.format == "bf16"
    with pytest.raises(ValueError, match="bf16-packed weight with K a multiple of 32"):
        native.bf16_dot_gemm(torch.randn(2, 48), narrow)
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        native.bf16_dot_gemm(torch.randn(2, 63), native.pack(weight))


@pytest.mark.parametrize("shape", [(1, 576), (9, 576), (3, 5, 64), (2, 7), (4, 33)])
def test_the_native_rms_norm_is_torchs_within_float32_rounding(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator)
    if not native.available():
        with pytest.raises(RuntimeError, match="native kernel is unavailable"):
            native.rms_norm(x, weight, 1e-5)
        return
    out = native.rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, F.rms_norm(x, shape[-1:], weight, 1e-5), rtol=2e-6, atol=2e-6)
    strided = torch.randn(shape[:-1] + (2 * shape[-1],), generator=generator)[..., ::2]  # read in logical order
    torch.testing.assert_close(native.rms_norm(strided, weight, 1e-5), F.rms_norm(strided, shape[-1:], weight, 1e-5),
                               rtol=2e-6, atol=2e-6)


@requires_native
def test_the_native_rms_norm_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="float32 CPU x"):
        native.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="float32 CPU x"):
        native.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-5)


@requires_native
@pytest.mark.parametrize("view", ["contiguous", "q and k heads of q/k/v", "one position"])
def test_the_native_rms_norm_gives_each_head_its_own_weight(view):
    generator = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 5, 12, 64, generator=generator) * 3  # [b, n, H + 2K, hd] with H = 6, K = 3
    x = {"contiguous": qkv[:, :, :9].contiguous(), "q and k heads of q/k/v": qkv[:, :, :9],
         "one position": qkv[0, 0, :9]}[view]
    weight = torch.randn(9, 64, generator=generator)
    out = native.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, F.rms_norm(x, (64,), None, 1e-6) * weight, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="weight \\[G, D\\]"):
        native.rms_norm(x, torch.randn(8, 64), 1e-6)


@requires_native
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("view", ["q and k heads of q/k/v", "contiguous"])
def test_the_native_norm_rotary_is_torchs_within_float32_rounding(normed, view):
    generator = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 5, 12, 64, generator=generator) * 3  # [b, n, H + 2K, hd] with H = 6, K = 3
    x = qkv[:, :, :9] if view != "contiguous" else qkv[:, :, :9].contiguous()
    angles = torch.rand(2, 5, 1, 32, generator=generator) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    norm = torch.rand(9, 64, generator=generator) + 0.5 if normed else None
    expected = F.rms_norm(x, (64,), None, 1e-6) * norm if normed else x
    half = 32  # rotate_half: (-x2, x1)
    expected = expected * cos + torch.cat([-expected[..., half:], expected[..., :half]], dim=-1) * angles.sin().repeat(
        1, 1, 1, 2)
    out = native.norm_rotary(x, cos, signed_sin, norm, 1e-6)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="norm_rotary takes"):
        native.norm_rotary(x, cos[:, :4], signed_sin, norm, 1e-6)


@requires_native
@pytest.mark.parametrize("shape", [(1, 3072), (8, 3072), (3, 2, 40), (2, 6)])
def test_the_native_swiglu_is_torchs_within_float32_rounding(shape):
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    out = native.swiglu(gate_up)
    assert out.shape == gate.shape
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=3e-6, atol=3e-6)
    extreme = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0] * 4 + [1.0] * 20])
    torch.testing.assert_close(native.swiglu(extreme), F.silu(extreme[:, :20]) * extreme[:, 20:])
    with pytest.raises(ValueError, match="gate/up"):
        native.swiglu(torch.zeros(2, 7))


def reference_attention(queries, keys, values, start):
    """torch's fused attention over the first start + n cached positions, causal within the step."""
    batch = keys.shape[0]
    rows, heads, head_dim = queries.shape
    n, end = rows // batch, start + rows // batch
    visible = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    attended = F.scaled_dot_product_attention(
        queries.reshape(batch, n, heads, head_dim).transpose(1, 2), keys[:, :, :end], values[:, :, :end],
        attn_mask=visible, enable_gqa=heads != keys.shape[1])
    return attended.transpose(1, 2).reshape(rows, heads * head_dim)


@requires_native
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 128), (2, 2, 64), (8, 2, 64)])
@pytest.mark.parametrize("batch, n, start", [(1, 1, 0), (1, 1, 200), (1, 3, 17), (2, 4, 100), (1, 6, 15), (3, 1, 31)])
def test_native_attention_is_torchs_within_float32_rounding(heads, kv_heads, head_dim, batch, n, start):
    generator = torch.Generator().manual_seed(heads * 100 + n * 10 + start)
    capacity = 256
    # q/k/v out of one product, as in the engine: the queries' rows are strided
    qkv = torch.randn(batch * n, heads + 2 * kv_heads, head_dim, generator=generator) * 2
    queries = qkv[:, :heads]
    keys = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator)
    values = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator)
    expected = reference_attention(queries, keys, values, start)
    serial = native.causal_attention(queries, keys, values, start)
    torch.testing.assert_close(serial, expected, rtol=1e-5, atol=2e-6)
    assert torch.equal(native.causal_attention(queries, keys, values, start, parallel=True), serial)


@requires_native
def test_native_attention_ignores_what_lies_beyond_each_querys_position():
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(3, 4, 64, generator=generator)
    keys, values = torch.randn(2, 1, 2, 64, 64, generator=generator)
    before = native.causal_attention(queries, keys, values, start=20)
    keys[:, :, 23:], values[:, :, 23:] = float("nan"), 1e9  # past the last query (position 22): never read
    keys[:, :, 22], values[:, :, 22] = keys[:, :, 22] * 3, values[:, :, 22] + 1  # seen by the last query only
    after = native.causal_attention(queries, keys, values, start=20)
    assert torch.equal(after[:2], before[:2]) and not torch.equal(after[2], before[2])
    assert torch.isfinite(after).all()


@requires_native
def test_native_attention_gives_each_query_its_bits_alone_in_any_batch_chunk_or_padding():
    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, length = 6, 2, 64, 45
    qkv = torch.randn(length, heads + 2 * kv_heads, head_dim, generator=generator)
    queries = qkv[:, :heads]
    keys, values = torch.randn(2, 1, kv_heads, 64, head_dim, generator=generator)
    alone = native.causal_attention(queries, keys, values, 0)  # the whole prompt at once
    for cut in (1, 16, 17, 30):  # a prefill in two chunks
        first = native.causal_attention(queries[:cut], keys, values, 0)
        rest = native.causal_attention(queries[cut:], keys, values, cut)
        assert torch.equal(torch.cat([first, rest]), alone)
    # Left padding: row 1 is the prompt after 7 padding positions, beside another row; its padding queries get zeros.
    pad = 7
    padded_keys, padded_values = (torch.randn(2, kv_heads, 64, head_dim, generator=generator) for _ in range(2))
    padded_keys[1, :, pad : pad + length] = keys[0, :, :length]
    padded_values[1, :, pad : pad + length] = values[0, :, :length]
    padded_keys[1, :, :pad] = float("nan")  # never read
    padded_queries = torch.randn(2, length + pad, heads, head_dim, generator=generator)
    padded_queries[1, pad:] = queries
    out = native.unchecked_causal_attention(padded_queries.view(-1, heads, head_dim), padded_keys, padded_values, 0,
                                            first_key=torch.tensor([0, pad]))
    out = out.view(2, length + pad, -1)
    assert torch.equal(out[1, pad:], alone) and torch.equal(out[1, :pad], torch.zeros(pad, heads * head_dim))
    # Each query at its own position (a cache by position): queries 3..9 of the prompt, given in reverse order.
    order = torch.arange(9, 2, -1)
    by_position = native.unchecked_causal_attention(queries[order].contiguous(), keys, values, 0,
                                                    positions=order.contiguous())
    assert torch.equal(by_position, alone[order])


@requires_native
def test_native_attention_refuses_what_it_cannot_compute():
    keys = torch.zeros(1, 2, 32, 64)
    with pytest.raises(ValueError, match="hd 64 or 128"):
        native.causal_attention(torch.zeros(1, 4, 32), torch.zeros(1, 2, 32, 32), torch.zeros(1, 2, 32, 32), 0)
    with pytest.raises(ValueError, match="within the capacity"):
        native.causal_attention(torch.zeros(2, 4, 64), keys, keys, start=31)
    with pytest.raises(ValueError, match="contiguous cache"):
        native.causal_attention(torch.zeros(1, 4, 64), keys.transpose(1, 2).contiguous().transpose(1, 2), keys, 0)
    with pytest.raises(ValueError, match="float32"):
        native.causal_attention(torch.zeros(1, 4, 64, dtype=torch.float64), keys, keys, 0)
    assert not native.attention_fits(4, 3, 64) and not native.attention_fits(4, 2, 96)


def _layer(generator: torch.Generator, form: str, d: int = 128, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
           features: int = 192):
    """`pack_layer`'s arguments with random values, the products in `form`: "float32" (with a q/k/v bias, no q/k
    norms: a Qwen2 layer), "packed" (bfloat16 values, packed exactly) or "int8" (a draft's 8-bit codes, Q8_0
    blocks for `quantized.block_gemm`)."""
    def weight(rows, columns):
        values = torch.randn(rows, columns, generator=generator) * 0.05
        if form == "int8":
            return quantized.q8_blocks(values)
        if form == "packed":
            return native.pack(values.bfloat16().float())
        return values

    bias = form == "float32"
    return dict(input_norm=1 + 0.1 * torch.randn(d, generator=generator),
                post_norm=1 + 0.1 * torch.randn(d, generator=generator),
                qk_norm=None if bias else 1 + 0.1 * torch.randn(heads + kv_heads, head_dim, generator=generator),
                qkv_bias=torch.randn((heads + 2 * kv_heads) * head_dim, generator=generator) if bias else None,
                qkv=weight((heads + 2 * kv_heads) * head_dim, d), o=weight(d, heads * head_dim),
                gate_up=weight(2 * features, d), down=weight(d, features),
                heads=heads, kv_heads=kv_heads, head_dim=head_dim)


def _product(x: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return native.small_gemm(x, weight)
    return (quantized.block_gemm if weight.format == "blocks" else native.packed_gemm)(x, weight)


@pytest.mark.parametrize("parallel", [0, 31])
@pytest.mark.parametrize("form, width, causal", [("float32", 0, True), ("packed", 0, True), ("int8", 3, False),
                                                 ("packed", 2, False)])
def test_a_native_layer_is_its_steps_in_order(form, width, causal, parallel):
    if not native.available():
        pytest.skip("needs the native kernel")
    generator = torch.Generator().manual_seed(parallel + width)
    parts = _layer(generator, form)
    layer = native.pack_layer(**parts)
    heads, kv_heads, head_dim, eps = 4, 2, 64, 1e-6
    block, start, capacity = 4, 5, 16
    n = width + block
    keys, values = torch.randn(2, kv_heads, capacity, head_dim, generator=generator)
    hidden, context = torch.randn(block, 128, generator=generator), torch.randn(width, 128, generator=generator)
    cos, sin = torch.randn(2, n, head_dim, generator=generator)
    # step by step, on the same kernels
    window = torch.cat([context, native.rms_norm(hidden, parts["input_norm"], eps)])
    qkv = _product(window, parts["qkv"])
    if parts["qkv_bias"] is not None:
        qkv = qkv + parts["qkv_bias"]
    qkv = qkv.view(n, heads + 2 * kv_heads, head_dim)
    qk = native.norm_rotary(qkv[:, : heads + kv_heads], cos, sin, parts["qk_norm"], eps)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[:, start : start + n] = qk[:, heads:].transpose(0, 1)
    expected_values[:, start : start + n] = qkv[:, heads + kv_heads :].transpose(0, 1)
    attended = native.causal_attention(qk[width:, :heads], expected_keys[None], expected_values[None],
                                       start + width, causal=causal)
    expected = hidden + _product(attended, parts["o"])
    up = _product(native.rms_norm(expected, parts["post_norm"], eps), parts["gate_up"])
    expected = expected + _product(native.swiglu(up), parts["down"])
    ours = hidden.clone()
    native.decoder_layer(layer, keys, values, ours, context if width else None, cos, sin, start, eps, causal,
                         parallel)
    assert torch.equal(ours, expected)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)  # nothing else written


@requires_native
def test_a_native_layer_refuses_what_it_cannot_compute():
    parts = _layer(torch.Generator().manual_seed(0), "float32")
    with pytest.raises(ValueError, match=r"o must be \(128, 256\)"):
        native.pack_layer(**{**parts, "o": parts["o"].T})
    with pytest.raises(ValueError, match=r"o must be \(128, 256\) .* not float32 \(128, 256\)"):
        native.pack_layer(**{**parts, "o": parts["o"].T.contiguous().T})  # not contiguous
    with pytest.raises(ValueError, match=r"qk_norm must be float32 \(6, 64\)"):
        native.pack_layer(**{**parts, "qk_norm": torch.ones(4, 64)})
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        native.pack_layer(**{**parts, "head_dim": 96})
    layer = native.pack_layer(**parts)
    cache = torch.zeros(2, 16, 64)
    tables = torch.zeros(7, 64)
    native.decoder_layer(layer, cache, cache.clone(), torch.zeros(4, 128), torch.zeros(3, 128), tables, tables, 9,
                         1e-6)  # the window fills the cache to its end
    with pytest.raises(ValueError, match="with room for the window at 10"):
        native.decoder_layer(layer, cache, cache.clone(), torch.zeros(4, 128), torch.zeros(3, 128), tables, tables,
                             10, 1e-6)
    with pytest.raises(ValueError, match=r"hidden \[q, 128\]"):
        native.decoder_layer(layer, cache, cache.clone(), torch.zeros(4, 64), torch.zeros(3, 128), tables, tables, 0,
                             1e-6)


def _draft(generator: torch.Generator, form: str, layers: int = 2, vocab: int = 96, feature_size: int = 384):
    """`pack_draft`'s arguments with random values (the layers as `_layer` makes them), and the layers' parts."""
    parts = [_layer(generator, form) for _ in range(layers)]

    def weight(rows, columns):
        values = torch.randn(rows, columns, generator=generator) * 0.05
        return quantized.q8_blocks(values) if form == "int8" else values

    return dict(layers=[native.pack_layer(**p) for p in parts], fc=weight(128, feature_size),
                hidden_norm=1 + 0.1 * torch.randn(128, generator=generator),
                norm=1 + 0.1 * torch.randn(128, generator=generator), head=weight(vocab, 128),
                embedding=torch.randn(200, 128, generator=generator)), parts


@pytest.mark.parametrize("form, parallel, vocab_ids", [("float32", 0, False), ("int8", 127, True),
                                                        ("int8", 0, False)])
def test_a_native_draft_pass_is_its_steps_in_order(form, parallel, vocab_ids):
    if not native.available():
        pytest.skip("needs the native kernel")
    generator = torch.Generator().manual_seed(parallel)
    arguments, parts = _draft(generator, form)
    draft = native.pack_draft(**arguments)
    eps, block, width, start, capacity = 1e-6, 4, 3, 5, 16
    keys, values = torch.randn(2, 2, 2, capacity, 64, generator=generator)
    features = torch.randn(width, 384, generator=generator)
    cos, sin = torch.randn(2, width + block, 64, generator=generator)
    ids = [7, 199, 199, 199]
    columns = torch.randperm(1000, generator=generator)[:96] if vocab_ids else None
    # step by step, on the same kernels
    hidden = arguments["embedding"][ids].clone()
    context = native.rms_norm(_product(features, arguments["fc"]), arguments["hidden_norm"], eps)
    expected_keys, expected_values = keys.clone(), values.clone()
    for layer, index in zip(arguments["layers"], range(2)):
        native.decoder_layer(layer, expected_keys[index], expected_values[index], hidden, context, cos, sin, start,
                             eps, causal=False)
    logits = _product(native.rms_norm(hidden[1:4], arguments["norm"], eps), arguments["head"])
    tokens = logits.argmax(-1)
    logits_ours, tokens_ours = native.draft_block(draft, list(keys), list(values), ids, features, cos, sin, start,
                                                  eps, 1, 3, columns, parallel)
    assert torch.equal(logits_ours, logits)
    assert torch.equal(tokens_ours, columns[tokens] if vocab_ids else tokens)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


@requires_native
def test_a_native_draft_pass_takes_the_first_of_equal_largest_logits():
    arguments, _ = _draft(torch.Generator().manual_seed(1), "float32", vocab=40)
    head = torch.zeros(40, 128)
    head[[3, 17, 33], 0], head[[5, 21], 0] = 1.0, -1.0  # equal largest logits at 3, 17, 33 or at 5, 21: the first
    draft = native.pack_draft(**{**arguments, "head": head})
    cache = [torch.zeros(2, 16, 64) for _ in range(2)]
    logits, tokens = native.draft_block(draft, cache, [c.clone() for c in cache], [1, 2], torch.zeros(1, 384),
                                        *torch.zeros(2, 3, 64), 0, 1e-6, 0, 2)
    assert (logits[:, 3] != 0).all() and torch.equal(logits[:, 3], logits[:, 33])
    assert tokens.tolist() == [3 if logits[row, 3] > 0 else 5 for row in range(2)] == logits.argmax(-1).tolist()


@requires_native
def test_a_native_draft_pass_refuses_what_it_cannot_compute():
    arguments, _ = _draft(torch.Generator().manual_seed(2), "float32")
    with pytest.raises(ValueError, match=r"head must be \(128, 128\) .* not float32 \(128, 96\)"):
        native.pack_draft(**{**arguments, "head": arguments["head"].T.contiguous()})
    with pytest.raises(ValueError, match=r"embedding must be float32"):
        native.pack_draft(**{**arguments, "embedding": arguments["embedding"].double()})
    with pytest.raises(ValueError, match="the same shapes"):
        native.pack_draft(**{**arguments, "layers": [arguments["layers"][0],
                                                     native.pack_layer(**_layer(torch.Generator(), "float32", d=64))]})
    draft = native.pack_draft(**arguments)
    cache = [torch.zeros(2, 16, 64) for _ in range(2)]
    tables, context = torch.zeros(7, 64), torch.zeros(3, 384)

    def call(ids=(1, 2, 3, 4), features=context, start=9, first=1, rows=3, keys=cache, columns=None):
        return native.draft_block(draft, keys, [c.clone() for c in keys], list(ids), features, tables, tables,
                                  start, 1e-6, first, rows, columns)

    call()  # the window fills the caches to their end
    for wrong in (dict(start=10), dict(ids=(1, 2, 3, 200)), dict(first=2), dict(rows=0),
                  dict(features=torch.zeros(3, 128)), dict(keys=cache[:1] * 2 + [torch.zeros(2, 16, 32)])):
        with pytest.raises(ValueError, match="draft_block takes"):
            call(**wrong)
    with pytest.raises(ValueError, match=r"vocab_ids must be int64 \[96\]"):
        call(columns=torch.arange(95))
