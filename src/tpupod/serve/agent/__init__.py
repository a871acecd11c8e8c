"""A worker's side of the fleet: ``ctl`` (what the launcher runs there through the
transport), the agent that keeps the model servers running (``server``, their
``supervisor``) and ``respawn``, the parent that restarts a detached service.
"""
