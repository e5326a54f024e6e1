"""Training scales out on torch.distributed: two gloo processes stay in sync through DDP."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import ToyPolicy, ToyStepModel, ToyTask
from learn2stop.core import StageConfig, StagedTrainer, StoppingModel
from learn2stop.utils.distributed import DistContext


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sm = StoppingModel(ToyStepModel(), ToyPolicy())
    ctx = DistContext(rank=rank, world_size=world)
    tr = StagedTrainer(sm, ToyTask(), out_dir, ctx=ctx, progress=False)
    tr.fit("stage1", StageConfig(objective="stage1", iterations=6, batch_size=16, lr=1e-2, eval_every=3, checkpoint_every=3))
    tr.fit("stage2", StageConfig(objective="stage2", iterations=6, batch_size=16, lr=1e-2, eval_every=3, checkpoint_every=3))
    torch.save(sm.state_dict(), os.path.join(out_dir, f"rank{rank}.state"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_ddp_training_keeps_ranks_identical(tmp_path):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    a = torch.load(tmp_path / "rank0.state")
    b = torch.load(tmp_path / "rank1.state")
    torch.manual_seed(0)
    init = StoppingModel(ToyStepModel(), ToyPolicy()).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    assert any(not torch.equal(a[k], init[k]) for k in a if k.startswith("model."))
    assert any(not torch.equal(a[k], init[k]) for k in a if k.startswith("policy."))
    assert (tmp_path / "checkpoints" / "stage2.pt").is_file()
