"""A load-time check that a target folder holds a working model, not one that decodes garbage without an error.

Checksums protect the registry's prepared folders; a local folder has none, and damaged weights (a few flipped
bytes) or a wrong config value (`rope_theta: 10`) load without complaint and answer nonsense. So a target loaded
from a local folder reads a short built-in text once (one forward of ~65 tokens, a fraction of a second on a CPU
for a 135M model) and its mean loss is held to two bounds:

- a model with the architecture of a registry model (a copy, a fine-tune) must stay within `LOSS_MARGIN` of the
  loss that registry model has on the text, recorded once (`RegisteredModel.reference_loss`);
- any model must not be far more confidently wrong than uniform guessing (`UNIFORM_MARGIN` above log(vocab)): a
  random model (a test's tiny one) guesses about uniformly, a damaged one is confidently wrong.

Measured on SmolLM2-135M-Instruct (reference 3.59): 64 flipped bytes in model.safetensors gave 414, a 4 KiB
stretch XORed NaN, `rope_theta: 10` 8.79.
"""

from __future__ import annotations

import math

# Plain English prose, none of it code or chat: every target of the registry predicts it well.
SANITY_TEXT = (
    "The river rises in the hills to the north and flows south through farmland for about forty miles before it "
    "reaches the sea. In the spring, melting snow swells the water, and the lower fields are often flooded. Farmers "
    "along its banks grow wheat, barley and potatoes, and many of them keep sheep on the higher ground."
)
# Nats above the recorded loss (7x its perplexity): a fine-tune stays well within it, a damaged config does not.
LOSS_MARGIN = 2.0
# Nats above log(vocabulary size), uniform guessing.
UNIFORM_MARGIN = 2.0


def text_loss(model, tokenizer, text: str = SANITY_TEXT) -> float:
    """The model's mean next-token loss (nats) on `text`, in one forward without gradients."""
    import torch

    ids = torch.tensor([tokenizer(text)["input_ids"]], dtype=torch.long, device=model.device)
    if ids.shape[1] < 2:  # a tokenizer that reads none of the text (a test's tiny one): nothing to predict
        return 0.0
    with torch.inference_mode():
        logits = model(ids).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()


def check_target_loss(loss: float, vocab_size: int, where: str, reference: tuple[str, float] | None = None) -> None:
    """Refuse a target whose loss on the built-in text says it is damaged; `reference` is (registry name, its
    recorded loss) for a model of a registry model's architecture. The message names `where` and what is wrong."""
    fix = "restore its weights and config.json from where they came from (or use the registry name instead)"
    if not math.isfinite(loss):
        raise ValueError(f"target {where} computes non-finite values ({loss}) on a short built-in English text: its "
                         f"weights or config.json are damaged; {fix}")
    if reference is not None and loss > reference[1] + LOSS_MARGIN:
        raise ValueError(
            f"target {where} has the architecture of {reference[0]} but predicts a short built-in English text far "
            f"worse than it (loss {loss:.2f} nats per token, {reference[0]}: {reference[1]:.2f}): its weights or "
            f"config.json (e.g. rope_theta, rms_norm_eps) are damaged; {fix}"
        )
    uniform = math.log(vocab_size)
    if loss > uniform + UNIFORM_MARGIN:
        raise ValueError(
            f"target {where} predicts a short built-in English text far worse than guessing at random (loss "
            f"{loss:.2f} nats per token, random guessing {uniform:.2f}): its weights or config.json are damaged; "
            f"{fix}"
        )
