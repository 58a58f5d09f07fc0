"""``tune``: an accuracy budget met at the lowest measured latency, by choosing which tensors stay float.

The search runs on an FP32 ONNX file (the ONNX front end). A PyTorch model is exported to one for the target first
(:func:`qdq.export.export_float_onnx`: its FP32 graph, which the two-doors test shows is placed the same way as the
model itself); a float Keras model by :func:`qdq.keras.export_float_onnx`. Its unit of choice is one activation
quantizer of the target's placement: the tensors that share one range, which the runtime's int8 kernels read and
write. Leaving such a unit float drops its Q/DQ pair and keeps every op that read it quantized in float, so the
runtime loses exactly the fused kernels that depended on it (:meth:`qdq.graphs.view.GraphView.keep_value_float`).
Every file is scored and timed on one runtime the target supports (ONNX Runtime, OpenVINO, TensorRT, or one
registered), through its backend, so both the accuracy and the latency are what that runtime computes; the FP32
reference is the float file on ONNX Runtime (its backend too).

1. Calibrate once (full INT8 with the chosen method); every later file reuses those ranges (no recalibration).
2. The sensitivity pass: for each unit (or the ``max_candidates`` noisiest: lowest SQNR of their tensors against
   their fake-quantized values), the file with that unit alone left float, scored by its output SQNR against FP32
   on the first tuning batch: a continuous score (a task metric such as F1 moves in steps of one detection).
3. Greedy: try the units of the largest gain one by one, keeping a unit only when the budget's own score improves,
   until the budget holds on the tuning data and on the held-out data. A score that moves in coarse steps (F1 over
   a few images) can leave every single step without a gain; then the leading units of the ranking (every unit:
   those that gained first, then the others by their proxy, so its end is the FP32 computation) go float together,
   2, 4, 8, ... of them until the budget holds, and a bisection between the last count that missed and the first
   that met finds the fewest. Last, drop again the units the budget does not need: the least useful half first,
   then quarters, down to single units.
4. Precision variants (where the runtime has the kernels): the configuration that met with the fewest units, its
   float MatMuls on constant weights run as ONNX Runtime's ``MatMulNBits`` (8-bit, then 4-bit block weights; int8
   activations per block at run time).
5. Time FP32, full INT8 and every configuration tried in interleaved rounds on the runtime; time FP32, INT8, the
   three fastest that meet the budget and the one that meets it with the fewest float units again in fresh rounds
   (the minimum of many noisy timings is biased low), and return the fastest of that confirmation, or one with
   fewer float units that is as fast within the timing's spread.

The package, one module per concern:

* :mod:`.budget`: :class:`Budget` (a score, its threshold, the proxy that ranks the units);
* :mod:`.result`: :class:`Trial`, :class:`TuneResult`, the report and the Pareto plot;
* :mod:`.sources`: the FP32 file (a PyTorch or Keras model exported for the target), the feeds, the splits;
* :mod:`.engine`: the target and the runtime its registered runtimes allow, asked through its backend;
* :mod:`.evaluation`: the state of one search on a :class:`~qdq.onnx_in.prepared.PreparedModel` (loaded and prepared
  once, placed again for every file), the one calibration, the files and their scores;
* :mod:`.search`: steps 2-4 above; :mod:`.timing`: step 5 and the choice; :mod:`.api`: :func:`tune`.

Importing this package imports nothing; names resolve on first use.
"""

from __future__ import annotations

from qdq.lazy import lazy_names

__all__ = ["Budget", "Trial", "TuneResult", "tune"]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "Budget": "qdq.tuning.budget",
        "Trial": "qdq.tuning.result",
        "TuneResult": "qdq.tuning.result",
        "tune": "qdq.tuning.api",
    },
)
