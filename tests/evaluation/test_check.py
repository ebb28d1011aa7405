"""The draft acceptance check: a draft that accepts far less than its folder records is named in one warning."""

from __future__ import annotations

import json

import pytest

from flashdraft.evaluation import check
from flashdraft.models import load_draft

from tiny import tiny_draft, tiny_target, tiny_tokenizer


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path / "home"))
    target = tiny_target("llama", forbid_token=1)
    tokenizer = tiny_tokenizer(96)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    folder = tmp_path / "draft"
    tiny_draft(target, block_size=4, mask_token_id=1).save_pretrained(folder)
    return target, tokenizer, folder, load_draft(str(folder))


def test_the_rule_is_half_of_the_tokens_beyond_the_bonus():
    assert check.falls_far_below(1.0, 2.5) and check.falls_far_below(1.7, 2.5)
    assert not check.falls_far_below(1.8, 2.5) and not check.falls_far_below(1.0, 1.0)


def test_a_draft_far_below_its_record_is_named_once_measured_then_cached(pair, monkeypatch, capsys):
    target, tokenizer, folder, draft = pair
    assert check.check_draft(folder, target, tokenizer, draft) is None  # no record, no check
    measured = check.record_check(folder, target, tokenizer, draft)
    record = json.loads((folder / check.CHECK_FILE).read_text())
    assert record["tau"] == round(measured, 4) and record["block_size"] == 4 and len(record["prompts"]) == 3
    assert check.check_draft(folder, target, tokenizer, draft) is None  # what it recorded
    record["tau"] = 2 * measured + 2  # a record the draft is now far below
    (folder / check.CHECK_FILE).write_text(json.dumps(record))
    calls = []
    monkeypatch.setattr(check, "measure_check", lambda *a: calls.append(1) or measured)
    for _ in range(2):
        check.warn_if_weak(folder, target, tokenizer, draft)
        assert f"warning: draft {folder} accepts far less than when it was shipped" in capsys.readouterr().err
    assert calls == [1]  # measured once, then read from the cache
    (folder / check.CHECK_FILE).write_text("{")
    assert "is unreadable" in check.check_draft(folder, target, tokenizer, draft)
