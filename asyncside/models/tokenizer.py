"""Tokenizers: mlx-lm's for model directories, a byte-level one written as standard files for the
embedded model, and the older self-contained :class:`ByteTokenizer`.

All expose what generation and the server need: ``encode(str) -> list[int]``,
``decode(list[int]) -> str`` and ``eos_token_ids: set[int]``.

:func:`save_byte_level_tokenizer` writes a ``tokenizers``-library ``tokenizer.json`` (UTF-8 bytes
as ids 0..255, ``<|bos|>`` 256, ``<|endoftext|>`` 257: the same ids as :class:`ByteTokenizer`) and a
``tokenizer_config.json`` with a chat template (:data:`BYTE_CHAT_TEMPLATE`), so mlx-lm's own tools
(``mlx_lm.server``, ``mlx_lm.generate``) load the directory like any Hugging Face model.
"""

from __future__ import annotations

import json
import os
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


#: The embedded model's chat template. Plain chats render as ``<|role|>`` lines (one per message,
#: then the assistant header); tools are offered and tool calls rendered in the ``<tool_call>``
#: JSON format (mlx-lm's json_tools parser); ``enable_thinking`` opens a ``<think>`` block.
BYTE_CHAT_TEMPLATE = (
    # Hugging Face renders with trim_blocks: a newline right after a tag is written as {{ '\\n' }}.
    "{% if tools %}<|system|>\n"
    "You can call these tools. To call one, answer with <tool_call>\n"
    "{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>\n"
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|{{ message.role }}|>\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer and decoder use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def save_byte_level_tokenizer(directory: str | pathlib.Path, *, model_max_length: int = 4096,
                              chat_template: str = BYTE_CHAT_TEMPLATE) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` of a
    byte-level tokenizer with :class:`ByteTokenizer`'s ids into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    mapping = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={mapping[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = [ByteTokenizer.SPECIALS[ByteTokenizer.BOS], ByteTokenizer.SPECIALS[ByteTokenizer.EOS]]
    tok.add_special_tokens(names)
    if [tok.token_to_id(n) for n in names] != [ByteTokenizer.BOS, ByteTokenizer.EOS]:
        raise AssertionError("special tokens did not get the byte tokenizer's ids")
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    bos, eos = names
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    (d / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": eos}, indent=1) + "\n", encoding="utf-8")


def load_tokenizer(directory: str | os.PathLike[str], config: dict[str, Any] | None = None) -> Any | None:
    """The tokenizer of a model or store directory: ByteTokenizer if the directory says so, else
    mlx-lm's TokenizerWrapper; None when the directory holds no tokenizer files at all. A StoreError
    naming the directory where its tokenizer files cannot be loaded or hold no vocabulary."""
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

    from ..errors import StoreError

    for name in TOKENIZER_FILES:
        # A FIFO under a tokenizer file's name (or /dev/zero linked there) hung transformers' read
        # for ever; a directory failed in its words, naming no file.
        if (d / name).exists() and not (d / name).is_file():
            raise StoreError(d / name, "a tokenizer file that is not a regular file (a FIFO, device or directory)")
    eos = (config or {}).get("eos_token_id")
    if isinstance(eos, int):
        eos = [eos]
    import huggingface_hub.errors

    # A huggingface_hub from before strict dataclasses has no such error: its configs do not validate.
    strict: tuple[type[BaseException], ...] = tuple(
        c for c in (getattr(huggingface_hub.errors, "StrictDataclassError", None),) if isinstance(c, type))

    try:
        tok = mlx_load_tokenizer(d, eos_token_ids=eos)
    except strict as exc:
        # transformers reads config.json to pick the tokenizer class, and its config classes
        # validate fields mlx-lm takes (e.g. deepseek_v3's n_shared_experts: null).
        text = " ".join(str(exc).split())
        raise StoreError(d / "config.json", f"transformers' config class, read to load the tokenizer, refuses it: "
                                            f"{text}") from None
    except (ValueError, OSError, ImportError) as exc:
        # transformers' words (several lines) name neither the directory nor its files.
        text = " ".join(str(exc).split())
        raise StoreError(d, f"its tokenizer files cannot be loaded ({_files_note(d)}): {text}") from None
    # Tokenizer files without a vocabulary (a tokenizer_config.json alone) can load, and encode
    # every text to no tokens: generation would then fail at its first step, naming nothing.
    if not tok.encode("hello", add_special_tokens=False):
        raise StoreError(d, f"its tokenizer files hold no vocabulary (they encode 'hello' to no tokens; "
                         f"{_files_note(d)}); convert a model directory whose tokenizer files are complete")
    return tok


#: files that carry a tokenizer's vocabulary, beside which a tokenizer_config.json means something
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _files_note(directory: pathlib.Path) -> str:
    """Which tokenizer files ``directory`` has, and which vocabulary files it lacks."""
    has = [n for n in TOKENIZER_FILES if (directory / n).exists()]
    lacks = [n for n in VOCABULARY_FILES if not (directory / n).exists()]
    return f"it has {', '.join(has) or 'none'}" + (f"; it lacks {', '.join(lacks)}" if lacks else "")


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
    "chat_template.json", BYTE_TOKENIZER_FILE,
)
