"""Seeding in one way: every random draw of the library comes from a ``torch.Generator`` it was handed.

``derive_seed`` turns printable parts (the config's seed, a stage name, an iteration) into a stable seed for
``torch.Generator().manual_seed``. Module constructors (``nn.Linear`` and the like) draw their initial weights from
the global RNG and take no generator; :func:`drawing_from` makes the draws inside it come from a given generator,
and leaves the caller's global RNG as it found it, so a builder takes a generator instead of seeding the global RNG.

Example:
    >>> g = torch.Generator().manual_seed(derive_seed(0, "init"))
    >>> with drawing_from(g):
    ...     layer = torch.nn.Linear(3, 2)  # its weights come from g, which advances past them
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any, Iterator

import torch


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any printable parts (same on every platform and run)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextmanager
def drawing_from(generator: torch.Generator) -> Iterator[torch.Generator]:
    """Inside, the global CPU RNG continues ``generator``'s stream; after, ``generator`` has advanced past every draw
    made inside and the global RNG is back where it was.

    A module built inside from a generator seeded with s gets the weights it got after ``torch.manual_seed(s)``
    (the two streams are the same), without the caller's RNG moving. Only CPU generators: the module's weights are
    drawn on the CPU and moved to a device afterwards.
    """
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise TypeError(f"drawing_from: needs a CPU torch.Generator; got {generator!r}")
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(generator.get_state())
        try:
            yield generator
        finally:
            generator.set_state(torch.get_rng_state())


__all__ = ["derive_seed", "drawing_from"]
