"""The sizes the engine decides by, for adapters that shape their tensors to them.

An adapter can save the engine work by handing it tensors already laid out
the way the engine would fuse them: torch's gradient buckets hold what the
engine would pack into a fusion buffer, up to the fusion threshold, and
TensorFlow's packed reducer leaves to the engine the groups it would stream
through shared memory; DistributedOptimizer skips the exchange on a rank
alone in its set unless the engine is told to move data there too. These
answers come from the running engine's settings and routes; this module is
the adapters' one door to them.
"""

from mpitrain.api import basics
from mpitrain.engine.execution import fusion

# A gradient of this many bytes or more is reduced in its own memory; smaller
# ones are packed into a fusion buffer and unpacked afterwards.
ALONE_BYTES = fusion.ALONE_BYTES


def fusion_threshold():
    """The most bytes the engine fuses into one buffer (MPITRAIN_FUSION_THRESHOLD;
    0 when fusion is off)."""
    return basics.engine().config.fusion_threshold


def streamed(process_set, nbytes):
    """Would the engine stream a fused group of nbytes of host arrays of this
    set through shared memory (mpitrain.engine.execution.streaming)?"""
    controller = basics.engine().controller_for(process_set.process_set_id)
    return (controller is not None and controller.streams_from is not None
            and nbytes >= controller.streams_from)


def one_rank_moves_data():
    """Does a set of one rank still move its data through the pipeline
    (MPITRAIN_TEST_ONE_RANK_PIPELINE, for testing every kernel and route on a
    machine with one GPU)? Otherwise such a rank skips the exchange."""
    return basics.engine().config.test_one_rank_pipeline
