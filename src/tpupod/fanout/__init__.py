"""One command on many workers: the engine (``execute``: policies, interrupts,
supervision), one worker's command (``worker``), the per-worker results (``results``),
what a person sees of them (``report``: [wN] lines, the summary, errors; ``progress``:
workers' progress markers as a table), and exec on a local pod without an event loop
(``local``: the console script's fast path).
"""
