"""Every setting of the CPU engine, read from the environment in one place: `EngineSettings.from_environment()`,
called when an engine is built (the command line's `--arithmetic` reaches it through `load_target`). Each cache key
that depends on a setting (kernels, verify costs) takes it from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..files import WAITING_VARIABLES

# How the target's products are computed (FLASHDRAFT_ARITHMETIC, `flashdraft generate --arithmetic`): float32, the
# same as transformers' forward; int8, the GGUF checkpoint's own blocks against activations rounded to 8-bit codes
# per 32 values (`quantized`, `csrc/block_gemm.c`), what llama.cpp computes; auto, int8 where the target has GGUF
# blocks.
ARITHMETICS = ("auto", "float32", "int8")
CHECKED_ROWS = 64  # rows of each weight compared with its blocks where a checksum covers the blocks file


# The environment variables the engine reads, each "1" (on) unless set to "0" (off); FLASHDRAFT_ARITHMETIC and CC
# name a choice.
VARIABLES = ("FLASHDRAFT_ARITHMETIC", "FLASHDRAFT_PACKED", "FLASHDRAFT_NATIVE_ATTENTION", "FLASHDRAFT_DRAFT_BF16",
             "FLASHDRAFT_DRAFT_INT8", "FLASHDRAFT_AMX", "FLASHDRAFT_NATIVE", "CC")
# How torch's threads wait and how many there are: not the engine's to set, but part of its cache keys.
THREADING_VARIABLES = (*WAITING_VARIABLES, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class EngineSettings:
    """arithmetic: ARITHMETICS' choice (FLASHDRAFT_ARITHMETIC); packed: a float32 weight read in its exactly packed
    form (FLASHDRAFT_PACKED); native_attention: attention on the native kernel where it fits
    (FLASHDRAFT_NATIVE_ATTENTION); draft_bf16 / draft_int8: a shipped draft's products in bfloat16 / 8-bit
    arithmetic (FLASHDRAFT_DRAFT_BF16 / FLASHDRAFT_DRAFT_INT8); tiles: the int8 kernel's AMX tile products for 9
    rows or more where the CPU and the operating system allow them (FLASHDRAFT_AMX: the same bits either way, other
    costs); native: the native C kernels built and offered
    (FLASHDRAFT_NATIVE); compiler: the C compiler that builds them (CC). The last two are not in `key()`: the
    native library's build identity (`flashdraft.native.build_identity()`, None when off) is in every key already."""

    arithmetic: str = "auto"
    packed: bool = True
    native_attention: bool = True
    draft_bf16: bool = True
    draft_int8: bool = True
    tiles: bool = True
    native: bool = True
    compiler: str = "cc"

    @classmethod
    def from_environment(cls) -> EngineSettings:
        def on(name: str) -> bool:
            return os.environ.get(name, "1") != "0"

        return cls(os.environ.get("FLASHDRAFT_ARITHMETIC", "auto"), on("FLASHDRAFT_PACKED"),
                   on("FLASHDRAFT_NATIVE_ATTENTION"), on("FLASHDRAFT_DRAFT_BF16"), on("FLASHDRAFT_DRAFT_INT8"),
                   on("FLASHDRAFT_AMX"), on("FLASHDRAFT_NATIVE"), os.environ.get("CC") or "cc")

    def key(self) -> dict:
        """The settings as part of a cache key."""
        return {"arithmetic": self.arithmetic, "packed": self.packed, "native_attention": self.native_attention,
                "draft_bf16": self.draft_bf16, "draft_int8": self.draft_int8, "tiles": self.tiles}


def arithmetic_setting() -> str:
    """FLASHDRAFT_ARITHMETIC alone (`TargetModel.engine` asks it on every access, so one lookup, not all of them)."""
    return os.environ.get("FLASHDRAFT_ARITHMETIC", "auto")


def threading_environment() -> dict[str, str | None]:
    """THREADING_VARIABLES as the environment has them now, for a cache key (kernels, costs)."""
    return {name: os.environ.get(name) for name in THREADING_VARIABLES}
