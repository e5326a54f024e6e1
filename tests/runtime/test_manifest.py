"""The export manifest cannot lie: its own checksum, every file a graph loads, every field checked at load, graphs
checked against it, providers and inputs refused with one line; random edits are refused naming a field, never
another exception (hypothesis)."""
import copy
import json
import math
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import sketch_lista
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learn2stop.core.inference import InferenceConfig
from learn2stop.core.model import StoppingModel
from learn2stop.export import ExportError, export_stop_model
from learn2stop.runtime import ManifestError, load
from learn2stop.runtime.manifest import MANIFEST, canonical_bytes, seal, sha256_file


@pytest.fixture(scope="module")
def sparse():
    return sketch_lista(40)


@pytest.fixture(scope="module")
def exported(sparse, tmp_path_factory):
    sm, y = sparse
    folder = tmp_path_factory.mktemp("manifest") / "sparse"
    export_stop_model(sm, InferenceConfig(rule="quantile", param=0.5), y[:2], folder, task="sparse")
    return folder, y.numpy()


def _copy(folder, to):
    shutil.copytree(folder, to)
    return to, json.loads((to / MANIFEST).read_text())


def _write(folder, m, reseal=True):
    (folder / MANIFEST).write_text(json.dumps(seal(m) if reseal else m))


# ----------------------------------------------------------------------------- the reported cases
def test_a_threshold_edited_to_nan_or_text_is_refused_at_load(exported, tmp_path):
    folder, _ = exported
    bad, m = _copy(folder, tmp_path / "bad")
    for value in (math.nan, "abc", math.inf, True):
        m["rule"]["threshold"] = value
        _write(bad, m)
        with pytest.raises(ManifestError, match=r"'rule.threshold' must be a finite number"):
            load(bad)


def test_an_edited_valid_threshold_is_refused_by_the_manifests_own_checksum(exported, tmp_path):
    folder, y = exported
    bad, m = _copy(folder, tmp_path / "bad")
    m["rule"]["threshold"] = 2.5  # another valid operating point: other stop times, if it loaded
    _write(bad, m, reseal=False)
    with pytest.raises(ManifestError, match=r"'manifest_sha256' does not match the manifest's content"):
        load(bad)
    _write(bad, m)  # sealed again (a deliberate edit): it loads, and stops later than the export
    assert load(bad).run(y).mean_depth > load(folder).run(y).mean_depth


def test_exit_costs_must_be_finite_and_non_decreasing(exported, tmp_path):
    folder, _ = exported
    bad, m = _copy(folder, tmp_path / "bad")
    for i, value, what in ((2, math.nan, "must be a finite number > 0"), (3, 0.5, r"must be >= exit_costs\[2\]"),
                           (0, -1.0, "must be a finite number > 0")):
        costs = list(m["exit_costs"])
        costs[i] = value
        _write(bad, {**m, "exit_costs": costs})
        with pytest.raises(ManifestError, match=rf"'exit_costs\[{i}\]' {what}"):
            load(bad)


def test_an_external_data_file_is_covered_by_the_manifest(exported, tmp_path):
    """A graph whose weights lie beside it: the data file is listed with its sha256, and an altered one is refused."""
    import onnx

    folder, y = exported
    bad, m = _copy(folder, tmp_path / "bad")
    graph = onnx.load(str(bad / "step_03.onnx"))
    onnx.save_model(graph, str(bad / "step_03.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="step_03.data", size_threshold=0)
    from learn2stop.export.graphs import _graph_files

    assert _graph_files(bad / "step_03.onnx")[1] == ["step_03.data"]  # what the exporter lists
    m["files"] = {**m["files"], "step_03.onnx": sha256_file(bad / "step_03.onnx"),
                  "step_03.data": sha256_file(bad / "step_03.data")}
    _write(bad, m)
    np.testing.assert_array_equal(load(bad).run(y).outputs, load(folder).run(y).outputs)
    data = bytearray((bad / "step_03.data").read_bytes())
    data[:4] = np.float32(0.66).tobytes()  # one weight changed
    (bad / "step_03.data").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"step_03.data does not match its sha256"):
        load(bad)


def test_an_unknown_provider_is_an_error_naming_it_and_the_available_ones(exported):
    import onnxruntime

    folder, _ = exported
    with pytest.raises(ValueError, match=r"providers: 'BogusProvider' is not available in this ONNX Runtime; "
                                         rf"available: .*{onnxruntime.get_available_providers()[0]}"):
        load(folder, providers=["BogusProvider"])
    for bad in ("CPUExecutionProvider", [], [3]):
        with pytest.raises(ValueError, match="providers must be a non-empty list"):
            load(folder, providers=bad)
    assert load(folder, providers=["CPUExecutionProvider"]).run_one(np.zeros(13, np.float32))[1] >= 1


def test_a_deeply_nested_or_huge_manifest_is_refused_before_parsing(exported, tmp_path):
    folder, _ = exported
    bad, m = _copy(folder, tmp_path / "bad")
    (bad / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match="nests deeper than 64 levels"):
        load(bad)
    (bad / MANIFEST).write_text(json.dumps({**m, "extra": {"notes": "]" * 100 + "x" * (5 << 20)}}))
    with pytest.raises(ManifestError, match="more than a manifest's"):
        load(bad)
    (bad / MANIFEST).write_text(json.dumps(m)[:-1] + ', "task": "other"}')
    with pytest.raises(ManifestError, match="key 'task' appears twice"):
        load(bad)
    _write(bad, {**m, "extra": {"notes": "[[[[" * 40}})  # brackets inside strings do not count
    assert load(bad).manifest["extra"]["notes"].startswith("[[[[")


def test_an_edited_input_shape_or_dtype_is_refused_at_load_by_the_graph(exported, tmp_path):
    folder, _ = exported
    bad, m = _copy(folder, tmp_path / "bad")
    for field, value, what in (("shape", [None, 14], r"input 'inputs' has dim 1 = 13 in the graph"),
                               ("shape", [None, 13, 1], r"input 'inputs' has rank 2 in the graph"),
                               ("dtype", "float64", r"input 'inputs' is float32 in the graph")):
        edited = copy.deepcopy(m)
        edited["inputs"][0][field] = value
        _write(bad, edited)
        with pytest.raises(ManifestError, match=r"step_01.onnx: " + what):
            load(bad)
    edited = copy.deepcopy(m)
    edited["state"][0]["shape"] = [None, 26]
    _write(bad, edited)
    with pytest.raises(ManifestError, match=r"output 'next_state.0' has dim 1 = 27 in the graph"):
        load(bad)


def test_a_graph_swapped_for_another_exports_is_refused_at_load(exported, tmp_path):
    from learn2stop.tasks.denoise.models import DeepSupervisedDnCNN
    from learn2stop.tasks.denoise.policy import DenoisePolicy

    folder, _ = exported
    net = DeepSupervisedDnCNN(depth=7, channels=4)
    other = StoppingModel(net, DenoisePolicy(net.num_steps, hidden=4)).eval()
    export_stop_model(other, InferenceConfig(rule="quantile", param=0.5), torch.rand(2, 1, 8, 8), tmp_path / "denoise")
    bad, m = _copy(folder, tmp_path / "bad")
    shutil.copy(tmp_path / "denoise" / "step_04.onnx", bad / "step_04.onnx")
    m["files"]["step_04.onnx"] = sha256_file(bad / "step_04.onnx")  # the checksums recomputed
    _write(bad, m)
    with pytest.raises(ManifestError, match=r"step_04.onnx(: input '\w+(\.\d)?' has rank| reads)"):
        load(bad)


def test_a_fixed_depth_past_the_steps_is_refused_at_export_and_evaluate(sparse, tmp_path):
    from learn2stop.core.deployment import load_deployment
    from learn2stop.tasks.sparse.app import APP, PRESETS, SparseConfig
    from learn2stop.utils.config import ConfigError
    from learn2stop.utils.config_files import resolve

    sm, y = sparse
    with pytest.raises(ExportError, match=r"inference.param: a fixed depth must be in 1..7 \(the model's steps\); got 99"):
        export_stop_model(sm, InferenceConfig(rule="fixed", param=99), y[:2], tmp_path / "a")
    with pytest.raises(ExportError, match=r"rule param: a fixed depth must be in 1..7"):
        export_stop_model(sm, {"name": "fixed", "param": 8}, y[:2], tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    cfg = resolve(SparseConfig, PRESETS["quick"], None, {"inference": {"rule": "fixed", "param": 99}})
    sm = next(iter(APP.build_models(cfg, "cpu").values()))
    with pytest.raises(ConfigError, match=rf"inference.param: a fixed depth must be in 1..{sm.num_steps}"):
        load_deployment(APP, cfg, None, stage=APP.stop_stage, sm=sm)
    cfg.inference.param = sm.num_steps  # the last step is a fixed depth like any other
    assert load_deployment(APP, cfg, None, stage=APP.stop_stage, sm=sm).online.depth == sm.num_steps


def test_run_refuses_a_threshold_that_is_not_a_finite_number(exported):
    folder, y = exported
    rt = load(folder)
    for bad in (math.nan, math.inf, "0.5", True, 10 ** 400):
        with pytest.raises(ValueError, match="threshold must be a finite number"):
            rt.run(y, threshold=bad)
    assert rt.run(y, threshold=np.float32(3.0)).mean_depth >= rt.run(y).mean_depth


def test_an_older_format_version_is_refused_in_one_line(exported, tmp_path):
    folder, _ = exported
    bad, m = _copy(folder, tmp_path / "bad")
    _write(bad, {**m, "version": 1})
    with pytest.raises(ManifestError, match=r"'version' is not 2, the format version this runtime reads; got 1"):
        load(bad)


# ----------------------------------------------------------------------------- random edits (hypothesis)
#: edits of these fields leave the runtime's computation as it was (what they record is never run)
_INERT = {("task",), ("exported_with",), ("extra",), ("opset",), ("exit_costs",), ("rule", "source"), ("rule", "param")}


def _paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, prefix + (i,))


_json = st.recursive(st.none() | st.booleans() | st.integers(-10, 10 ** 6) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=6)
_edit = st.one_of(st.tuples(st.just("change"), _json), st.tuples(st.just("remove"), st.none()),
                  st.tuples(st.just("nan"), st.none()), st.tuples(st.just("nest"), st.integers(1, 80)),
                  st.tuples(st.just("add"), _json), st.tuples(st.just("nudge"), st.floats(-3, 3)))


def _at(m, path):
    for k in path:
        m = m[k]
    return m


def _apply(m, path, op, arg):
    """The manifest ``m`` with one edit at ``path`` (() is the whole manifest)."""
    box = {"manifest": m}
    path = ("manifest", *path)
    parent = box
    for k in path[:-1]:
        parent = parent[k]
    key, value = path[-1], parent[path[-1]]
    if op == "remove":
        del parent[key]
    elif op == "change":
        parent[key] = arg
    elif op == "nan":
        parent[key] = math.nan
    elif op == "nest":
        for _ in range(arg):
            value = [value]
        parent[key] = value
    elif op == "add":  # a field added to an object; anything else retyped to the value
        if isinstance(value, dict):
            value["unknown_field"] = arg
        else:
            parent[key] = arg
    elif op == "nudge":  # a number moved a little; anything else retyped to a float
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        parent[key] = value + (round(arg) if isinstance(value, int) else arg) if number else arg
    return box.get("manifest")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data(), reseal=st.booleans())
def test_random_edits_are_refused_naming_a_field_or_run_as_before(exported, tmp_path_factory, data, reseal):
    folder, y = exported
    original = json.loads((folder / MANIFEST).read_text())
    paths = sorted(_paths(original), key=repr)
    leaves = [p for p in paths if not isinstance(_at(original, p), (dict, list))]  # numbers, names: valid edits too
    path = data.draw(st.sampled_from(paths) | st.sampled_from(leaves), label="path")
    op, arg = data.draw(_edit, label="edit")
    m = _apply(copy.deepcopy(original), path, op, arg)
    bad = tmp_path_factory.mktemp("edit")
    for name in original["files"]:
        shutil.copy(folder / name, bad / name)
    text = json.dumps(seal(m) if reseal and isinstance(m, dict) and path != ("manifest_sha256",) else m)
    (bad / MANIFEST).write_text(text)
    try:
        rt = load(bad)
    except ManifestError as e:
        msg = str(e)
        assert "\n" not in msg and str(bad) in msg
        named = (any(f"'{f}" in msg for f in (*original, "unknown_field")) or "in the graph" in msg
                 or " reads " in msg or " gives " in msg)
        assert named or "nests deeper" in msg or "corrupt" in msg or "must be an object" in msg, msg
        return
    # it loaded: the manifest was sealed again (or the edit changed nothing), and it runs
    unchanged = canonical_bytes(json.loads(text)) == canonical_bytes(original)
    assert reseal or unchanged, (path, op, arg)
    got, want = rt.run(y), load(folder).run(y)
    assert ((1 <= got.stop_times) & (got.stop_times <= rt.last_step)).all() and np.isfinite(got.outputs).all()
    if path[:1] in _INERT or path[:2] in _INERT or unchanged:
        np.testing.assert_array_equal(got.stop_times, want.stop_times)
        np.testing.assert_array_equal(got.outputs, want.outputs)


_valid_edit = st.one_of(
    st.tuples(st.just(("task",)), st.text(max_size=20)),
    st.tuples(st.just(("rule", "source")), st.text(max_size=20)),
    st.tuples(st.just(("exported_with", "torch")), st.text(max_size=10)),
    st.tuples(st.just(("opset",)), st.integers(1, 1000)),
    st.tuples(st.just(("exit_costs",)), st.floats(1e-3, 1e3)),  # every cost scaled: still cumulative
    st.tuples(st.just(("extra",)), st.dictionaries(st.text(max_size=5), st.text(max_size=5) | st.integers(), max_size=3)),
    st.tuples(st.just(("rule", "threshold")), st.floats(-5, 5)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(edit=_valid_edit, reseal=st.booleans())
def test_valid_edits_load_only_when_sealed_again_and_run_as_recorded(exported, tmp_path_factory, edit, reseal):
    """A valid edit is refused by the manifest's checksum unless sealed again; sealed, what the runtime never runs
    gives the same outputs, and a moved threshold the stop times of that threshold on the original export."""
    folder, y = exported
    (path, value), m = edit, json.loads((folder / MANIFEST).read_text())
    if path == ("exit_costs",):
        value = [c * value for c in m["exit_costs"]]
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    bad, _ = _copy(folder, tmp_path_factory.mktemp("valid") / "edit")
    _write(bad, m, reseal=reseal)
    unchanged = canonical_bytes(m) == canonical_bytes(json.loads((folder / MANIFEST).read_text()))
    if not reseal and not unchanged:
        with pytest.raises(ManifestError, match="'manifest_sha256' does not match"):
            load(bad)
        return
    got = load(bad).run(y)
    want = load(folder).run(y, threshold=value) if path == ("rule", "threshold") else load(folder).run(y)
    np.testing.assert_array_equal(got.stop_times, want.stop_times)
    np.testing.assert_array_equal(got.outputs, want.outputs)
