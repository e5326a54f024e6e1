"""Outputs the user names never destroy what the user made: an export's --out, predict's and denoise's output,
and a calibration replaced (learn2stop.utils.outputs). Each refusal comes before any work, in one line naming the
user's argument and path, and what is replaced is kept beside the new one."""
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from learn2stop.cli import main
from learn2stop.utils.outputs import OutputError, check_output_file, json_output, previous_path, run_record

SPARSE = ["--problem.m", "13", "--problem.n", "27", "--problem.test_per_snr", "20", "--problem.val_per_snr", "20",
          "--lista.num_steps", "5", "--policy.sketch_dim", "4", "--run_stage3", "false", "--run_aevb", "false",
          "--no-progress", "--threads", "1",
          *[a for s in ("baseline", "stage1", "stage2") for a in (f"--{s}.iterations", "4", f"--{s}.batch_size", "16",
                                                                 f"--{s}.eval_every", "4", f"--{s}.checkpoint_every", "4")]]
CLASSIFY = ["--data.kind", "synthetic", "--data.size", "16", "--data.synthetic_per_class", "24",
            "--data.synthetic_classes", "3", "--model.arch", "vgg6-narrow", "--model.fc_width", "16", "--eval_batch", "64",
            "--no-progress", "--threads", "1",
            *[a for s in ("baseline", "sdn", "stage1", "stage2")
              for a in (f"--{s}.iterations", "4", f"--{s}.batch_size", "16", f"--{s}.eval_every", "4",
                        f"--{s}.checkpoint_every", "4")]]
DENOISE = {
    "data": {"synthetic_train": 4, "synthetic_test": 2, "synthetic_size": 32, "patch_size": 16, "stride": 16,
             "scales": [1.0], "val_patches": 8},
    "model": {"depth": 5, "channels": 4, "policy_hidden": 4},
    **{s: {"iterations": 4, "batch_size": 8, "eval_every": 4, "checkpoint_every": 4}
       for s in ("baseline", "heads", "stage1", "stage2")},
    "eval": {"sigmas": [25.0], "figure_sigmas": [25.0], "bm3d": False, "crop": 16},
}


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes (what must survive a refused command), the lock file aside."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _image(path: Path, seed: int = 0, size: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size), dtype=np.uint8)).save(path)
    return path


def _refused(capsys, *names) -> str:
    """The command's one error line; it names each of ``names`` and no hidden temporary path."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in names:
        assert str(n) in err, (n, err)
    assert "-tmp" not in err and ".tmp" not in err and "probe" not in err, err
    return err


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("sparse") / "run"
    assert main(["sparse", "train", "--run-dir", str(run), *SPARSE]) == 0
    return run


@pytest.fixture(scope="module")
def classify_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("classify") / "run"
    assert main(["classify", "train", "--run-dir", str(run), *CLASSIFY]) == 0
    return run


@pytest.fixture(scope="module")
def denoise_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("denoise")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(DENOISE))
    args = ["--run-dir", str(root / "run"), "--config", str(config), "--no-progress", "--threads", "1"]
    assert main(["denoise", "train", *args]) == 0
    return args


# ----------------------------------------------------------------------------- the module
def test_previous_paths_and_run_records(tmp_path):
    assert previous_path(tmp_path / "calibration.json") == tmp_path / "calibration.previous.json"
    assert previous_path(tmp_path / "exported") == tmp_path / "exported.previous"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "fingerprint.json").write_text("{}")
    for name in ("config.yaml", "config.predict.yaml", "metrics.jsonl", "calibration.json", "deployment.json",
                 "checkpoints/stage2.pt", "previous-20200101-000000/config.yaml"):
        assert run_record(run / name) == (run, name.split("/")[0]), name
    assert run_record(run / "predictions.json") is None and run_record(tmp_path / "config.yaml") is None
    # the command's own run directory counts before it has a fingerprint; a symlink resolves to its target
    other = tmp_path / "other"
    other.mkdir()
    assert run_record(other / "calibration.json", [other]) == (other, "calibration.json")
    (tmp_path / "link.json").symlink_to(run / "calibration.json")
    assert run_record(tmp_path / "link.json") == (run, "calibration.json")


def test_an_existing_file_is_replaced_only_if_it_is_ours(tmp_path):
    ours = json_output("rule", "predictions")
    mine = tmp_path / "notes.json"
    mine.write_text('{"todo": 1}')
    with pytest.raises(OutputError, match=r"out: .*notes.json exists and is not an earlier output .*'rule' and 'predictions'"):
        check_output_file(mine, "out", ours=ours)
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"rule": "r", "predictions": []}')
    assert check_output_file(earlier, "out", ours=ours) == earlier
    with pytest.raises(OutputError, match="is a folder"):
        check_output_file(tmp_path, "out")
    with pytest.raises(OutputError, match="names no file"):
        check_output_file("/", "out")
    with pytest.raises(OutputError, match=r"^out: .* cannot be written: the name 'x+\.\.\.' is 300 bytes; this file "
                                          r"system holds names of at most \d+$"):
        check_output_file(tmp_path / ("x" * 300), "out")
    with pytest.raises(OutputError, match=r"out: .*notes.json/a.json cannot be written: .*notes.json is a file"):
        check_output_file(mine / "a.json", "out")


# ----------------------------------------------------------------------------- export --out
def test_export_refuses_a_folder_of_the_users_files_with_a_manifest(sparse_run, tmp_path, capsys):
    out = tmp_path / "D"
    (out / "photos").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"format": "learn2stop-onnx"}))
    (out / "precious.txt").write_text("mine")
    (out / "photos" / "p1.jpg").write_bytes(b"\xff\xd8 a photo")
    before = _tree(out)
    assert main(["sparse", "export", "--run-dir", str(sparse_run), "--out", str(out), *SPARSE]) == 2
    assert "exists and is not an earlier export" in _refused(capsys, "--out", out)
    assert _tree(out) == before and not previous_path(out).exists()


def test_export_replaces_only_a_complete_earlier_export_and_keeps_it(sparse_run, tmp_path, capsys):
    out = tmp_path / "D"
    args = ["sparse", "export", "--run-dir", str(sparse_run), "--out", str(out), *SPARSE]
    assert main(args) == 0 and not previous_path(out).exists()
    first = _tree(out)
    capsys.readouterr()
    assert main(args) == 0  # a complete earlier export: replaced, and kept beside
    assert f"the earlier export is kept in {previous_path(out)}" in capsys.readouterr().out
    assert _tree(previous_path(out)) == first and set(_tree(out)) == set(first)
    assert main(args) == 0  # an older .previous that is ours goes
    assert set(_tree(previous_path(out))) == set(first)
    capsys.readouterr()
    # an export with the user's file added, or with a graph changed since, is not ours any more
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    assert main(args) == 2
    assert "notes.txt" in _refused(capsys, "--out", out) and _tree(out) == before
    (out / "notes.txt").unlink()
    graph = next(out.glob("step_*.onnx"))
    graph.write_bytes(graph.read_bytes() + b"\0")
    before = _tree(out)
    assert main(args) == 2
    assert "sha256" in _refused(capsys, "--out", out) and _tree(out) == before
    # a complete export whose .previous holds the user's files: nothing is replaced
    shutil.rmtree(out)
    shutil.copytree(previous_path(out), out)
    (previous_path(out) / "precious.txt").write_text("mine")
    kept = _tree(previous_path(out))
    assert main(args) == 2
    assert "move it away" in _refused(capsys, "--out", previous_path(out)) and _tree(previous_path(out)) == kept


def test_export_refuses_a_run_record_or_the_run_itself(sparse_run, capsys):
    before = _tree(sparse_run)
    for out in (sparse_run, sparse_run / "checkpoints", sparse_run / "checkpoints" / "onnx", sparse_run / "config.yaml"):
        assert main(["sparse", "export", "--run-dir", str(sparse_run), "--out", str(out), *SPARSE]) == 2, out
        _refused(capsys, "--out", out)
    assert _tree(sparse_run) == before


def _immutable(folder: Path) -> bool:
    """Make ``folder`` immutable (chattr +i) where the file system and our rights allow it."""
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0


def test_export_errors_name_the_users_path_not_a_hidden_temp_one(sparse_run, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    outs = [a_file, a_file / "D", Path("/proc") / "D"] if Path("/proc/self").is_dir() else [a_file, a_file / "D"]
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    if _immutable(frozen):
        outs.append(frozen / "D")
    try:
        for out in outs:
            assert main(["sparse", "export", "--run-dir", str(sparse_run), "--out", str(out), *SPARSE]) == 2, out
            _refused(capsys, "--out", out)
        assert a_file.read_text() == "mine"
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    finally:
        subprocess.run(["chattr", "-i", str(frozen)], capture_output=True)


# ----------------------------------------------------------------------------- calibrate
def test_calibrate_keeps_the_calibration_it_replaces(sparse_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(sparse_run, run, ignore=shutil.ignore_patterns(".lock"))
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.6", *SPARSE]) == 0
    first = (run / "calibration.json").read_bytes()
    assert not (run / "calibration.previous.json").exists()
    capsys.readouterr()
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.7", *SPARSE]) == 0
    assert f"kept in {run / 'calibration.previous.json'}" in capsys.readouterr().out
    assert (run / "calibration.previous.json").read_bytes() == first
    assert json.loads((run / "calibration.json").read_text())["target"]["budget"] == 0.7
    second = (run / "calibration.json").read_bytes()
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.8", *SPARSE]) == 0
    assert (run / "calibration.previous.json").read_bytes() == second  # an older kept one, a calibration, goes
    # a calibration.previous.json that is not a calibration: refused before any work, nothing replaced
    (run / "calibration.previous.json").write_text("my notes")
    before = _tree(run)
    capsys.readouterr()
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.6", *SPARSE]) == 2
    _refused(capsys, run / "calibration.previous.json", "move it away")
    assert _tree(run) == before


# ----------------------------------------------------------------------------- classify predict
def test_predict_never_overwrites_its_input_or_a_run_record(classify_run, tmp_path, capsys):
    img = _image(tmp_path / "img.png")
    (tmp_path / "hard.png").hardlink_to(img)
    (tmp_path / "soft.json").symlink_to(img)
    other = _image(tmp_path / "other.png", seed=1)
    before, record = img.read_bytes(), (classify_run / "fingerprint.json").read_bytes()
    base = ["classify", "predict", "--run-dir", str(classify_run), "--predict.input", str(img), *CLASSIFY]
    for out in (img, tmp_path / "hard.png", tmp_path / "soft.json", classify_run / "fingerprint.json",
                classify_run / "config.yaml", classify_run / "checkpoints" / "stage2.pt", other, tmp_path):
        capsys.readouterr()
        assert main([*base, "--predict.output", str(out)]) == 2, out
        err = _refused(capsys, "predict.output", out)
        assert "exit" not in capsys.readouterr().out  # refused before the model ran: no prediction logged
        assert img.read_bytes() == before and (classify_run / "fingerprint.json").read_bytes() == record, err
    # a folder of inputs: none of them is written either
    folder = tmp_path / "imgs"
    a = _image(folder / "sub" / "a.png", seed=2)
    saved = a.read_bytes()
    assert main(["classify", "predict", "--run-dir", str(classify_run), "--predict.input", str(folder), *CLASSIFY,
                 "--predict.output", str(a)]) == 2
    _refused(capsys, "predict.output", a)
    assert a.read_bytes() == saved
    # a new file, then the same file again (an earlier predictions file of ours is replaced)
    preds = tmp_path / "preds.json"
    assert main([*base, "--predict.output", str(preds)]) == 0 and main([*base, "--predict.output", str(preds)]) == 0
    assert json.loads(preds.read_text())["predictions"][0]["file"] == str(img)


def test_predict_refuses_an_unwritable_output_before_the_model_runs(classify_run, tmp_path, capsys):
    img = _image(tmp_path / "img.png")
    run = tmp_path / "untrained"  # the run's configuration without its checkpoints: any work would fail on them
    shutil.copytree(classify_run, run, ignore=shutil.ignore_patterns(".lock", "checkpoints"))
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    outs = [a_file / "preds.json"] + ([Path("/proc") / "preds.json"] if Path("/proc/self").is_dir() else [])
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    if _immutable(frozen):
        outs.append(frozen / "preds.json")
    try:
        for out in outs:
            assert main(["classify", "predict", "--run-dir", str(run), "--predict.input", str(img), *CLASSIFY,
                         "--predict.output", str(out)]) == 2, out
            assert "cannot be written" in _refused(capsys, "predict.output", out)
    finally:
        subprocess.run(["chattr", "-i", str(frozen)], capture_output=True)


# ----------------------------------------------------------------------------- denoise denoise
def test_denoise_never_overwrites_its_input(denoise_run, tmp_path, capsys):
    folder = tmp_path / "in"
    _image(folder / "x.png", seed=0, size=20)
    _image(folder / "x_denoised.png", seed=1, size=20)  # an input named like an output of another input
    before = _tree(folder)
    assert main(["denoise", "denoise", *denoise_run, "--denoise.input", str(folder), "--denoise.output", str(folder)]) == 2
    _refused(capsys, "denoise.output", folder / "x_denoised.png")
    assert _tree(folder) == before
    # an output that is a hard link to the input (written in place, it would change the input)
    src, out = tmp_path / "a.png", tmp_path / "out"
    _image(src, seed=2, size=20)
    out.mkdir()
    (out / "a_denoised.png").hardlink_to(src)
    saved = src.read_bytes()
    assert main(["denoise", "denoise", *denoise_run, "--denoise.input", str(src), "--denoise.output", str(out)]) == 2
    _refused(capsys, "denoise.output", out / "a_denoised.png")
    assert src.read_bytes() == saved
    # the user's own depths.json in the output folder is not replaced; two inputs with one stem are refused
    (out / "a_denoised.png").unlink()
    (out / "depths.json").write_text("my notes")
    assert main(["denoise", "denoise", *denoise_run, "--denoise.input", str(src), "--denoise.output", str(out)]) == 2
    _refused(capsys, "denoise.output", out / "depths.json")
    assert (out / "depths.json").read_text() == "my notes" and not (out / "a_denoised.png").exists()
    (folder / "x_denoised.png").rename(folder / "x.jpg")
    assert main(["denoise", "denoise", *denoise_run, "--denoise.input", str(folder), "--denoise.output", str(out)]) == 2
    _refused(capsys, "denoise.input", "x_denoised.png")
    # a good output, twice: its own depths.json is replaced; an image it replaces is replaced whole (atomically),
    # never written through, so another name of that file (a hard link) keeps its bytes
    (out / "depths.json").unlink()
    elsewhere = _image(tmp_path / "elsewhere.png", seed=3)
    (out / "a_denoised.png").hardlink_to(elsewhere)
    kept = elsewhere.read_bytes()
    for _ in range(2):
        assert main(["denoise", "denoise", *denoise_run, "--denoise.input", str(src), "--denoise.output", str(out)]) == 0
    assert json.loads((out / "depths.json").read_text())[0]["input"] == str(src)
    assert elsewhere.read_bytes() == kept and (out / "a_denoised.png").read_bytes() != kept
