"""Character data: the vocabulary, the split by position, seeded windows, and the refusals of bad text."""
from __future__ import annotations

import pytest
import torch
from conftest import shared_data

from learn2stop.tasks.lm import (
    CharVocab,
    load_corpus,
    read_text,
    sample_windows,
    split_by_position,
)

TEXT = "To be, or not to be: that is the question.\n"


def test_the_vocabulary_is_the_sorted_characters_and_round_trips():
    vocab = CharVocab.of(TEXT)
    assert vocab.chars == "".join(sorted(set(TEXT))) and len(vocab) == len(set(TEXT))
    ids = vocab.encode(TEXT)
    assert ids.dtype == torch.long and vocab.decode(ids) == TEXT


def test_a_prompt_outside_the_vocabulary_is_a_named_mismatch():
    vocab = CharVocab.of(TEXT)
    with pytest.raises(ValueError, match=r"prompt holds 2 character\(s\) outside the vocabulary.*'Z'.*'z'"):
        vocab.encode("Zoo z", what="prompt")
    with pytest.raises(ValueError, match="vocabulary mismatch: the run has vocab_size 65"):
        vocab.check_size(65, "the run")
    vocab.check_size(len(vocab))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab.decode(torch.tensor([len(vocab)]))


def test_the_split_is_by_position_90_5_5():
    ids = torch.arange(1000)
    s = split_by_position(ids)
    assert (len(s.train), len(s.val), len(s.test)) == (900, 50, 50)
    assert torch.equal(torch.cat([s.train, s.val, s.test]), ids)  # contiguous, in order: never shuffled across
    with pytest.raises(ValueError, match="train_fraction"):
        split_by_position(ids, 1.0)


def test_windows_are_next_token_pairs_drawn_from_the_generator():
    ids = torch.arange(50)
    x, y = sample_windows(ids, 6, 7, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (6, 7)
    assert torch.equal(y, x + 1) and torch.equal(x[:, 1:], x[:, :-1] + 1) and int(y.max()) <= 49
    again, _ = sample_windows(ids, 6, 7, torch.Generator().manual_seed(0))
    other, _ = sample_windows(ids, 6, 7, torch.Generator().manual_seed(1))
    assert torch.equal(x, again) and not torch.equal(x, other)
    x, y = sample_windows(ids, 3, 49, torch.Generator().manual_seed(0))  # the longest window that fits
    assert torch.equal(x[0], ids[:49]) and torch.equal(y[0], ids[1:])


@pytest.mark.parametrize("batch,context,match", [
    (0, 4, "batch must be an integer >= 1"), (2, 0, "context must be"), (2, 10, r"shorter than the context \+ 1"),
    (2.0, 4, "batch")])
def test_bad_windows_are_refused_naming_the_problem(batch, context, match):
    with pytest.raises(ValueError, match=match):
        sample_windows(torch.arange(10), batch, context, torch.Generator().manual_seed(0))


def test_empty_or_non_utf8_text_is_refused_naming_the_file(tmp_path):
    empty, latin = tmp_path / "empty.txt", tmp_path / "latin.txt"
    empty.write_bytes(b"")
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match="empty.txt: the corpus is empty"):
        read_text(empty)
    with pytest.raises(ValueError, match=r"latin.txt: not UTF-8 text \(byte 3 is 0xe9\)"):
        read_text(latin)
    with pytest.raises(ValueError, match="empty"):
        CharVocab.of("")


@pytest.mark.data
def test_tiny_shakespeare_has_65_characters_and_splits_by_position():
    vocab, splits = load_corpus(shared_data("tinyshakespeare") / "input.txt")
    assert len(vocab) == 65
    n = len(splits.train) + len(splits.val) + len(splits.test)
    assert n == 1_115_394 and len(splits.train) == int(n * 0.9)
    assert vocab.decode(splits.train[:14]) == "First Citizen:"
