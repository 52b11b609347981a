"""The Hugging Face files a checkpoint carries in its metadata: shared by ``ucp convert`` (which records
them from a ``save_pretrained`` folder) and ``ucp export --format hf`` (which writes them back).

A leaf: JSON and paths only, no torch, so the torch-free convert path stays so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# The files AutoTokenizer.from_pretrained reads, across tokenizer kinds (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# metadata keys (the inference runtime reads ``hf_config`` too: training/inference/config.py)
META_CONFIG = "hf_config"
META_GENERATION = "hf_generation_config"
META_TOKENIZER = "hf_tokenizer"


def source_files(folder: Path) -> dict[str, Any]:
    """The metadata recorded from a ``save_pretrained`` folder: its ``config.json`` and
    ``generation_config.json`` (as JSON objects) and where its tokenizer files are. A file that is not
    a JSON object is not recorded (a warning says so): the weights still convert, and the export's
    ``config`` option can supply the config."""
    meta: dict[str, Any] = {}
    if not folder.is_dir():
        return meta
    for name, key in ((CONFIG, META_CONFIG), (GENERATION_CONFIG, META_GENERATION)):
        path = folder / name
        if path.is_file():
            try:
                doc = json.loads(path.read_bytes())
            except (OSError, ValueError) as exc:
                log.warning("%s: not recorded, unreadable (%s)", path, exc)
                continue
            if isinstance(doc, dict):
                meta[key] = doc
            else:
                log.warning("%s: not recorded, not a JSON object", path)
    found = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if found:
        meta[META_TOKENIZER] = {"dir": str(folder.resolve()), "files": found}
    return meta
