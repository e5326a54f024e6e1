"""learn2stop: teach any step-wise model when to stop (Chen et al., ICML 2020).

Wrap a step-wise model and a stopping policy in :class:`StoppingModel`, train it stage by stage
with :class:`StagedTrainer`, and run inference that really skips the remaining steps.
"""
from .core import *  # noqa: F401,F403  (the public API is core's __all__)
from .core import __all__  # noqa: F401

__version__ = "0.1.0"
