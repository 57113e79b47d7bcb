"""`python -m exo`: the same entry point as the `exo` command."""

from exo.cli import main

main()
