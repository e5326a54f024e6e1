"""Language models (the fifth application, in progress): a small character-level GPT whose tokens can exit after any
exit layer, with CALM's state propagation for the layers a stopped token skips, generation with a KV cache and
LayerSkip's self-speculative decoding. Not yet registered as a task (no stages, policy or CLI yet)."""
from .config import GPTConfig  # noqa: F401
from .data import (  # noqa: F401
    CharVocab,
    Splits,
    load_corpus,
    read_text,
    sample_windows,
    split_by_position,
)
from .generate import Generation, KVCache, decode_token, generate, prefill  # noqa: F401
from .models import GPT, StepwiseGPT, score_with_exits  # noqa: F401
from .speculative import SpeculativeResult, self_speculative_decode  # noqa: F401
