"""send and recv of the "mpitrain" backend, through the group's store.

mpitrain's engine moves collectives only; a tensor sent to one rank travels
through the torch store the group was made with (the job's TCPStore), under a
key of the sender, the receiver, the tag and the message's number among
theirs. That suits the small, rare messages torch's tools send so (a
pipeline's activations belong on a collective or on another backend).
A recv waits as long as the store's timeout (init_process_group's timeout=).

A recv waits by asking the store now and then whether its key is there, not
with a blocking ``store.get``: a store client answers one request at a time,
so a get that waits would hold back every later send of this process, and
``dist.batch_isend_irecv([recv_from_left, send_to_right])`` (torch's own
example) hung on every rank.
"""

import threading
import time

import torch

from mpitrain.torch.distributed.work import MpitrainWork, completed_work


def _bytes(tensor):
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


class Channels:
    """The numbers of one group's messages, per (peer, tag) and direction."""

    def __init__(self):
        self._sent = {}
        self._received = {}
        self._lock = threading.Lock()

    def _key(self, counts, sender, receiver, tag):
        with self._lock:
            number = counts.get((sender, receiver, tag), 0)
            counts[(sender, receiver, tag)] = number + 1
        return f"p2p/{sender}->{receiver}/{tag}/{number}"

    def send(self, group, tensors, dst, tag):
        tensor, = tensors
        data = _bytes(tensor)
        key = self._key(self._sent, group.rank(), dst, tag)
        group.store.set(key, f"{tensor.dtype}|{tuple(tensor.shape)}|".encode() + data)
        return completed_work([tensor])

    def recv(self, group, tensors, src, tag):
        tensor, = tensors
        key = self._key(self._received, src, group.rank(), tag)
        future = torch.futures.Future()

        def receive():
            try:
                _wait_for(group.store, key, f"dist.recv from rank {src} with tag {tag}")
                message = group.store.get(key)
                group.store.delete_key(key)
                dtype, shape, data = message.split(b"|", 2)
                mine = f"{tensor.dtype}|{tuple(tensor.shape)}".encode()
                if dtype + b"|" + shape != mine:
                    raise ValueError(
                        f"dist.recv from rank {src} with tag {tag}: it sent "
                        f"{dtype.decode()} of shape {shape.decode()}, this rank "
                        f"receives into {tensor.dtype} of shape {tuple(tensor.shape)}")
                received = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                tensor.copy_(received.view(tensor.dtype).view(tensor.shape))
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result([tensor])
        threading.Thread(target=receive, daemon=True).start()
        return MpitrainWork(future)


def _wait_for(store, key, call):
    """Returns once ``key`` is in ``store``; raises after the store's timeout."""
    deadline = time.monotonic() + store.timeout.total_seconds()
    pause = 1e-4
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{call}: nothing arrived within the store's timeout "
                               f"of {store.timeout}")
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
