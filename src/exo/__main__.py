"""`python -m exo`: the same entry point as the `exo` command."""

from exo.main import main

main()
