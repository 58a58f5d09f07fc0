"""Optimizer helpers of the seed toolkit (``pytorch_quantization.optim.helper``)."""

from qdq.optim.helper import freeze_parameters, group_parameters, match_parameters, quant_weight_inplace

__all__ = ["freeze_parameters", "group_parameters", "match_parameters", "quant_weight_inplace"]
