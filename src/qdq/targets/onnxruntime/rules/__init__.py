"""The ``"onnxruntime"`` target's own placement rules, one module each (the shared ones are in
:mod:`qdq.targets.common`)."""
