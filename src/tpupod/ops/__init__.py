"""Things done to every worker: copy files in and out, sync code, bootstrap, free the TPU.

Design notes: docs/decisions.md.
"""
