"""The language model's config: the GPT's shape, where it can exit, and how a stopped token's later layers are filled."""
from __future__ import annotations

from dataclasses import dataclass

from ...utils.config import one_of, positive_int, require

#: how a token that stops at layer k gets the keys and values of layers k+1..L (CALM's state propagation):
#: ``copy`` feeds its exit hidden state to each later layer's own key/value projection; ``learned`` first maps it
#: by a per-layer linear map (initialised to the identity, so it starts as ``copy``)
PROPAGATIONS = ("copy", "learned")


@dataclass
class GPTConfig:
    """A small character-level GPT (nanoGPT's shape): ``n_layer`` pre-norm blocks of width ``n_embd``."""

    vocab_size: int = 65
    """Distinct tokens (characters): 65 for Tiny Shakespeare."""
    context: int = 128
    """The longest sequence the model reads (its position embeddings)."""
    n_layer: int = 6
    """Transformer blocks; a step runs ``exit_every`` of them."""
    n_head: int = 4
    """Attention heads per block (``n_embd`` must be a multiple)."""
    n_embd: int = 128
    """Width of the hidden state."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches while training."""
    exit_every: int = 1
    """An exit (final norm + shared LM head) after every this many blocks, and always after the last."""
    propagation: str = "copy"
    """How a stopped token's later layers get its keys and values: ``copy`` or ``learned`` (see PROPAGATIONS)."""

    def __post_init__(self):
        for name in ("vocab_size", "context", "n_layer", "n_head", "n_embd", "exit_every"):
            positive_int(getattr(self, name), name)
        require(self.n_embd % self.n_head == 0, "n_embd",
                f"must be a multiple of n_head ({self.n_head}); got {self.n_embd}")
        require(isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1, "dropout",
                f"must be in [0, 1); got {self.dropout!r}")
        require(self.exit_every <= self.n_layer, "exit_every",
                f"must be at most n_layer ({self.n_layer}); got {self.exit_every}")
        one_of(self.propagation, PROPAGATIONS, "propagation")

    @property
    def exit_layers(self) -> list[int]:
        """The 1-based layers after which the model can exit: every ``exit_every`` blocks, and the last."""
        layers = list(range(self.exit_every, self.n_layer + 1, self.exit_every))
        return layers if layers[-1] == self.n_layer else layers + [self.n_layer]
