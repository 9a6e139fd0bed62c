"""The OpenAI-compatible request and response shapes the server speaks, as pure functions.

Parsing turns a decoded JSON body into a :class:`CompletionRequest`; any field that is missing,
of the wrong type, out of range or unsupported raises :class:`RequestError`, which the server
answers with a 4xx JSON body in OpenAI's error shape naming the field (``param``) and what was
expected. Nothing here does I/O or knows about the model.

Decoding is greedy: sampling knobs (``temperature``, ``top_p``, ``seed``, penalties) are
validated for type and range and then ignored, so clients that always send them keep working.
Features that would change the answer's shape (``n > 1``, ``logprobs``, ``echo``, ``tools``) are
refused with a 400 instead of being silently dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_SEQUENCES = 4


class RequestError(Exception):
    """A request the server refuses; rendered as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class CompletionRequest:
    """One parsed request of either endpoint; ``prompt_ids`` is filled in by the server."""

    kind: str                         # "completion" | "chat"
    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    prompt: str | None = None         # completions: text prompt
    prompt_ids: tuple[int, ...] | None = None  # completions: token prompt as given
    messages: tuple[ChatMessage, ...] = field(default_factory=tuple)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _expect_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean, got {_type_name(value)} {value!r}", param=key)
    return value


def _expect_number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {_type_name(value)} {value!r}", param=key)
    if not lo <= value <= hi:
        raise RequestError(f"'{key}' must be between {lo} and {hi}, got {value}", param=key)


def _expect_int(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {_type_name(value)} {value!r}", param=key)
    return value


def _max_tokens(body: Mapping[str, Any], keys: Sequence[str], default: int, limit: int) -> int:
    for key in keys:
        if body.get(key) is not None:
            value = _expect_int(body[key], key)
            if value < 1:
                raise RequestError(f"'{key}' must be at least 1, got {value}", param=key)
            if value > limit:
                raise RequestError(f"'{key}' is {value}; this server allows at most {limit}", param=key)
            return value
    return min(default, limit)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(f"'stop' must be a string or a list of strings, got {_type_name(value)}", param="stop")
    if len(value) > MAX_STOP_SEQUENCES:
        raise RequestError(f"'stop' has {len(value)} sequences; at most {MAX_STOP_SEQUENCES} are allowed", param="stop")
    if any(s == "" for s in value):
        raise RequestError("'stop' sequences must not be empty strings", param="stop")
    return tuple(value)


def _common(body: Mapping[str, Any], served_models: Sequence[str]) -> tuple[str, bool, bool, tuple[str, ...]]:
    model = body.get("model")
    if model is None:
        raise RequestError("'model' is required", param="model")
    if not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {_type_name(model)}", param="model")
    if model not in served_models:
        raise RequestError(
            f"model {model!r} does not exist; this server serves {list(served_models)}",
            status=404,
            param="model",
            code="model_not_found",
        )
    stream = _expect_bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(f"'stream_options' must be an object, got {_type_name(options)}", param="stream_options")
        if not stream:
            raise RequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        include_usage = _expect_bool(options, "include_usage", False)
    n = body.get("n")
    if n is not None and _expect_int(n, "n") != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", param="n")
    _expect_number(body, "temperature", 0.0, 2.0)
    _expect_number(body, "top_p", 0.0, 1.0)
    _expect_number(body, "presence_penalty", -2.0, 2.0)
    _expect_number(body, "frequency_penalty", -2.0, 2.0)
    if body.get("seed") is not None:
        _expect_int(body["seed"], "seed")
    return model, stream, include_usage, _stop(body)


def _check_body(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


def parse_completion(
    body: object, *, served_models: Sequence[str], default_max_tokens: int = 16, max_tokens_limit: int = 512
) -> CompletionRequest:
    """Validate a ``/v1/completions`` body."""
    body = _check_body(body)
    model, stream, include_usage, stop = _common(body, served_models)
    if body.get("echo"):
        raise RequestError("'echo' is not supported", param="echo")
    if body.get("logprobs") is not None:
        raise RequestError("'logprobs' is not supported", param="logprobs")
    if body.get("suffix") is not None:
        raise RequestError("'suffix' is not supported", param="suffix")
    best_of = body.get("best_of")
    if best_of is not None and _expect_int(best_of, "best_of") != 1:
        raise RequestError(f"'best_of' must be 1, got {best_of}", param="best_of")
    max_tokens = _max_tokens(body, ["max_tokens"], default_max_tokens, max_tokens_limit)

    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("'prompt' is required", param="prompt")
    # OpenAI accepts a string, a list of strings, a list of token ids, or a list of such lists;
    # one prompt per request here (n == 1), so a list must hold exactly one prompt.
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts; send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt == "":
            raise RequestError("'prompt' must not be empty", param="prompt")
        return CompletionRequest("completion", model, max_tokens, stream, include_usage, stop, prompt=prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError("'prompt' must not be empty", param="prompt")
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise RequestError(f"'prompt[{i}]' must be a non-negative token id, got {t!r}", param="prompt")
        return CompletionRequest("completion", model, max_tokens, stream, include_usage, stop, prompt_ids=tuple(prompt))
    raise RequestError(
        f"'prompt' must be a string, a list of token ids, or a one-element list of either; got {_type_name(prompt)}",
        param="prompt",
    )


_ROLES = ("system", "developer", "user", "assistant")


def _message_text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"'messages[{i}].content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                    "only text is supported",
                    param=f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(
        f"'messages[{i}].content' must be a string or a list of text parts, got {_type_name(content)}",
        param=f"messages[{i}].content",
    )


def parse_chat(
    body: object, *, served_models: Sequence[str], default_max_tokens: int = 256, max_tokens_limit: int = 512
) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` body."""
    body = _check_body(body)
    model, stream, include_usage, stop = _common(body, served_models)
    for key in ("tools", "functions", "response_format"):
        if body.get(key) is not None:
            raise RequestError(f"'{key}' is not supported", param=key)
    if body.get("logprobs"):
        raise RequestError("'logprobs' is not supported", param="logprobs")
    max_tokens = _max_tokens(body, ["max_completion_tokens", "max_tokens"], default_max_tokens, max_tokens_limit)
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"'messages[{i}]' must be an object, got {_type_name(m)}", param=f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(
                f"'messages[{i}].role' must be one of {list(_ROLES)}, got {role!r}", param=f"messages[{i}].role"
            )
        if "content" not in m:
            raise RequestError(f"'messages[{i}].content' is required", param=f"messages[{i}].content")
        parsed.append(ChatMessage(role, _message_text(m["content"], i)))
    return CompletionRequest("chat", model, max_tokens, stream, include_usage, stop, messages=tuple(parsed))


def simple_chat_template(messages: Sequence[ChatMessage]) -> str:
    """The chat format used when the tokenizer has no chat template of its own (the embedded model).

    One line of ``<|role|>`` then the content, per message, then the assistant header, so the
    model continues as the assistant.
    """
    out = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
    out.append("<|assistant|>\n")
    return "".join(out)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of a chat: the tokenizer's own template when it has one, else the simple one."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is not None and getattr(tokenizer, "chat_template", None):
        text = apply([{"role": m.role, "content": m.content} for m in messages],
                     add_generation_prompt=True, tokenize=False)
        try:  # the template already carries the special tokens (BOS): do not add them twice
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    return list(tokenizer.encode(simple_chat_template(messages)))


# --- responses ---------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    req: CompletionRequest, rid: str, created: int, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The body of a non-streaming answer."""
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk(
    req: CompletionRequest,
    rid: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    no_choices: bool = False,
) -> dict[str, Any]:
    """One server-sent-event payload of a streaming answer."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
        obj = "text_completion"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model}
    out["choices"] = [] if no_choices else choices
    if req.include_usage:
        out["usage"] = usage_
    return out


def now() -> int:
    return int(time.time())


Parser = Callable[..., CompletionRequest]
