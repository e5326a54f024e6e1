"""The classify networks (VGG-BN, CIFAR ResNet-20/56, ResNet-18 at 64x64) with exits attached by attach_exits:
SDN's FLOP-based placement, FLOP identities, exits that read the right features, early exit that skips
rows, every registered architecture on a tiny batch, and clear errors for bad inputs."""
import pytest
import torch
from torch import nn

from learn2stop.core.exits import SDN_FRACTIONS, attach_exits
from learn2stop.core.loop import run_with_early_exit, unroll
from learn2stop.core.rules import StopAtTimes
from learn2stop.tasks.classify.models import VGG, ResNet, build_network, list_archs


def randomise_bn(net):
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return net


def small_vgg(positions=(1, 2, 4), size=12):
    """Five convs, odd-ish sizes (12 -> 6 -> 3), non-trivial BN statistics, eval mode."""
    torch.manual_seed(0)
    net = randomise_bn(VGG([4, "M", 6, 6, "M", 8, 5], num_classes=7, input_size=size, fc_width=9))
    cands = net.exit_candidates()
    return attach_exits(net, [cands[p - 1] for p in positions], example_input=torch.zeros(1, 3, size, size),
                        pool_size=2).eval()


def test_vgg_steps_read_the_features_after_their_conv_layer():
    model = small_vgg()
    net = model.backbone
    assert model.after == ["features.0", "features.1", "features.3"] and model.num_steps == 4
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        r = unroll(model, x, keep_outputs=True)
        feats, h = [], x
        for layer in net.features:
            h = layer(h)
            feats.append(h)
    assert [tuple(o.shape) for o in r.step_outputs] == [(3, 7)] * 4
    for t, p in enumerate((1, 2, 4)):
        torch.testing.assert_close(r.step_outputs[t], model.heads[t](feats[p - 1]))
    torch.testing.assert_close(r.outputs, net(x))  # the last step is the network alone


def test_resnet_exits_sit_between_blocks_and_the_last_step_is_the_network():
    torch.manual_seed(0)
    net = randomise_bn(ResNet((2, 1), (4, 6), (1, 2), num_classes=5)).eval()
    assert net.exit_candidates() == ["layer1.0", "layer1.1"]  # never after the last block
    model = attach_exits(net, ["layer1.1", "layer1.0"], example_input=torch.zeros(1, 3, 10, 10)).eval()
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        r = unroll(model, x, keep_outputs=True)
        a = net.layer1[0](net.stem(x))
        b = net.layer1[1](a)
        torch.testing.assert_close(r.step_outputs[0], model.heads[0](a))
        torch.testing.assert_close(r.step_outputs[1], model.heads[1](b))
        torch.testing.assert_close(r.outputs, net(x))


def test_flops_add_up_to_the_network_and_count_two_per_multiply_add():
    for model in (small_vgg(), build_network("vgg6-narrow", 10, 32), build_network("resnet20", 10, 32)):
        f = model.flops
        assert sum(f.backbone) == model.network_flops  # the segments are the network, once
        assert model.exit_costs[-1] == model.network_flops + sum(f.heads[:-1])  # ... plus every exit passed
        assert all(a < b for a, b in zip(model.exit_costs, model.exit_costs[1:]))
    net = VGG([4], num_classes=3, input_size=5, fc_width=2)
    fc = 2 * (4 * 25 * 2 + 2 * 2 + 2 * 3)
    model = attach_exits(nn.Sequential(net.features[0], nn.Conv2d(4, 4, 1, bias=False), net.classifier), ["0"],
                         example_input=torch.zeros(1, 3, 5, 5))
    assert model.flops.backbone == (2 * 9 * 3 * 4 * 25, 2 * 4 * 4 * 25 + fc)


def test_flop_counting_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    net = VGG([4, "M", 6, 6], num_classes=3, input_size=8, fc_width=4).train()
    bn = net.features[0][1]
    before = bn.running_mean.clone()
    model = attach_exits(net, ["features.0"], example_input=torch.randn(2, 3, 8, 8))
    assert net.training and model.heads.training and model.rows_computed == 0
    torch.testing.assert_close(bn.running_mean, before)


def test_default_exits_follow_sdn():
    vgg = build_network("vgg16", num_classes=10, input_size=32)
    assert vgg.after == [f"features.{p - 1}" for p in (2, 4, 6, 7, 9, 10)]  # SDN's add_ic for VGG16-BN
    assert build_network("vgg6-narrow", 10).after == [f"features.{i}" for i in range(5)]  # the quick preset's own
    r20 = build_network("resnet20", num_classes=10)
    assert r20.after == ["layer1.0", "layer1.2", "layer2.0", "layer2.1", "layer3.0", "layer3.1"]
    r56 = build_network("resnet56", num_classes=10)
    cum = torch.tensor(r56.flops.backbone[:-1]).cumsum(0).double() / r56.network_flops
    assert torch.allclose(cum, torch.tensor(SDN_FRACTIONS, dtype=torch.float64), atol=0.03), cum


def test_early_exit_matches_the_full_run_and_skips_rows():
    model = small_vgg()
    x = torch.randn(9, 3, 12, 12)
    stops = torch.tensor([1, 4, 2, 3, 1, 4, 2, 1, 3])
    with torch.no_grad():
        full = unroll(model, x, keep_outputs=True)
        model.rows_computed = 0
        early = run_with_early_exit(model, x, StopAtTimes(stops))
    expected = torch.stack([full.step_outputs[int(t) - 1][i] for i, t in enumerate(stops)])
    torch.testing.assert_close(early.outputs, expected)
    assert torch.equal(early.stop_times, stops)
    assert model.rows_computed == int(stops.sum()) < 9 * model.num_steps


@pytest.mark.parametrize("bad, match", [
    (torch.randn(2, 1, 12, 12), r"\(B, 3, 12, 12\) like its example_input; got \(2, 1, 12, 12\)"),
    (torch.randn(2, 3, 16, 16), r"got \(2, 3, 16, 16\)"),
    (torch.randn(3, 12, 12), r"got \(3, 12, 12\)"),
    (torch.zeros(2, 3, 12, 12, dtype=torch.uint8), "torch.float32 inputs"),
])
def test_bad_inputs_are_clear_errors(bad, match):
    model = small_vgg()
    with pytest.raises(ValueError, match=match):
        model.initial_state(bad)


@pytest.mark.parametrize("kw, match", [
    (dict(exits=(0,)), "exit positions"), (dict(exits=(6,)), "exit positions"),
    (dict(exits=(3, 2)), "exit positions"), (dict(dropout=1.0), "dropout"), (dict(input_size=4), "too small"),
])
def test_bad_network_arguments(kw, match):
    args = dict(arch="vgg6-narrow", num_classes=3, input_size=16) | kw
    with pytest.raises(ValueError, match=match):
        build_network(**args)
    with pytest.raises(ValueError, match="'M' must follow"):
        VGG(["M", 4], 3)
    with pytest.raises(KeyError, match="resnet20"):
        build_network("resnet99", 5)


def test_exit_and_classifier_losses_reach_every_parameter():
    model = small_vgg().train()
    x, y = torch.randn(4, 3, 12, 12), torch.tensor([0, 1, 2, 3])
    r = unroll(model, x, target=y, loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"))
    r.losses.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", list_archs())
def test_every_architecture_builds_and_runs_a_tiny_batch(name):
    size = 64 if name == "resnet18" else 32
    kw = {"width": 8} if name == "resnet18" else {"fc_width": 8} if name.startswith("vgg") else {}
    model = build_network(name, num_classes=5, input_size=size, **kw).eval()
    assert model.num_steps == len(model.after) + 1 >= 6
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        r = unroll(model, x, keep_outputs=True)
        torch.testing.assert_close(r.outputs, model(x))
    assert all(o.shape == (2, 5) for o in r.step_outputs)


def test_exit_policy_equals_its_written_out_definition_bit_for_bit():
    """The functional forward (few operations: it is asked at every exit) is the modules' composition."""
    import math

    from learn2stop.core.policies import ExitPolicy

    torch.manual_seed(0)
    pol = ExitPolicy(10, 7)
    for p in pol.parameters():
        torch.nn.init.normal_(p)
    logits = torch.randn(300, 10) * 3
    logp = torch.log_softmax(logits, dim=1)
    p = logp.exp()
    top = p.topk(3, dim=1).values
    feats = torch.cat([top, -(p * logp).sum(1, keepdim=True) / math.log(10), top[:, :1] - top[:, 1:2],
                       logits.amax(1, keepdim=True) / 10], dim=1)
    assert torch.equal(pol.features(logits), feats)
    for t in range(1, 7):
        assert torch.equal(pol(None, logits, t), pol.rest(pol.first(feats) + pol.step_bias[t - 1]).squeeze(1))
    pol(None, logits.requires_grad_(), 3).sum().backward()  # trains: gradients reach every parameter
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in pol.parameters())
