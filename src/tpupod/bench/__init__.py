"""``tpupod bench checkpoint``: Orbax's checkpoint benchmarks on every worker of a pod.

config.py         the YAML (Orbax's harness format) -> a checked BenchConfig and its sweep
orbax_harness.py  the one module that imports Orbax's private benchmark harness
verify.py         restored arrays against the saved ones: values and sharding
worker.py         what runs on every worker (``python -m tpupod.bench.worker``)
results.py        typed samples and results, across hosts and repeats; two runs' noise band
wire.py           worker 0's results as output lines, and back
baseline.py       an earlier results file (or the latest of the suite), each metric's verdict
plots.py          one PNG per benchmark (matplotlib)
launcher.py       the launcher's side: the plan, ``tpupod run``, the results on disk
(results are written through tpupod.base.storage: a local folder, or gs:// through fsspec)

Design notes: docs/checkpoint-bench.md.
"""
