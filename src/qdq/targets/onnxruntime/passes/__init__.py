"""The passes of the ``"onnxruntime"`` ONNX rewrite, one module each, in the order
:func:`qdq.targets.onnxruntime.rewrite.rewrite_for_onnxruntime` runs them. Each takes an ``onnx_ir.Graph`` (the
model's main graph or an ``If`` branch), edits it in place with onnx_ir's methods and :mod:`qdq.graphs.ir_graph`,
and returns how many edits it made."""
