"""What a command does once its arguments are read, shared by its typer command and the
console script's fast path (so no typer here): exec (``exec``), run (``run``) and its
``--retries`` and ``--resume`` (``recover``), and running fan-outs with printed output and
signal handling (``live``).
"""
