"""The model-level API: what you do with your own :class:`~learn2stop.core.model.StoppingModel` and data.

- :func:`train`: the paper's stages in order, from a DataLoader or a sampling function and a loss;
- :func:`calibrate`: the stop rule set on held-out data to a budget or a certified quality loss (and attached);
- :func:`frontier`: fixed depths, classical rules, the policy and the oracle, in steps and in time;
- :func:`benchmark`: each rule's samples/s at the batch sizes served;
- ``sm.save_pretrained(folder)`` / ``StoppingModel.from_pretrained(folder, model=..., policy=...)``: one folder;
- :func:`export_model`: ONNX graphs and a manifest for ``learn2stop.runtime`` (no torch; the name, since
  ``learn2stop.export`` is the exporter module it calls).

Degenerate results warn (:mod:`learn2stop.api.guards`), each warning naming its fix.
"""
from .calibrating import calibrate
from .deploy import export_model
from .guards import CalibrationWarning, DegenerateDepthWarning, RuleCostWarning, StoppingWarning
from .measuring import FrontierResult, benchmark, frontier
from .training import default_stages, train

__all__ = ["train", "default_stages", "calibrate", "frontier", "benchmark", "export_model", "FrontierResult",
           "StoppingWarning", "DegenerateDepthWarning", "CalibrationWarning", "RuleCostWarning"]
