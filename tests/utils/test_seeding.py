"""Seeding in one way (learn2stop.utils.seeding): module weights drawn from a generator, the caller's RNG untouched,
the same draws as the global RNG seeded alike; every task's builder draws from its own generator."""
import pytest
import torch

from learn2stop.tasks.base import get_task
from learn2stop.utils.config_files import resolve
from learn2stop.utils.seeding import derive_seed, drawing_from


def _weights(module):
    return [p.detach().clone() for p in module.state_dict().values() if isinstance(p, torch.Tensor)]


def test_drawing_from_a_generator_gives_the_global_rngs_draws_and_leaves_it_alone():
    torch.manual_seed(5)
    reference = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(3, 2))
    after_reference = torch.rand(4)  # what the global stream gives next
    torch.manual_seed(123)
    caller = torch.get_rng_state()
    g = torch.Generator().manual_seed(5)
    with drawing_from(g):
        made = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(3, 2))
    assert all(torch.equal(a, b) for a, b in zip(_weights(made), _weights(reference)))
    assert torch.equal(torch.get_rng_state(), caller)  # the caller's RNG did not move
    assert torch.equal(torch.rand(4, generator=g), after_reference)  # the generator advanced past the draws
    with pytest.raises(TypeError, match="CPU torch.Generator"):
        with drawing_from(5):
            pass


def test_derive_seed_is_stable_and_63_bit():
    assert derive_seed(0, "init", "") == derive_seed("0", "init", "")  # printable parts
    assert derive_seed(0, "init") != derive_seed(1, "init") and 0 <= derive_seed(0, "init") < 2**63


@pytest.mark.parametrize("task", ["sparse", "maml", "denoise"])
def test_a_builder_draws_from_its_own_generator_not_the_callers_rng(task):
    """Two builds of the quick preset give the same weights whatever the caller's RNG holds, and leave it as it was."""
    spec = get_task(task)
    cfg = resolve(spec.config_class, spec.presets["quick"], None, {})
    built = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        caller = torch.get_rng_state()
        models = spec.app.build_models(cfg, "cpu")
        assert torch.equal(torch.get_rng_state(), caller), f"{task}: the build moved the caller's RNG"
        built.append([w for sm in models.values() for w in _weights(sm)])
    assert len(built[0]) == len(built[1]) and all(torch.equal(a, b) for a, b in zip(*built))
