"""Runs that survive preemption: ``tpupod run --retries`` (issue 23).

``loop`` drives the attempts of one run; ``confirm`` tells a preemption (the
provider says so: the TPU's state, or a worker's metadata) from a host that is
only unreachable or an API call that failed (retried with backoff, never a
recreate); ``replace`` deletes and recreates a preempted TPU (same zone, then
the others) and reruns the pod's setup; ``record`` keeps the recovery's state in
the run directory, so ``tpupod run --resume RUN`` continues after the launcher
died; ``checkpoints`` finds the newest complete Orbax step.
"""
