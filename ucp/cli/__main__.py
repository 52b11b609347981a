"""``python -m ucp.cli`` runs the same app as the ``ucp`` console script."""

from .main import main

main()
