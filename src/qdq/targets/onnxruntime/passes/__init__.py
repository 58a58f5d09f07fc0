"""The passes of the ``"onnxruntime"`` ONNX rewrite, one module each, in the order
:func:`qdq.targets.onnxruntime.rewrite.rewrite_for_onnxruntime` runs them. Each takes the graph's
:class:`~qdq.graphs.onnx.GraphIndex`, edits it in place and returns how many edits it made."""
