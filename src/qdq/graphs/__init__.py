"""The graphs placement rules and ONNX rewrite passes read and edit, one module per kind of graph.

* :mod:`qdq.graphs.view`, :mod:`qdq.graphs.ops`: the placement language: a front-end-neutral view of a model's
  graph (ops in the ONNX vocabulary, values, sites, quantizers) and the decisions rules make on it;
* :mod:`qdq.graphs.fx_view`, :mod:`qdq.graphs.fx_edit`, :mod:`qdq.graphs.fx_ops`: the PyTorch front end: a model
  traced by ``torch.fx`` as a view, the decisions made into quantizer modules, the torch spelling of each op;
* :mod:`qdq.graphs.keras`: the Keras front end's view of a layer graph and the per-layer Q/DQ plans;
* :mod:`qdq.graphs.onnx`, :mod:`qdq.graphs.ir_graph`, :mod:`qdq.graphs.onnx_tags`: ONNX graphs: the round trip
  to onnx_ir every edit goes through, the questions passes ask of an onnx_ir graph, the Q/DQ tags.

They hold no knowledge of any target: the targets' rules (:mod:`qdq.targets`) are written against the view. Importing
this package imports none of the submodules.
"""
