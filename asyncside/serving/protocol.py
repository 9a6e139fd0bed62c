"""The OpenAI-compatible request and response shapes the server speaks, as pure functions.

Parsing turns a decoded JSON body into a :class:`CompletionRequest`; any field that is missing,
of the wrong type, out of range or unknown raises :class:`RequestError`, which the server answers
with a 4xx JSON body in OpenAI's error shape naming the field (``param``) and what was expected.
A field this server does not implement is refused by name, except the few in
:data:`IGNORED_KEYS` that change nothing in the answer (``metadata``, ``store``, ``service_tier``,
...): those are accepted and ignored. Nothing here does I/O or knows about the model.

Sampling follows mlx-lm (``mlx_lm.sample_utils``): ``temperature`` (0: greedy), ``top_p``,
``top_k``, ``min_p``, ``seed``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty`` (each over the last ``*_context_size`` tokens, prompt included, as mlx-lm),
``logit_bias``, plus ``logprobs`` / ``top_logprobs``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import AsyncsideError

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
DEFAULT_PENALTY_CONTEXT = 20  # mlx-lm's default context of each penalty


class RequestError(AsyncsideError):
    """A request the server refuses; rendered as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (mlx-lm's sampler and logits processors, per request)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = DEFAULT_PENALTY_CONTEXT
    presence_penalty: float | None = None
    presence_context_size: int = DEFAULT_PENALTY_CONTEXT
    frequency_penalty: float | None = None
    frequency_context_size: int = DEFAULT_PENALTY_CONTEXT
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False      # report each token's log-probability
    top_logprobs: int = 0       # ... and this many alternatives per position

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ChatMessage:
    """One chat message as the chat template receives it."""

    role: str
    content: str | None
    tool_calls: tuple[dict[str, Any], ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content if self.content is not None else ""}
        if self.tool_calls is not None:
            out["tool_calls"] = [dict(tc) for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class CompletionRequest:
    """One parsed request of either endpoint."""

    kind: str                         # "completion" | "chat"
    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    prompt: str | None = None         # completions: text prompt
    prompt_ids: tuple[int, ...] | None = None  # completions: token prompt as given
    messages: tuple[ChatMessage, ...] = field(default_factory=tuple)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: tuple[dict[str, Any], ...] | None = None  # chat: tools offered to the model (tool_choice "auto")
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: whether the client gave ``max_tokens`` (else it is the server's default, which the context may cut)
    max_tokens_given: bool = True


# --- field checks ------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _expect_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean, got {_type_name(value)} {value!r:.50}", param=key)
    return value


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float, default: float,
            *, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {_type_name(value)} {value!r:.50}", param=key)
    value = float(value)
    if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise RequestError(f"'{key}' must be in {left}{lo:g}, {hi:g}], got {value:g}", param=key)
    return value


def _expect_int(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {_type_name(value)} {value!r:.50}", param=key)
    return value


def _int_in(body: Mapping[str, Any], key: str, lo: int, hi: int, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    value = _expect_int(value, key)
    if not lo <= value <= hi:
        raise RequestError(f"'{key}' must be an integer in [{lo}, {hi}], got {value}", param=key)
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
    if not isinstance(value, list):
        raise RequestError(f"'stop' must be a string or a list of strings, got {_type_name(value)}", param="stop")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise RequestError(f"'stop[{i}]' must be a string ('stop' is a string or a list of strings), got "
                               f"{_type_name(s)}", param="stop")
    if len(value) > MAX_STOP_SEQUENCES:
        raise RequestError(f"'stop' has {len(value)} sequences; at most {MAX_STOP_SEQUENCES} are allowed", param="stop")
    if any(s == "" for s in value):
        raise RequestError("'stop' sequences must not be empty strings", param="stop")
    return tuple(value)


def _logit_bias(body: Mapping[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(f"'logit_bias' must be an object mapping token ids to biases, got {_type_name(value)}",
                           param="logit_bias")
    out = []
    for k, v in value.items():
        try:
            token = int(k)
        except ValueError:
            raise RequestError(f"'logit_bias' key {k!r:.40} is not a token id", param="logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"'logit_bias' token id {token} is outside the vocabulary [0, {vocab_size})",
                               param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(f"'logit_bias[{k}]' must be a number in [-100, 100], got {v!r:.40}", param="logit_bias")
        out.append((token, float(v)))
    return tuple(out)


def _seed(body: Mapping[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    value = _expect_int(value, "seed")
    if not -(2**63) <= value < 2**64:
        raise RequestError(f"'seed' must fit in 64 bits, got {value}", param="seed")
    return value % 2**64


def _sampling(body: Mapping[str, Any], *, default_temperature: float, vocab_size: int | None,
              logprobs: bool, top_logprobs: int) -> SamplingParams:
    def penalty(key: str, lo: float, hi: float) -> float | None:
        if body.get(key) is None:
            return None
        return _number(body, key, lo, hi, 0.0, lo_open=key == "repetition_penalty")

    return SamplingParams(
        temperature=_number(body, "temperature", 0.0, 2.0, default_temperature),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        top_k=_int_in(body, "top_k", 0, 2**31 - 1, 0),
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        seed=_seed(body),
        repetition_penalty=penalty("repetition_penalty", 0.0, 10.0),
        repetition_context_size=_int_in(body, "repetition_context_size", 1, 1 << 20, DEFAULT_PENALTY_CONTEXT),
        presence_penalty=penalty("presence_penalty", -2.0, 2.0),
        presence_context_size=_int_in(body, "presence_context_size", 1, 1 << 20, DEFAULT_PENALTY_CONTEXT),
        frequency_penalty=penalty("frequency_penalty", -2.0, 2.0),
        frequency_context_size=_int_in(body, "frequency_context_size", 1, 1 << 20, DEFAULT_PENALTY_CONTEXT),
        logit_bias=_logit_bias(body, vocab_size),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


_SAMPLING_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size", "logit_bias",
})
#: Fields OpenAI defines that change nothing in the answer here (bookkeeping on OpenAI's side,
#: routing hints, prompt-cache keys): accepted and ignored, each checked for its JSON type only.
IGNORED_KEYS: dict[str, tuple[type, ...]] = {
    "metadata": (dict,),
    "store": (bool,),
    "service_tier": (str,),
    "safety_identifier": (str,),
    "prompt_cache_key": (str,),
    "prompt_cache_retention": (str,),
    "prediction": (dict,),
}
_COMMON_KEYS = (frozenset({"model", "max_tokens", "stream", "stream_options", "stop", "n", "user"}) | _SAMPLING_KEYS
                | frozenset(IGNORED_KEYS))
COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_KEYS = _COMMON_KEYS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs", "response_format",
}


_IGNORED_TYPE_NAMES: dict[tuple[type, ...], str] = {(dict,): "an object", (bool,): "a boolean", (str,): "a string"}


def _known_keys(body: Mapping[str, Any], known: frozenset[str], endpoint: str) -> None:
    for key, types in IGNORED_KEYS.items():
        value = body.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool) != (bool in types)):
            raise RequestError(f"'{key}' must be {_IGNORED_TYPE_NAMES[types]}, got {_type_name(value)} (the field is "
                               "accepted and ignored by this server)", param=key)
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(
            f"'{unknown[0]}' is not supported by {endpoint} on this server"
            + (f" (nor {', '.join(repr(k) for k in unknown[1:])})" if len(unknown) > 1 else ""),
            param=unknown[0],
        )


def _common(body: Mapping[str, Any], served_models: Sequence[str]) -> tuple[str, bool, bool, tuple[str, ...]]:
    model = body.get("model")
    if model is None:
        raise RequestError("'model' is required", param="model")
    if not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {_type_name(model)}", param="model")
    if model not in served_models:
        raise RequestError(
            f"model {model!r:.100} does not exist; this server serves {list(served_models)}",
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
        extra = sorted(set(options) - {"include_usage", "include_obfuscation"})  # the latter: padding only
        if extra:
            raise RequestError(f"'stream_options.{extra[0]}' is not supported", param="stream_options")
        include_usage = _expect_bool(options, "include_usage", False)
    n = body.get("n")
    if n is not None and _expect_int(n, "n") != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", param="n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"'user' must be a string, got {_type_name(user)}", param="user")
    return model, stream, include_usage, _stop(body)


def _check_body(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


def check_strings(value: object, where: str = "") -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON
    can spell but UTF-8 cannot): RequestError naming the field. Iterative, so any depth the JSON
    decoder accepted is fine."""
    stack: list[tuple[object, str]] = [(value, where)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                name = path or "the request body"
                raise RequestError(
                    f"'{name}' holds a lone surrogate (U+{ord(v[exc.start]):04X} at character {exc.start}); "
                    "text must be valid Unicode",
                    param=path.split(".")[0].split("[")[0] or None,
                ) from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((k, path))
                stack.append((item, f"{path}.{k}" if path else str(k)))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(v))


# --- the endpoints -----------------------------------------------------------------------------


def parse_completion(
    body: object, *, served_models: Sequence[str], default_max_tokens: int = 16, max_tokens_limit: int = 512,
    default_temperature: float = 0.0, vocab_size: int | None = None,
) -> CompletionRequest:
    """Validate a ``/v1/completions`` body."""
    body = _check_body(body)
    _known_keys(body, COMPLETION_KEYS, "/v1/completions")
    model, stream, include_usage, stop = _common(body, served_models)
    if body.get("echo"):
        raise RequestError("'echo' is not supported (the answer never repeats the prompt)", param="echo")
    if body.get("suffix") is not None:
        raise RequestError("'suffix' is not supported", param="suffix")
    best_of = body.get("best_of")
    if best_of is not None and _expect_int(best_of, "best_of") != 1:
        raise RequestError(f"'best_of' must be 1, got {best_of}", param="best_of")
    max_tokens = _max_tokens(body, ["max_tokens"], default_max_tokens, max_tokens_limit)
    # Legacy completions: 'logprobs' is the number of alternatives per token (0: the chosen one only).
    top = body.get("logprobs")
    logprobs = top is not None
    top_n = _int_in(body, "logprobs", 0, MAX_TOP_LOGPROBS, 0) if logprobs else 0
    sampling = _sampling(body, default_temperature=default_temperature, vocab_size=vocab_size,
                         logprobs=logprobs, top_logprobs=top_n)

    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("'prompt' is required", param="prompt")
    # OpenAI accepts a string, a list of strings, a list of token ids, or a list of such lists;
    # one prompt per request here (n == 1), so a list must hold exactly one prompt.
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts; send one prompt per request", param="prompt")
        prompt = prompt[0]
    common = dict(kind="completion", model=model, max_tokens=max_tokens, stream=stream,
                  include_usage=include_usage, stop=stop, sampling=sampling,
                  max_tokens_given=body.get("max_tokens") is not None)
    if isinstance(prompt, str):
        if prompt == "":
            raise RequestError("'prompt' must not be empty", param="prompt")
        return CompletionRequest(prompt=prompt, **common)  # type: ignore[arg-type]
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError("'prompt' must not be empty", param="prompt")
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise RequestError(f"'prompt[{i}]' must be a non-negative token id, got {t!r:.40}", param="prompt")
            if vocab_size is not None and t >= vocab_size:
                raise RequestError(f"'prompt' holds token id {t}; the vocabulary has {vocab_size} ids", param="prompt")
        return CompletionRequest(prompt_ids=tuple(prompt), **common)  # type: ignore[arg-type]
    raise RequestError(
        f"'prompt' must be a string, a list of token ids, or a one-element list of either; got {_type_name(prompt)}",
        param="prompt",
    )


_ROLES = ("system", "developer", "user", "assistant", "tool")


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


def _tool_calls_of(value: object, i: int) -> tuple[dict[str, Any], ...]:
    """An assistant message's tool calls, with arguments decoded to objects (chat templates expect that)."""
    import json

    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise RequestError(f"'{where}' must be a list, got {_type_name(value)}", param=where)
    out = []
    for j, tc in enumerate(value):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"'{where}[{j}]' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                               "\"arguments\"}}}}", param=where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise RequestError(f"'{where}[{j}].function.arguments' is not valid JSON", param=where) from None
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(tc.get("id"), str):
            call["id"] = tc["id"]
        out.append(call)
    return tuple(out)


def _messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
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
                f"'messages[{i}].role' must be one of {list(_ROLES)}, got {role!r:.40}", param=f"messages[{i}].role"
            )
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise RequestError(f"'messages[{i}].{extra[0]}' is not supported", param=f"messages[{i}].{extra[0]}")
        tool_calls = None
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError(f"'messages[{i}].tool_calls' is only allowed on assistant messages",
                                   param=f"messages[{i}].tool_calls")
            tool_calls = _tool_calls_of(m["tool_calls"], i)
        if "content" not in m:
            raise RequestError(f"'messages[{i}].content' is required", param=f"messages[{i}].content")
        content = m["content"]
        if content is None and tool_calls is None:
            raise RequestError(f"'messages[{i}].content' may be null only on an assistant message with tool_calls",
                               param=f"messages[{i}].content")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise RequestError(f"'messages[{i}].{key}' must be a string", param=f"messages[{i}].{key}")
        parsed.append(ChatMessage(role, None if content is None else _message_text(content, i), tool_calls,
                                  m.get("tool_call_id"), m.get("name")))
    return tuple(parsed)


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(f"'tools' must be a list of function tools, got {_type_name(tools)}", param="tools")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"'tools[{j}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"'tools[{j}].function.name' must be a non-empty string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"'tools[{j}].function.parameters' must be a JSON schema object", param="tools")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise RequestError(
            f"'tool_choice' {choice!r:.60} is not supported; use \"auto\" (the model decides) or \"none\"",
            param="tool_choice",
        )
    if choice == "none" or not tools:
        return None
    return tuple(tools)


_TEMPLATE_RESERVED = ("conversation", "messages", "tools", "add_generation_prompt", "tokenize", "return_dict",
                      "continue_final_message")


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"'chat_template_kwargs' must be an object, got {_type_name(value)}",
                           param="chat_template_kwargs")
    for key in value:
        if key in _TEMPLATE_RESERVED:
            raise RequestError(f"'chat_template_kwargs.{key}' is set by the server and cannot be overridden",
                               param="chat_template_kwargs")
    return dict(value)


def parse_chat(
    body: object, *, served_models: Sequence[str], default_max_tokens: int = 256, max_tokens_limit: int = 512,
    default_temperature: float = 0.0, vocab_size: int | None = None,
) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` body."""
    body = _check_body(body)
    _known_keys(body, CHAT_KEYS, "/v1/chat/completions")
    model, stream, include_usage, stop = _common(body, served_models)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("'response_format' is not supported beyond {\"type\": \"text\"}", param="response_format")
    logprobs = _expect_bool(body, "logprobs", False)
    top_n = _int_in(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if body.get("top_logprobs") is not None and not logprobs:
        raise RequestError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    sampling = _sampling(body, default_temperature=default_temperature, vocab_size=vocab_size,
                         logprobs=logprobs, top_logprobs=top_n)
    max_tokens = _max_tokens(body, ["max_completion_tokens", "max_tokens"], default_max_tokens, max_tokens_limit)
    messages = _messages(body)
    tools = _tools(body)
    parallel = _expect_bool(body, "parallel_tool_calls", True)
    return CompletionRequest(
        "chat", model, max_tokens, stream, include_usage, stop, messages=messages, sampling=sampling, tools=tools,
        parallel_tool_calls=parallel, chat_template_kwargs=_template_kwargs(body),
        max_tokens_given=any(body.get(k) is not None for k in ("max_completion_tokens", "max_tokens")),
    )


# --- prompts -----------------------------------------------------------------------------------


def simple_chat_template(messages: Sequence[ChatMessage]) -> str:
    """The chat format used when the tokenizer has no chat template of its own.

    One line of ``<|role|>`` then the content, per message, then the assistant header, so the
    model continues as the assistant.
    """
    out = [f"<|{m.role}|>\n{m.content or ''}\n" for m in messages]
    out.append("<|assistant|>\n")
    return "".join(out)


def has_chat_template(tokenizer: Any) -> bool:
    return getattr(tokenizer, "apply_chat_template", None) is not None and bool(
        getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage], *, tools: Sequence[dict[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of a chat: the tokenizer's own template when it has one, else the simple one.

    ``tools`` and ``template_kwargs`` go to the template; without a template they are refused
    (RequestError) rather than dropped.
    """
    if not has_chat_template(tokenizer):
        if tools:
            raise RequestError("'tools' needs a model whose tokenizer has a chat template; this one has none",
                               param="tools")
        if template_kwargs:
            raise RequestError("'chat_template_kwargs' needs a model whose tokenizer has a chat template; "
                               "this one has none", param="chat_template_kwargs")
        return list(tokenizer.encode(simple_chat_template(messages)))
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = [dict(t) for t in tools]
    try:
        text = tokenizer.apply_chat_template([m.to_template() for m in messages], add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    except Exception as exc:  # a template raising on its input (jinja's raise_exception, a missing key)
        raise RequestError(f"the chat template refused these messages: {type(exc).__name__}: {exc}",
                           param="messages") from None
    if not isinstance(text, str):
        raise RequestError("the chat template did not render text", param="messages")
    try:  # the template already carries the special tokens (BOS): do not add them twice
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


# --- responses ---------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its top alternatives, as text."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    #: the token's bytes and each alternative's (chat's ``bytes``); left out, their text's UTF-8
    token_bytes: bytes | None = None
    top_bytes: tuple[bytes, ...] = ()
    #: where the token's text starts in the answer, in characters (completions' ``text_offset``)
    offset: int | None = None


def logprobs_body(req: CompletionRequest, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The ``logprobs`` object of a choice (chat: ``content`` entries; completions: parallel lists,
    each ``text_offset`` the entry's own, else counted from the answer's start)."""
    if req.kind == "chat":
        def one(tok: str, lp: float, raw: bytes | None) -> dict[str, Any]:
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8") if raw is None else raw)}

        def alternatives(e: TokenLogprob) -> list[dict[str, Any]]:
            raws: tuple[bytes | None, ...] = e.top_bytes or (None,) * len(e.top)
            return [one(t, l, raw) for (t, l), raw in zip(e.top, raws, strict=True)]

        return {"content": [dict(one(e.token, e.logprob, e.token_bytes), top_logprobs=alternatives(e))
                            for e in entries], "refusal": None}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at if e.offset is None else e.offset)
        at += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries] if req.sampling.top_logprobs > 0 else None,
        "text_offset": offsets,
    }


def full_response(
    req: CompletionRequest, rid: str, created: int, text: str | None, finish_reason: str, usage_: dict[str, Any],
    *, logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The body of a non-streaming answer."""
    if req.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason,
                                  "logprobs": logprobs}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice], "usage": usage_}


def chunk(
    req: CompletionRequest,
    rid: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage_: dict[str, Any] | None = None,
    no_choices: bool = False,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One server-sent-event payload of a streaming answer."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}]
        obj = "text_completion"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model}
    out["choices"] = [] if no_choices else choices
    if req.include_usage:
        out["usage"] = usage_
    return out


def now() -> int:
    return int(time.time())


Parser = Callable[..., CompletionRequest]
