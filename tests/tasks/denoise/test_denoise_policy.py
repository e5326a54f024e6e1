"""DnCNN-stop's policy: any image size, its statistics, and its first exit kept with the weights."""
import torch

from learn2stop.tasks.denoise import DenoisePolicy, image_statistics


def test_policy_any_size_and_its_statistics():
    p = DenoisePolicy(num_steps=5, hidden=4).eval()
    for h, w in [(7, 9), (40, 33)]:
        x = torch.rand(3, 1, h, w)
        assert p(x, x * 0.9, 2).shape == (3,)
    # log mean r^2 of the residual tracks the noise level (blind)
    g = torch.Generator().manual_seed(0)
    clean = torch.rand(2, 1, 64, 64, generator=g)
    noise = torch.randn(clean.shape, generator=g)
    stats = image_statistics(clean + noise * torch.tensor([0.1, 0.3])[:, None, None, None], clean)
    torch.testing.assert_close(stats[:, 3].exp().sqrt(), torch.tensor([0.1, 0.3]), rtol=0.05, atol=0)
    assert torch.isfinite(image_statistics(clean, clean)).all()  # a perfect output: no log(0)


def test_policy_min_step_survives_the_state_dict():
    p = DenoisePolicy(num_steps=5, hidden=4)
    p.min_step = 3
    q = DenoisePolicy(num_steps=5, hidden=4)
    q.load_state_dict(p.state_dict())
    assert q.min_step == 3
