"""``python -m tpupod`` is the ``tpupod`` command."""

from tpupod.cli import main

main()
