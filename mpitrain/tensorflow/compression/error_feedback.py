"""Error feedback on numpy arrays (see mpitrain/torch/compression/error_feedback.py)."""

from mpitrain.tensorflow.compression.gathered import GradientCompressor


class ErrorFeedback(GradientCompressor):
    """Adds each gradient's residual from the last step, and keeps the new one."""

    def __init__(self, compressor):
        if not isinstance(compressor, GradientCompressor):
            raise TypeError("error feedback wraps a GradientCompressor (such as "
                            f"Compression.topk(0.01)), got {compressor!r}")
        self.compressor = compressor
        self.residuals = {}

    @property
    def min_elements(self):
        return self.compressor.min_elements

    @property
    def bytes_sent(self):
        return self.compressor.bytes_sent

    def applies_to(self, shape):
        return self.compressor.applies_to(shape)

    def compress(self, array, name=None):
        return self.compressor.compress(array, name)

    def decompress(self, payload, context):
        return self.compressor.decompress(payload, context)

    def exchange(self, array, name, process_set):
        residual = self.residuals.get(name)
        corrected = array if residual is None else array + residual
        total, mine = self.compressor.exchange(corrected, name, process_set)
        self.residuals[name] = corrected - mine
        return total, mine
