"""send and recv of the "mpitrain" backend, on MPI (mpitrain.api.point_to_point).

Each group's process set has a pair of communicators of its own for
messages, made beside the set's communicator, so that torch's threads send
and receive on them while mpitrain's engine thread runs collectives on the
set's. A tensor travels as a header (its dtype and shape), then its bytes
straight from a contiguous host copy (a non-contiguous or CUDA tensor is
copied first); a recv checks the header against the tensor it receives
into and raises, naming the source, the tag and both, after draining what
was sent so that the sender completes. ``recv`` from any source
(``dist.recv(tensor)``) tells torch the sender (``work._source_rank()``).
Sends and receives in flight move without anyone waiting on them (a
progress thread), and a recv, or a send no rank receives, fails after the
group's timeout (init_process_group's or new_group's timeout=).
"""

import torch

from mpitrain.api import point_to_point
from mpitrain.torch.distributed.work import MpitrainWork, set_later


class MessageWork(MpitrainWork):
    """A send or recv in flight; a recv's Work knows its sender once complete."""

    def __init__(self, future):
        super().__init__(future)
        self.source = None

    def _source_rank(self):
        self.wait()
        return self.source


def _host_bytes(tensor):
    """A contiguous host copy (or the tensor itself, where it is one) and its bytes."""
    host = tensor.detach()
    if host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu", memory_format=torch.contiguous_format, copy=True)
    return host, host.reshape(-1).view(torch.uint8).numpy()


def _described(tensor):
    return f"{tensor.dtype} of shape {tuple(tensor.shape)}"


def _timeout(group):
    """init_process_group's or new_group's timeout=, else the store's."""
    return (group.timeout or group.store.timeout).total_seconds()


def send(group, tensors, dst, tag):
    tensor, = tensors
    _, payload = _host_bytes(tensor)
    future = torch.futures.Future()

    def done(error, source):
        set_later(future, lambda: _result(lambda: [tensor], error))
    point_to_point.send(payload, _described(tensor), dst, tag, group.process_set,
                        _timeout(group), done, f"dist.send to rank {dst} with tag {tag}")
    return MessageWork(future)


def recv(group, tensors, src, tag):
    tensor, = tensors
    call = (f"dist.recv from rank {src}" if src is not None else
            "dist.recv from any rank") + f" with tag {tag}"
    host, payload = _host_bytes(tensor)
    future = torch.futures.Future()
    work = MessageWork(future)

    def received():
        if host is not tensor:        # on a pool thread: a CUDA copy may take a while
            tensor.copy_(host)
        return [tensor]

    def done(error, source):
        work.source = source
        set_later(future, lambda: _result(received, error))
    point_to_point.receive(payload, _described(tensor), src, tag, group.process_set,
                           _timeout(group), done, call)
    return work


def _result(value, error):
    if error is not None:
        raise error
    return value()
