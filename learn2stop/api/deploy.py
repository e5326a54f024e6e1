"""Export a trained model and its rule for serving without torch (:func:`learn2stop.export.export_stop_model`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.inference import InferenceConfig
from ..core.model import StoppingModel
from ..export import export_stop_model


def export_model(sm: StoppingModel, example_inputs: Any, out_dir: str | Path, *, rule: Any = None,
                 **options: Any) -> Path:
    """Write ``sm`` as ONNX graphs (one per step, and the policy's) with a checksummed manifest, to be run by
    ``learn2stop.runtime.load(out_dir)`` with numpy and ONNX Runtime alone.

    ``rule``: the deployed rule (a :class:`~learn2stop.core.calibration_file.Calibration`, an ``InferenceConfig``, or
    ``{"name": "fixed", "param": d}``); default ``sm.calibration``, else the default inference rule, else full depth.
    ``options`` go to :func:`~learn2stop.export.export_stop_model` (``exit_costs``, ``dynamic_dims``, ``opset``).
    """
    if not isinstance(sm, StoppingModel):
        raise TypeError(f"sm: expected a StoppingModel; got {type(sm).__name__}")
    if rule is None:
        rule = (sm.calibration if sm.calibration is not None else InferenceConfig() if sm.policy is not None
                else {"name": "fixed", "param": sm.num_steps})
    return export_stop_model(sm, rule, example_inputs, out_dir, **options)
