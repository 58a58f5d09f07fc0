"""Small tensor utilities of the seed toolkit (``pytorch_quantization.utils``)."""

from qdq.utils.reduce_amax import reduce_amax

__all__ = ["reduce_amax"]
