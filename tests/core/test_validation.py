"""Validation scores: an empty or non-finite validation set is an error, never a silent no-selection."""
import pytest
import torch

from learn2stop.core import StageConfig, StagedTrainer, validation_scores

from test_model import sm  # noqa: F401 - the LISTA stopping model fixture


class _Task:
    def __init__(self, val):
        self.val = val

    def loss_fn(self, out, tgt):
        return (out - tgt).pow(2).sum(1)

    def sample_batch(self, n, gen, device):
        y = torch.randn(n, 7, generator=gen)
        return y, torch.randn(n, 11, generator=gen)

    def validation_batches(self, device):
        return self.val


def test_an_empty_or_nan_validation_set_is_an_error_not_a_silent_no_selection(sm, tmp_path):
    with pytest.raises(ValueError, match="validation set is empty"):
        validation_scores(sm, [], _Task([]).loss_fn)
    nan_target = [(torch.randn(4, 7), torch.full((4, 11), float("nan")))]
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        validation_scores(sm, nan_target, _Task([]).loss_fn)
    trainer = StagedTrainer(sm, _Task([]), tmp_path, progress=False)
    with pytest.raises(ValueError, match="validation set is empty"):
        trainer.fit("stage2", StageConfig(objective="stage2", iterations=2, eval_every=1, batch_size=4))
