"""`python -m kiln` runs the CLI (used to start background servers)."""

from kiln.cli.main import main

main()
