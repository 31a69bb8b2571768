"""Error feedback: what compression lost this step is added to the next step's gradient.

Seide et al. (1-bit SGD), Karimireddy et al. (EF-SGD): each rank keeps, per
parameter, the residual r = (g + r_before) - what its payload stood for, so
over the steps every part of every gradient is sent, only late. The
residuals are this rank's own; they are part of the optimizer's state_dict.
"""

from mpitrain.torch.compression.base import GradientCompressor


class ErrorFeedback(GradientCompressor):
    """Wraps a GradientCompressor, keeping a residual per parameter name."""

    def __init__(self, compressor):
        if not isinstance(compressor, GradientCompressor):
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

    def applies_to(self, p):
        return self.compressor.applies_to(p)

    def compress(self, tensor, name=None):
        return self.compressor.compress(tensor, name)

    def decompress(self, payload, context):
        return self.compressor.decompress(payload, context)

    def start(self, tensor, name, process_set):
        residual = self.residuals.get(name)
        corrected = tensor if residual is None else tensor + residual
        return ResidualExchange(self, self.compressor.start(corrected, name, process_set),
                                corrected, name)

    def state(self, name):
        state = dict(self.compressor.state(name))
        if name in self.residuals:
            state["residual"] = self.residuals[name]
        return state

    def load_state(self, name, state, own):
        # Another rank's residual is its own error, not this rank's: keep ours.
        if own and "residual" in state:
            self.residuals[name] = state["residual"].clone()
        self.compressor.load_state(name, state, own)

    def __repr__(self):
        return f"Compression.error_feedback({self.compressor!r})"


class ResidualExchange:
    """An exchange that keeps the residual once this rank's part is known."""

    __slots__ = ("_feedback", "_exchange", "_corrected", "_name", "mine")

    def __init__(self, feedback, exchange, corrected, name):
        self._feedback = feedback
        self._exchange = exchange
        self._corrected = corrected
        self._name = name
        self.mine = None

    def wait(self):
        total = self._exchange.wait()
        self.mine = self._exchange.mine
        # Before the caller writes the result into the gradient, which
        # ``corrected`` may be.
        self._feedback.residuals[self._name] = self._corrected - self.mine
        return total
