"""A byte-level BPE vocabulary for the language model, the alternative to characters (:class:`~.data.CharVocab`).

``BPEVocab.train(text, vocab_size)`` learns GPT-2's kind of tokenizer (byte-level pre-tokenisation, BPE merges) from
the given text in memory with the ``tokenizers`` library: nothing is downloaded. Every byte is in its alphabet, so any
text encodes and decodes back to itself. The interface is CharVocab's (``encode``, ``decode``, ``len``,
``check_size``), plus ``save``/``load`` of the tokenizer's JSON in a run directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from ...utils.report import write_text_atomic

#: symbols of the byte-level alphabet: a vocabulary holds at least these
BYTE_ALPHABET = 256


class Vocab(Protocol):
    """What the task reads of a vocabulary (:class:`~.data.CharVocab`, :class:`BPEVocab`)."""

    def __len__(self) -> int: ...

    def encode(self, text: str, what: str = "text") -> Tensor: ...

    def decode(self, ids: Tensor) -> str: ...

    def check_size(self, vocab_size: int, what: str = "the model") -> None: ...


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("BPEVocab needs the tokenizers package: pip install 'learn2stop[lm]' "
                          "(or pip install tokenizers)") from None
    return tokenizers


class BPEVocab:
    """A trained byte-level BPE tokenizer; token ids are 0..len - 1.

    Example::

        vocab = BPEVocab.train(text, vocab_size=512)
        ids = vocab.encode("ROMEO:", what="prompt")   # (N,) torch.long
        assert vocab.decode(ids) == "ROMEO:"
        vocab.save(run_dir / "tokenizer.json"); same = BPEVocab.load(run_dir / "tokenizer.json")
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPEVocab:
        """Learn up to ``vocab_size`` tokens (the 256 bytes and merges) from ``text``; fewer when the text has fewer
        pairs to merge. Empty text and a size below the byte alphabet are refused."""
        if not isinstance(text, str) or not text:
            raise ValueError("text: the corpus is empty; a BPE vocabulary needs text to learn merges from")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < BYTE_ALPHABET:
            raise ValueError(f"vocab_size must be an integer >= {BYTE_ALPHABET} (every byte of the byte-level "
                             f"alphabet is a token; merges come on top); got {vocab_size!r}")
        tk = _tokenizers()
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator([text], trainer=trainer)
        return cls(tokenizer)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, what: str = "text") -> Tensor:
        """The (N,) token ids of ``text``; text that is not a string or that encodes to no token is refused, named."""
        if not isinstance(text, str):
            raise ValueError(f"{what} must be a string; got {type(text).__name__}")
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise ValueError(f"{what} encodes to no tokens (is it empty?)")
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        """The text of (N,) token ids (a cut through a multi-byte character decodes to U+FFFD there)."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < len(self)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of {len(self)}")
        return self.tokenizer.decode(ids)

    def check_size(self, vocab_size: int, what: str = "the model") -> None:
        """Refuse a model whose vocabulary size is not this vocabulary's (a run and a tokenizer that do not match)."""
        if vocab_size != len(self):
            raise ValueError(f"vocabulary mismatch: {what} has vocab_size {vocab_size}, the BPE vocabulary has "
                             f"{len(self)} tokens")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer's JSON to ``path`` atomically."""
        return write_text_atomic(path, self.tokenizer.to_str())

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPEVocab:
        """The vocabulary saved at ``path``; a file that is not a saved byte-level BPE tokenizer is refused, named."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a tokenizer JSON file ({e.msg} at line {e.lineno})") from None
        model = spec.get("model") if isinstance(spec, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE" or \
                (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
            raise ValueError(f"{path}: not a saved byte-level BPE tokenizer (model type "
                             f"{model.get('type') if isinstance(model, dict) else None!r})")
        return cls(_tokenizers().Tokenizer.from_str(text))

    def __eq__(self, other) -> bool:
        return isinstance(other, BPEVocab) and self.tokenizer.to_str() == other.tokenizer.to_str()

    __hash__ = None
