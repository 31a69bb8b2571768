"""Gradient buckets: small parameters' gradients as views of one flat tensor.

The engine reduces a gradient of ``engine_sizes.ALONE_BYTES`` or more in its
own memory, but packs smaller ones into a fusion buffer and unpacks them
afterwards, and each one costs a request. A bucket (DDP's
``gradient_as_bucket_view``) keeps the gradients of many small parameters in
one persistent 1-D tensor: ``p.grad`` is a view of it shaped and laid out
like ``p``, so autograd accumulates into the bucket in place and the whole
bucket travels as one in-place allreduce, with nothing to pack or unpack.
"""

import torch

from mpitrain.api import engine_sizes

# The most bytes in one bucket where the engine's fusion threshold is 0.
DEFAULT_CAP = 64 * 1024 * 1024


def small(p):
    """Is p's gradient small enough for a bucket (the engine would fuse it)?"""
    return p.numel() * p.element_size() < engine_sizes.ALONE_BYTES


def plan(parameters, names, cap):
    """Buckets as lists of names: ``parameters`` (in the optimizer's order)
    taken in reverse, the order backward produces their gradients, each
    bucket of one dtype and device and at most ``cap`` bytes (one parameter
    at least)."""
    buckets, open_buckets = [], {}
    for p in reversed(parameters):
        nbytes = p.numel() * p.element_size()
        key = (p.dtype, p.device)
        current = open_buckets.get(key)
        if current is None or current[1] + nbytes > cap:
            current = open_buckets[key] = [[], 0]
            buckets.append(current[0])
        current[0].append(names[p])
        current[1] += nbytes
    return buckets


class Bucket:
    """The flat gradient of some parameters, and each one's view of it."""

    __slots__ = ("name", "params", "flat", "_views")

    def __init__(self, index, names, params):
        dtype, device = params[0].dtype, params[0].device
        for name, p in zip(names, params):
            if p.dtype != dtype or p.device != device:
                raise ValueError(
                    f"'{name}' is {p.dtype} on {p.device} here but rank 0 put it in "
                    f"a bucket of {dtype} on {device} with '{names[0]}'; every rank "
                    "must build the same model")
        members = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        count = "1 parameter" if len(names) == 1 else f"{len(names)} parameters"
        self.name = f"DistributedOptimizer.bucket.{index} ({members}, {count})"
        self.params = tuple(params)
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype,
                                device=device)
        self._views, start = {}, 0
        for p in params:
            # In p's own layout where it is dense (channels_last stays so), as
            # DDP's bucket views: autograd then accumulates into it without a
            # strided pass, and p.grad keeps the layout it had without buckets.
            layout = torch.empty_like(p, device="meta").stride()
            self._views[p] = self.flat.as_strided(p.shape, layout, start)
            start += p.numel()

    def __len__(self):
        return len(self.params)

    def take(self, p):
        """Make ``p.grad`` its view, copying in what autograd or the user put
        there instead (zeros for None)."""
        view, grad = self._views[p], p.grad
        if grad is view:
            return
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.to_dense() if grad.is_sparse else grad)
        p.grad = view

    def gather(self):
        """The flat gradient, every member's ``p.grad`` taken in first."""
        for p in self.params:
            self.take(p)
        return self.flat

    def point(self):
        """Make every member's ``p.grad`` its view again, copying nothing: a
        tensor the user put there while the bucket travelled is dropped, as
        the result would have overwritten it."""
        for p, view in self._views.items():
            if p.grad is not view:
                p.grad = view


def form(plan_names, by_name, rank):
    """This rank's buckets following rank 0's plan (lists of names)."""
    missing = [name for names in plan_names for name in names if name not in by_name]
    if missing:
        raise ValueError(
            f"rank {rank} has no parameter outside groups named "
            f"{', '.join(sorted(missing))}, which rank 0 puts in a gradient bucket; "
            "every rank must build the same model and groups")
    return [Bucket(index, names, [by_name[name] for name in names])
            for index, names in enumerate(plan_names)]
