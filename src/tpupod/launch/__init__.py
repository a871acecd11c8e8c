"""Lockstep launch: who each worker is, rendezvous between them, and `tpupod run`.

Design notes: docs/launch.md.
"""
