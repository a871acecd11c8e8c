"""What ``tpupod serve`` and ``tpupod fanout`` do from the launcher: one blocking call per
command (``control``), the work on the workers through the fan-out (``remote``), the
fleet's record (``record``), ``serve status`` as typed records (``status``) and the
fan-out client (``broadcast``).
"""
