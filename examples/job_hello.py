"""A code job, as seed 003 writes them: ``tpupod jobs submit --pod dev examples/job_hello.py``.

It runs on every worker of the pod at once, with ``logger`` and ``result`` given; the
worker's identity is in the environment (``tpupod.init_jax()`` would work here too).
"""

import tpupod

me = tpupod.worker()
logger.info(f"hello from worker {me.id} of {me.count}")  # noqa: F821 (given by the runner)
result = {"workers": me.count}
