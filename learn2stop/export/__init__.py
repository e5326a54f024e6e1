"""Export a trained stop model to ONNX, for :mod:`learn2stop.runtime` (numpy + ONNX Runtime, no torch).

What is written to ``out_dir``:

- ``step_01.onnx`` .. ``step_<last>.onnx``: one graph per step. Step 1 takes the inputs and builds the
  initial state itself; step t > 1 takes the state of step t-1 (and the inputs it reads). Each returns
  the new state (not at the last step), the readout where the rule needs it (every step where a sample
  can stop), and the policy's stop logit where the policy is asked (a planning policy: its (B, T-1)
  plan at ``plan_step``; one that plans twice, also its (B, T) second plan at ``replan_step``, from the
  previous step's output, which that graph takes as ``previous.*`` inputs). One graph per step, not one graph with a loop: compaction then happens
  between ONNX Runtime calls in numpy, and each call runs only the rows still going.
- ``manifest.json``: the task, T, the rule and its parameter (from the run's ``calibration.json`` or the
  inference config), the inputs and outputs (names, shapes with ``null`` for the batch, dtypes), each
  graph's own inputs and outputs, the exit costs, the sha256 of every file a graph loads (the graph and any
  external-data file it names) and the manifest's own checksum (:mod:`learn2stop.runtime.manifest`).

The folder is written to a temporary sibling and renamed into place: nothing is ever half-written.
``out_dir`` must be new, empty or a complete earlier export (:func:`export_mismatch`: its manifest lists
every file in it, each with its sha256); that one is kept at ``<out_dir>.previous`` once the new one is
complete. Anything else is refused before any work (:mod:`learn2stop.utils.outputs`).

Modules: :mod:`.graphs` (the rule as recorded, the schedule of step graphs, tracing them), :mod:`.folder`
(what an export may replace, the manifest written with its checksum), :mod:`.command` (the CLI command).

Example:
    >>> from learn2stop.export import export_stop_model              # doctest: +SKIP
    >>> export_stop_model(sm, {"name": "quantile", "param": 0.5}, y[:2], "exported", task="sparse")
"""
from .command import export_command
from .folder import ExportError, check_out_dir, export_mismatch
from .graphs import export_stop_model, rule_spec

__all__ = ["ExportError", "check_out_dir", "export_command", "export_mismatch", "export_stop_model", "rule_spec"]
