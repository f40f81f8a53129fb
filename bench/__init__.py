"""LayerLift's benchmarks, installed as ``layerlift.bench``.

* ``ttft`` (``layerlift bench ttft``): recompute vs barrier vs overlap, with
  ``stores`` (the shared stores per link), ``stats`` (the performance model)
  and ``report`` (table, Markdown, plot);
* ``store`` (``python -m layerlift.bench.store``): Mooncake ranged vs whole reads;
* ``pools`` (``python -m layerlift.bench.pools``): tri-pool admission;
* ``overhead`` (``python -m layerlift.bench.overhead``): per-layer scheduling cost.

Nothing in the engine imports from here.
"""
