"""VGG-BN with internal classifiers: FLOP identities, SDN's IC placement, early exit that really
skips conv layers, and clear errors for bad inputs."""
import pytest
import torch
from torch import nn

from learn2stop.core.loop import StopAtTimes, run_with_early_exit, unroll
from learn2stop.tasks.classify.models import (
    SDN_FRACTIONS, ICHead, VGGEarlyExit, build_vgg, exit_flops, flop_table, full_network_flops, list_vgg_configs,
    step_flops)


def small_net(positions=(1, 2, 4), size=12):
    """Five convs, odd-ish sizes (12 -> 6 -> 3), non-trivial BN statistics, eval mode."""
    torch.manual_seed(0)
    net = VGGEarlyExit([4, "M", 6, 6, "M", 8, 5], num_classes=7, input_size=size, ic_positions=positions,
                       fc_width=9, pool_size=2)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return net.eval()


def test_layout_steps_and_heads():
    net = small_net()
    assert net.num_convs == 5 and net.num_steps == 4
    assert [net.convs_at(t) for t in range(1, 5)] == [1, 2, 4, 5]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) == 5
    x = torch.randn(3, 3, 12, 12)
    r = unroll(net, x, keep_outputs=True)
    assert [tuple(o.shape) for o in r.step_outputs] == [(3, 7)] * 4
    torch.testing.assert_close(r.outputs, net(x))  # the last step is the network alone
    # each IC reads the features after its conv layer
    with torch.no_grad():
        h, feats = x, []
        for layer in net.convs:
            h = layer(h)
            feats.append(h)
    for t, p in enumerate(net.ic_positions):
        torch.testing.assert_close(r.step_outputs[t], net.heads[t](feats[p - 1]))
    assert not torch.allclose(r.step_outputs[0], r.step_outputs[1])


def test_ic_head_mixes_max_and_avg_pooling_and_skips_small_maps():
    head = ICHead(channels=3, in_size=8, num_classes=5, pool_size=4)
    with torch.no_grad():
        head.alpha.fill_(0.7)
    x = torch.randn(2, 3, 8, 8)
    a = torch.sigmoid(torch.tensor(0.7))
    mixed = a * nn.functional.max_pool2d(x, 2) + (1 - a) * nn.functional.avg_pool2d(x, 2)
    torch.testing.assert_close(head(x), head.linear(mixed.flatten(1)))
    small = ICHead(channels=3, in_size=4, num_classes=5, pool_size=4)
    assert small.alpha is None and small.linear.in_features == 3 * 16
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(small(x), small.linear(x.flatten(1)))


def test_step_flops_add_up_to_the_full_network():
    for net in (small_net(), build_vgg("vgg6-narrow", 10, 32)):
        table = flop_table(net)
        full = full_network_flops(net)
        assert sum(table.backbone) + table.heads[-1] == full  # backbone parts + final classifier
        assert exit_flops(net)[-1] == full + sum(table.heads[:-1])  # ... + every IC passed
        assert step_flops(net) == [b + h for b, h in zip(table.backbone, table.heads)]
        assert all(a < b for a, b in zip(exit_flops(net), exit_flops(net)[1:]))
    # a conv layer counts 2 * 9 * C_in * C_out * H * W (multiply-adds count 2)
    net = VGGEarlyExit([4], num_classes=3, input_size=5, ic_positions=(), fc_width=2)
    fc = 2 * (4 * 25 * 2 + 2 * 2 + 2 * 3)
    assert full_network_flops(net) == 2 * 9 * 3 * 4 * 25 + fc


def test_flop_counting_leaves_the_model_as_it_was():
    net = small_net().train()
    bn = next(m for m in net.modules() if isinstance(m, nn.BatchNorm2d))
    before = bn.running_mean.clone()
    flop_table(net), full_network_flops(net)
    assert net.training and net.conv_rows == 0
    torch.testing.assert_close(bn.running_mean, before)


def test_default_ic_positions_follow_sdn():
    net = build_vgg("vgg16", num_classes=10, input_size=32)
    assert net.ic_positions == (2, 4, 6, 7, 9, 10)  # SDN's add_ic for VGG16-BN
    table = flop_table(net)
    full = full_network_flops(net)
    cum = torch.tensor(table.backbone[:-1]).cumsum(0).double() / full
    assert torch.allclose(cum, torch.tensor(SDN_FRACTIONS, dtype=torch.float64), atol=0.04), cum
    assert build_vgg("vgg6-narrow", 10).ic_positions == (1, 2, 3, 4, 5)  # the quick preset's explicit ICs


def test_early_exit_matches_the_full_run_and_skips_conv_layers():
    net = small_net()
    x = torch.randn(9, 3, 12, 12)
    stops = torch.tensor([1, 4, 2, 3, 1, 4, 2, 1, 3])
    with torch.no_grad():
        full = unroll(net, x, keep_outputs=True)
        net.conv_rows = 0
        early = run_with_early_exit(net, x, StopAtTimes(stops))
    expected = torch.stack([full.step_outputs[int(t) - 1][i] for i, t in enumerate(stops)])
    torch.testing.assert_close(early.outputs, expected)
    assert torch.equal(early.stop_times, stops)
    assert net.conv_rows == sum(net.convs_at(int(t)) for t in stops) < 9 * net.num_convs


@pytest.mark.parametrize("bad, match", [
    (torch.randn(2, 1, 12, 12), r"\(B, 3, 12, 12\); got \(2, 1, 12, 12\)"),
    (torch.randn(2, 3, 16, 16), r"got \(2, 3, 16, 16\)"),
    (torch.randn(3, 12, 12), r"got \(3, 12, 12\)"),
    (torch.zeros(2, 3, 12, 12, dtype=torch.uint8), "float images"),
])
def test_bad_inputs_are_clear_errors(bad, match):
    net = small_net()
    with pytest.raises(ValueError, match=match):
        net(bad)
    with pytest.raises(ValueError, match=match):
        run_with_early_exit(net, bad, StopAtTimes(torch.ones(bad.shape[0], dtype=torch.long)))


@pytest.mark.parametrize("kw, match", [
    (dict(ic_positions=(0,)), "ic_positions"), (dict(ic_positions=(5,)), "ic_positions"),
    (dict(ic_positions=(3, 2)), "ic_positions"), (dict(widths=["M", 4]), "'M' must follow"),
    (dict(widths=[4, "X"]), "positive ints"), (dict(input_size=2), "too small"), (dict(dropout=1.0), "dropout"),
])
def test_bad_constructor_arguments(kw, match):
    args = dict(widths=[4, "M", 6, "M", 8, 8, 8], num_classes=3, input_size=12, fc_width=4) | kw
    with pytest.raises(ValueError, match=match):
        VGGEarlyExit(**args)


def test_ic_and_classifier_losses_reach_every_head():
    net = small_net().train()
    x, y = torch.randn(4, 3, 12, 12), torch.tensor([0, 1, 2, 3])
    r = unroll(net, x, target=y, loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"))
    r.losses.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


@pytest.mark.parametrize("size", [32, 64])
def test_vgg16_builds_and_runs_a_tiny_batch(size):
    net = build_vgg("vgg16", num_classes=10, input_size=size).eval()
    assert net.num_convs == 13 and net.num_steps == 7
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        out = net(x)
        r = unroll(net, x, keep_outputs=True)
    assert out.shape == (2, 10) and all(o.shape == (2, 10) for o in r.step_outputs)
    torch.testing.assert_close(r.outputs, out)


@pytest.mark.parametrize("name", list_vgg_configs())
def test_every_registered_config_builds(name):
    net = build_vgg(name, num_classes=5, input_size=32, fc_width=8).eval()
    with torch.no_grad():
        assert unroll(net, torch.randn(1, 3, 32, 32)).outputs.shape == (1, 5)
    with pytest.raises(KeyError, match="vgg16"):
        build_vgg("resnet", 5)
