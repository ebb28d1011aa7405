"""The options every model-loading command shares: one definition, one default, `auto` resolved the same way."""

import argparse

import pytest
import torch

from flashdraft.cli import build_parser
from flashdraft.commands.options import device_and_dtype


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

    code = "import os, flashdraft; flashdraft.generate; print(os.environ.get('OMP_WAIT_POLICY'))"
    environment = {key: value for key, value in __import__("os").environ.items() if key != "OMP_WAIT_POLICY"}
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                             timeout=120)
    assert process.stdout.strip() == "None", process.stderr
