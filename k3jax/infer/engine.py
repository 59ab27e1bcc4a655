"""The continuous-batching engine: fixed cache slots, chunked prefill, per-request sampling.

Requests wait in a FIFO queue and enter free slots between steps, while the other slots
decode (continuous batching). Each step feeds every slot at once (`slots.step`): a long
prompt is fed one chunk per step, and every decoding slot still gains a token in that
step, so a long prompt never stalls running decodes. A request's own sampling settings
and seed ride along as arrays: its tokens do not depend on what shares the batch. With
greedy sampling, a request gives the tokens `generate` gives it alone.

Prefix reuse: after a prompt is fed, its slot is saved (one row, LRU); a later prompt that
starts with a saved one restores it and feeds only the rest (a multi-turn chat's next
turn). The lookup leaves at least one token to feed, whose logits start the reply.

The engine runs on its own thread (`start`, `submit`, `cancel`, `shutdown`), or stepped by
the caller (`run`: a batch of requests to completion, e.g. rollouts). Results and text
stream through each request's `on_event(request, new_ids, new_text)`, called on the
engine's thread; `request.finish_reason` is set ("stop", "length", "cancelled", "error")
before the last call.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.errors import InputError
from k3jax.infer import slots as S
from k3jax.infer.caches import cache_shardings, init_cache
from k3jax.infer.sampling import SamplingParams

_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One generation: `prompt` ids, up to `max_tokens` new ones, its own sampling and
    stops (ids end the reply and are not part of it; strings cut the text before them)."""
    prompt: list[int]
    max_tokens: int | None = None           # None: as many as the slot has room for
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset = frozenset()
    stop: tuple[str, ...] = ()
    on_event: Callable | None = None
    detok: Callable | None = None           # ids -> the text stops apply to (default: tokenizer.decode)
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    # what the engine fills in
    out: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_prompt: int = 0                  # prompt tokens restored from a saved prefix
    t_submit: float = 0.0
    t_first: float | None = None
    t_done: float | None = None
    _fed: int = 0
    _emitted: int = 0
    _sent: int = 0
    _cancel: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class EngineFull(InputError):
    """The waiting queue is full: come back later (the server's 429)."""


class Engine:
    """`slots` sequences at once, each up to `max_len` tokens (prompt and reply), prompts fed
    `chunk` tokens a step. `tokenizer` (optional) gives the text and the stop strings;
    `scope()` the context (mesh) the steps trace under (a scope with `mesh` and `rules`, as
    `generator.MeshScope`, also lays the cache's rows out over the mesh:
    `caches.cache_shardings`); `max_waiting` bounds the queue; `prefix_entries` the saved
    prefixes (0: no reuse)."""

    def __init__(self, cfg: ModelConfig, params, *, slots: int = 8, max_len: int = 512, chunk: int = 32,
                 tokenizer=None, scope=None, max_waiting: int = 256, prefix_entries: int = 8):
        if slots < 1 or chunk < 1 or max_len < 2:
            raise InputError(f"slots ({slots}) and chunk ({chunk}) must be >= 1 and max_len ({max_len}) >= 2")
        if max_len > cfg.max_position_embeddings:
            raise InputError(f"max_len {max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self.slots, self.max_len, self.chunk = slots, max_len, min(chunk, max_len)
        self.max_waiting, self.prefix_entries = max_waiting, prefix_entries
        self.scope = scope
        self.cache = self._new_cache()
        self._blank = init_cache(cfg, 1, max_len)
        self._prefixes: OrderedDict[tuple, object] = OrderedDict()
        self.active: list[Request | None] = [None] * slots
        self.waiting: deque[Request] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = self._stopped = False
        self.error: BaseException | None = None
        self.generated_total = self.prompt_total = self.steps = 0
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of the last steps

    def _new_cache(self):
        cache = init_cache(self.cfg, self.slots, self.max_len)
        mesh = getattr(self.scope, "mesh", None)
        if mesh is None:
            return cache
        return jax.device_put(cache, cache_shardings(cache, mesh, self.scope.rules))

    # -- requests --------------------------------------------------------------------------
    def check(self, req: Request) -> Request:
        """Validate a request against this engine (raises InputError naming the field)."""
        if not req.prompt:
            raise InputError("prompt: at least one token is needed")
        bad = [i for i in req.prompt if not 0 <= int(i) < self.cfg.vocab_size]
        if bad:
            raise InputError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(req.prompt) >= self.max_len:
            raise InputError(f"prompt: {len(req.prompt)} tokens leave no room to reply within max_len={self.max_len}")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {req.max_tokens}")
        room = self.max_len - len(req.prompt) + 1     # the last sampled token is never fed back
        req.max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
        return req

    def submit(self, req: Request) -> Request:
        """Queue a request (thread-safe). Raises EngineFull when `max_waiting` wait already."""
        self.check(req)
        with self._lock:
            if self._closing:
                raise EngineFull("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise EngineFull(f"{len(self.waiting)} requests are waiting already (--max-waiting)")
            req.t_submit = time.perf_counter()
            self.waiting.append(req)
            self._lock.notify_all()
        return req

    def cancel(self, req: Request):
        """Stop a request (thread-safe): its slot is freed before the next step."""
        req._cancel = True
        with self._lock:
            self._lock.notify_all()

    # -- the loop -----------------------------------------------------------------------
    def run(self, requests) -> list[Request]:
        """Step on the calling thread until these requests are done (no engine thread)."""
        for r in requests:
            self.submit(r)
        while not all(r.done for r in requests):
            self.step()
        return list(requests)

    @property
    def alive(self) -> bool:
        """Whether the engine's thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="k3jax-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = None):
        """Refuse new requests; with `drain` finish those queued and running, else cancel them."""
        with self._lock:
            self._closing = True
            if not drain:
                for r in [*self.waiting, *filter(None, self.active)]:
                    r._cancel = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self):
        with self.scope() if self.scope is not None else contextlib.nullcontext():
            while True:
                with self._lock:
                    while not self.waiting and not any(self.active) and not self._closing:
                        self._lock.wait()
                    if self._closing and not self.waiting and not any(self.active):
                        return
                try:
                    self.step()
                except Exception as e:          # a broken step fails its requests, not the server
                    self.error = e
                    for r in [*filter(None, self.active)]:
                        self._finish(r, "error")
                    self.cache = self._new_cache()

    def warmup(self):
        """Compile both step widths (idle slots: nothing changes)."""
        with self.scope() if self.scope is not None else contextlib.nullcontext():
            for width in {self.chunk, 1}:
                self._call(np.zeros((self.slots, width), np.int32), np.zeros(self.slots, np.int32))
            self._restart_slot(0, None)

    def step(self):
        """Admit waiting requests into free slots, feed every slot once, hand out tokens."""
        self._drop_cancelled()
        self._admit()
        live = [(b, r) for b, r in enumerate(self.active) if r is not None]
        if not live:
            return
        width = self.chunk if any(r._fed < len(r.prompt) for _, r in live) else 1
        tokens = np.zeros((self.slots, width), np.int32)
        n_new = np.zeros(self.slots, np.int32)
        for b, r in live:
            if r._fed < len(r.prompt):
                piece = r.prompt[r._fed:r._fed + width]
            else:
                piece = r.out[-1:]
            tokens[b, :len(piece)] = piece
            n_new[b] = len(piece)
        ids = self._call(tokens, n_new, live)
        self.steps += 1
        made = 0
        for b, r in live:
            if r._fed < len(r.prompt):
                r._fed += int(n_new[b])
                self.prompt_total += int(n_new[b])
                if r._fed < len(r.prompt):
                    continue
                self._save_prefix(b, r)
            made += 1
            self._take(r, int(ids[b]))
        now = time.perf_counter()
        self._recent.append((now, made))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()

    def _call(self, tokens, n_new, live=()):
        seeds = np.zeros(self.slots, np.uint32)
        counts = np.zeros(self.slots, np.int32)
        temp, top_p = np.zeros(self.slots, np.float32), np.ones(self.slots, np.float32)
        top_k = np.zeros(self.slots, np.int32)
        for b, r in live:
            s = r.sampling
            seeds[b], counts[b] = s.seed % 2**32, len(r.out)
            temp[b], top_k[b], top_p[b] = s.temperature, s.top_k, s.top_p
        ids, _, self.cache = S.step(self.cfg, self.params, self.cache, jnp.asarray(tokens), jnp.asarray(n_new),
                                    jnp.asarray(seeds), jnp.asarray(counts), jnp.asarray(temp),
                                    jnp.asarray(top_k), jnp.asarray(top_p))
        return np.asarray(ids)

    # -- slots --------------------------------------------------------------------------
    def _admit(self):
        with self._lock:
            free = [b for b, r in enumerate(self.active) if r is None]
            while free and self.waiting:
                b, r = free.pop(0), self.waiting.popleft()
                self.active[b] = r
                r._fed = r.cached_prompt = self._restart_slot(b, r.prompt)

    def _restart_slot(self, b: int, prompt) -> int:
        """Write a blank row, or the longest saved prefix of the prompt (leaving at least
        one token to feed) into slot b; returns the tokens it holds."""
        n, snap = 0, self._blank
        if prompt is not None and self.prefix_entries:
            head = tuple(prompt[:-1])
            best = max((k for k in self._prefixes if len(k) <= len(head) and head[:len(k)] == k), key=len,
                       default=None)
            if best is not None:
                n, snap = len(best), self._prefixes[best]
                self._prefixes.move_to_end(best)
        self.cache = S.put_row(self.cache, snap, b)
        return n

    def _save_prefix(self, b: int, r: Request):
        if not self.prefix_entries or len(r.prompt) <= r.cached_prompt:
            return
        self._prefixes[tuple(r.prompt)] = S.take_row(self.cache, b)
        self._prefixes.move_to_end(tuple(r.prompt))
        while len(self._prefixes) > self.prefix_entries:
            self._prefixes.popitem(last=False)

    def _drop_cancelled(self):
        with self._lock:
            for r in [r for r in self.waiting if r._cancel]:
                self.waiting.remove(r)
                self._finish(r, "cancelled")
        for r in self.active:
            if r is not None and r._cancel:
                self._finish(r, "cancelled")

    # -- tokens out -----------------------------------------------------------------------
    def _take(self, r: Request, tok: int):
        if r.t_first is None:
            r.t_first = time.perf_counter()
        if tok in r.stop_ids:
            return self._finish(r, "stop")
        r.out.append(tok)
        self.generated_total += 1
        reason = "length" if len(r.out) >= r.max_tokens else None
        detok = r.detok or (self.tokenizer.decode if self.tokenizer is not None else None)
        if detok is not None:
            text = detok(r.out).rstrip("\ufffd") if reason is None else detok(r.out)
            cut = min((i for i in (text.find(s, max(0, len(r.text) - len(s))) for s in r.stop if s) if i >= 0),
                      default=-1)
            if cut >= 0:                     # nothing of a stop string was handed on (held back)
                r.text, reason = text[:cut], "stop"
            elif len(text) > len(r.text) and text.startswith(r.text):
                r.text = text
        if reason:
            return self._finish(r, reason)
        self._emit(r, hold=max((len(s) for s in r.stop), default=1) - 1)

    def _emit(self, r: Request, hold: int = 0):
        """Hand on the new ids and text; `hold` characters stay back while they could
        still begin a stop string."""
        upto = max(r._emitted, len(r.text) - hold)
        new_text, r._emitted = r.text[r._emitted:upto], upto
        new_ids, r._sent = r.out[r._sent:], len(r.out)
        if r.on_event is not None and (new_ids or new_text or r.done):
            r.on_event(r, new_ids, new_text)

    def _finish(self, r: Request, reason: str):
        r.finish_reason, r.t_done = reason, time.perf_counter()
        for b, a in enumerate(self.active):
            if a is r:
                self.active[b] = None
        self._emit(r)

    # -- metrics --------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            waiting = len(self.waiting)
        span = (self._recent[-1][0] - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        recent = sum(n for _, n in list(self._recent)[1:])
        return {"running": sum(r is not None for r in self.active), "waiting": waiting, "slots": self.slots,
                "tokens_per_s": recent / span if span > 0 else 0.0, "generated_tokens": self.generated_total,
                "prompt_tokens": self.prompt_total, "steps": self.steps, "prefixes": len(self._prefixes)}
