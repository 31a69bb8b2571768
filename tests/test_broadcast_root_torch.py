"""mpitrain.torch's broadcasts on a process set take root_rank as a rank of
the job, as Horovod does (numpy's are in tests/test_process_sets.py)."""

import pytest
import torch

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test, on_a_new_process_set

torch.set_num_threads(1)

OUTSIDER = r"root_rank 0 is not a member of the process set, whose ranks are \[1, 2\]"


def on_the_set_of_ranks_1_and_2(r, upper):
    x = torch.full((2,), float(r), requires_grad=True)
    got = hvd.broadcast(x, root_rank=2, process_set=upper)
    assert got.tolist() == [2.0, 2.0]
    got.sum().backward()                 # the set's average gradient, on the root alone
    assert x.grad.tolist() == ([1.0, 1.0] if r == 2 else [0.0, 0.0])
    into = torch.full((3,), float(r))
    hvd.broadcast_(into, 1, process_set=upper)
    assert into.tolist() == [1.0, 1.0, 1.0]
    assert hvd.broadcast_object({"from": r}, root_rank=2, process_set=upper) == {"from": 2}

    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, float(r))
    hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=upper)
    assert model.weight.flatten().tolist() == [2.0] * 4
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * r)
    hvd.broadcast_optimizer_state(optimizer, root_rank=2, process_set=upper)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)

    with pytest.raises(ValueError, match=rf"broadcast of 'outsider' failed.*{OUTSIDER}"):
        hvd.broadcast(x, root_rank=0, name="outsider", process_set=upper)
    with pytest.raises(ValueError, match=OUTSIDER):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=upper)
    with pytest.raises(ValueError, match=OUTSIDER):
        hvd.broadcast_object("epoch 1", root_rank=0, process_set=upper)
    with pytest.raises(ValueError, match=OUTSIDER):
        hvd.broadcast_optimizer_state(optimizer, root_rank=0, process_set=upper)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=upper).item() == 2


@mpi_test(np=(3,))
def test_on_a_set_root_rank_is_a_rank_of_the_job():
    on_a_new_process_set((1, 2), on_the_set_of_ranks_1_and_2)

