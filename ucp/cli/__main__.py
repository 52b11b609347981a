"""``python -m ucp.cli`` runs the same app as the ``ucp`` console script."""

from ucp.cli.main import main

main()
