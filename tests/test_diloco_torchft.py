"""DiLoCoOptimizer against torchft's DiLoCo (PyPI ``torchft``), where torchft imports.

torchft's DiLoCo (torchft/local_sgd.py) runs unchanged on a model of its
own; its Manager, which for torchft is a fault-tolerant process group with
a lighthouse server, is stood in for by ``AveragingManager``: the calls its
DiLoCo makes, with each allreduce an mpitrain Average. What is compared is
torchft's algorithm: its schedule of fragments, its outer step from the
backed-up parameters, its merging of local and global parameters.

torchft comes with the test extras (setup.py); where it is not installed
the test skips.
"""

import importlib.util

import torch

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test
from tests.test_diloco import assert_parameters, train
from tests.test_torch_optimizer import make_model

torch.set_num_threads(1)


def without_torchft(nprocs, env):
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install -c constraints.txt torchft)"
    return None


class Averaged:
    """torchft's Work over an mpitrain handle: wait() leaves the mean in the tensor."""

    def __init__(self, handle):
        self._handle = handle

    def wait(self, timeout=None):
        self._handle.wait()
        return True


class AveragingManager:
    """The part of torchft's Manager that its DiLoCo calls, on every rank of
    the job: one quorum, always committing, allreduce as an average."""

    _use_async_quorum = False

    def __init__(self):
        self._step = 0
        self._allreduces = 0

    def allreduce(self, tensor, should_quantize=False):
        self._allreduces += 1
        return Averaged(hvd.allreduce_async_(tensor, op=hvd.Average,
                                             name=f"torchft.allreduce.{self._allreduces}"))

    def should_commit(self):
        self._step += 1
        return True

    def current_step(self):
        return self._step

    def start_quorum(self):
        pass

    def register_state_dict_fn(self, key, load_state_dict, state_dict):
        pass

    def allow_state_dict_read(self):
        pass

    def disallow_state_dict_read(self):
        pass


def nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@mpi_test(skip=without_torchft)
def test_the_same_parameters_as_torchfts_diloco_and_streaming_diloco():
    """AdamW inside, Nesterov SGD outside: plain DiLoCo (H=3), then two
    fragments, the model's two layers, with one step of overlap and torchft's
    fragment_update_alpha 0.5 as the mixing."""
    from torchft.local_sgd import DiLoCo

    for streaming in (False, True):
        model, theirs = make_model(), make_model()
        layers = [model[0], model[2]] if streaming else [model]
        their_layers = [theirs[0], theirs[2]] if streaming else [theirs]
        options = dict(overlap_steps=1, mixing=0.5) if streaming else {}
        ours = hvd.DiLoCoOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(), inner_steps=4, fragments=layers,
            outer_optimizer=nesterov(model.parameters()), **options)
        inner = torch.optim.AdamW(theirs.parameters(), lr=0.01)
        with DiLoCo(AveragingManager(), their_layers, inner,
                    [nesterov(layer.parameters()) for layer in their_layers],
                    sync_every=4, pin_memory=False,
                    fragment_sync_delay=1 if streaming else 0,
                    fragment_update_alpha=0.5 if streaming else 0.0):
            for step in range(8):
                train(model, ours, 1, step)
                train(theirs, inner, 1, step)
                assert_parameters(model, list(theirs.parameters()),
                                  what=f"streaming={streaming} step {step + 1}")
        assert ours.exchanges == (4 if streaming else 2), (streaming, ours.exchanges)
