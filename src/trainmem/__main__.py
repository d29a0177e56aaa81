"""``python -m trainmem`` runs the CLI."""

from trainmem.cli import main

main()
