"""Character-level text for the language model: read a corpus, its vocabulary, the split by position, and batches.

The corpus is split once, by position, never shuffled across the split: the first ``train_fraction`` trains, the
rest is halved into validation then test (Tiny Shakespeare: 90 % / 5 % / 5 %).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``path``; an empty file or bytes that are not UTF-8 are refused, naming the file."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
    if not text:
        raise ValueError(f"{path}: the corpus is empty")
    return text


@dataclass(frozen=True)
class CharVocab:
    """The characters of a corpus in sorted order; token id i is ``chars[i]``."""

    chars: str

    def __post_init__(self):
        if not self.chars:
            raise ValueError("the vocabulary is empty (the corpus has no characters)")
        if "".join(sorted(set(self.chars))) != self.chars:
            raise ValueError("vocabulary chars must be distinct and sorted")

    @classmethod
    def of(cls, text: str) -> CharVocab:
        """The vocabulary of ``text`` (refused when empty)."""
        if not isinstance(text, str) or not text:
            raise ValueError("text: the corpus is empty; a vocabulary needs at least one character")
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str, what: str = "text") -> Tensor:
        """The (N,) token ids of ``text``; characters outside the vocabulary are refused, named."""
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - index.keys())
        if unknown:
            shown = ", ".join(repr(c) for c in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
            raise ValueError(f"{what} holds {len(unknown)} character(s) outside the vocabulary of {len(self)}: "
                             f"{shown} (a vocabulary mismatch between the run and the {what}?)")
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        """The text of (N,) token ids."""
        ids = ids.tolist()
        bad = [i for i in ids if not 0 <= i < len(self)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of {len(self)}")
        return "".join(self.chars[i] for i in ids)

    def check_size(self, vocab_size: int, what: str = "the model") -> None:
        """Refuse a model whose vocabulary size is not this vocabulary's (a run and a corpus that do not match)."""
        if vocab_size != len(self):
            raise ValueError(f"vocabulary mismatch: {what} has vocab_size {vocab_size}, the text's vocabulary has "
                             f"{len(self)} characters")


@dataclass(frozen=True)
class Splits:
    """The corpus's token ids split by position: train, validation, test, each (N,)."""

    train: Tensor
    val: Tensor
    test: Tensor


def split_by_position(ids: Tensor, train_fraction: float = 0.9) -> Splits:
    """The first ``train_fraction`` of ids (N,) for training, the rest halved: validation first, then test."""
    if not (isinstance(train_fraction, float) and 0 < train_fraction < 1):
        raise ValueError(f"train_fraction must be in (0, 1); got {train_fraction!r}")
    if ids.dim() != 1 or ids.numel() < 3:
        raise ValueError(f"ids must be a 1-D tensor of at least 3 tokens to split in three; got {tuple(ids.shape)}")
    n_train = int(ids.numel() * train_fraction)
    n_val = (ids.numel() - n_train) // 2
    return Splits(ids[:n_train], ids[n_train:n_train + n_val], ids[n_train + n_val:])


def sample_windows(ids: Tensor, batch: int, context: int, generator: torch.Generator,
                   what: str = "corpus") -> tuple[Tensor, Tensor]:
    """``batch`` random windows of ``context`` tokens from ids (N,) and the windows one position on (the next-token
    targets): x, y (batch, context), drawn from ``generator``."""
    for name, value in (("batch", batch), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    if ids.numel() < context + 1:
        raise ValueError(f"the {what} ({ids.numel()} tokens) is shorter than the context + 1 ({context + 1}): "
                         f"no window of inputs and next-token targets fits")
    starts = torch.randint(ids.numel() - context, (batch,), generator=generator)  # (batch,)
    offsets = torch.arange(context)
    x = ids[starts[:, None] + offsets]  # (batch, context)
    return x, ids[starts[:, None] + offsets + 1]


def load_corpus(path: str | os.PathLike, train_fraction: float = 0.9) -> tuple[CharVocab, Splits]:
    """The vocabulary of the text at ``path`` and its token ids split by position."""
    text = read_text(path)
    vocab = CharVocab.of(text)
    return vocab, split_by_position(vocab.encode(text, what=str(path)), train_fraction)
