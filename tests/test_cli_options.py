"""The options every model-loading command shares: one definition, one default, `auto` resolved the same way."""

import argparse
import os

import pytest
import torch

from flashdraft import files
from flashdraft.cli import build_parser
from flashdraft.commands.options import device_and_dtype
from flashdraft.files import SPIN_COUNT, WAITING_VARIABLES

from tiny import tiny_draft, tiny_target


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench"]])
def test_every_command_defaults_to_auto(command):
    args = build_parser().parse_args(command)
    assert (args.device, args.dtype) == ("auto", "auto")


def test_auto_means_the_gpu_in_bfloat16_when_there_is_one_else_the_cpu_in_float32(monkeypatch):
    args = argparse.Namespace(device="auto", dtype="auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_and_dtype(args) == (torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_and_dtype(args) == (torch.device("cuda"), torch.bfloat16)


def test_explicit_values_are_kept():
    args = argparse.Namespace(device="cpu", dtype="bfloat16")
    assert device_and_dtype(args) == (torch.device("cpu"), torch.bfloat16)
    assert device_and_dtype(argparse.Namespace(device="cpu", dtype="auto"))[1] == torch.float32


def test_importing_the_library_leaves_the_environment_alone():
    import subprocess
    import sys

    code = ("import os, flashdraft; flashdraft.generate; "
            f"print([os.environ.get(name) for name in {WAITING_VARIABLES}])")
    environment = {key: value for key, value in __import__("os").environ.items() if key not in WAITING_VARIABLES}
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                             timeout=120)
    assert process.stdout.strip() == "[None, None, None]", process.stderr


@pytest.mark.parametrize(("other_cores", "chosen"), [(0.1, {"GOMP_SPINCOUNT": SPIN_COUNT, "KMP_BLOCKTIME": "1"}),
                                                      (1.0, {"OMP_WAIT_POLICY": "PASSIVE"})])
def test_threads_spin_on_a_quiet_machine_and_sleep_beside_other_work(monkeypatch, other_cores, chosen):
    for name in WAITING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(files, "other_processes_cpu", lambda seconds: other_cores)
    assert files.choose_thread_waiting() == chosen
    assert {name: os.environ[name] for name in WAITING_VARIABLES if name in os.environ} == chosen


def test_a_users_own_thread_waiting_is_kept(monkeypatch):
    for name in WAITING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setattr(files, "other_processes_cpu", lambda seconds: 2.0)
    assert files.choose_thread_waiting() == {}
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ


def test_the_command_line_chooses_before_torch_loads():
    import subprocess
    import sys

    code = """if True:
        import os, sys
        from flashdraft import cli
        choose = cli.choose_thread_waiting
        cli.choose_thread_waiting = lambda: print("torch loaded:", "torch" in sys.modules, "chose:", choose())
        cli.main(["models", "list"])
        """
    environment = {key: value for key, value in os.environ.items() if key not in WAITING_VARIABLES}
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                             timeout=120)
    assert process.returncode == 0, process.stderr
    assert process.stdout.splitlines()[0].startswith("torch loaded: False chose: {'"), process.stdout


def test_a_reader_that_leaves_the_pipe_early_ends_the_command_quietly():
    import subprocess
    import sys

    # `flashdraft models list | head -0`: the reader has left before the first line.
    read, write = os.pipe()
    os.close(read)
    process = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "models", "list"], stdout=write,
                               stderr=subprocess.PIPE)
    os.close(write)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141 and b"Traceback" not in err, err.decode()


def test_a_missing_file_is_reported_as_its_path_and_the_problem(tmp_path, capsys):
    from flashdraft.cli import main

    heldout, draft = tmp_path / "heldout.txt", tmp_path / "draft"
    tiny_draft(tiny_target("qwen3"), num_layers=1, block_size=4).save_pretrained(draft)
    capsys.readouterr()  # the save's progress bar
    # Refused before the target is prepared or loaded: the error is the only thing written.
    assert main(["draft", "evaluate", "--target", "smollm2-135m-instruct", "--heldout-ids", str(heldout),
                 "--sets", "humaneval", str(draft)]) == 2
    assert capsys.readouterr().err == f"flashdraft draft: error: {heldout}: no such file or directory\n"
    assert main(["draft", "evaluate", "--target", "smollm2-135m-instruct", "--heldout-ids", str(heldout),
                 "--sets", "humaneval", str(tmp_path / "mistyped")]) == 2
    assert "mistyped is not a draft folder: it has no config.json" in capsys.readouterr().err


def test_an_error_with_its_own_message_keeps_it():
    from flashdraft.cli import _describe

    assert _describe(FileNotFoundError("x is not a draft folder: it has no config.json")) == (
        "x is not a draft folder: it has no config.json")
    assert _describe(ValueError("draft expects hidden size 896")) == "draft expects hidden size 896"
    assert _describe(PermissionError(13, "Permission denied", "RUNS/x")) == "RUNS/x: permission denied"
