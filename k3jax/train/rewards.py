"""GRPO rewards: Python callables `fn(record, reply) -> float`, named in the train config.

`record` is the prompt's JSONL object as written (its `messages`, `answer`, `tools` and any
other field a reward reads); `reply` is the parsed completion, `k3jax.chat.parse_reply`'s
{'reasoning_content', 'content', 'tool_calls'} plus 'finish_reason' ('stop': the model ended
its turn; 'length': cut at grpo.max_tokens). A name is a built-in below or `module:function`
(imported as Python imports it, so a module beside the working directory or on PYTHONPATH).

Built-ins (each 0 or 1):
- `exact_match`: the reply's content, stripped, equals `str(record['answer'])` stripped.
- `tool_call`: the reply holds one tool call of a tool the record declares, its arguments a
  JSON object valid against that tool's `parameters` schema (the subset of JSON Schema tool
  declarations use: type, properties, required, enum, items, additionalProperties); where
  the record's `answer` is an object {'name', 'arguments'}, the call must also equal it.
- `format`: the model ended its turn itself (not cut by max_tokens), with non-empty content
  or a tool call.
"""
from __future__ import annotations

import importlib
import json

from k3jax.config import ConfigError
from k3jax.errors import InputError


def exact_match(record: dict, reply: dict) -> float:
    return float(str(reply.get("content") or "").strip() == str(record.get("answer", "")).strip())


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value, schema: dict, where: str = "arguments") -> list[str]:
    """Why `value` breaks `schema` (the tool-declaration subset of JSON Schema): [] if valid."""
    if not isinstance(schema, dict):
        return []
    out = []
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t else []
    if types:
        def ok(kind):
            if kind == "integer":
                return isinstance(value, int) and not isinstance(value, bool)
            if kind == "number":
                return isinstance(value, (int, float)) and not isinstance(value, bool)
            return isinstance(value, _TYPES.get(kind, object))
        if not any(ok(k) for k in types):
            return [f"{where}: expected {t}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        out += [f"{where}.{k}: missing" for k in schema.get("required") or [] if k not in value]
        for k, v in value.items():
            if k in props:
                out += schema_errors(v, props[k], f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}.{k}: not allowed")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += schema_errors(v, schema["items"], f"{where}[{i}]")
    return out


def tool_call(record: dict, reply: dict) -> float:
    calls = reply.get("tool_calls") or []
    if len(calls) != 1:
        return 0.0
    fn = calls[0].get("function") or {}
    tools = {t.get("function", {}).get("name"): t.get("function", {}) for t in record.get("tools") or []
             if isinstance(t, dict)}
    if fn.get("name") not in tools:
        return 0.0
    try:
        args = json.loads(fn.get("arguments") or "")
    except (json.JSONDecodeError, TypeError):
        return 0.0
    if not isinstance(args, dict) or schema_errors(args, tools[fn["name"]].get("parameters") or {}):
        return 0.0
    want = record.get("answer")
    if isinstance(want, dict) and "name" in want:
        want_args = want.get("arguments", {})
        if isinstance(want_args, str):
            want_args = json.loads(want_args)
        return float(fn["name"] == want["name"] and args == want_args)
    return 1.0


def format_reward(record: dict, reply: dict) -> float:
    said = bool(str(reply.get("content") or "").strip()) or bool(reply.get("tool_calls"))
    return float(reply.get("finish_reason") == "stop" and said)


BUILTINS = {"exact_match": exact_match, "tool_call": tool_call, "format": format_reward}


def resolve(name: str):
    """The callable a config names: a built-in, or `module:function`."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise ConfigError(f"config train.grpo.rewards: {name!r} is neither a built-in ({', '.join(BUILTINS)}) nor "
                          f"'module:function'")
    mod, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config train.grpo.rewards: cannot load {name!r} ({e})") from None
    if not callable(fn):
        raise ConfigError(f"config train.grpo.rewards: {name!r} is not callable")
    return fn


class Rewards:
    """The config's rewards, weighted and summed: `score(where, record, reply) -> (total,
    [each])`. A reward that raises or returns a non-number stops the run with one line naming
    the record (file:line) and the function."""

    def __init__(self, names, weights=None):
        self.names = list(names)
        self.fns = [resolve(n) for n in self.names]
        self.weights = [1.0] * len(self.fns) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.fns):
            raise ConfigError(f"config train.grpo.reward_weights: {len(self.weights)} weights for "
                              f"{len(self.fns)} rewards")

    def score(self, where: str, record: dict, reply: dict) -> tuple[float, list[float]]:
        each = []
        for name, fn in zip(self.names, self.fns):
            try:
                r = fn(record, reply)
                r = float(r)
            except Exception as e:   # noqa: BLE001  (any failure of user code is reported the same way)
                msg = " ".join(str(e).split()) or type(e).__name__
                raise InputError(f"{where}: reward {name} raised {type(e).__name__}: {msg}") from None
            if r != r:
                raise InputError(f"{where}: reward {name} returned NaN")
            each.append(r)
        return sum(w * r for w, r in zip(self.weights, each)), each
