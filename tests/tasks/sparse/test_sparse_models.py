"""LISTA, ISTA and FISTA against hand-written references."""
import numpy as np
import torch

from learn2stop.core import unroll
from learn2stop.tasks.sparse import FISTA, ISTA, LISTA, ProblemConfig, make_matrix, sample_problems

SMALL = ProblemConfig(m=13, n=27, sparsity=0.2, test_per_snr=40, val_per_snr=30)


def numpy_ista(A, y, L, rho, T):
    x = np.zeros((y.shape[0], A.shape[1]))
    for _ in range(T):
        v = x - (x @ A.T - y) @ A / L
        x = np.sign(v) * np.maximum(np.abs(v) - rho / L, 0)
    return x


def numpy_fista(A, y, L, rho, T):
    x = z = np.zeros((y.shape[0], A.shape[1]))
    s = 1.0
    for _ in range(T):
        v = z - (z @ A.T - y) @ A / L
        x_new = np.sign(v) * np.maximum(np.abs(v) - rho / L, 0)
        s_new = (1 + np.sqrt(1 + 4 * s * s)) / 2
        z = x_new + (s - 1) / s_new * (x_new - x)
        x, s = x_new, s_new
    return z


def test_ista_fista_and_lista_init_match_reference():
    A = make_matrix(SMALL).double()
    b = sample_problems(A.float(), SMALL, 9, torch.Generator().manual_seed(0))
    y = b.y.double()
    ref = numpy_ista(A.numpy(), y.numpy(), 3.0, 0.1, 7)
    np.testing.assert_allclose(unroll(ISTA(A, 7, 3.0, 0.1), y).outputs.numpy(), ref, atol=1e-10)
    np.testing.assert_allclose(unroll(FISTA(A, 7, 3.0, 0.1), y).outputs.numpy(), numpy_fista(A.numpy(), y.numpy(), 3.0, 0.1, 7), atol=1e-10)
    lista = LISTA(A, 7, L=3.0, rho=0.1).double()  # ISTA initialisation: identical iterates
    np.testing.assert_allclose(unroll(lista, y).outputs.detach().numpy(), ref, atol=1e-10)


def test_lista_thresholds_are_untied():
    lista = LISTA(make_matrix(SMALL), 5)
    lista.theta.grad = None
    loss = unroll(lista, torch.randn(4, 13)).outputs.abs().sum() + 0 * lista.theta.sum()
    loss.backward()
    assert lista.W_x.shape == (5, 27, 27) and lista.W_b.shape == (5, 27, 13) and lista.theta.shape == (5,)
    with torch.no_grad():
        lista.theta[0] += 1.0
    assert lista.theta[1] != lista.theta[0]
