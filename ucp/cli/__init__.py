"""The ``ucp`` command line (typer). ``ucp.cli.main:main`` is the console script."""
