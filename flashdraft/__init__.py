"""flashdraft: lossless speculative decoding with DFlash block-diffusion drafts."""

from .decoding import GenerationResult, TokenStream, generate, stream
from .draft import DFlashDraftModel, default_target_layer_ids
from .target import TargetModel

__all__ = [
    "DFlashDraftModel",
    "GenerationResult",
    "TargetModel",
    "TokenStream",
    "default_target_layer_ids",
    "generate",
    "stream",
]
__version__ = "0.1.0"
