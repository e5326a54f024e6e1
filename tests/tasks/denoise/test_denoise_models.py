"""DnCNN-stop networks: shapes, cheap exits, declared exit costs, and early exit that really skips layers."""
import numpy as np
import pytest
import torch
from torch import nn

from learn2stop.core import FixedDepth, StopAtTimes, StoppingModel, exit_costs, run_with_early_exit, unroll
from learn2stop.tasks.denoise import DeepSupervisedDnCNN, DenoisePolicy, psnr


def small_net(positions=(1, 3), depth=6, channels=8, **kw):
    torch.manual_seed(0)
    net = DeepSupervisedDnCNN(depth=depth, channels=channels, output_positions=positions, **kw)
    # non-trivial BN statistics and last layers, so that outputs differ between exits
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    for m in [net.final, *net.heads]:
        nn.init.normal_(m.weight, std=0.1)
    return net.eval()


def test_dncnn_layout_no_bias_and_residual():
    net = DeepSupervisedDnCNN(depth=20, channels=64, output_positions=())
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 20 and all(c.bias is None for c in convs)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) == 18
    assert net.num_steps == 1 and net.layers_at(1) == 20
    paper = DeepSupervisedDnCNN(depth=20, channels=64)
    assert paper.num_steps == 19 and paper.output_positions == tuple(range(1, 19))
    # an exit after block k is a (k+1)-layer DnCNN: one conv C->1 per exit
    assert [paper.layers_at(t) for t in (1, 18, 19)] == [2, 19, 20]
    assert all(h.in_channels == 64 and h.out_channels == 1 for h in paper.heads)
    # residual learning: with a zero final layer the output is the noisy input itself
    nn.init.zeros_(net.final.weight)
    x = torch.rand(2, 1, 11, 13)
    torch.testing.assert_close(net.eval()(x), x)


@pytest.mark.parametrize("head_kernel", [3, 1])
def test_every_output_has_the_input_shape_and_comes_from_its_head(head_kernel):
    net = small_net(head_kernel=head_kernel)
    x = torch.rand(3, 1, 19, 23)  # odd sizes
    r = unroll(net, x, keep_outputs=True)
    assert net.num_steps == 3 and len(r.step_outputs) == 3
    assert all(o.shape == x.shape for o in r.step_outputs)
    with torch.no_grad():
        h, feats = x, []
        for block in net.blocks:
            h = block(h)
            feats.append(h)
        expected = [x - net.heads[0](feats[0]), x - net.heads[1](feats[2]), x - net.final(feats[-1])]
    for got, want in zip(r.step_outputs, expected):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(r.step_outputs[-1], net(x))
    assert not torch.allclose(r.step_outputs[0], r.step_outputs[1])


@pytest.mark.parametrize("positions", [(0,), (4, 5), (3, 2), (2, 2)])
def test_bad_output_positions_are_rejected(positions):
    with pytest.raises(ValueError, match="output_positions"):
        DeepSupervisedDnCNN(depth=6, channels=4, output_positions=positions)


def test_bad_depth_head_and_input_shape():
    with pytest.raises(ValueError, match="depth"):
        DeepSupervisedDnCNN(depth=2)
    with pytest.raises(ValueError, match="head_kernel"):
        DeepSupervisedDnCNN(depth=5, head_kernel=5)
    with pytest.raises(ValueError, match="B, C, H, W"):
        unroll(small_net(), torch.rand(1, 9, 9))


def test_early_exit_matches_full_depth_and_skips_layers():
    net = small_net(positions=(1, 2, 4), depth=7)
    x = torch.rand(5, 1, 15, 17)
    full = unroll(net, x, keep_outputs=True)
    times = torch.tensor([1, 3, 2, 4, 1])
    net.block_rows = 0
    with torch.no_grad():
        r = run_with_early_exit(net, x, StopAtTimes(times))
    for i, t in enumerate(times.tolist()):
        torch.testing.assert_close(r.outputs[i], full.step_outputs[t - 1][i])
    assert torch.equal(r.stop_times, times)
    assert net.block_rows == sum(net.blocks_at(t) for t in times.tolist())  # 1+4+2+6+1 = 14
    assert net.block_rows < 5 * (net.depth - 1)


class _MacCounter:
    """Multiply-accumulates of every conv actually run, and of every policy call, summed over rows."""

    def __init__(self, net, policy):
        self.total = 0.0
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                m.register_forward_hook(self._conv)
        policy.register_forward_hook(self._policy)
        self.policy_macs = policy.macs_per_pixel()

    def _conv(self, mod, inp, out):
        k = mod.kernel_size[0] * mod.kernel_size[1]
        self.total += out.shape[0] * out.shape[2] * out.shape[3] * mod.out_channels * mod.in_channels * k

    def _policy(self, mod, inp, out):
        x = inp[0]
        self.total += x.shape[0] * x.shape[2] * x.shape[3] * self.policy_macs


@pytest.mark.parametrize("head_kernel", [3, 1])
def test_exit_costs_are_the_macs_actually_computed(head_kernel):
    torch.manual_seed(0)
    policy = DenoisePolicy(4, hidden=4).eval()
    net = small_net(positions=(1, 2, 4), depth=7, head_kernel=head_kernel, policy_macs=policy.macs_per_pixel())
    counter = _MacCounter(net, policy)
    x = torch.rand(5, 1, 9, 11)
    times = torch.tensor([1, 3, 2, 4, 1])
    at_times = StopAtTimes(times)

    def rule(view):  # ask the policy at every exit, as the deployed rules do, then stop at the given times
        policy(view.inputs, view.output, view.t)
        return at_times(view)

    with torch.no_grad():
        run_with_early_exit(net, x, rule)
    costs = torch.tensor(net.exit_costs, dtype=torch.float64)
    assert counter.total == pytest.approx(float(costs[times - 1].sum()) * 9 * 11, rel=1e-9)
    # the core reads them: non-decreasing, normalised to 1 at full depth, and a stop at exit 1 is cheap
    c = exit_costs(net)
    assert c[-1] == 1 and bool((c.diff() > 0).all()) and c[0] < 0.05
    # full depth with every exit computed costs little more than plain DnCNN
    plain = DeepSupervisedDnCNN(depth=7, channels=8, output_positions=())
    assert costs[-1] < 1.1 * plain.exit_costs[-1]
    # a fixed depth computes its own output alone: no earlier head, no policy
    fixed = torch.tensor(net.fixed_exit_costs, dtype=torch.float64)
    for d in range(1, net.num_steps + 1):
        counter.total = 0
        with torch.no_grad():
            run_with_early_exit(net, x, FixedDepth(d))
        assert counter.total == pytest.approx(float(fixed[d - 1]) * 5 * 9 * 11, rel=1e-9)
    assert fixed[-1] == pytest.approx(plain.exit_costs[-1]) and bool((fixed < costs).all())


def test_policy_early_exit_equals_full_depth_at_the_policy_stop():
    net = small_net(positions=(1, 2, 3, 4), depth=7)
    torch.manual_seed(1)
    policy = DenoisePolicy(net.num_steps, hidden=4).eval()
    with torch.no_grad():
        policy.out.bias.fill_(0.0)
    sm = StoppingModel(net, policy)
    x = torch.rand(6, 1, 13, 16)
    full = sm.unroll(x, keep_outputs=True)
    assert full.stop_logits.shape == (6, 4)
    net.block_rows = 0
    with torch.no_grad():
        r = sm(x)
    # the rule stops at the first t with pi_t > 0.5, read from the full rollout's logits
    first = [(row > 0).nonzero() for row in full.stop_logits]
    want = torch.tensor([int(f[0]) + 1 if len(f) else 5 for f in first])
    assert torch.equal(r.stop_times, want)
    for i in range(6):
        torch.testing.assert_close(r.outputs[i], full.step_outputs[int(want[i]) - 1][i])
    assert net.block_rows == sum(net.blocks_at(int(t)) for t in want)


def test_fixed_depth_counts_blocks():
    net = small_net(positions=(2, 3), depth=6)
    net.block_rows = 0
    with torch.no_grad():
        run_with_early_exit(net, torch.rand(4, 1, 9, 9), FixedDepth(1))
    assert net.block_rows == 4 * 2


def test_frozen_backbone_trains_only_the_heads():
    net = small_net(frozen_backbone=True)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)  # every parameter offered, as the trainer does
    net.train()
    assert not net.blocks.training
    x = torch.rand(4, 1, 12, 12)
    r = unroll(net, x, target=x, loss_fn=lambda o, t: ((o - t) ** 2).flatten(1).sum(1))
    r.losses.sum().backward()
    opt.step()
    after = net.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("heads.") for k in changed)


def test_load_backbone_copies_blocks_not_heads():
    src = small_net(positions=(), depth=6)
    dst = DeepSupervisedDnCNN(depth=6, channels=8, output_positions=(1, 3))
    heads = [h.weight.clone() for h in dst.heads]
    dst.load_backbone(src)
    torch.testing.assert_close(dst.final.weight, src.final.weight)
    assert all(torch.equal(h.weight, w) for h, w in zip(dst.heads, heads))
    with pytest.raises(ValueError, match="backbone"):
        dst.load_backbone(DeepSupervisedDnCNN(depth=6, channels=4, output_positions=()))


def test_bm3d_baseline_when_installed():
    pytest.importorskip("bm3d")
    from learn2stop.tasks.denoise.images import synthetic_images
    from learn2stop.tasks.denoise.models import bm3d_denoise

    clean = synthetic_images(1, 32, seed=3)[0]
    noisy = clean + np.random.default_rng(0).normal(0, 25 / 255, clean.shape).astype(np.float32)
    out = bm3d_denoise(noisy, 25.0)
    t = lambda a: torch.from_numpy(np.asarray(a, np.float32))[None, None]
    assert float(psnr(t(out), t(clean))) > float(psnr(t(noisy), t(clean))) + 1.0
