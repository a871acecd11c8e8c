"""The pod model: what a pod is (``spec``: tpupod.yaml and up's flags; ``record``: Pod and
Worker, a pod that exists; ``accelerators``: Cloud TPU types), where it is recorded
(``state``: the state directory), how it comes and goes (``lifecycle``: up, down), who uses
it (``users``), and the small rules every command reads on its way in (``names``,
``selection``, ``choices``, ``identity``: the variables that tell a worker who it is).
"""
