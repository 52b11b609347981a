"""Loading: whole state dicts, partial (``into=``) reads, end-to-end verification."""
