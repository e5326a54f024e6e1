"""learn2stop: teach any step-wise model when to stop (Chen et al., ICML 2020).

Wrap a step-wise model and a stopping policy in :class:`StoppingModel`; ``train``, ``calibrate``, ``frontier``,
``benchmark`` and ``export_model`` it (:mod:`learn2stop.api`); run inference that really skips the remaining steps.
"""
__version__ = "0.1.0"


def __getattr__(name: str):
    # The public API is core's __all__ and the model-level API's (learn2stop.api), imported on first use (PEP 562),
    # so that the deployed runtime (learn2stop.runtime: numpy + ONNX Runtime) can be imported where torch is not.
    from importlib import import_module

    core = import_module(".core", __name__)  # (not 'from . import core': that would ask this hook again)
    if name == "core":
        return core
    api = import_module(".api", __name__)
    if name == "api":
        return api
    if name == "__all__":
        return [*core.__all__, *api.__all__]
    if name in core.__all__:
        return getattr(core, name)
    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'learn2stop' has no attribute {name!r}")
