"""The ``tpupod`` command line, the only part that prints for a person and reads argv: the
console script (``entry``: the fast paths, else the typer app), the typer app (``app``), a
module per command group, options (``options``, ``args``), and the commands' flows
(``flow/``). Nothing outside ``cli/`` imports it.
"""
