"""OpenAI request bodies checked field by field, and the response bodies built from results.

Every check raises `BadRequest(param, message)`, which the app answers with HTTP 400 and
OpenAI's error body naming the field. Fields OpenAI defines but this server does not
implement are accepted at their neutral value only (n = 1, no penalties, no logprobs);
any other field is refused by name, so a typo never passes silently.
"""
from __future__ import annotations

import json
import time
import uuid


class BadRequest(ValueError):
    def __init__(self, param: str | None, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


SAMPLING = {"temperature", "top_p", "top_k", "seed", "stop", "max_tokens", "ignore_eos", "stream", "stream_options",
            "n", "presence_penalty", "frequency_penalty", "logprobs", "user", "model", "logit_bias"}
CHAT = SAMPLING | {"messages", "tools", "tool_choice", "max_completion_tokens", "response_format",
                   "reasoning_effort", "parallel_tool_calls", "top_logprobs"}
COMPLETION = SAMPLING | {"prompt", "echo", "best_of", "suffix"}
ROLES = ("system", "user", "assistant", "tool", "developer")
EFFORTS = ("low", "high", "max", "none")


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(None, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    return body


def _number(body, key, lo=None, hi=None, integer=False, default=None, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise BadRequest(key, f"'{key}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}")
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        rng = f"{'>' if lo_open else '>='} {lo}" + ("" if hi is None else f" and <= {hi}")
        raise BadRequest(key, f"'{key}' must be {rng}, got {v}")
    return v


def _neutral(body, key, ok):
    if key in body and body[key] is not None and body[key] not in ok:
        raise BadRequest(key, f"'{key}' = {json.dumps(body[key])} is not supported (only {ok[0]!r})")


def sampling_options(body: dict, allowed: set, default_max: int | None) -> dict:
    """The request's sampling and stop settings; refuses unknown fields."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field '{unknown[0]}'")
    for key, ok in (("n", (1,)), ("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)),
                    ("logprobs", (False,)), ("best_of", (1,)), ("echo", (False,)), ("logit_bias", ({},))):
        _neutral(body, key, ok)
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("model", "'model' must be a string")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop", "'stop' must be a non-empty string or a list of them")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("stream_options", "'stream_options' takes only 'include_usage'")
    for flag in ("stream", "ignore_eos"):
        if not isinstance(body.get(flag, False), bool):
            raise BadRequest(flag, f"'{flag}' must be true or false")
    return {"temperature": _number(body, "temperature", 0, 2, default=1.0),
            "top_p": _number(body, "top_p", 0, 1, default=1.0, lo_open=True),
            "top_k": max(_number(body, "top_k", -1, integer=True, default=0), 0),     # vLLM's -1: no cut
            "seed": _number(body, "seed", integer=True, default=0) % 2**32,
            "max_tokens": _number(body, key, 1, integer=True, default=default_max),
            "max_tokens_field": key, "stop": tuple(stop or ()), "stream": bool(body.get("stream", False)),
            "include_usage": bool(stream_options.get("include_usage", False)),
            "ignore_eos": bool(body.get("ignore_eos", False))}


def chat_request(body: dict) -> dict:
    """Messages, tools and render options of a /v1/chat/completions body (checked)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "'messages' must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role", f"messages[{i}] needs a 'role' among {', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of parts")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", None):
                    raise BadRequest(f"messages[{i}].content[{j}]",
                                     f"messages[{i}].content[{j}]: only text parts are served (images are not yet)")
    tools = body.get("tools")
    if tools is not None:
        _check_tools(tools)
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none", "required"):
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
                                            "{'type': 'function', 'function': {'name': ...}}")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise BadRequest("tool_choice", f"tool_choice names the function {name!r}, which 'tools' does not declare")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")):
        raise BadRequest("response_format", "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema'}")
    effort = body.get("reasoning_effort", "max")
    if effort not in EFFORTS:
        raise BadRequest("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {effort!r}")
    return {"messages": messages, "tools": tools, "tool_choice": choice if isinstance(choice, str) else None,
            "response_format": None if fmt is None or fmt.get("type") == "text" else fmt,
            "thinking": effort != "none", "thinking_effort": None if effort == "none" else effort}


def _check_tools(tools):
    if not isinstance(tools, list):
        raise BadRequest("tools", "'tools' must be a list of {'type': 'function', 'function': {...}}")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise BadRequest(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRequest(f"tools[{i}].function.name", f"tools[{i}].function.name must be a non-empty string")
        params = f.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise BadRequest(f"tools[{i}].function.parameters",
                             f"tools[{i}].function.parameters must be a JSON Schema object ({{'type': 'object', ...}})")


def completion_prompt(body: dict, vocab_size: int):
    """The prompt of a /v1/completions body: text, or a list of token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        if not all(0 <= i < vocab_size for i in p):
            raise BadRequest("prompt", f"'prompt' token ids must lie in [0, {vocab_size})")
        return p
    raise BadRequest("prompt", "'prompt' must be a non-empty string or list of token ids (one prompt a request)")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_message(reply: dict) -> dict:
    """The assistant message of a parsed reply (`k3jax.chat.parse_reply`)."""
    msg = {"role": "assistant", "content": reply["content"] or (None if reply["tool_calls"] else ""),
           "reasoning_content": reply["reasoning_content"] or None}
    if reply["tool_calls"]:
        msg["tool_calls"] = reply["tool_calls"]
    return msg


def finish_reason(engine_reason: str, reply: dict | None = None) -> str:
    if reply is not None and reply["tool_calls"] and engine_reason == "stop":
        return "tool_calls"
    return {"cancelled": "abort"}.get(engine_reason, engine_reason)


def chat_completion(rid: str, model: str, reply: dict, reason: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": chat_message(reply), "finish_reason": finish_reason(reason, reply),
                         "logprobs": None}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict | None, reason: str | None = None, use: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion(rid: str, model: str, text: str, reason: str | None, use: dict | None, chunk: bool = False) -> dict:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
