"""From generated token ids to the text a client sees: text deltas, stop sequences, tool calls.

:class:`TextAssembler` turns the token stream into text deltas: it holds back an incomplete UTF-8
sequence and any tail that could be the start of a stop sequence, and stops at the model's EOS
tokens. :class:`ToolCallSplitter` then takes the text between the tokenizer's tool-call markers
(``<tool_call>`` ... ``</tool_call>`` for the json_tools format) out of the content, and
:func:`parse_tool_calls` turns each call into OpenAI's ``tool_calls`` entries with the
tokenizer's own parser (``mlx_lm.tool_parsers``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("asyncside.serving")


class TextAssembler:
    """Accumulates token ids and releases text that is final.

    ``push(id)`` returns the text that may be sent now. After a stop sequence or an EOS token,
    ``finished`` is True and ``finish_reason`` is ``"stop"``; the stop sequence itself is never
    sent (as OpenAI does). ``flush()`` returns what was held back when generation ended by length.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), eos_token_ids: set[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.eos = set(eos_token_ids if eos_token_ids is not None else getattr(tokenizer, "eos_token_ids", ()) or ())
        self.ids: list[int] = []
        self.completion_tokens = 0
        self.sent = 0          # characters of the decoded text already released
        self.text = ""         # everything released so far
        self.finished = False
        self.finish_reason: str | None = None

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if k > best and text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, token_id: int) -> str:
        if self.finished:
            return ""
        self.completion_tokens += 1
        if token_id in self.eos:
            self.finished, self.finish_reason = True, "stop"
            return self._release(self._decoded(final=True), final=True)
        self.ids.append(token_id)
        return self._release(self._decoded(final=False), final=False)

    def decoded_length(self) -> int:
        """Characters the tokens pushed so far decode to, an incomplete last character left out:
        where the next token's text starts in the answer (completions' logprobs ``text_offset``)."""
        return len(self._decoded(final=False))

    def flush(self, finish_reason: str = "length") -> str:
        """Release everything held back; called when the model stops yielding."""
        if self.finished:
            return ""
        self.finished, self.finish_reason = True, finish_reason
        return self._release(self._decoded(final=True), final=True)

    def _decoded(self, *, final: bool) -> str:
        text = self.tokenizer.decode(self.ids) if self.ids else ""
        if not final:
            # An incomplete multi-byte character decodes to U+FFFD until its last byte arrives.
            text = text.rstrip("\ufffd")
        return text

    def _release(self, text: str, *, final: bool) -> str:
        if self.stop:
            start = max(0, self.sent - max(len(s) for s in self.stop))
            hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                cut = min(i for i, _ in hits)
                self.finished, self.finish_reason = True, "stop"
                return self._advance(text[:cut])
        if not final:
            text = text[: len(text) - self._held_tail(text)]
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if len(text) <= self.sent:
            return ""
        delta = text[self.sent :]
        self.sent = len(text)
        self.text += delta
        return delta


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token adds to the generated text: OpenAI's logprobs ``bytes``, which a client
    joins across tokens to rebuild a character split between them. A byte-level BPE token or a
    SentencePiece byte token (``<0xE2>``) is its own bytes, part of a character or not; its decoded
    text would be U+FFFD there. Other tokens are their decoded text."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

    kind = type(getattr(tokenizer, "_detokenizer", None))
    piece = None
    if kind in (BPEStreamingDetokenizer, SPMStreamingDetokenizer):
        try:
            piece = tokenizer.convert_ids_to_tokens(int(token_id))
        except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError):
            piece = None
    if isinstance(piece, str) and piece:
        if kind is SPMStreamingDetokenizer:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
        else:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
    return str(tokenizer.decode([token_id])).encode("utf-8")


class ToolCallSplitter:
    """Splits released text into content and tool-call bodies delimited by ``start`` / ``end``.

    ``push(text)`` returns the content that may be sent now (a possible partial start marker is
    held back) and appends every tool-call body that closed to ``calls``; ``flush()`` releases
    the rest at the end (an unterminated call counts as a call, as mlx-lm's server does).
    """

    def __init__(self, start: str, end: str) -> None:
        if not start or not end:
            raise ValueError("tool-call markers must be non-empty")
        self.start = start
        self.end = end
        self.calls: list[str] = []
        self._buf = ""
        self._inside = False

    def push(self, text: str) -> str:
        self._buf += text
        out: list[str] = []
        while True:
            if self._inside:
                i = self._buf.find(self.end)
                if i < 0:
                    return "".join(out)
                self.calls.append(self._buf[:i])
                self._buf = self._buf[i + len(self.end):]
                self._inside = False
                continue
            i = self._buf.find(self.start)
            if i >= 0:
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(self.start):]
                self._inside = True
                continue
            keep = 0
            for k in range(min(len(self.start) - 1, len(self._buf)), 0, -1):
                if self._buf.endswith(self.start[:k]):
                    keep = k
                    break
            out.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return "".join(out)

    def flush(self) -> str:
        rest, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            if rest.strip():
                self.calls.append(rest)
            return ""
        return rest


def parse_tool_calls(bodies: Sequence[str], parser: Callable[[str, Any], Any], tools: Sequence[dict[str, Any]] | None,
                     *, first_index: int = 0, streaming: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """OpenAI ``tool_calls`` entries of the tool-call ``bodies`` (the tokenizer's ``parser``), and the
    bodies that did not parse (returned so the caller can keep them as content instead of losing them)."""
    calls: list[dict[str, Any]] = []
    failed: list[str] = []
    for body in bodies:
        try:
            parsed = parser(body, list(tools) if tools else None)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.info("tool call did not parse (%s: %s); kept as content", type(exc).__name__, exc)
            failed.append(body)
            continue
        for tc in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(tc, dict) or not isinstance(tc.get("name"), str):
                failed.append(body)
                break
            args = tc.get("arguments", {})
            entry: dict[str, Any] = {
                "id": str(tc.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                "type": "function",
                "function": {"name": tc["name"],
                             "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)},
            }
            if streaming:
                entry["index"] = first_index + len(calls)
            calls.append(entry)
    return calls, failed
