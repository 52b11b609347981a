"""Peer harnesses: drive other checkpointing systems (DeepSpeed, ...) to produce real files."""
