"""Run an exported stop model with numpy and ONNX Runtime only: no torch, no training code.

    from learn2stop.runtime import load
    rt = load("exported/")                  # checks the manifest, its checksum and every file's sha256
    result = rt.run(y)                      # a batch: outputs, stop_times, steps_computed
    x, t = rt.run_one(y[0])                 # one input: its output and stop step

The folder is written by ``learn2stop <task> export`` (:func:`learn2stop.export.export_stop_model`).
Importing this package imports neither torch nor the rest of learn2stop (a test checks it).
"""
from .manifest import ManifestError, read_manifest
from .rules import make_rule
from .runner import RuntimeResult, StopRuntime, load

__all__ = ["ManifestError", "RuntimeResult", "StopRuntime", "load", "make_rule", "read_manifest"]
