"""``learn2stop lm`` end to end on a tiny config (train, evaluate, generate), and bad input refused by name with
nothing written."""
from __future__ import annotations

import json

import pytest
from conftest import shared_data
from test_lm_stages import markov_text

from learn2stop.cli import main


def tiny(run_dir, corpus, *extra):
    return ["--preset", "tiny", "--threads", "1", "--no-progress", "--run-dir", str(run_dir), "--data.path",
            str(corpus), *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    corpus = root / "corpus.txt"
    corpus.write_text(markov_text(4000), encoding="utf-8")
    run_dir = root / "run"
    assert main(["lm", "train", *tiny(run_dir, corpus)]) == 0
    assert main(["lm", "evaluate", *tiny(run_dir, corpus)]) == 0
    return run_dir, corpus


def test_train_and_evaluate_write_the_tables(trained):
    run_dir, _ = trained
    for name in ("results.md", "results.json", "in_time.md", "in_time.json", "frontier.png", "deployed.json",
                 "head_to_head.md", "training.json", "vocab.json", "exits.md", "certified.md"):
        assert (run_dir / name).is_file(), name
    exits = json.loads((run_dir / "exits.json").read_text())
    assert list(exits) == ["GPT", "deep supervision", "Stage I"] and all(len(v) == 3 for v in exits.values())
    by_eps = json.loads((run_dir / "certified.json").read_text())
    assert [r["epsilon"] for r in by_eps] == [0.005, 0.01, 0.02, 0.05, 0.1]
    for looser, tighter in zip(by_eps[1:], by_eps):  # a larger allowed loss certifies at least as much skipping
        assert all(looser["mean_layers"][k] <= tighter["mean_layers"][k] + 1e-9 for k in tighter["mean_layers"])
    results = json.loads((run_dir / "results.json").read_text())
    rows = {r["row"]: r for r in results}
    assert abs(exits["GPT"][-1] - rows["full depth (GPT)"]["val_loss"]) < 1e-4  # the last exit is full depth
    rows = {r["row"]: r for r in results}
    assert rows["full depth (GPT)"]["test_mean_layers"] == 3.0
    assert rows["Stage I, full depth"]["generation_agreement"] == 1.0
    assert any(r["row"].startswith("self-speculative") and r["generation_agreement"] == 1.0 for r in results)
    gpt_val = rows["full depth (GPT)"]["val_loss"]
    for r in results:
        if r["certified"] is not None:
            assert r["certified"]["risk"] <= 0.01 or r["threshold"] is None  # certified within epsilon, or nowhere
            if r["threshold"] is not None and r["rule"] != "fixed":  # certified on what is deployed: real early exit
                assert r["certified"]["risk"] == pytest.approx(r["val_loss"] - gpt_val, abs=1e-5)
    propagation = json.loads((run_dir / "propagation.json").read_text())
    for p in propagation:  # each certified Stage I rule, its cache propagated against recomputed in full
        assert p["propagated_loss"] == rows[p["row"]]["test_loss"] and 1 <= p["recomputed_layers"] <= 3
    in_time = json.loads((run_dir / "in_time.json").read_text())
    assert in_time["rows"][0]["rule"] == "baseline" and in_time["batch_sizes"] == [1, 4]
    keeps = rows["full depth (GPT)"]["val_loss"] + 0.01  # a row reaches the GPT's validation quality within epsilon
    assert all(r["reached"] == (rows[r["label"]]["val_loss"] <= keeps) for r in in_time["rows"][1:])
    assert "Tokens per second" in (run_dir / "results.md").read_text()  # every row's speed, reached or not
    deployed = json.loads((run_dir / "deployed.json").read_text())
    assert 0.02 <= deployed["tie"] <= 0.10  # the timing's own spread, within its floor and cap
    if deployed["backbone"] == "baseline":  # the plain GPT at full depth: nothing kept its quality faster
        assert deployed["rule"] == "full" and deployed["row"] == "full depth (GPT)"
    else:  # a Stage I rule within epsilon of the plain GPT's validation loss
        assert deployed["backbone"] == "stage1" and deployed["rule"] in ("policy", "margin", "saturation", "fixed",
                                                                         "speculative")
        assert rows[deployed["row"]]["val_loss"] <= rows["full depth (GPT)"]["val_loss"] + 0.01


def test_generate_streams_text_and_reports_depth_and_speed(trained, capsys):
    run_dir, corpus = trained
    prompt = markov_text(3)
    assert main(["lm", "generate", *tiny(run_dir, corpus, "--prompt", prompt, "--max-new-tokens", "10")]) == 0
    out = capsys.readouterr().out  # the deployed generation: an exit rule, or self-speculative decoding
    assert out.startswith(prompt) and ("mean exit layer" in out or "drafts accepted" in out) and "tokens/s" in out
    assert main(["lm", "generate", *tiny(run_dir, corpus, "--prompt", prompt, "--max_new_tokens", "5",
                                         "--exit_rule", "margin")]) == 0
    assert "mean exit layer" in capsys.readouterr().out
    past = "45"  # past the tiny preset's context of 32: the window restarts
    assert main(["lm", "generate", *tiny(run_dir, corpus, "--prompt", prompt, "--max_new_tokens", past,
                                         "--exit_rule", "full")]) == 0
    full = capsys.readouterr().out
    assert "mean exit layer 3.00 of 3" in full and len(full.splitlines()[0]) == len(prompt) + 45
    assert main(["lm", "generate", *tiny(run_dir, corpus, "--prompt", prompt, "--max_new_tokens", past,
                                         "--exit_rule", "speculative")]) == 0
    fast = capsys.readouterr().out  # self-speculative decoding writes Stage I's full-depth text exactly
    assert "drafts accepted" in fast and fast.splitlines()[0] == full.splitlines()[0]
    moved = corpus.parent / "moved-away.txt"  # generation reads the run's vocabulary, not the corpus
    assert main(["lm", "generate", *tiny(run_dir, moved, "--prompt", prompt, "--max-new-tokens", "3")]) == 0
    capsys.readouterr()  # with no preset, a reading command starts from the settings the run was trained with
    assert main(["lm", "generate", "--run-dir", str(run_dir), "--prompt", prompt, "--max-new-tokens", "4",
                 "--exit_rule", "full"]) == 0
    assert "of 3," in capsys.readouterr().out
    assert cli(["lm", "generate", "--preset", "quick", "--run-dir", str(run_dir), "--prompt", prompt]) == 2
    assert "was trained with" in capsys.readouterr().err  # a preset asked for is still checked against the run



def test_calibrate_certifies_a_new_epsilon_on_real_early_exit_and_keeps_the_deployment_it_replaces(trained, tmp_path,
                                                                                                   capsys, monkeypatch):
    import shutil

    from learn2stop.tasks.lm import calibrate as lm_calibrate

    src, corpus = trained
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir, ignore=shutil.ignore_patterns(".lock"))
    before = (run_dir / "deployed.json").read_text()
    plan = json.loads(before)["speculative"]

    def timed_again(*args):
        raise AssertionError("the draft plan was timed again")

    monkeypatch.setattr(lm_calibrate, "draft_plan", timed_again)  # the record's plan is carried over, not re-timed
    assert main(["lm", "calibrate", *tiny(run_dir, corpus, "--epsilon", "0.2", "--fastest")]) == 0
    out = capsys.readouterr().out
    assert "gen tok/s b=1" in out and "(deployed)" in out
    assert (run_dir / "deployed.previous.json").read_text() == before
    deployed = json.loads((run_dir / "deployed.json").read_text())
    assert set(deployed["thresholds"]) == {"policy", "margin", "saturation", "fixed"} and deployed["target"] == {"epsilon": 0.2, "delta": 0.1, "risk": "loss"}
    assert deployed["speculative"] == plan
    for cal in deployed["calibration"]["stage1"].values():
        assert cal["target"]["epsilon"] == 0.2 and (cal["calibration"]["risk"] <= 0.2 or cal["threshold"] is None)
    assert main(["lm", "calibrate", *tiny(run_dir, corpus, "--budget", "0.5", "--rule", "saturation")]) == 0
    capsys.readouterr()
    deployed = json.loads((run_dir / "deployed.json").read_text())
    assert deployed["rule"] == "saturation" and list(deployed["thresholds"]) == ["saturation"]
    assert deployed["target"] == {"budget": 0.5}
    assert deployed["calibration"]["stage1"]["saturation"]["calibration"]["mean_cost"] <= 0.5
    assert main(["lm", "generate", *tiny(run_dir, corpus, "--prompt", markov_text(3), "--max-new-tokens", "5")]) == 0
    assert "saturation" in capsys.readouterr().out  # generate serves what calibrate deployed
    assert cli(["lm", "generate", *tiny(run_dir, corpus, "--prompt", "ab", "--exit_rule", "margin")]) == 2
    assert "no threshold of the 'margin' rule" in capsys.readouterr().err
    for args, needle in [(["--epsilon", "0.1", "--rule", "bogus"], "--rule: the language model's rules"),
                         (["--epsilon", "0.1", "--speed-batch", "4"], "--speed-batch"),
                         (["--epsilon", "0.1", "--rule", "margin", "--fastest"], "give one or the other"),
                         (["--budget", "0.1"], "the least any rule runs is the first exit"),
                         ([], "exactly one target")]:
        assert cli(["lm", "calibrate", *tiny(run_dir, corpus, *args)]) == 2, args
        assert needle in capsys.readouterr().err


def test_a_word_level_corpus_trains_with_a_bpe_vocabulary_and_generates(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from learn2stop.tasks.lm.commands import run_vocab
    from learn2stop.tasks.lm.tokenizer import BPEVocab

    words = markov_text(6000).replace("a", "the ").replace("b", "king ").replace("c", "and ")  # recurring words
    corpus = tmp_path / "words.txt"
    corpus.write_text(words, encoding="utf-8")
    run_dir = tmp_path / "bpe"
    bpe = ["--data.tokenizer", "bpe", "--data.vocab_size", "300"]
    assert main(["lm", "train", *tiny(run_dir, corpus, *bpe)]) == 0
    vocab = run_vocab(run_dir)
    assert isinstance(vocab, BPEVocab) and 256 < len(vocab) <= 300 and not (run_dir / "vocab.json").exists()
    assert vocab.decode(vocab.encode("the king and")) == "the king and"
    capsys.readouterr()
    assert main(["lm", "generate", "--run-dir", str(run_dir), "--prompt", "the king", "--max-new-tokens", "6",
                 "--exit_rule", "full"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the king") and "6 tokens" in out  # tokens, not characters
    assert main(["lm", "train", *tiny(run_dir, corpus, *bpe)]) == 0  # resumes: the same corpus learns the same BPE
    assert cli(["lm", "train", *tiny(tmp_path / "x", corpus, "--data.tokenizer", "bpe", "--data.vocab_size",
                                      "100")]) == 2
    assert "data.vocab_size" in capsys.readouterr().err


def cli(args: list[str]) -> int:
    """The exit code of ``learn2stop ...`` (a refused flag exits through argparse, code 2)."""
    try:
        return main(args)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "Z!"], "outside the vocabulary"),
    (["--prompt", "a" * 40], "more than the model's context"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", ""], "prompt"),
])
def test_generate_refuses_bad_input_by_name(trained, capsys, args, needle):
    run_dir, corpus = trained
    files = lambda: sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir() if p.name != ".lock")  # noqa: E731
    before = files()
    assert cli(["lm", "generate", *tiny(run_dir, corpus, *args)]) == 2
    assert needle in capsys.readouterr().err
    assert files() == before  # nothing written (the run lock aside)


def test_train_refuses_bad_corpora_and_settings_writing_nothing(tmp_path, capsys):
    empty, binary, short, ok = (tmp_path / n for n in ("empty.txt", "bin.txt", "short.txt", "ok.txt"))
    empty.write_bytes(b"")
    binary.write_bytes(b"abc\xff\xfe")
    short.write_text("to be or not to be " * 5, encoding="utf-8")
    ok.write_text(markov_text(3000), encoding="utf-8")
    for corpus, needle, extra in [(empty, "empty", []), (binary, "not UTF-8", []), (short, "context + 1", []),
                                  (tmp_path / "missing.txt", "data.path", []),
                                  (ok, "baseline.batch", ["--baseline.batch", "0"]),
                                  (ok, "method.stage2_target", ["--method.stage2_target", "kl"])]:
        run_dir = tmp_path / "never"
        assert cli(["lm", "train", *tiny(run_dir, corpus, *extra)]) == 2
        assert needle in capsys.readouterr().err
        assert not run_dir.exists()


def test_the_real_corpus_trains_a_little(tmp_path):
    corpus = shared_data("tinyshakespeare") / "input.txt"
    run_dir = tmp_path / "real"
    assert main(["lm", "train", *tiny(run_dir, corpus)]) == 0
    summary = json.loads((run_dir / "training.json").read_text())
    assert summary["baseline"]["val_loss_full_depth"] < 4.17  # below uniform over 65 characters, ln 65


def test_generate_refuses_a_deployment_record_without_a_valid_draft_plan(trained, tmp_path, capsys):
    import shutil

    src, corpus = trained
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir, ignore=shutil.ignore_patterns(".lock"))
    record = json.loads((run_dir / "deployed.json").read_text())
    (run_dir / "deployed.json").write_text(json.dumps({**record, "speculative": {"draft_layer": 0, "num_draft": 2}}))
    assert cli(["lm", "generate", *tiny(run_dir, corpus, "--prompt", markov_text(3), "--exit_rule",
                                        "speculative")]) == 2
    assert "holds no valid self-speculative draft plan" in capsys.readouterr().err
