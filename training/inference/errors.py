"""Errors of offloaded inference: each names the file, tensor or layer at fault."""

from __future__ import annotations


class InferenceError(ValueError):
    """Base class: bad weights, config, budget or prompt for ``ucp infer``."""


class WeightSourceError(InferenceError):
    """A weight directory or checkpoint is missing a file, or a header lies about its tensors."""


class ModelConfigError(InferenceError):
    """config.json is missing or unreadable, or a tensor's shape disagrees with it."""


class BudgetError(InferenceError):
    """The memory budget cannot hold what streaming needs (the largest layer, at least)."""


class TokenizerError(InferenceError):
    """The checkpoint's tokenizer files cannot be read."""
