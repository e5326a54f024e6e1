"""StoppingModel at its door: inputs a model cannot take are refused in the user's terms, naming the type, shape,
dtype or bad values."""
import numpy as np
import pytest
import torch
from torch import nn

from learn2stop.core import StoppingModel
from learn2stop.tasks.sparse import LISTA, ProblemConfig, make_matrix


class Pol(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, 1)

    def forward(self, y, x, t):
        return self.lin(x).squeeze(1)


@pytest.fixture(scope="module")
def sm():
    A = make_matrix(ProblemConfig(m=7, n=11))
    return StoppingModel(LISTA(A, 4), Pol(11)).eval()


@pytest.mark.parametrize("inputs, error, message", [
    (np.zeros((3, 7), dtype=np.float32), TypeError, "numpy.ndarray.*torch.as_tensor"),
    ([[0.0] * 7] * 3, TypeError, "list.*torch.as_tensor"),
    (3.0, TypeError, "must be a torch tensor"),
    (torch.zeros(3, 5), ValueError, "measurements have 5 entries but A has 7 rows"),  # LISTA's own check
    (torch.zeros(3, 7, dtype=torch.float64), ValueError, "dtype torch.float64"),
    (torch.tensor([[float("nan")] * 7, [0.0] * 7]), ValueError, "NaN or inf values in 1 sample"),
    (torch.tensor([[float("inf")] * 7] * 2), ValueError, "NaN or inf values in 2 sample"),
    (torch.zeros(0, 7), ValueError, "empty batch"),
])
def test_stopping_model_refuses_bad_inputs_in_the_users_terms(sm, inputs, error, message):
    for call in (lambda: sm(inputs), lambda: sm.unroll(inputs)):
        with pytest.raises(error, match=message):
            with torch.no_grad():
                call()


def test_a_feature_size_mismatch_is_reported_at_the_first_step_not_deep_in_a_matmul():
    class Net(nn.Module):
        num_steps = 3

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def initial_state(self, y):
            return y

        def step(self, t, x, y):
            return torch.tanh(self.lin(x))

        def readout(self, t, x, y):
            return x

    with pytest.raises(ValueError, match=r"Net cannot take inputs of shape \(3, 4\) and dtype torch.float32"):
        StoppingModel(Net())(torch.zeros(3, 4))
