"""Tiny folders the `flashdraft bench` command tests share: a target and a draft saved to disk."""

import json

from tiny import tiny_draft, tiny_target, tiny_tokenizer

MASK = 1


def save_tiny_bench_folders(root, prompt_records: list[dict]):
    """A tiny Llama target with its tokenizer (`root/target`), a block-4 draft for it (`root/draft`) and the given
    prompt records as `root/prompts.jsonl`."""
    target = tiny_target("llama", forbid_token=MASK)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    tiny_draft(target, block_size=4, mask_token_id=MASK).save_pretrained(root / "draft")
    (root / "prompts.jsonl").write_text("".join(json.dumps(record) + "\n" for record in prompt_records))
    return root
