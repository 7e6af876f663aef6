"""``python -m tokenbus.cli``: the same as the ``tokenbus`` command."""

from tokenbus.cli import main

main()
