"""The ``ucp`` command line (typer). ``ucp.cli.main:app`` is the console script."""
