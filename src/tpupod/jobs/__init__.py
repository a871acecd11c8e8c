"""The job service: a SQL job store (SQLite or PostgreSQL), runners that lease jobs and
gang-run them on a pod through ``tpupod run``, and an HTTP API (``tpupod jobs``).

Design notes: docs/jobs.md."""
