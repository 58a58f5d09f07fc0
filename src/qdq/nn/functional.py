"""Functional forms of qdq's autograd operations (seed path: ``quant_nn.functional``)."""

from qdq.clip import ClipFunction, clip

__all__ = ["ClipFunction", "clip"]
