"""Distributed activation extraction: ``tpupod extract`` and its reader.

    >>> import tpupod.extract
    >>> ds = tpupod.extract.open("/tmp/acts")          # or gs://bucket/prefix
    >>> ds.activations(ds.ids[0], 16).shape              # (tokens, d_model)

Modules: ``data`` (JSONL samples), ``arc`` (ARC tasks to prompts), ``plan``
(shards by hash of id), ``shards`` (the file format), ``store`` (local or
fsspec, the write queue), ``runner`` (one host's part), ``launcher`` (a run on
a pod), ``progress``, ``reader`` (``open``).

Design notes: docs/extract.md.
"""

from tpupod.extract.reader import Dataset, open

__all__ = ["Dataset", "open"]
