"""Conversions: reshape to another layout, importers of foreign checkpoints, exporters."""
