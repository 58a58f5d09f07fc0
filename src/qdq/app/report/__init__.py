"""The report of a quantization run: ``report.md``, ``report.html``, ``summary.json`` and PNG plots.

Build a :class:`ReportData` per model (or per configuration: W8A8, W4A8...) from what the library
(:mod:`qdq.workflow`) returned, then call :func:`write_report`::

    result = qdq.ptq(model, calib_loader, evaluate)
    data = ReportData(model="resnet-digits", dataset="digits", ptq=result,
                      histograms=collect_histograms(model, result))
    write_report("out", data)

Files written into ``out_dir`` (each atomically: a temporary file in the same folder, then ``os.replace``):

* ``accuracy.png``: a bar per configuration (``ReportData.accuracy``, or PTQ methods and QAT when that
  is empty), the float score as a dashed line;
* ``sensitivity.png``: per layer, horizontal bars "only this layer quantized" and "all but this one";
* ``latency.png``: median latency bars per runtime / batch / threads, one per variant (FP32, INT8...),
  the speed-up over FP32 written above each quantized bar;
* ``hist_<quantizer>.png``: the activation histogram (log counts) with a vertical line per method's amax;
* ``calibration_worst.png`` (with ``ReportData.calibration``, a :func:`qdq.calibration_report`): the quantizers
  whose range clips the most, each histogram with every method's amax and the range kept; the report's
  "Calibration diagnostics" section tables every quantizer (method, amax / max, what it clips, PASS/FAIL);
* ``report.md`` and ``report.html`` (HTML5; plots referenced by **relative path**, so keep the folder
  together; every text escaped);
* ``summary.json``: every number, stable keys (absent parts are ``null`` or empty), written last.

Parts with no data (no sensitivity, no latency, no histograms...) are left out of the report, not errors.
File names are made of ``[A-Za-z0-9._-]`` only (other characters become ``_``, clashes get a hash).

One job per module: :mod:`~.inputs` (what a report shows, normalised), :mod:`~.histograms` (reading
calibrators), :mod:`~.plots` (PNG), :mod:`~.document` (the page's content), :mod:`~.md_page` and
:mod:`~.html_page` (rendering it), :mod:`~.summary` (JSON), :mod:`~.filenames`, :mod:`~.writer`
(:func:`write_report`).
"""

from qdq.app.report.histograms import collect_histograms, read_histogram
from qdq.app.report.inputs import LayerHistogram, ReportData, latency_row
from qdq.app.report.writer import write_report

__all__ = ["LayerHistogram", "ReportData", "collect_histograms", "latency_row", "read_histogram", "write_report"]
