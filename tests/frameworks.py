"""One adapter per framework, so that a test is written once for all of them.

tests/bad_input_table.py runs each of its cases on numpy, torch, TensorFlow
and TensorFlow inside tf.function through these. An adapter makes tensors,
calls each collective of its framework, and names the errors its framework
raises where numpy raises MismatchError, TypeError and ValueError. It imports
its framework when it is made, inside a test body, so a machine without
TensorFlow skips only TensorFlow's tests, on every rank.
"""

import numpy as np
import pytest

import mpitrain as mt
from tests import test_errors


def framework(name):
    """The adapter called ``name``: numpy, torch, tensorflow or tf.function."""
    return {"numpy": Numpy, "torch": Torch, "tensorflow": TensorFlow,
            "tf.function": TensorFlowFunction}[name]()


class Numpy:
    """The numpy core, ``import mpitrain as mt``: the others change what differs."""

    api = mt
    mismatch_error, type_error, value_error = mt.MismatchError, TypeError, ValueError
    unsupported_dtypes = ("bool", "complex64", "uint32", "object", "<U1")

    def zeros(self, shape, dtype="float32"):
        return np.zeros(shape, dtype)

    def ones(self, shape, dtype="float32"):
        return np.ones(shape, dtype)

    def scalar(self, value, dtype):
        return np.dtype(dtype).type(value)

    def from_numpy(self, array):
        """``array`` as this framework's tensor, in the same memory layout."""
        return array

    def is_contiguous(self, array):
        return array.flags.c_contiguous

    def to_numpy(self, array):
        return np.asarray(array)

    def splits(self, counts):
        """alltoall's splits= as this framework takes them."""
        return counts

    def run(self, call):
        """Call ``call``: eagerly, but inside tf.function for tf.function. Each
        call of a case that runs on tf.function goes through here."""
        return call()

    def refuses(self, collective, dtype):
        """Whether ``collective`` refuses an unsupported ``dtype``: all do here."""
        return True

    def engine_still_works(self):
        test_errors.engine_still_works()

    def every_broadcast(self, array, name, root_rank, process_set=mt.global_process_set):
        """Each call that broadcasts ``array`` from ``root_rank``: label -> thunk."""
        return {"broadcast": lambda: mt.broadcast(array, root_rank, name=f"{name}.broadcast",
                                                  process_set=process_set)}

    def every_collective(self, array, name, process_set=mt.global_process_set):
        """One call of each collective on ``array``: label -> thunk."""
        kw = {"process_set": process_set}
        return {
            "allreduce": lambda: mt.allreduce(array, name=f"{name}.allreduce", **kw),
            "allgather": lambda: mt.allgather(array, name=f"{name}.allgather", **kw),
            **self.every_broadcast(array, name, 0, process_set),
            "alltoall": lambda: mt.alltoall(array, name=f"{name}.alltoall", **kw),
            "reducescatter": lambda: mt.reducescatter(array, name=f"{name}.reducescatter",
                                                      **kw),
            "grouped_allreduce": lambda: mt.grouped_allreduce([array, array],
                                                              name=f"{name}.grouped", **kw),
            "grouped_allgather": lambda: mt.grouped_allgather([array],
                                                              name=f"{name}.ggather", **kw),
        }

    def calls_that_need_init(self):
        """Each public call that needs a running engine: label -> thunk."""
        one = np.ones((2, 1))
        return {
            **self.every_collective(one, "uninitialized"),
            "allreduce_async": lambda: mt.allreduce_async(one),
            "grouped_reducescatter": lambda: mt.grouped_reducescatter([one]),
            "barrier": mt.barrier,
            "join": mt.join,
            "broadcast_object": lambda: mt.broadcast_object({"epoch": 1}),
            "allgather_object": lambda: mt.allgather_object(1),
            "add_process_set": lambda: mt.add_process_set([0]),
            "start_timeline": lambda: mt.start_timeline("/dev/null"),
            "rank": mt.rank,
        }


class HorovodStyle(Numpy):
    """What torch and TensorFlow share: Horovod's API, on their own tensors."""

    def engine_still_works(self):
        got = self.api.allreduce(self.ones((2,)), op=self.api.Sum, name="still.works")
        assert self.to_numpy(got).tolist() == [self.api.size()] * 2

    def every_broadcast(self, tensor, name, root_rank, process_set=mt.global_process_set):
        return {"broadcast": lambda: self.api.broadcast(tensor, root_rank, name=f"{name}.bc",
                                                        process_set=process_set)}

    def every_collective(self, tensor, name, process_set=mt.global_process_set):
        hvd, kw = self.api, {"process_set": process_set}
        return {
            "allreduce": lambda: hvd.allreduce(tensor, name=f"{name}.ar", **kw),
            "allgather": lambda: hvd.allgather(tensor, name=f"{name}.ag", **kw),
            **self.every_broadcast(tensor, name, 0, process_set),
            "alltoall": lambda: hvd.alltoall(tensor, name=f"{name}.a2a", **kw),
            "reducescatter": lambda: hvd.reducescatter(tensor, name=f"{name}.rs", **kw),
            "grouped_allreduce": lambda: hvd.grouped_allreduce([tensor], name=f"{name}.gar",
                                                               **kw),
            "grouped_allgather": lambda: hvd.grouped_allgather([tensor], name=f"{name}.gag",
                                                               **kw),
        }

    def calls_that_need_init(self):
        return self.every_collective(self.ones((2, 1)), "uninitialized")


class Torch(HorovodStyle):
    """``import mpitrain.torch as hvd``, on CPU tensors, on one thread."""

    unsupported_dtypes = ("bool", "complex64", "uint32", "complex32")

    def __init__(self):
        import torch
        import mpitrain.torch as hvd
        torch.set_num_threads(1)
        self.torch, self.api, self.mismatch_error = torch, hvd, hvd.MismatchError

    def zeros(self, shape, dtype="float32"):
        return self.torch.zeros(shape, dtype=getattr(self.torch, dtype))

    def ones(self, shape, dtype="float32"):
        return self.torch.ones(shape, dtype=getattr(self.torch, dtype))

    def scalar(self, value, dtype):
        return self.torch.tensor(value, dtype=getattr(self.torch, dtype))

    def from_numpy(self, array):
        return self.torch.from_numpy(array)

    def is_contiguous(self, tensor):
        return tensor.is_contiguous()

    def splits(self, counts):
        return self.torch.tensor(counts)

    def every_broadcast(self, tensor, name, root_rank, process_set=mt.global_process_set):
        return {**super().every_broadcast(tensor, name, root_rank, process_set),
                "broadcast_": lambda: self.api.broadcast_(tensor, root_rank, name=f"{name}.bc_",
                                                          process_set=process_set)}

    def every_collective(self, tensor, name, process_set=mt.global_process_set):
        hvd, kw = self.api, {"process_set": process_set}
        return {
            **super().every_collective(tensor, name, process_set),
            "allreduce_": lambda: hvd.allreduce_(tensor, name=f"{name}.ar_", **kw),
            "grouped_reducescatter": lambda: hvd.grouped_reducescatter(
                [tensor], name=f"{name}.grs", **kw),
        }

    def calls_that_need_init(self):
        hvd, model = self.api, self.torch.nn.Linear(2, 2)
        return {
            **super().calls_that_need_init(),
            "allreduce_async_": lambda: hvd.allreduce_async_(self.torch.ones(2)),
            "broadcast_parameters": lambda: hvd.broadcast_parameters(model.state_dict(), 0),
            "join": hvd.join,
        }


class TensorFlow(HorovodStyle):
    """``import mpitrain.tensorflow as hvd``, eagerly, on one thread."""

    unsupported_dtypes = ("complex64", "bool", "uint32", "string")

    def __init__(self):
        tf = pytest.importorskip("tensorflow")
        import mpitrain.tensorflow as hvd
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        self.tf, self.api = tf, hvd
        self.mismatch_error = hvd.MismatchError      # a tf.errors.FailedPreconditionError
        self.type_error = self.value_error = tf.errors.InvalidArgumentError

    def zeros(self, shape, dtype="float32"):
        return self.tf.zeros(shape, dtype)

    def ones(self, shape, dtype="float32"):
        return self.tf.ones(shape, dtype)

    def scalar(self, value, dtype):
        return self.tf.constant(value, dtype)

    def refuses(self, collective, dtype):
        """TensorFlow's broadcast moves bool, uint32 and complex as raw bytes
        (strings it refuses in words of its own), and so do its allgathers and
        alltoall with bool: tests/test_bad_input_tensorflow.py checks those."""
        return collective != "broadcast" and not (
            dtype == "bool" and collective in ("allgather", "grouped_allgather", "alltoall"))


class TensorFlowFunction(TensorFlow):
    """TensorFlow inside tf.function, whose errors are all tf.errors.OpError."""

    def __init__(self):
        super().__init__()
        self.mismatch_error = self.tf.errors.OpError

    def run(self, call):
        """Without autograph, as the bodies of test modules always ran (the
        worker loads those where autograph cannot find them): converting
        mpitrain's own code on each first call costs seconds a job."""
        return self.tf.function(call, autograph=False)()
