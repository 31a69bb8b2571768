"""What the torch and TensorFlow gradient compressors share, whatever the tensors.

The argument checks, the rule for which gradients a compressor chosen for
the whole model takes, the shape record that travels with an allgathered
payload, error feedback's and PowerSGD's bookkeeping and state, and the
``Compression`` factories. The tensor math lives in
mpitrain/torch/compression and mpitrain/tensorflow/compression. No torch
or tensorflow import here.
"""

import math

DEFAULT_MIN_ELEMENTS = 1024


def _is_whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_chunk_size(chunk_size):
    if not _is_whole(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a whole number >= 1, got {chunk_size!r}")


def padded_shape(shape, length=8):
    """A shape as ``length`` integers, the same count on every rank so that the
    gathered shapes slice apart by rank: -1 pads, and dimensions beyond the
    last slot are multiplied into it."""
    record = list(shape[:length - 1])
    if len(shape) >= length:
        record.append(math.prod(shape[length - 1:]))
    return record + [-1] * (length - len(record))


def check_gathered_shapes(records, name):
    """ValueError, on every rank (each holds every rank's ``padded_shape``
    record), if the gradient ``name`` differs in shape between ranks."""
    shapes = [tuple(int(d) for d in record if d >= 0) for record in records]
    if len(set(shapes)) > 1:
        raise ValueError(f"the gradient '{name}' differs in shape between ranks: "
                         + ", ".join(f"rank {rank}: {list(shape)}"
                                     for rank, shape in enumerate(shapes)))


def chosen_compressor(compressor, name, what, none, compressor_class):
    """What a per-tensor choice (a dict's value, a function's result) gave for
    ``name``: a compressor of ``compressor_class``, or None for uncompressed
    (None or the framework's ``none`` cast); anything else is a ValueError.
    what: "parameter" or "variable", as the framework calls the tensor."""
    if compressor is None or compressor is none:
        return None
    if not isinstance(compressor, compressor_class):
        raise ValueError(
            f"compression chose {compressor!r} for '{name}': a choice per "
            f"{what} is Compression.topk, .onebit, .int8, .int4, .powersgd "
            "(or another GradientCompressor) or None for uncompressed")
    return compressor


def saved_states(states, rank):
    """The compressors' state as checkpoints and broadcasts carry it:
    {"rank": rank, "parameters": {key: state}} of the non-empty ``states``
    (key -> state), or None where there are none."""
    parameters = {key: state for key, state in states.items() if state}
    return {"rank": rank, "parameters": parameters} if parameters else None


class CompressorSettings:
    """The framework-neutral half of a GradientCompressor: ``min_elements``,
    the bytes it sent, and no state of its own."""

    def __init__(self, min_elements=DEFAULT_MIN_ELEMENTS):
        if not _is_whole(min_elements) or min_elements < 0:
            raise ValueError(f"min_elements must be a whole number >= 0, got "
                             f"{min_elements!r}")
        self.min_elements = min_elements
        self.bytes_sent = 0         # by this rank, summed over every exchange

    def takes_shape(self, shape):
        """Is a gradient of ``shape`` compressed when this compressor is chosen
        for the whole model? Two or more dimensions and ``min_elements``."""
        shape = tuple(shape)
        return len(shape) >= 2 and math.prod(shape) >= max(1, self.min_elements)

    def state(self, name):
        """The arrays to keep in a checkpoint for ``name``."""
        return {}

    def load_state(self, name, state, own):
        """Take back ``state(name)``; ``own``: this rank saved it."""

    def __repr__(self):
        # The same on every rank (no address): ranks compare their choices by it.
        return f"{type(self).__qualname__}(min_elements={self.min_elements!r})"


class TopKSettings(CompressorSettings):
    """Top-k keeps a fraction (a float in (0, 1]) or a count (an int) of the entries."""

    def __init__(self, amount, min_elements=DEFAULT_MIN_ELEMENTS):
        super().__init__(min_elements)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                or not (0 < amount <= 1 if isinstance(amount, float) else amount >= 1):
            raise ValueError("topk takes a fraction in (0, 1] (a float) or a count >= 1 "
                             f"(an int), got {amount!r}")
        self.amount = amount

    def count(self, entries):
        """How many of ``entries`` entries travel."""
        if isinstance(self.amount, float):
            return max(1, min(entries, round(self.amount * entries)))
        return min(entries, self.amount)

    def __repr__(self):
        return f"Compression.topk({self.amount!r})"


class OneBitSettings(CompressorSettings):
    """1-bit: a scale per ``chunk_size`` entries (None: one per tensor)."""

    def __init__(self, chunk_size=512, min_elements=DEFAULT_MIN_ELEMENTS):
        super().__init__(min_elements)
        if chunk_size is not None:
            check_chunk_size(chunk_size)
        self.chunk_size = chunk_size

    def __repr__(self):
        return f"Compression.onebit(chunk_size={self.chunk_size!r})"


class QuantizeSettings(CompressorSettings):
    """Codes of ``bits`` (8 or 4) in -levels..levels, a scale per chunk."""

    def __init__(self, bits, chunk_size=512, min_elements=DEFAULT_MIN_ELEMENTS):
        super().__init__(min_elements)
        if bits not in (4, 8):
            raise ValueError(f"quantization takes bits=8 or bits=4, got {bits!r}")
        check_chunk_size(chunk_size)
        self.bits = bits
        self.levels = 2 ** (bits - 1) - 1
        self.chunk_size = chunk_size

    def __repr__(self):
        return f"Compression.int{self.bits}(chunk_size={self.chunk_size!r})"


class PowerSGDSettings(CompressorSettings):
    """PowerSGD's rank, the seed of the first Q, and the last summed Q per name
    (the same on every rank: a checkpoint restores it on every rank).
    Subclasses say how a saved array is copied (``copy``)."""

    def __init__(self, rank=4, min_elements=DEFAULT_MIN_ELEMENTS, seed=0):
        super().__init__(min_elements)
        if not _is_whole(rank) or rank < 1:
            raise ValueError(f"powersgd takes a rank >= 1, got {rank!r}")
        self.rank = rank
        self.seed = seed
        self.q = {}                 # name -> the last summed Q

    def state(self, name):
        return {} if name not in self.q else {"powersgd_q": self.q[name]}

    def load_state(self, name, state, own):
        if "powersgd_q" in state:
            self.q[name] = self.copy(state["powersgd_q"])

    def __repr__(self):
        return f"Compression.powersgd(rank={self.rank})"


class ErrorFeedbackSettings:
    """Error feedback's bookkeeping around a wrapped compressor: a residual per
    name, delegation, and the residuals' state. Subclasses name the class
    they wrap (``wraps``) and how a saved array is copied (``copy``)."""

    wraps = CompressorSettings

    def __init__(self, compressor):
        if not isinstance(compressor, self.wraps):
            raise TypeError("error feedback wraps a GradientCompressor (such as "
                            f"Compression.topk(0.01)), got {compressor!r}")
        self.compressor = compressor
        self.residuals = {}         # name -> residual, shaped like the gradient

    @property
    def min_elements(self):
        return self.compressor.min_elements

    @property
    def bytes_sent(self):
        return self.compressor.bytes_sent

    def applies_to(self, gradient):
        return self.compressor.applies_to(gradient)

    def compress(self, tensor, name=None):
        return self.compressor.compress(tensor, name)

    def decompress(self, payload, context):
        return self.compressor.decompress(payload, context)

    def state(self, name):
        state = dict(self.compressor.state(name))
        if name in self.residuals:
            state["residual"] = self.residuals[name]
        return state

    def load_state(self, name, state, own):
        # Another rank's residual is its own error, not this rank's: keep ours.
        if own and "residual" in state:
            self.residuals[name] = self.copy(state["residual"])
        self.compressor.load_state(name, state, own)

    def __repr__(self):
        return f"Compression.error_feedback({self.compressor!r})"


class CompressionFactories:
    """``Compression``: Horovod's casts and mpitrain's compressors, with error
    feedback unless ``error_feedback=False``. A framework subclasses it and
    names its classes: none, fp16, bf16, error_feedback, and the
    ``topk_class``, ``onebit_class``, ``quantize_class``, ``powersgd_class``."""

    @classmethod
    def _with_feedback(cls, compressor, error_feedback):
        return cls.error_feedback(compressor) if error_feedback else compressor

    @classmethod
    def topk(cls, amount, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """The largest entries: a fraction (0.01) or a count (1000) of each gradient."""
        return cls._with_feedback(cls.topk_class(amount, min_elements), error_feedback)

    @classmethod
    def onebit(cls, chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """Signs, with a mean magnitude per chunk (None: per tensor)."""
        return cls._with_feedback(cls.onebit_class(chunk_size, min_elements), error_feedback)

    @classmethod
    def int8(cls, chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """Codes in -127..127 with a scale per chunk."""
        return cls._with_feedback(cls.quantize_class(8, chunk_size, min_elements),
                                  error_feedback)

    @classmethod
    def int4(cls, chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """Codes in -7..7, two to a byte, with a scale per chunk."""
        return cls._with_feedback(cls.quantize_class(4, chunk_size, min_elements),
                                  error_feedback)

    @classmethod
    def powersgd(cls, rank=4, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """Two factors of ``rank`` columns, warm-started from the last step."""
        return cls._with_feedback(cls.powersgd_class(rank, min_elements), error_feedback)
