"""Message-level normalisation shared by the renderer and the image collector: tool-call
arguments, and tool results put in call order (CHAT_FORMAT.md §3.6–3.7)."""
from __future__ import annotations

import json
from typing import Any


def normalize_arguments(arguments, where: str) -> tuple[dict, str | None]:
    """(arguments as a dict, raw text when it is not JSON): dict or JSON-object string; None
    or a blank string is {}; unparsable text is kept raw (rendered as a `json` block)."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}, arguments
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: tool call arguments must be a JSON object, got {type(parsed).__name__}")
        return parsed, None
    raise ValueError(f"{where}: tool call arguments must be a dict or a JSON object string, "
                     f"got {type(arguments).__name__}")


def call_function(call, where: str) -> dict:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: a tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise ValueError(f"{where}: tool call 'function' must be an object, got {type(fn).__name__}")
    return fn


def reorder_tool_results(messages: list) -> list:
    """Each run of consecutive tool messages whose `tool_call_id` (or `id`) all match the last
    assistant's `tool_calls[].id` is put in call order, `tool` (and `name`, if present) set to
    the matched call's function name; any other run keeps its order. Inputs are not mutated."""
    return [m for _, m in in_render_order(messages)]


def in_render_order(messages) -> list[tuple[int, Any]]:
    """`reorder_tool_results` as (position given, message) pairs."""
    out, index, i = [], {}, 0
    while i < len(messages):
        m = messages[i]
        if not (isinstance(m, dict) and m.get("role") == "tool"):
            if isinstance(m, dict) and m.get("role") == "assistant":
                index = {}
                calls = m.get("tool_calls")
                for pos, call in enumerate(calls if isinstance(calls, list) else [], start=1):
                    if isinstance(call, dict) and call.get("id") is not None and str(call["id"]) not in index:
                        fn = call.get("function")
                        index[str(call["id"])] = (pos, fn.get("name") if isinstance(fn, dict) else call.get("name"))
            out.append((i, m))
            i += 1
            continue
        run = []
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            t = messages[i]
            call_id = t.get("tool_call_id", t.get("id"))
            run.append((index.get(str(call_id)) if call_id is not None else None, i, t))
            i += 1
        if any(match is None for match, _, _ in run):
            out.extend((k, t) for _, k, t in run)
            continue
        for (_, name), k, t in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is not None:
                t = {**t, "tool": name, **({"name": name} if "name" in t else {})}
            out.append((k, t))
    return out
