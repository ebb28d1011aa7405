"""flashdraft's native matrix product for the few rows of a speculative step (`csrc/small_gemm.c`).

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
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "small_gemm.c"
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
        "\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), platform.machine(), _cpu_description()])
        .encode()
    ).hexdigest()[:20]
    from .models import cache_home

    library = cache_home() / "native" / f"small_gemm-{identity}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed into place: a reader never loads half a library.
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            for flags in ((*FLAGS, OPENMP_FLAG), FLAGS):
                try:
                    result = subprocess.run([compiler, *flags, "-o", str(built), str(SOURCE)],
                                            capture_output=True, text=True, timeout=COMPILE_SECONDS)
                except (OSError, subprocess.SubprocessError) as error:
                    return None, f"compiling {SOURCE.name} failed: {error}", None
                if result.returncode == 0:
                    break
            else:
                last = (result.stderr.strip().splitlines() or ["no message"])[-1]
                return None, f"compiling {SOURCE.name} with {compiler} failed: {last}", None
            built.replace(library)
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as error:
        return None, f"loading {library} failed: {error}", None
    for function in (loaded.small_gemm, loaded.small_gemm_parallel):
        function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
        function.restype = None
    return loaded, None, identity


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
