"""Conversions: reshape to another layout, importers of foreign checkpoints, exporters.

The functions users call are ``ucp.reshape``, ``ucp.convert`` and ``ucp.export`` (:mod:`ucp.conversion.api`,
the command line's options); this package holds what they run. Importing it stays light (no torch).
"""
