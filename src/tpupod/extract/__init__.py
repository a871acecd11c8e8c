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

from tpupod.base.lazy import attributes

TYPE_CHECKING = False
if TYPE_CHECKING:
    from tpupod.extract.reader import Dataset, open

# Imported on first use: the command's light parts (convert-arc) need no numpy.
__getattr__, __dir__ = attributes(
    __name__, {"Dataset": "tpupod.extract.reader", "open": "tpupod.extract.reader"}
)
__all__ = ["Dataset", "open"]
