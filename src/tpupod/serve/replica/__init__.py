"""A model too big for one host served by several in lockstep: one member process per
host (``member``), the leader's step broadcast (``lockstep``) and the engine whose
every device call the followers mirror (``stepped``).
"""
