"""The byte-level BPE vocabulary: trained in memory, text round trips, save/load identity, bad input refused."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import shared_data

pytest.importorskip("tokenizers")

from learn2stop.tasks.lm.tokenizer import BPEVocab  # noqa: E402

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n") * 4


def test_text_round_trips_and_merges_shorten_it():
    vocab = BPEVocab.train(TEXT, 300)
    assert 256 < len(vocab) <= 300
    ids = vocab.encode(TEXT)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert int(ids.min()) >= 0 and int(ids.max()) < len(vocab)
    assert ids.numel() < len(TEXT.encode("utf-8")) / 2  # repeated words became single tokens
    assert vocab.decode(ids) == TEXT
    unseen = "naïve café — 日本語 🙂\ttabs  and  spaces\r\n"  # bytes the training text never held
    assert vocab.decode(vocab.encode(unseen)) == unseen
    vocab.check_size(len(vocab))


def test_a_text_with_few_pairs_gives_fewer_tokens_than_asked():
    vocab = BPEVocab.train("abababab", 1000)
    assert 256 < len(vocab) < 1000
    assert vocab.decode(vocab.encode("abba")) == "abba"


@pytest.mark.data
def test_tiny_shakespeare_round_trips():
    text = (shared_data("tinyshakespeare") / "input.txt").read_text(encoding="utf-8")[:20_000]
    vocab = BPEVocab.train(text, 512)
    assert len(vocab) == 512
    ids = vocab.encode(text, what="corpus")
    assert vocab.decode(ids) == text
    assert ids.numel() < 0.5 * len(text)  # 512 tokens compress English text to under half its characters


def test_save_and_load_give_the_same_vocabulary(tmp_path):
    vocab = BPEVocab.train(TEXT, 320)
    path = vocab.save(tmp_path / "tokenizer.json")
    assert path == tmp_path / "tokenizer.json" and json.loads(path.read_text())["model"]["type"] == "BPE"
    same = BPEVocab.load(path)
    assert same == vocab and len(same) == len(vocab)
    assert torch.equal(same.encode(TEXT), vocab.encode(TEXT))
    assert BPEVocab.train(TEXT + "zzzz qqqq zzzz qqqq", 320) != vocab


def test_bad_input_is_refused_naming_the_problem(tmp_path):
    for text in ("", None, b"bytes"):
        with pytest.raises(ValueError, match="text: the corpus is empty"):
            BPEVocab.train(text, 300)
    for size in (1, 2, 255, True, "512", 300.0):
        with pytest.raises(ValueError, match=r"vocab_size must be an integer >= 256 \(every byte"):
            BPEVocab.train(TEXT, size)
    vocab = BPEVocab.train(TEXT, 300)
    with pytest.raises(ValueError, match="prompt encodes to no tokens"):
        vocab.encode("", what="prompt")
    with pytest.raises(ValueError, match="prompt must be a string; got int"):
        vocab.encode(5, what="prompt")
    with pytest.raises(ValueError, match=f"token id {len(vocab)} is outside the vocabulary of {len(vocab)}"):
        vocab.decode(torch.tensor([1, len(vocab)]))
    with pytest.raises(ValueError, match=f"vocabulary mismatch: the run has vocab_size 65, the BPE vocabulary has "
                                         f"{len(vocab)} tokens"):
        vocab.check_size(65, what="the run")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not a tokenizer JSON file"):
        BPEVocab.load(broken)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(ValueError, match=r"other.json: not a saved byte-level BPE tokenizer \(model type 'WordPiece'\)"):
        BPEVocab.load(other)
