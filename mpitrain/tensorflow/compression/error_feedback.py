"""Error feedback on numpy arrays (see mpitrain/torch/compression/error_feedback.py)."""

import numpy as np

from mpitrain.api.compression import ErrorFeedbackSettings
from mpitrain.tensorflow.compression.gathered import GradientCompressor


class ErrorFeedback(ErrorFeedbackSettings, GradientCompressor):
    """Adds each gradient's residual from the last step, and keeps the new one."""

    wraps = GradientCompressor
    copy = staticmethod(np.array)

    def exchange(self, array, name, process_set):
        residual = self.residuals.get(name)
        corrected = array if residual is None else array + residual
        total, mine = self.compressor.exchange(corrected, name, process_set)
        self.residuals[name] = corrected - mine
        return total, mine
