"""Error feedback: what compression lost this step is added to the next step's gradient.

Seide et al. (1-bit SGD), Karimireddy et al. (EF-SGD): each rank keeps, per
parameter, the residual r = (g + r_before) - what its payload stood for, so
over the steps every part of every gradient is sent, only late. The
residuals are this rank's own; they are part of the optimizer's state_dict.
"""

from mpitrain.api.compression import ErrorFeedbackSettings
from mpitrain.torch.compression.base import GradientCompressor


class ErrorFeedback(ErrorFeedbackSettings, GradientCompressor):
    """Wraps a GradientCompressor, keeping a residual per parameter name."""

    wraps = GradientCompressor

    @staticmethod
    def copy(tensor):
        return tensor.clone()

    def start(self, tensor, name, process_set):
        residual = self.residuals.get(name)
        # A residual loaded from a checkpoint may lie on another device than the
        # gradient (torch.load(map_location="cpu")).
        corrected = tensor if residual is None else tensor + residual.to(tensor.device)
        return ResidualExchange(self, self.compressor.start(corrected, name, process_set),
                                corrected, name)


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
