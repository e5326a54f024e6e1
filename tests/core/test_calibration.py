"""The calibrators check their arguments: shapes, NaN scores or losses, unknown signals, each refused by name."""
from __future__ import annotations

import pytest
import torch

from learn2stop.core.calibration import calibrate_budget
from learn2stop.core.inference import active_rule
from learn2stop.core.risk_control import calibrate_risk


S, C = torch.rand(20, 4), torch.arange(1, 6) / 5.0


L = torch.rand(20, 5)


@pytest.mark.parametrize("call, error, message", [
    (lambda: calibrate_budget(torch.full((20, 4), float("nan")), C, 0.5, "quantile"), ValueError, r"scores: 80 NaN"),
    (lambda: calibrate_budget(S, C[:3], 0.5, "quantile"), ValueError, r"costs: expected a \(5,\) tensor"),
    (lambda: calibrate_budget(torch.zeros(0, 4), C, 0.5, "quantile"), ValueError, r"scores: expected a \(N, T-1\)"),
    (lambda: calibrate_budget(torch.rand(4), C, 0.5, "quantile"), ValueError, r"scores: expected a \(N, T-1\)"),
    (lambda: calibrate_budget([[0.1]], C, 0.5, "quantile"), TypeError, "scores: expected a"),
    (lambda: calibrate_budget(S, torch.tensor([0.2, float("nan"), 0.6, 0.8, 1.0]), 0.5, "quantile"), ValueError, "costs: NaN"),
    (lambda: calibrate_budget(S, C, 0.5, "bogus"), ValueError, "signal_name: must be one of"),
    (lambda: calibrate_risk(S, torch.full((20, 5), float("nan")), 0.1, 0.1, "quantile"), ValueError, "risk_losses: 100 NaN"),
    (lambda: calibrate_risk(torch.full((20, 4), float("nan")), L, 0.1, 0.1, "quantile"), ValueError, "scores: 80 NaN"),
    (lambda: calibrate_risk(S, torch.rand(7, 5), 0.1, 0.1, "quantile"), ValueError, r"risk_losses: expected \(20, 5\)"),
    (lambda: calibrate_risk(S, L, 0.1, 0.1, "quantile", loss_range=(1, 1)), ValueError, "loss_range: expected two"),
    (lambda: active_rule("quantile", None), TypeError, "inference: expected an InferenceConfig"),
    (lambda: active_rule(None, None), TypeError, "inference: expected an InferenceConfig"),
])
def test_calibrators_check_their_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()
