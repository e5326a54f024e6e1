"""Small batches at inference in numpy (core/fastpath.py): when a policy may decide in numpy, the copies of its
weights made again when a weight changes, and the classify policy's numpy decision against its torch one."""
import pytest
import torch
from torch import nn

from learn2stop.core.fastpath import NUMPY_MAX_BATCH, NumpyCopies, numpy_eligible, torch_only
from learn2stop.core.policies import ExitPolicy


def test_numpy_only_at_inference_on_small_float32_cpu_batches():
    m = nn.Linear(3, 2).eval()
    x = torch.zeros(NUMPY_MAX_BATCH, 3)
    with torch.no_grad():
        assert numpy_eligible(m, x) and numpy_eligible(m, x[:1], x[:1])
        assert not numpy_eligible(m, torch.zeros(NUMPY_MAX_BATCH + 1, 3))
        assert not numpy_eligible(m, x.double()) and not numpy_eligible(m, x, x.half())
        m.train()
        assert not numpy_eligible(m, x)
        m.eval()
        with torch_only():
            assert not numpy_eligible(m, x[:1])
        assert numpy_eligible(m, x[:1])
    assert not numpy_eligible(m, x)  # gradients on


def test_copies_are_made_again_when_a_weight_changes():
    m = nn.Linear(3, 2)
    copies, made = NumpyCopies(), []

    def build():
        made.append(m.weight.detach().numpy().copy())
        return made[-1]
    first = copies.get("w", lambda: [m.weight, m.bias], build)
    assert copies.get("w", lambda: [m.weight, m.bias], build) is first and len(made) == 1
    with torch.no_grad():
        m.bias.add_(1.0)  # any tensor it was made from
    second = copies.get("w", lambda: [m.weight, m.bias], build)
    assert second is not first and len(made) == 2
    m.load_state_dict(nn.Linear(3, 2).state_dict())
    third = copies.get("w", lambda: [m.weight, m.bias], build)
    assert third is not second
    m.weight.data = torch.randn(2, 3)  # a new storage, at the same version
    assert copies.get("w", lambda: [m.weight, m.bias], build) is not third
    assert torch.equal(torch.from_numpy(made[-1]), m.weight.detach())
    copies.clear()
    copies.get("w", lambda: [m.weight, m.bias], build)
    assert len(made) == 5
    with torch.inference_mode():  # no version to check against: no copy, the caller runs torch
        frozen = nn.Linear(3, 2)
    assert copies.get("frozen", lambda: [frozen.weight], build) is None


@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("top_k", [1, 3])
def test_the_exit_policys_numpy_decision_is_its_torch_one(batch, top_k):
    torch.manual_seed(0)
    policy = ExitPolicy(num_classes=10, num_steps=5, top_k=top_k, hidden=16).eval()
    with torch.no_grad():
        policy.step_bias.normal_()
    for t in range(1, 6):
        logits = torch.randn(batch, 10) * 4
        with torch.no_grad():
            fast = policy(None, logits, t)
        with torch.enable_grad():
            slow = policy(None, logits, t).detach()
        assert fast.dtype == torch.float32 and fast.shape == (batch,)
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # a changed weight reaches the numpy decision
        before = policy(None, logits, 5)
        policy.rest[1].bias.add_(1.0)
        torch.testing.assert_close(policy(None, logits, 5), before + 1.0)


def test_a_traced_policy_keeps_its_torch_graph():
    """Export and tracing record torch's operations: a numpy decision there would be kept as a constant."""
    torch.manual_seed(1)
    policy = ExitPolicy(num_classes=10, num_steps=4, hidden=8).eval()
    class AtExit2(nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = policy

        def forward(self, z):
            return self.policy(None, z, 2)
    with torch.no_grad():
        traced = torch.jit.trace(AtExit2().eval(), torch.randn(1, 10), check_trace=False)
        other = torch.randn(1, 10) * 5
        torch.testing.assert_close(traced(other), policy(None, other, 2))
