"""The engine's int8 arithmetic on a tiny target that comes with GGUF blocks, as a registry target does: every
product on its blocks, each token of a verification exactly what a one-token step gives it, so that decoding with a
draft is plain decoding, token for token; and the ways it refuses or steps aside."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_block_gemm import random_blocks
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import flashdraft
from flashdraft import native, quantized
from flashdraft.engine.weights import _layer_products
from flashdraft.models import load_target
from flashdraft.target import TargetModel, remember_engine

from tiny import tiny_draft, tiny_tokenizer

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels do not build here")

# Each product in a type of its own, as a Q4_K_M file mixes them; the head is Q8_0, as the default target's.
TYPES = {"attn_q": "Q5_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q5_1",
         "ffn_up": "Q5_0", "ffn_down": "Q6_K"}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def gguf_target(folder, arch: str = "llama", types: dict[str, str] = TYPES, damage: str | None = None):
    """A tiny target (head_dim 64, as the native attention takes) saved in `folder` with a blocks file: random GGUF
    blocks for every product and the head, the model's weights their dequantized values (a Llama's q and k rows in
    llama.cpp's permuted order in the blocks, as its converter writes them). `damage`: a tensor whose blocks are
    changed after the weights were taken from them."""
    common = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common)))
    blocks = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for tensor, type_name in types.items():
                linear = layer.get_submodule(HF_NAMES[tensor])
                shape = tuple(linear.weight.shape)
                raw = random_blocks(type_name, shape, seed=100 * index + len(blocks))
                codes = quantized.decode(type_name, raw, shape)
                if arch == "llama" and tensor in ("attn_q", "attn_k"):
                    heads = 2 if tensor == "attn_q" else 1
                    codes = codes.rows(quantized.unpermute_order(shape[0], heads))
                linear.weight.copy_(torch.from_numpy(codes.dequantize()))
                blocks[f"blk.{index}.{tensor}.weight"] = (type_name, shape, raw)
        # The head (tied to the embedding) with scales a fifth as large: a random model that guesses about
        # uniformly, as the load's sanity check expects of one (flashdraft/sanity.py).
        raw = random_blocks("Q8_0", (96, 128), seed=7).reshape(96, 4, 34).copy()
        raw[..., :2] = (raw[..., :2].copy().view(np.float16) / np.float16(5)).view(np.uint8)
        raw = raw.reshape(-1)
        model.model.embed_tokens.weight.copy_(torch.from_numpy(quantized.decode("Q8_0", raw, (96, 128)).dequantize()))
        blocks["token_embd.weight"] = ("Q8_0", (96, 128), raw)
    if damage is not None:
        type_name, shape, raw = blocks[damage]
        raw = raw.copy()
        raw[-1] ^= 1
        blocks[damage] = (type_name, shape, raw)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tiny_tokenizer(96).save_pretrained(folder)
    quantized.write_blocks(blocks, folder / quantized.BLOCKS_FILE)
    return folder


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_target_with_gguf_blocks_runs_int8_and_each_token_of_a_block_is_its_one_token_step(tmp_path, arch):
    model, _ = load_target(str(gguf_target(tmp_path, arch)))
    engine = TargetModel(model).engine
    assert engine.arithmetic == "int8" and len(engine.blocks) == 2 * 4 + 1  # every product and the head
    prompt = torch.randint(0, 96, (1, 20))
    positions = torch.arange(40)[None]
    cache = engine.new_cache()
    engine.forward(prompt, positions[:, :20], cache)
    step = torch.randint(0, 96, (1, 16))
    block, _ = engine.forward(step, positions[:, 20:36], cache)
    cache.crop(20)
    for i in range(16):
        alone, _ = engine.forward(step[:, i : i + 1], positions[:, 20 + i : 21 + i], cache)
        assert torch.equal(alone[0, 0], block[0, i])
    float32 = TargetModel(load_target(str(tmp_path))[0], engine="transformers")
    expected = float32.model(torch.cat([prompt, step], 1)).logits[0, 20:]
    assert ((block[0] - expected).norm() / expected.norm()) < 0.05  # llama.cpp's rounding of the activations


def test_an_int8_engine_leaves_the_float32_weights_where_they_are_and_copies_none(tmp_path):
    model, _ = load_target(str(gguf_target(tmp_path, "qwen2")))
    before = {name: parameter.data_ptr() for name, parameter in model.named_parameters()}
    engine = TargetModel(model).engine
    assert engine.arithmetic == "int8"
    assert {name: parameter.data_ptr() for name, parameter in model.named_parameters()} == before
    # Every product reads its blocks: what stands for its float32 weight holds no memory, and nothing is packed.
    assert all(w.device.type == "meta" for layer in engine.layers for w in _layer_products(layer))
    assert engine.head_weight.data_ptr() == model.lm_head.weight.data_ptr() and not engine.forms
    assert engine.matches(model)
    model.to(torch.bfloat16)  # moved: this engine no longer runs on the model's weights
    assert not engine.matches(model)


def test_the_blocks_made_on_several_threads_are_the_blocks_made_on_one(tmp_path):
    model, _ = load_target(str(gguf_target(tmp_path)))
    threads = torch.get_num_threads()
    engines = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            engines.append(TargetModel(model, engine="flashdraft").engine.__class__(model))
    finally:
        torch.set_num_threads(threads)
    one, several = engines
    pairs = [(one.blocks[id(w)], several.blocks[id(v)]) for w, v in zip(one._weights(), several._weights())]
    assert len(pairs) == 2 * 4 + 1
    for alone, shared in pairs:
        assert [part.type for part in alone.parts] == [part.type for part in shared.parts]
        for a, b in zip(alone.parts, shared.parts):
            assert all((x is None and y is None) or np.array_equal(x, y)
                       for x, y in ((a.codes, b.codes), (a.high, b.high), (a.scale, b.scale), (a.minimum, b.minimum)))


def test_decoding_with_a_draft_gives_plain_int8_decoding_token_for_token(tmp_path):
    model, _ = load_target(str(gguf_target(tmp_path)))
    draft = tiny_draft(model, num_layers=1, block_size=8, mask_token_id=5)
    for seed in range(3):
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = flashdraft.generate(model, None, prompt, max_new_tokens=40, block_size=1)
        for block_size in (4, 8, "auto"):
            fast = flashdraft.generate(model, draft, prompt, max_new_tokens=40, block_size=block_size)
            assert fast.tokens == plain.tokens


def test_a_batchs_prefill_padded_or_chunked_gives_each_row_the_bits_it_gets_alone(tmp_path, monkeypatch):
    model, _ = load_target(str(gguf_target(tmp_path)))
    target = TargetModel(model)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (length,), generator=generator) for length in (9, 30, 17)]
    width = 30
    input_ids = torch.zeros(3, width, dtype=torch.long)
    padding = torch.ones(3, width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):], padding[row, width - len(prompt):] = prompt, False
    positions = ((~padding).cumsum(-1) - 1).clamp(min=0)
    batched, _ = target.engine.forward(input_ids, positions, target.new_cache(), padding=padding)
    rows = target.new_row_cache()  # a batch's prefill: chunks of different lengths, each row at its own positions
    for _ in prompts:
        rows.add_empty()
    target.prefill_rows([prompt[:5] for prompt in prompts], [0, 0, 0], rows, None)
    chunked, _ = target.prefill_rows([prompt[5:] for prompt in prompts], [5, 5, 5], rows, None)
    for row, prompt in enumerate(prompts):
        alone, _ = target.engine.forward(prompt[None], torch.arange(len(prompt))[None], target.new_cache())
        assert torch.equal(batched[row, width - len(prompt):], alone[0])
        assert torch.equal(chunked[row, -1], alone[0, -1])
    # A decoding step of those rows, each at its own positions: each layer one native call, the same bits as the
    # layer operator by operator, and as each row's step alone.
    steps = torch.randint(0, 96, (3, 2), generator=generator)
    positions = torch.tensor([[len(prompt), len(prompt) + 1] for prompt in prompts])
    stepped, native_calls = {}, []
    layer_call = native.unchecked_decoder_layer
    monkeypatch.setattr(native, "unchecked_decoder_layer",
                        lambda *args, **kwargs: native_calls.append(1) or layer_call(*args, **kwargs))
    for layers in (True, False):
        target.engine.use_native_layers = layers
        stepped[layers], _ = target.forward_rows(steps, positions, rows, None)
    target.engine.use_native_layers = True
    assert len(native_calls) == 2  # both layers, once
    assert torch.equal(stepped[True], stepped[False])
    for row, prompt in enumerate(prompts):
        cache = target.new_cache()
        target.engine.forward(prompt[None], torch.arange(len(prompt))[None], cache)
        alone, _ = target.engine.forward(steps[row : row + 1], positions[row : row + 1], cache)
        assert torch.equal(stepped[True][row], alone[0])


def test_batched_decoding_gives_each_prompt_its_plain_int8_tokens(tmp_path):
    from flashdraft.train.regenerate import generate_batch

    model, _ = load_target(str(gguf_target(tmp_path)))
    draft = tiny_draft(model, num_layers=1, block_size=8, mask_token_id=5)
    generator = torch.Generator().manual_seed(4)
    opening = torch.randint(0, 96, (20,), generator=generator).tolist()  # shared: later prompts reuse its K/V
    prompts = [opening + torch.randint(0, 96, (length,), generator=generator).tolist() for length in (3, 41, 12, 27)]
    plain = [flashdraft.generate(model, None, prompt, max_new_tokens=30, block_size=1).tokens for prompt in prompts]
    assert generate_batch(model, prompts, 30, stop_ids=[], pad_token_id=0)[0] == plain
    for batch_draft, block_size, prefill_tokens in ((None, 1, 512), (None, 1, 16), (draft, "auto", 24)):
        batch = flashdraft.Batch(model, batch_draft, block_size=block_size, prefill_tokens=prefill_tokens)
        sequences = [batch.add(prompt, max_new_tokens=30) for prompt in prompts]
        while batch:
            batch.step()
        assert [sequence.result.tokens for sequence in sequences] == plain, (block_size, prefill_tokens)
    # Sampled plain decoding with a seed: the same draws as alone, since every row's logits are its own, bit for
    # bit. (With a draft the rounds are planned with the batch's costs, so the draws follow the same distribution
    # but are other draws.)
    sampled = dict(max_new_tokens=30, temperature=0.9, seed=11, block_size=1)
    alone = [flashdraft.generate(model, None, prompt, **sampled).tokens for prompt in prompts]
    together = flashdraft.generate(model, None, prompts, **sampled)
    assert [result.tokens for result in together] == alone


def test_float32_arithmetic_stays_on_the_same_model(tmp_path):
    model, _ = load_target(str(gguf_target(tmp_path)))
    remember_engine(model, "auto", arithmetic="float32")
    engine = TargetModel(model).engine
    assert engine.arithmetic == "float32" and not engine.blocks
    remember_engine(model, "auto", arithmetic="int8")
    assert TargetModel(model).engine.arithmetic == "int8"
    with pytest.raises(ValueError, match="arithmetic must be one of auto, float32, int8"):
        remember_engine(model, "auto", arithmetic="int4")


def test_a_type_without_a_kernel_stays_float32_with_a_note(tmp_path, capsys):
    folder = gguf_target(tmp_path)
    meta = quantized.GGUFBlocks(folder / quantized.BLOCKS_FILE).meta
    tensors = {name: (type_name if name != "blk.1.ffn_up.weight" else "Q2_K", (n, k),
                      quantized.GGUFBlocks(folder / quantized.BLOCKS_FILE)._file.get_tensor(name))
               for name, (type_name, n, k) in meta.items()}
    quantized.write_blocks(tensors, folder / quantized.BLOCKS_FILE)
    model, _ = load_target(str(folder))
    engine = TargetModel(model).engine
    assert engine.arithmetic == "int8" and len(engine.blocks) == 8
    assert "int8 arithmetic: 1 product(s) stay float32 (blk.1.ffn_up.weight is Q2_K, which has no int8 kernel)" in (
        capsys.readouterr().err)
    # That product alone gets its float32 weight, gate and up fused (each projection now a view of it).
    mlp = model.model.layers[1].mlp
    gate_up = engine.layers[1].gate_up
    assert gate_up.device.type == "cpu" and id(gate_up) in engine.forms
    assert torch.equal(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert mlp.up_proj.weight.data_ptr() == gate_up[mlp.gate_proj.weight.shape[0]:].data_ptr()
    assert engine.layers[0].gate_up.device.type == "meta"
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    draft = tiny_draft(model, num_layers=1, mask_token_id=5)
    assert flashdraft.generate(model, draft, prompt, max_new_tokens=24).tokens == (
        flashdraft.generate(model, None, prompt, max_new_tokens=24, block_size=1).tokens)


def prepared_like(folder):
    """`folder` marked as a prepared registry folder is: its blocks covered by the marker's checksums."""
    from flashdraft.files import COMPLETE_MARKER

    (folder / COMPLETE_MARKER).write_text(json.dumps({"files": {quantized.BLOCKS_FILE: {"sha256": "0", "size": 0}}}))
    return folder


def engine_blocks(engine) -> list[list[tuple]]:
    return [[(part.type, part.shape, part.codes.tobytes(), None if part.high is None else part.high.tobytes(),
              part.scale.tobytes(), None if part.minimum is None else part.minimum.tobytes()) for part in fused.parts]
            for fused in (engine.blocks[id(w)] for w in engine._weights())]


def test_a_prepared_folder_keeps_its_panels_and_a_later_engine_reads_them_unpacking_nothing(tmp_path, monkeypatch):
    folder = prepared_like(gguf_target(tmp_path))
    model, _ = load_target(str(folder))
    first = TargetModel(model).engine
    assert (folder / quantized.PANELS_FILE).is_file() and not list(folder.glob(".panels-*"))
    monkeypatch.setattr(quantized, "fused_blocks", lambda *args: pytest.fail("unpacked although cached"))
    second = first.__class__(model)
    assert engine_blocks(second) == engine_blocks(first)
    prompt = torch.randint(0, 96, (1, 12))
    positions = torch.arange(12)[None]
    assert torch.equal(first.forward(prompt, positions, first.new_cache())[0],
                       second.forward(prompt, positions, second.new_cache())[0])


@pytest.mark.parametrize("change", ["weights", "layout", "damage"])
def test_a_stale_or_damaged_panels_cache_is_unpacked_again_and_rewritten(tmp_path, monkeypatch, change):
    import os

    folder = prepared_like(gguf_target(tmp_path))
    model, _ = load_target(str(folder))
    expected = engine_blocks(TargetModel(model).engine)
    cache = folder / quantized.PANELS_FILE
    if change == "weights":  # the model's weights written again: the blocks were checked against other ones
        os.utime(folder / "model.safetensors", ns=(1, 1))
    elif change == "layout":
        monkeypatch.setattr(quantized, "PANELS_LAYOUT", quantized.PANELS_LAYOUT + 1)
    else:
        cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    assert quantized.load_panels(folder) is None
    unpacked = []
    real = quantized.fused_blocks
    monkeypatch.setattr(quantized, "fused_blocks", lambda *args: unpacked.append(args[1]) or real(*args))
    assert engine_blocks(TargetModel(model).engine.__class__(model)) == expected
    assert len(unpacked) == 2 * 4 + 1 and quantized.load_panels(folder) is not None  # every product; rewritten


def test_panels_are_kept_only_for_a_prepared_folder_and_a_folder_it_cannot_write_costs_nothing(tmp_path,
                                                                                               monkeypatch):
    folder = gguf_target(tmp_path / "own")  # not prepared by flashdraft: every load checks every row, no cache
    model, _ = load_target(str(folder))
    _ = TargetModel(model).engine
    assert not (folder / quantized.PANELS_FILE).exists()

    def refuse(*args):
        raise PermissionError("read-only")

    monkeypatch.setattr(quantized, "save_panels", refuse)
    prepared = prepared_like(gguf_target(tmp_path / "prepared"))
    model, _ = load_target(str(prepared))
    assert TargetModel(model).engine.arithmetic == "int8"
    assert not (prepared / quantized.PANELS_FILE).exists()


def test_a_damaged_block_is_refused_by_name(tmp_path):
    model, _ = load_target(str(gguf_target(tmp_path, damage="blk.0.ffn_gate.weight")))
    with pytest.raises(ValueError, match="blk.0.ffn_gate.weight in .* does not give the model's weight back"):
        _ = TargetModel(model).engine


def test_int8_asked_of_a_target_without_blocks_says_why(tmp_path):
    folder = gguf_target(tmp_path)
    (folder / quantized.BLOCKS_FILE).unlink()
    model, _ = load_target(str(folder))
    assert TargetModel(model).engine.arithmetic == "float32"  # auto: float32 where there are no blocks
    remember_engine(model, "auto", arithmetic="int8")
    with pytest.raises(ValueError, match="int8 arithmetic cannot run this target: .* holds no GGUF blocks"):
        _ = TargetModel(model).engine


def test_the_command_lines_arithmetic_reaches_the_engine(tmp_path, capsys):
    from flashdraft.cli import build_parser

    folder = gguf_target(tmp_path)
    for command in ("generate", "serve", "bench"):
        args = build_parser().parse_args([command, *(["hi"] if command == "generate" else []), "--arithmetic",
                                          "float32", "--target", str(folder)])
        assert args.arithmetic == "float32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--arithmetic", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    model, _ = load_target(str(folder), arithmetic="float32")
    assert TargetModel(model).engine.arithmetic == "float32"


@pytest.mark.slow
def test_a_prepared_registry_target_keeps_its_gguf_blocks_and_an_older_folder_gets_them(tmp_path, monkeypatch):
    import json

    from flashdraft.models import COMPLETE_MARKER, DEFAULT_TARGET, prepare, verify_prepared

    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path))
    folder = prepare(DEFAULT_TARGET)
    blocks = folder / quantized.BLOCKS_FILE
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    assert blocks.is_file() and quantized.BLOCKS_FILE in marker["files"]
    assert quantized.GGUFBlocks(blocks).meta["token_embd.weight"] == ["Q8_0", 49152, 576]
    # a folder prepared before the blocks were kept: the next prepare extracts them and records their checksum
    blocks.unlink()
    del marker["files"][quantized.BLOCKS_FILE]
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert prepare(DEFAULT_TARGET) == folder and blocks.is_file()
    assert quantized.BLOCKS_FILE in json.loads((folder / COMPLETE_MARKER).read_text())["files"]
    with blocks.open("r+b") as handle:  # and a damaged blocks file is caught like any file of the folder
        handle.seek(-1, 2)
        handle.write(b"\x00" if handle.read(1) != b"\x00" else b"\x01")
    with pytest.raises(ValueError, match="gguf-blocks.safetensors does not match the checksum"):
        verify_prepared(folder, DEFAULT_TARGET)


def test_a_copy_of_a_model_in_another_folder_shares_its_measurements(tmp_path):
    from flashdraft.files import shape_key

    model, _ = load_target(str(gguf_target(tmp_path / "a")))
    copy, _ = load_target(str(gguf_target(tmp_path / "b")))
    assert model.config._name_or_path != copy.config._name_or_path
    assert shape_key(model.config) == shape_key(copy.config)
    copy.config.rope_theta = 20.0  # a field that changes what is computed changes the key
    assert shape_key(model.config) != shape_key(copy.config)


def test_a_measurement_taken_on_a_busy_machine_says_why_it_is_measured_again(tmp_path, monkeypatch, capsys):
    import flashdraft.files as files

    path = tmp_path / "costs" / "abc.json"
    files.save_measurement(path, {"verify": {"1": 0.01}}, busy=True)
    monkeypatch.setattr(files, "other_processes_cpu", lambda: 0.0)
    assert files.cached_measurement(path) is None
    assert "measuring again: costs/abc.json was measured while other work kept this machine busy" in (
        capsys.readouterr().err)
    files.save_measurement(path, {"verify": {"1": 0.01}}, busy=False)
    assert files.cached_measurement(path) == {"verify": {"1": 0.01}}


def test_a_prefill_past_the_measured_row_counts_shares_its_products_among_the_threads(tmp_path, monkeypatch):
    """Rows past the kernel choice's measured counts (a prefill) have no measured choice: with threads, every product
    splits its panels among them (it ran on one thread before), and the logits are the same bits either way."""
    model, _ = load_target(str(gguf_target(tmp_path)))
    engine = TargetModel(model).engine
    prompt, positions = torch.randint(0, 96, (1, 48)), torch.arange(48)[None]
    calls = []
    real = quantized.block_gemm
    monkeypatch.setattr(quantized, "block_gemm", lambda x, w, parallel=False, **k: (
        calls.append((x.shape[0], parallel)), real(x, w, parallel=parallel, **k))[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = engine.forward(prompt, positions, engine.new_cache())[0]
        assert calls and not any(parallel for _, parallel in calls)
        calls.clear()
        torch.set_num_threads(2)
        shared = engine.forward(prompt, positions, engine.new_cache())[0]
    finally:
        torch.set_num_threads(threads)
    assert calls and all(parallel for rows, parallel in calls if rows == 48)
    assert torch.equal(single, shared)


@pytest.mark.parametrize("layers", [[0, 1], [0]])  # [0]: the features' forward stops after the first layer
def test_training_features_on_the_int8_engine_are_those_decoding_gives_the_draft(tmp_path, layers):
    target = TargetModel(load_target(str(gguf_target(tmp_path, "qwen2")))[0])
    sequences = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (30, 17)]
    features, mask = target.padded_hidden_states(sequences, layers)
    assert features.shape == (2, 30, len(layers) * 128) and mask.sum(1).tolist() == [30, 17]
    assert not features[1, 17:].any()  # padding stays zero
    for row, ids in enumerate(sequences):
        # As decoding collects them: a prompt's prefill, then blocks verified after it.
        cache, collected = target.new_cache(), []
        for start, end in ((0, 9), (9, 13), (13, 14), (14, len(ids))):
            _, hidden = target.forward(ids[None, start:end], torch.arange(start, end)[None], cache, layers)
            collected.append(hidden[0])
        assert torch.equal(features[row, : len(ids)], torch.cat(collected))
    # transformers' padded forward over the float32 weights: the same features but for the activations' rounding
    float32 = TargetModel(target.model, engine="transformers").padded_hidden_states(sequences, layers)[0]
    float32 = float32 * mask[:, :, None]  # its padding positions hold what the pads computed
    assert ((features - float32).norm() / float32.norm()) < 0.05


def test_a_features_only_forward_skips_the_layers_after_the_last_feature_layer_and_the_head(tmp_path):
    engine = TargetModel(load_target(str(gguf_target(tmp_path, "qwen2")))[0]).engine
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None]
    full_cache, cache = engine.new_cache(), engine.new_cache()
    _, full = engine.forward(ids, positions, full_cache, [0])
    logits, features = engine.forward(ids, positions, cache, [0], features_only=True)
    assert logits is None and torch.equal(features, full)
    assert torch.equal(cache.keys[0][..., :12, :], full_cache.keys[0][..., :12, :])
    assert not cache.keys[1].any() and full_cache.keys[1][..., :12, :].any()  # the second layer never ran
    with pytest.raises(ValueError, match="features_only needs layer_ids"):
        engine.forward(ids, positions, engine.new_cache(), None, features_only=True)


def test_a_bfloat16_training_target_with_gguf_blocks_is_told_of_the_engine(tmp_path):
    from flashdraft.train.features import engine_features_hint

    folder = gguf_target(tmp_path / "gguf")
    assert "--dtype float32" in engine_features_hint(load_target(str(folder), dtype=torch.bfloat16)[0])
    assert engine_features_hint(load_target(str(folder))[0]) is None  # float32: already on the engine
    (folder / quantized.BLOCKS_FILE).unlink()  # no blocks: the engine would run float32, slower than bfloat16
    assert engine_features_hint(load_target(str(folder), dtype=torch.bfloat16)[0]) is None
