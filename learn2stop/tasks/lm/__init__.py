"""Language models (the fifth application): a small character-level GPT whose tokens can exit after any exit layer,
with CALM's state propagation for the layers a stopped token skips, generation with a KV cache, LayerSkip's
self-speculative decoding, the stages (baseline, deep supervision, Stage I, Stage II's per-token policy), CALM's
rules, Learn-then-Test calibration, and the ``learn2stop lm`` task (:mod:`.app`)."""
from .config import GPTConfig, LmConfig, preset  # noqa: F401
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
from .rules import ExitRule, make_rule  # noqa: F401
from .speculative import SpeculativeResult, self_speculative_decode  # noqa: F401
from .commands import evaluate, generate_command, reproduce, train  # noqa: F401
from . import app  # noqa: F401,E402  (registers the task)
