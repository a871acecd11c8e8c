"""Lockstep launch: who each worker is, rendezvous between them, and `tpupod run`."""
