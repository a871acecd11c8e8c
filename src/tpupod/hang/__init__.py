"""Hung runs (issue 40): where every worker's program is, its progress, and a watchdog.

- ``stacks.py``: every worker's Python stacks at once (py-spy, run on the workers by the
  fan-out), for ``tpupod stacks`` and the watchdog;
- ``digest.py``: those stacks grouped by identical stack, the odd ones first, and saved;
- ``heartbeat.py``: ``tpupod.heartbeat(step)``, a program's progress as a marker line;
- ``progress.py``: the launcher's view of each worker's progress, the hang and straggler
  rules, and ``progress.json`` in the run's folder.
"""
