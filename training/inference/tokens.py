"""Prompts to token ids: the checkpoint's tokenizer.json when present, else ids written as numbers."""

from __future__ import annotations

import os
import re
from typing import Any

from training.inference.errors import TokenizerError
from training.inference.files import LOCAL, Files

TOKENIZER_NAME = "tokenizer.json"


class Tokenizer:
    """``tokenizers``' fast tokenizer of a weights directory, or none (prompts are ids: ``"1 2 3"``)."""

    def __init__(self, impl: Any | None, path: str | None) -> None:
        self.impl, self.path = impl, path

    @classmethod
    def for_weights(cls, root: str, files: Files = LOCAL) -> "Tokenizer":
        """The tokenizer.json beside the weights (local, or read through ``files`` from an object store)."""
        path = os.path.join(root, TOKENIZER_NAME)
        if not files.isfile(path):
            return cls(None, None)
        try:
            from tokenizers import Tokenizer as Fast
        except ImportError:
            raise TokenizerError(
                f"{path}: reading it needs the 'tokenizers' package (pip install tokenizers)"
            ) from None
        try:
            if files.remote:
                return cls(Fast.from_str(files.read(path).decode()), path)
            return cls(Fast.from_file(path), path)
        except Exception as exc:  # tokenizers raises its own Exception subclass on a bad file
            raise TokenizerError(f"{path}: unreadable tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        if self.impl is None:
            if not re.fullmatch(r"\s*\d+([\s,]+\d+)*\s*", text):
                raise TokenizerError(
                    f"prompt {text[:40]!r}: the weights have no {TOKENIZER_NAME}, so prompts are token ids "
                    "(integers separated by spaces or commas)"
                )
            return [int(t) for t in re.split(r"[\s,]+", text.strip())]
        return list(self.impl.encode(text).ids)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.impl is None else str(self.impl.decode(ids))
