"""``python -m tpupod`` is the ``tpupod`` command."""

from tpupod.entry import main

main()
