"""Early-exit image recognition (paper Sec. 5.4, Table 7): VGG-BN and ResNets with internal classifiers (--model.arch).

    learn2stop classify reproduce --preset quick        # CIFAR-10 subset of ../shared/data, vgg6-narrow
    learn2stop classify reproduce --preset quick --model.arch resnet20 --run-dir runs/classify-quick-resnet20
    learn2stop classify frontier --run-dir runs/classify-quick
    learn2stop classify predict --run-dir runs/classify-quick --predict.input photo.png

Trainings on one architecture: the network alone (last classifier only), SDN (internal classifiers
weighted by SDN's tau), and Stage I with the oracle (softmin of the cross-entropies, beta = 1,
optionally with a price on FLOPs), then the Stage II policy. Exit rules compared on the same
networks: confidence (SDN), entropy, patience (PABEE), the learned policy calibrated to budgets,
and the oracle exit (the first internal classifier that is right: a bound).

This module declares the task for the core pipeline (:class:`ClassifyApp`); the config and presets are in
:mod:`.config`, the commands (``train``, ``evaluate``, ``predict``, ``reproduce``) and the registration in
:mod:`.commands`.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from ...core import Metric, StageConfig, StoppingModel, derive_seed
from ...core.policies import ExitPolicy
from ...core.signals import ConfidenceSignal, EntropySignal, PatienceSignal
from ...core.task import Stage, StoppingApp
from ...utils.config import ConfigError
from .config import ClassifyConfig
from .data import ClassifyTask, Images
from .metric import accuracy, accuracy_lead, consistency_losses
from .models import build_network, initialise


class ClassifyApp(StoppingApp):
    baseline_label = "the network alone"
    budget_by = "cost"  # budgets and the frontier's x-axis in FLOPs
    frontier_also = {"sdn": "sdn"}  # the confidence, entropy and patience rules on the SDN-trained network too
    speed_batch = 256
    # about 100 points are timed at two batch sizes: 48 images one by one and 256 at once, best of two passes
    # (the quick preset's frontier: about a minute on 2 cores)
    speed_samples = 48
    speed_batches = 1
    speed_passes = 2
    reproduce_frontier = True  # Table 7, then the frontier

    def images(self, cfg: ClassifyConfig) -> Images:
        return self.cached(f"images {(cfg.data, cfg.seed)!r}", lambda: Images(cfg))

    def training_note(self, cfg: ClassifyConfig) -> str:
        imgs = self.images(cfg)
        return (f"classify: {len(imgs.train)} train / {len(imgs.val)} validation / {len(imgs.test)} test images, "
                f"{len(imgs.classes)} classes, {cfg.data.size}x{cfg.data.size}")

    def network(self, cfg: ClassifyConfig):
        m, imgs = cfg.model, self.images(cfg)

        def build():  # tracing, placing exits and counting FLOPs once; every model is a copy
            try:  # exit_costs: cumulative FLOPs of exiting at t, the price's and the frontier's cost
                return build_network(
                    m.arch, len(imgs.classes), cfg.data.size, m.ic_positions or None, in_channels=imgs.train.image_shape[0],
                    fc_width=None if m.fc_width < 0 else m.fc_width, dropout=m.dropout, width=m.width or None)
            except ValueError as e:
                raise ConfigError(f"model ({m.arch} at data.size {cfg.data.size}): {e}") from None
        key = f"network {(m, cfg.data.size, len(imgs.classes), imgs.train.image_shape[0])!r}"
        return copy.deepcopy(self.cached(key, build))

    def build_models(self, cfg: ClassifyConfig, device) -> dict[str, StoppingModel]:
        torch.manual_seed(derive_seed(cfg.seed, "init") % 2**63)
        nets = {k: self.network(cfg) for k in ("baseline", "sdn", "stop")}
        for net in nets.values():
            initialise(net)  # fresh weights drawn under this seed, whenever the template was built
        n = nets["stop"]
        policy = ExitPolicy(n.num_classes, n.num_steps, hidden=cfg.model.policy_hidden)
        fmt = torch.contiguous_format
        if cfg.model.channels_last:
            fmt = torch.channels_last
            for name, mod in nets["stop"].named_modules():
                if isinstance(mod, nn.Conv2d) and mod.kernel_size == (1, 1) and max(mod.stride) > 1 and mod.in_channels < 8:
                    raise ConfigError(f"model.channels_last: {name} is a strided 1x1 convolution of {mod.in_channels} "
                                      f"input channels, whose NHWC backward corrupts memory in this PyTorch on CPU; "
                                      f"set --model.channels_last false or a wider network")
        return {k: StoppingModel(v.to(memory_format=fmt), policy if k == "stop" else None).to(device)
                for k, v in nets.items()}

    def training_task(self, cfg, key, sm):
        return ClassifyTask(self.images(cfg), cfg.data.augment, cfg.eval_batch, cfg.stop_loss, cfg.data.cutout)

    def stages(self, cfg: ClassifyConfig) -> list[Stage]:
        T = self.network(cfg).num_steps
        tau = np.interp(np.linspace(0, 1, T - 1), np.linspace(0, 1, len(cfg.sdn_tau)), cfg.sdn_tau).tolist()
        sdn = StageConfig(**{**cfg.sdn.__dict__, "step_weights": tuple(tau) + (1.0,)})
        out = [Stage("baseline", "baseline", cfg.baseline, describe="the network alone (last classifier)"),
               Stage("sdn", "sdn", sdn, init_from="baseline" if cfg.sdn_from == "baseline" else None,
                     describe=f"SDN: IC losses weighted {[round(t, 2) for t in tau]} + final"
                              + (", from the network alone" if cfg.sdn_from == "baseline" else "")),
               # Stage I fine-tunes the SDN network: trained from scratch on the oracle alone, each image's
               # loss concentrates on whichever exit already fits it, and the other exits decay (measured:
               # final classifier 9 %, oracle exit 98 % on VGG16 / CIFAR subset), which no label-free rule can use.
               Stage("stage1", "stop", cfg.stage1, init_from="sdn", describe="Stage I: oracle-weighted IC losses, from SDN"),
               Stage("stage2", "stop", cfg.stage2, describe="Stage II: the exit policy")]
        if cfg.stage3.iterations > 0:
            out.append(Stage("stage3", "stop", cfg.stage3, describe="Stage III"))
        return out

    def eval_batches(self, cfg, split, device):
        return self.images(cfg).batches(split, cfg.eval_batch, device)

    def metric(self, cfg) -> Metric:
        return accuracy()

    def classical_signals(self, cfg):
        return {"confidence": ConfidenceSignal, "entropy": EntropySignal, "patience": PatienceSignal}

    def risk_losses(self, cfg, trace):
        """Wrong where full depth is right, in [0, 1] (:func:`~.metric.consistency_losses`)."""
        return consistency_losses(trace)

    def quality_lead(self, cfg, stop, base):
        """The accuracy lead (fraction) at full depth (:func:`~.metric.accuracy_lead`)."""
        return accuracy_lead(stop, base)

    def cost_unit(self, cfg, sm):
        return "flops", float(sm.model.exit_costs[-1])


APP = ClassifyApp()
