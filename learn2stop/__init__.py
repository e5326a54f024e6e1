"""learn2stop: teach any step-wise model when to stop (Chen et al., ICML 2020).

Wrap a step-wise model and a stopping policy in :class:`StoppingModel`, train it stage by stage
with :class:`StagedTrainer`, and run inference that really skips the remaining steps.
"""
__version__ = "0.1.0"


def __getattr__(name: str):
    # The public API is core's __all__, imported on first use (PEP 562), so that the deployed runtime
    # (learn2stop.runtime: numpy + ONNX Runtime) can be imported where torch is not installed.
    from importlib import import_module

    core = import_module(".core", __name__)  # (not 'from . import core': that would ask this hook again)
    if name == "core":
        return core
    if name == "__all__":
        return core.__all__
    if name in core.__all__:
        return getattr(core, name)
    raise AttributeError(f"module 'learn2stop' has no attribute {name!r}")
