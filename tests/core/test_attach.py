"""attach_exits: exits on any network equal a hand-built step-wise model, FLOPs add up, early exit skips
rows and picks the same outputs, the core trains it, and bad input is named."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from learn2stop import StageConfig, StagedTrainer, StoppingModel, attach_exits
from learn2stop.core.exits import ExitHead, sdn_exit_points
from learn2stop.core.loop import run_with_early_exit, unroll
from learn2stop.core.rules import StopAtTimes


class Block(nn.Module):
    """A residual block: a cut after it is fine, a cut inside it crosses the skip connection."""

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn(self.conv(x)))


class SmallNet(nn.Module):
    """stem (3 -> 5 channels, 9x9), two residual blocks with a stride-3 conv between (-> 3x3), a linear head."""

    def __init__(self, classes=7):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU())
        self.block1 = Block(5)
        self.down = nn.Conv2d(5, 6, 3, stride=3, padding=1)  # 9x9 -> 3x3
        self.block2 = Block(6)
        self.fc = nn.Linear(6, classes)

    def forward(self, x):
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def small(seed=0):
    torch.manual_seed(seed)
    net = SmallNet()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return net.eval()


EXAMPLE = torch.zeros(1, 3, 9, 9)


def test_attached_model_equals_a_hand_built_one_on_the_same_weights():
    net = small()
    model = attach_exits(net, after=["down", "block1"], example_input=EXAMPLE).eval()  # any order: forward order kept
    assert model.after == ["block1", "down"] and model.num_steps == 3 and model.num_classes == 7
    h1, h2 = model.heads
    assert h1.pools and h1.linear.in_features == 5 * 16  # 9x9 pooled to 4x4
    assert not h2.pools and h2.linear.in_features == 6 * 9  # 3x3 is not larger than 4: flattened as it is
    with torch.no_grad():
        h1.alpha.fill_(0.3)
    x = torch.randn(4, 3, 9, 9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = net.block1(net.stem(x))
        b = net.down(a)
        mix = torch.sigmoid(torch.tensor(0.3))
        pooled = mix * F.adaptive_max_pool2d(a, 4) + (1 - mix) * F.adaptive_avg_pool2d(a, 4)
        by_hand = [h1.linear(pooled.flatten(1)), h2.linear(b.flatten(1)), net(x)]
        r = unroll(model, x, keep_outputs=True)
    for t in range(3):
        torch.testing.assert_close(r.step_outputs[t], by_hand[t], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model(x), net(x))  # forward is the network alone
    # the network's weights are the model's: nothing copied
    assert model.backbone is net and model.state_dict()["backbone.fc.weight"].data_ptr() == net.fc.weight.data_ptr()


def test_blocks_give_the_same_model_as_names():
    net = small()
    blocks = [nn.Sequential(net.stem, net.block1), nn.Sequential(net.down, net.block2),
              nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), net.fc)]
    by_blocks = attach_exits(blocks=blocks, example_input=EXAMPLE).eval()
    by_names = attach_exits(net, after=["block1", "block2"], example_input=EXAMPLE).eval()
    by_blocks.heads.load_state_dict(by_names.heads.state_dict())
    x = torch.randn(3, 3, 9, 9)
    with torch.no_grad():
        a, b = unroll(by_blocks, x, keep_outputs=True), unroll(by_names, x, keep_outputs=True)
    for u, v in zip(a.step_outputs, b.step_outputs):
        torch.testing.assert_close(u, v)
    assert by_blocks.flops == by_names.flops


class Scaled(nn.Module):
    """A parameter read in forward (an fx get_attr) and a second input with a default."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.fc = nn.Linear(4, 5)

    def forward(self, x, shift=0.25):
        h = torch.relu(self.stem(x)) * self.gain + shift
        return self.fc(h.mean((2, 3)))


def test_segments_read_the_weights_of_the_network_they_run_and_copies_keep_their_own():
    torch.manual_seed(0)
    model = attach_exits(Scaled(), after=["stem"], example_input=EXAMPLE).eval()
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        copy_.backbone.gain.fill_(-2.0)
        copy_.backbone.stem.weight.mul_(3.0)
    x = torch.randn(4, 3, 9, 9)
    with torch.no_grad():
        for m in (model, copy_):
            torch.testing.assert_close(unroll(m, x, keep_outputs=True).step_outputs[-1], m(x))
        assert not torch.allclose(copy_(x), model(x))


def test_flops_per_exit_add_up_to_the_network():
    net = small()
    model = attach_exits(net, after=["block1", "down"], example_input=torch.zeros(2, 3, 9, 9))
    f = model.flops
    conv = lambda cin, cout, hw: 2 * 9 * cin * cout * hw  # multiply-adds count 2
    assert f.backbone[0] == conv(3, 5, 81) + conv(5, 5, 81)  # per sample, whatever the example's batch
    assert f.backbone[1] == conv(5, 6, 9)
    assert f.backbone[2] == conv(6, 6, 9) + 2 * 6 * 7
    assert sum(f.backbone) == model.network_flops  # the segments are the network, once
    assert f.heads == (2 * 80 * 7, 2 * 54 * 7, 0)
    assert model.exit_costs == [f.backbone[0] + f.heads[0], sum(f.backbone[:2]) + sum(f.heads[:2]),
                                model.network_flops + sum(f.heads)]
    # a fixed depth reads its own exit alone; at T it is the network
    assert model.fixed_exit_costs == [f.backbone[0] + f.heads[0], sum(f.backbone[:2]) + f.heads[1], model.network_flops]


def test_early_exit_computes_fewer_rows_and_picks_the_same_outputs():
    model = attach_exits(small(), after=["block1", "down"], example_input=EXAMPLE).eval()
    x = torch.randn(9, 3, 9, 9)
    stops = torch.tensor([1, 3, 2, 1, 1, 3, 2, 2, 1])
    with torch.no_grad():
        full = unroll(model, x, keep_outputs=True)
        model.rows_computed = 0
        r = run_with_early_exit(model, x, StopAtTimes(stops))
    assert model.rows_computed == int(stops.sum()) < 9 * 3  # a stopped image costs no further segment
    assert torch.equal(r.stop_times, stops)
    expected = torch.stack([full.step_outputs[int(t) - 1][i] for i, t in enumerate(stops)])
    torch.testing.assert_close(r.outputs, expected)


class Task:
    """Two classes told apart by the mean brightness."""

    def loss_fn(self, logits, y):
        return F.cross_entropy(logits, y, reduction="none")

    def sample_batch(self, n, gen, device):
        y = torch.randint(0, 2, (n,), generator=gen)
        x = torch.randn(n, 3, 9, 9, generator=gen) + (2 * y - 1).float().view(-1, 1, 1, 1)
        return x, y

    def validation_batches(self, device):
        return [self.sample_batch(32, torch.Generator().manual_seed(5), device)]


def test_the_core_trains_an_attached_model(tmp_path):
    torch.manual_seed(0)
    model = attach_exits(SmallNet(classes=2), after=["block1", "down"], example_input=EXAMPLE)
    sm = StoppingModel(model, None)  # Stage I trains the network; its price reads the model's exit_costs
    out = StagedTrainer(sm, Task(), tmp_path, progress=False).fit(
        "stage1", StageConfig(objective="stage1", variant="marginal", iterations=20, batch_size=16, lr=1e-2,
                              eval_every=10, checkpoint_every=10, price=1.0))
    assert out["iterations"] == 20 and (tmp_path / "checkpoints" / "stage1.pt").is_file()


def test_sdn_placement_picks_the_candidates_nearest_each_fraction():
    net = small()
    names = ["stem", "block1", "down", "block2"]
    assert sdn_exit_points(net, names, EXAMPLE, fractions=(0.0,)) == ["stem"]
    assert sdn_exit_points(net, names, EXAMPLE, fractions=(1.0,)) == ["block2"]
    # cumulative shares: stem 0.32, block1 0.84, down 0.91, block2 1.0
    assert sdn_exit_points(net, names, EXAMPLE, fractions=(0.8, 0.85)) == ["block1"]  # coinciding picks kept once
    assert sdn_exit_points(net, names, EXAMPLE, fractions=(0.92, 0.1)) == ["stem", "down"]


class TwoOutputs(SmallNet):
    def forward(self, x):
        return super().forward(x)[:, :, None]  # (B, classes, 1): not logits


@pytest.mark.parametrize("kwargs, message", [
    (dict(after=["block3"]), "no module 'block3'"),
    (dict(after=["fc"]), "'fc' is the network's last layer"),
    (dict(after=["block1", "block1"]), "'block1' is named twice"),
    (dict(after=["block1", "block1.conv"]), "'block1.conv' lies inside 'block1'"),
    (dict(after=["block1.conv"]), "skip connection"),
    (dict(after="block1"), "after: a list of module names"),
    (dict(after=[]), "at least one module"),
    (dict(after=["block1"], example_input=torch.zeros(1, 4, 9, 9)), "example_input of shape (1, 4, 9, 9)"),
    (dict(after=["block1"], example_input=torch.zeros(3, 9, 9, 2)), "example_input"),
    (dict(after=["block1"], num_classes=10), "num_classes is 10 but SmallNet outputs 7"),
    (dict(blocks=[nn.Linear(2, 2)]), "blocks: at least two"),
])
def test_bad_input_is_named(kwargs, message):
    kwargs = {"example_input": EXAMPLE, **kwargs}
    backbone = None if "blocks" in kwargs else small()
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        attach_exits(backbone, **kwargs)


def test_an_output_that_is_not_batch_by_classes_is_refused_and_inputs_are_checked():
    with pytest.raises(ValueError, match=r"TwoOutputs's output must be \(batch, classes\) logits"):
        attach_exits(TwoOutputs(), after=["block1"], example_input=EXAMPLE)
    model = attach_exits(small(), after=["block1"], example_input=EXAMPLE)
    with pytest.raises(ValueError, match=r"expects inputs \(B, 3, 9, 9\)"):
        model.initial_state(torch.zeros(2, 3, 8, 8))


def test_exit_head_reads_features_of_two_dims():
    head = ExitHead((6,), num_classes=3)
    x = torch.randn(2, 6)
    torch.testing.assert_close(head(x), head.linear(x))
    with pytest.raises(ValueError, match="exit head reads"):
        ExitHead((2, 3), num_classes=3)


def test_grad_steps_skip_the_exits_backward_and_keep_the_networks_gradient():
    """The network alone trained with its exits attached: the last step's loss gives the backbone the same
    gradient with or without the exits' backward, every step's loss is still recorded, and the heads get none."""
    torch.manual_seed(0)
    exits = attach_exits(SmallNet(), ["stem", "block1"], example_input=torch.zeros(1, 3, 9, 9))
    x, y = torch.randn(6, 3, 9, 9), torch.randint(0, 7, (6,))
    ce = lambda logits, target: F.cross_entropy(logits, target, reduction="none")  # noqa: E731
    grads, losses = [], []
    for steps in (None, {exits.num_steps}):
        exits.zero_grad(set_to_none=True)
        r = unroll(exits, x, target=y, loss_fn=ce, grad_steps=steps)
        r.losses[:, -1].mean().backward()
        grads.append({n: p.grad for n, p in exits.named_parameters()})
        losses.append(r.losses.detach())
    torch.testing.assert_close(losses[0], losses[1])
    assert losses[1].shape == (6, exits.num_steps)
    for n, g in grads[0].items():
        if n.startswith("heads."):
            assert grads[1][n] is None and (g is None or not g.any())
        else:
            torch.testing.assert_close(grads[1][n], g)


def test_a_fixed_depth_is_costed_without_the_exits_it_does_not_read():
    from learn2stop.core import ConfidenceSignal, FixedDepth, SignalRule
    from learn2stop.core.curves import fixed_depth_curve
    from learn2stop.core.trace import Metric, collect_trace, evaluate_rule

    model = attach_exits(small(), after=["block1", "down"], example_input=EXAMPLE).eval()
    batches = [(torch.randn(6, 3, 9, 9), torch.randint(0, 7, (6,)))]
    acc = Metric("accuracy", lambda o, y: (o.argmax(1) == y).float(), lower_is_better=False)
    full = model.exit_costs[-1]
    trace = collect_trace(model, batches, acc)
    costs = [p["mean_cost"] for p in fixed_depth_curve(trace, acc)]
    assert costs == pytest.approx([c / full for c in model.fixed_exit_costs])
    assert costs[-1] == pytest.approx(model.network_flops / full) and costs[-1] < 1
    for d in (1, 2, 3):
        got = evaluate_rule(model, batches, lambda: FixedDepth(d), acc)
        assert got["mean_cost"] == pytest.approx(model.fixed_exit_costs[d - 1] / full)
    # a rule asked at every exit reads every head up to its stop: the full exit costs
    asked = evaluate_rule(model, batches, lambda: SignalRule(ConfidenceSignal(), 2.0), acc)  # never confident enough
    assert (asked["stop_times"] == 3).all() and asked["mean_cost"] == pytest.approx(1.0)
    # a model that declares no fixed costs: a fixed depth costs its exit costs
    model.fixed_exit_costs = None
    assert torch.equal(collect_trace(model, batches, acc).fixed_depth_costs, trace.costs)
    from learn2stop.core.distributions import fixed_depth_costs

    model.fixed_exit_costs, model.exit_costs = [1, 2, 3], None  # fixed costs without their scale: named
    with pytest.raises(ValueError, match="fixed_exit_costs without exit_costs"):
        fixed_depth_costs(model)
