"""The graphs placement rules and ONNX rewrite passes read and edit, one module per kind of graph.

* :mod:`qdq.graphs.fx`, :mod:`qdq.graphs.fx_ops`: a PyTorch model traced by ``torch.fx`` (``PlacementContext``)
  and the torch op vocabulary rules read on it;
* :mod:`qdq.graphs.keras`: a Keras model's layer graph and the per-layer Q/DQ plans (``KerasPlacement``);
* :mod:`qdq.graphs.onnx`: an exported ONNX graph (``GraphIndex``) and its Q/DQ tags.

They hold no knowledge of any target: the targets (:mod:`qdq.targets`) are written against them. Importing
this package imports none of the submodules.
"""
