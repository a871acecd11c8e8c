"""The ``builtin`` backend, tpupod's own OpenAI-compatible server: the process and its
roles (``__main__``, ``server``, ``split``: keeper, engine, front end), continuous
batching (``engine``), the front end's HTTP face (``openai_api``) and text side
(``text``), and what front end and engine say to each other (``events``, ``link``).
"""
