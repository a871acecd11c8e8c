"""``python -m tpupod`` is the ``tpupod`` command."""

from tpupod.cli.entry import main

main()
