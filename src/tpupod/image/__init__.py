"""Containers on every worker: the engine, images built once and loaded everywhere, and
commands run in a container per worker (``tpupod image``, ``run --image``, ``exec --image``).

Design notes: docs/containers.md."""
