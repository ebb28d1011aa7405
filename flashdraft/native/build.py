"""Building, caching and loading flashdraft's native C kernels (`flashdraft/csrc/`), and the C signatures of what
the library exports.

Every C file of `csrc/` is compiled together into one library, once per machine, with the system's C compiler
(`$CC`, else `cc`) for this very CPU (`-march=native`, with OpenMP where the compiler has it): the kernels choose
their instructions (AVX-512, AVX2, NEON or plain C) when compiled. The library is cached under
`$FLASHDRAFT_HOME/native/`, named by a hash of every source and header, the compiler, the flags and the CPU, so a
change to any of them builds anew. Where no compiler works, or with `FLASHDRAFT_NATIVE=0`, it is simply not offered
(`unavailable_reason()` says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..files import cache_home

CSRC = Path(__file__).parents[1] / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.c")))  # every kernel file, so that a change to any of them builds anew
HEADERS = tuple(sorted(CSRC.glob("*.h")))
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
    """The C compiler's path (EngineSettings' `compiler`: `$CC`, else `cc`), or None where there is none."""
    return shutil.which(_settings().compiler)


def _settings():
    # Imported here: `flashdraft.engine`'s package imports this one, and its settings are read when the library is
    # first built.
    from ..engine.settings import EngineSettings

    return EngineSettings.from_environment()


def _identity(compiler: str, version: str) -> str:
    """What names a build: every source and header, the compiler, the flags and the CPU."""
    return hashlib.sha256(
        "\0".join([*(path.read_text() for path in (*SOURCES, *HEADERS)), compiler, version, " ".join(FLAGS),
                   platform.machine(), _cpu_description()])
        .encode()
    ).hexdigest()[:20]


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(library, None, build identity) when it builds and loads, else (None, the reason, None)."""
    settings = _settings()
    if not settings.native:
        return None, "turned off by FLASHDRAFT_NATIVE=0", None
    compiler = _compiler()
    if compiler is None:
        return None, f"no C compiler found ({settings.compiler}; set CC, or install gcc)", None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the C compiler {compiler} does not run: {error}", None
    identity = _identity(compiler, version)
    library = cache_home() / "native" / f"kernels-{identity}.so"
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
    loaded.causal_attention.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_long] * 8 + [ctypes.c_void_p] * 2
                                        + [ctypes.c_float]
                                        + [ctypes.c_int] * 2)
    loaded.causal_attention.restype = None
    loaded.decoder_layer.argtypes = ([ctypes.POINTER(_DecoderLayer)] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 7
                                     + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2
                                     + [ctypes.c_float]
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
    loaded.block_gemm_use_tiles.argtypes = [ctypes.c_int]
    loaded.block_gemm_use_tiles.restype = ctypes.c_int
    loaded.block_gemm_use_tiles(int(settings.tiles))  # FLASHDRAFT_AMX=0 turns the tile products off
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


class _LayerWeight(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int), ("data", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("rows", ctypes.c_long), ("parts", ctypes.c_long)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qk_norm", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("qkv", _LayerWeight), ("o", _LayerWeight),
                ("gate_up", _LayerWeight), ("down", _LayerWeight)]


class _DraftWeights(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_DecoderLayer)), ("num_layers", ctypes.c_long), ("fc", _LayerWeight),
                ("head", _LayerWeight), ("hidden_norm", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("embedding", ctypes.c_void_p)]
