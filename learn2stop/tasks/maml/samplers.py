"""Task samplers: N-way, k1-k2-shot task-imbalanced tasks (one K per task) and the vanilla fixed-K case.

A meta-batch is a batch-first tree the core loop can slice (tasks are the batch):

- ``support_x`` (B, S, *x_shape), ``support_y`` (B, S) class ids or (B, S, 1) targets,
  ``support_mask`` (B, S) 1 for real examples, 0 for padding (tasks have different K, S = N * k2);
- ``query_x`` (B, Q, *x_shape) with Q = N * query_per_class, the same for every task;
- ``shots`` (B,) the task's K (known at test time, so the policy may use it);

and the target is the query labels, (B, Q) or (B, Q, 1).

Guarantees (tested): a task's N classes are distinct; K is uniform in [k1, k2] and the same for
every class of the task; support and query images of a class are distinct images.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .classes import DataError


def check_shots(k_min: int, k_max: int) -> None:
    if not (isinstance(k_min, int) and isinstance(k_max, int)):
        raise DataError(f"shot range must be integers; got k1={k_min!r}, k2={k_max!r}")
    if k_min < 1:
        raise DataError(f"invalid shot range: k1 = {k_min} < 1 (every class needs at least one support example)")
    if k_min > k_max:
        raise DataError(f"invalid shot range: k1 = {k_min} > k2 = {k_max}")


@dataclass
class Episode:
    """One sampled task: its classes, its K and the image indices of each class."""

    classes: Tensor  # (N,) dataset class ids, label i is classes[i]
    shots: int
    support: Tensor  # (N, K) image indices
    query: Tensor  # (N, Q) image indices


class FewShotSampler:
    """N-way tasks with K ~ U{k1..k2} shots per task (k1 == k2: the vanilla setting).

    Args:
        n_way: classes per task.
        k_min, k_max: shot range; all classes of one task get the same K.
        query_per_class: query examples per class (1 for Omniglot, 5 for MiniImagenet in the paper).
    """

    def __init__(self, n_way: int, k_min: int, k_max: int, query_per_class: int):
        check_shots(k_min, k_max)
        if n_way < 1:
            raise DataError(f"n_way must be >= 1; got {n_way}")
        if query_per_class < 1:
            raise DataError(f"query_per_class must be >= 1; got {query_per_class}")
        self.n_way, self.k_min, self.k_max, self.q = n_way, k_min, k_max, query_per_class

    def check(self, dataset, what: str = "dataset") -> None:
        """Raise DataError if ``dataset`` cannot provide every task this sampler may draw."""
        if dataset.num_classes < self.n_way:
            raise DataError(f"{what} has {dataset.num_classes} classes, fewer than n_way = {self.n_way}")
        need = self.k_max + self.q
        small = [(n, s) for n, s in zip(dataset.names, dataset.class_sizes) if s < need]
        if small:
            raise DataError(f"{what}: class {small[0][0]!r} has {small[0][1]} images, fewer than "
                            f"k2 + query = {self.k_max} + {self.q} = {need} ({len(small)} such classes)")

    def episode(self, dataset, generator: torch.Generator) -> Episode:
        classes = torch.randperm(dataset.num_classes, generator=generator)[: self.n_way]
        k = int(torch.randint(self.k_min, self.k_max + 1, (), generator=generator))
        support, query = [], []
        for c in classes.tolist():
            perm = torch.randperm(dataset.class_sizes[c], generator=generator)
            support.append(perm[:k])
            query.append(perm[k: k + self.q])
        return Episode(classes, k, torch.stack(support), torch.stack(query))

    def batch(self, dataset, num_tasks: int, generator: torch.Generator) -> tuple[dict, Tensor]:
        """A meta-batch of ``num_tasks`` tasks (see the module docstring for the layout)."""
        return self.collate(dataset, [self.episode(dataset, generator) for _ in range(num_tasks)])

    def collate(self, dataset, episodes: list[Episode]) -> tuple[dict, Tensor]:
        n, s_max = self.n_way, self.n_way * self.k_max
        sx, sy, sm, qx, qy = [], [], [], [], []
        for ep in episodes:
            xs = torch.cat([dataset.images(int(c), ep.support[i]) for i, c in enumerate(ep.classes)])  # (N*K, C, H, W)
            xq = torch.cat([dataset.images(int(c), ep.query[i]) for i, c in enumerate(ep.classes)])  # (N*Q, C, H, W)
            labels = torch.arange(n)
            pad = s_max - xs.shape[0]
            sx.append(torch.cat([xs, xs.new_zeros(pad, *xs.shape[1:])]))
            sy.append(torch.cat([labels.repeat_interleave(ep.shots), labels.new_zeros(pad)]))
            sm.append(torch.cat([torch.ones(xs.shape[0]), torch.zeros(pad)]))
            qx.append(xq)
            qy.append(labels.repeat_interleave(self.q))
        inputs = {"support_x": torch.stack(sx), "support_y": torch.stack(sy), "support_mask": torch.stack(sm),
                  "query_x": torch.stack(qx), "shots": torch.tensor([ep.shots for ep in episodes])}
        return inputs, torch.stack(qy)


class Sinusoid:
    """The classic MAML toy: y = A sin(x - phase), A ~ U[0.1, 5], phase ~ U[0, pi], x ~ U[-5, 5].

    Needs no data. A task's support size is its shot count K; ``noise`` adds Gaussian noise to
    the support targets only (query targets stay clean), which makes few-shot tasks easy to overfit.
    """

    def __init__(self, noise: float = 0.0):
        self.noise = noise

    def task(self, k: int, q: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One task: support (k, 1), (k, 1) and query (q, 1), (q, 1)."""
        amp = 0.1 + 4.9 * torch.rand((), generator=generator)
        phase = math.pi * torch.rand((), generator=generator)
        x = -5 + 10 * torch.rand(k + q, 1, generator=generator)
        y = amp * torch.sin(x - phase)
        ys = y[:k] + self.noise * torch.randn(k, 1, generator=generator)
        return x[:k], ys, x[k:], y[k:]


class SinusoidSampler:
    """Sinusoid-regression tasks with K ~ U{k1..k2} support points and a fixed number of query points."""

    n_way = 1

    def __init__(self, k_min: int, k_max: int, query_size: int, noise: float = 0.0):
        check_shots(k_min, k_max)
        if query_size < 1:
            raise DataError(f"query_size must be >= 1; got {query_size}")
        self.k_min, self.k_max, self.q = k_min, k_max, query_size
        self.source = Sinusoid(noise)

    def batch(self, dataset, num_tasks: int, generator: torch.Generator) -> tuple[dict, Tensor]:
        sx, sy, sm, qx, qy, ks = [], [], [], [], [], []
        for _ in range(num_tasks):
            k = int(torch.randint(self.k_min, self.k_max + 1, (), generator=generator))
            xs, ys, xq, yq = self.source.task(k, self.q, generator)
            pad = self.k_max - k
            sx.append(torch.cat([xs, xs.new_zeros(pad, 1)]))
            sy.append(torch.cat([ys, ys.new_zeros(pad, 1)]))
            sm.append(torch.cat([torch.ones(k), torch.zeros(pad)]))
            qx.append(xq)
            qy.append(yq)
            ks.append(k)
        inputs = {"support_x": torch.stack(sx), "support_y": torch.stack(sy), "support_mask": torch.stack(sm),
                  "query_x": torch.stack(qx), "shots": torch.tensor(ks)}
        return inputs, torch.stack(qy)
