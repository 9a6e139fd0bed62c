"""Tokenizers: a self-contained byte-level one (embedded model) and mlx-lm's for real model dirs.

Both expose what generation and the server need: ``encode(str) -> list[int]``,
``decode(list[int]) -> str`` and ``eos_token_ids: set[int]``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

#: file written into a model/store directory that uses :class:`ByteTokenizer`
BYTE_TOKENIZER_FILE = "asyncside_tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then special tokens (``<|bos|>`` 256, ``<|endoftext|>`` 257).

    Tokens >= 258 (unused rows of a larger vocabulary) decode to nothing.
    """

    BOS = 256
    EOS = 257
    SPECIALS = {256: "<|bos|>", 257: "<|endoftext|>"}

    def __init__(self, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids: set[int] = {self.EOS}
        self.bos_token_id = self.BOS

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int] | Any) -> str:
        data = bytes(int(t) for t in ids if 0 <= int(t) < 256)
        return data.decode("utf-8", errors="replace")

    def to_json(self) -> dict[str, Any]:
        return {"type": "bytes", "vocab_size": self.vocab_size, "bos": self.BOS, "eos": self.EOS}

    def save(self, directory: str | pathlib.Path) -> None:
        path = pathlib.Path(directory) / BYTE_TOKENIZER_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")


def load_tokenizer(directory: str | pathlib.Path, config: dict[str, Any] | None = None) -> Any | None:
    """The tokenizer of a model or store directory: ByteTokenizer if the directory says so, else
    mlx-lm's TokenizerWrapper; None when the directory holds no tokenizer files at all."""
    d = pathlib.Path(directory)
    byte_file = d / BYTE_TOKENIZER_FILE
    if byte_file.exists():
        spec = json.loads(byte_file.read_text(encoding="utf-8"))
        if spec.get("type") != "bytes":
            raise ValueError(f"{byte_file}: unknown tokenizer type {spec.get('type')!r}; expected 'bytes'")
        return ByteTokenizer(int(spec.get("vocab_size", 258)))
    if not any((d / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    eos = (config or {}).get("eos_token_id")
    if isinstance(eos, int):
        eos = [eos]
    return mlx_load_tokenizer(d, eos_token_ids=eos)


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
    "chat_template.json", BYTE_TOKENIZER_FILE,
)
