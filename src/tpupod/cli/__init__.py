"""The ``tpupod`` command line, the only part that prints for a person and reads argv: the
console script (``entry``: the fast paths, else the typer app), the typer app (``app``), a
module per command group, options (``options``, ``args``), and the commands' flows
(``flow/``). Nothing outside ``cli/`` imports it.

Deferred imports: every module under ``cli/`` imports what a command runs inside that
command's function, for start-up time. ``tpupod --help`` imports every command module and
``entry`` each fast path's (``exec``, ``run``, ``jobs submit``); a command loads only what it
uses. Measured (BENCHMARKS.md, "Start-up"): ``tpupod exec -- true`` 0.054 s of CPU and
``tpupod --help`` 0.26 s, where importing everything the cli defers takes 1.29 s.
"""
