"""ShardedOptimizer with torch.amp.GradScaler, stages 1 and 2: trains like DDP
with the same scaler, and an overflow on one rank skips the step on every
rank and lowers the scale as it does under DDP.

The reference is torch's DDP over a gloo process group of
torch.distributed, with its own GradScaler.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test
from tests.test_sharded_optimizer_stage2 import (BUCKET, assert_identical_across_ranks,
                                                 assert_same_parameters, batch, gloo,
                                                 make_model)

torch.set_num_threads(1)

OVERFLOW_STEP = 2
STEPS = 5
MAX_NORM = 0.05


def scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)


def scaled_backward(model, grad_scaler, step):
    """float16 autocast; at OVERFLOW_STEP, on the last rank only, one element
    of the first weight's gradient is inf: a slice or parameter of one rank."""
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    if step == OVERFLOW_STEP and hvd.rank() == hvd.size() - 1:
        loss = loss + next(model.parameters())[0, 0] * float("inf")
    grad_scaler.scale(loss).backward()


@mpi_test(np=(2, 3), timeout=90)
def test_grad_scaler_steps_and_skips_an_overflow_of_one_rank_as_with_ddp():
    gloo()
    for stage in (2, 1):
        for clip in (False, True):
            model, reference = make_model(), make_model()
            sharded = hvd.ShardedOptimizer(torch.optim.Adam, model.parameters(), stage=stage,
                                           lr=0.01, bucket_bytes=BUCKET if stage == 2 else None)
            ddp = DistributedDataParallel(reference)
            plain = torch.optim.Adam(reference.parameters(), lr=0.01)
            mine, theirs = scaler(), scaler()
            for step in range(STEPS):
                before = [p.detach().clone() for p in model.parameters()]
                sharded.zero_grad()
                scaled_backward(model, mine, step)
                if clip and stage == 2:
                    sharded.clip_grad_norm_(MAX_NORM, grad_scaler=mine)
                elif clip:                  # stage 1 keeps torch's recipe
                    mine.unscale_(sharded)
                    sharded.clip_grad_norm_(MAX_NORM)
                mine.step(sharded)
                mine.update()
                plain.zero_grad()
                scaled_backward(ddp, theirs, step)
                if clip:
                    theirs.unscale_(plain)
                    torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
                theirs.step(plain)
                theirs.update()
                skipped = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
                assert skipped == (step == OVERFLOW_STEP), (stage, clip, step)
                assert mine.get_scale() == theirs.get_scale(), (stage, clip, step)
                assert_same_parameters(model, reference)
                assert_identical_across_ranks(model)
            # 2^10, grown at steps 1 and 4, halved at the overflow.
            assert mine.get_scale() == 2.0 ** 11


@mpi_test(np=(2, 3), timeout=60)
def test_grad_scaler_unscale_before_a_stage_2_step_fails_on_every_rank_saying_what_to_call():
    model = make_model()
    sharded = hvd.ShardedOptimizer(torch.optim.SGD, model.parameters(), stage=2, lr=0.1,
                                   bucket_bytes=BUCKET)
    grad_scaler = scaler()
    scaled_backward(model, grad_scaler, 0)
    grad_scaler.unscale_(sharded)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm, grad_scaler=scaler\)"):
        grad_scaler.step(sharded)
    sharded.zero_grad()
