"""Sparse recovery's app: a short two-stage run on a tiny problem beats its start."""
from learn2stop.core import StageConfig, StagedTrainer, validation_scores
from learn2stop.tasks.sparse import SparseRecoveryTask, build_lista_stop, preset


def test_two_stage_training_beats_deep_supervision_baseline_on_tiny_problem(tmp_path):
    """A short run: Stage I lowers the oracle error below the start; Stage II's early exit
    recovers most of it; both are better than the untrained ISTA initialisation."""
    cfg = preset("quick", problem={"m": 13, "n": 27, "sparsity": 0.2, "val_per_snr": 40},
                 lista={"num_steps": 6})
    task = SparseRecoveryTask(cfg.problem)
    sm = build_lista_stop(cfg, task)
    before = validation_scores(sm, task.validation_batches("cpu"), task.loss_fn)
    tr = StagedTrainer(sm, task, tmp_path, progress=False)
    tr.fit("stage1", StageConfig(objective="stage1", beta=0.05, iterations=150, batch_size=64, lr=3e-3, eval_every=50))
    tr.fit("stage2", StageConfig(objective="stage2", beta=0.05, iterations=150, batch_size=64, lr=3e-3, eval_every=50))
    after = validation_scores(sm, task.validation_batches("cpu"), task.loss_fn)
    assert after["oracle"] < 0.7 * before["oracle"]
    assert after["policy"] < 0.8 * before["last"]
    assert after["oracle"] <= after["policy"]
