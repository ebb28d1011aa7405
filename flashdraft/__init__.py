"""flashdraft: lossless speculative decoding with DFlash block-diffusion drafts."""

import os

# OpenMP's default busy-waiting makes torch on a shared CPU many times slower (measured 15x here when another
# process computes); passive waiting costs nothing when the machine is quiet. Only effective before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .decoding import GenerationResult, TokenStream, generate, stream
from .draft import DFlashDraftModel, default_target_layer_ids
from .models import DEFAULT_TARGET, load_draft, load_target
from .target import TargetModel
from .text import encode_chat, stop_token_ids

__all__ = [
    "DEFAULT_TARGET",
    "DFlashDraftModel",
    "GenerationResult",
    "TargetModel",
    "TokenStream",
    "default_target_layer_ids",
    "encode_chat",
    "generate",
    "load_draft",
    "load_target",
    "stop_token_ids",
    "stream",
]
__version__ = "0.1.0"
