"""The K3 text model: embedding → decoder layers → AttnRes output mix → norm → lm_head.

Depth is a repeated group of layers (K3: [KDA, KDA, KDA, MLA]) between a few irregular
ones (the dense layer 0, the final MLA). `layer_plan` finds that group; the repeated
groups run under `nn.scan` over params stacked on a leading `layers` axis, the irregular
ends are unrolled, so compile time does not grow with depth. The residual state — the
partial sum and, with Block AttnRes, the fixed-size block stack and its count — is the
scan carry; AttnRes pushes are decided from the (traced) layer index.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.errors import InputError, check_token_ids
from k3jax.layers.attn_res import AttnRes, defer_block, flush_block, push_block
from k3jax.layers.common import TokenEmbed, compute_dtype, constrain, dense, logical, param_dtype
from k3jax.layers.kda import KimiDeltaAttention
from k3jax.layers.mla import GatedMLA, StackedPast
from k3jax.layers.mlp import GatedMLP
from k3jax.layers.moe import StableLatentMoE
from k3jax.layers.norms import RMSNorm
from k3jax.layout import GROUPS, layer_plan, slot_name, slot_pushes, unrolled_name
from k3jax.ops.splice import splice_rows


# LoRA adapters (RuntimeOptions.lora) are the flax collection 'lora', laid out like the
# params they adapt; the user-facing param tree carries them under this top-level key.
LORA_KEY = "lora"


def variables_of(params) -> dict:
    """Flax variables from a param tree that may hold adapters under LORA_KEY."""
    if LORA_KEY not in params:
        return {"params": params}
    return {"params": {k: v for k, v in params.items() if k != LORA_KEY}, LORA_KEY: params[LORA_KEY]}


# ---------------------------------------------------------------------------------------
# Where the layers go
# ---------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------
# Residual state
# ---------------------------------------------------------------------------------------
class Residual(NamedTuple):
    """p: the running partial sum [B, T, D] (the plain residual stream without AttnRes);
    stack [N, B, T, D] and count: frozen block representations (empty without AttnRes);
    pending / has_pending: inside a scanned group, a block pushed but not yet written into
    the stack (`attn_res.defer_block`; None elsewhere)."""
    p: jax.Array
    stack: jax.Array
    count: jax.Array
    pending: jax.Array | None = None
    has_pending: jax.Array | None = None


class DecoderLayer(nn.Module):
    """One layer; returns (residual, cache update). With `cache` it continues cached
    sequences (see `K3Model`) and the update is the attention's new cache (KDA) or the new
    tokens' latents (MLA); without, the update is None.

    `may_push`: whether this layer can ever start an AttnRes block (False for a scanned
    slot that no group's layer index puts on a block boundary); `defer`: push into
    `pending` instead of the stack (scanned groups, which flush it at their end). Either
    way the stack passes through the layer untouched, so under remat the layers of a group
    save one stack between them instead of a fresh copy each: for K3 the backward keeps
    27 stacks instead of 93."""
    cfg: ModelConfig
    attn_kind: str
    ffn_kind: str
    may_push: bool = True
    defer: bool = False

    @nn.compact
    def __call__(self, res: Residual, segment_ids, layer_idx, cache=None, pos=None):
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        attn = (KimiDeltaAttention(cfg, name="self_attn") if self.attn_kind == "kda"
                else GatedMLA(cfg, name="self_attn"))
        ffn = (StableLatentMoE(cfg, name="block_sparse_moe") if self.ffn_kind == "moe"
               else GatedMLP(cfg, cfg.intermediate_size, name="mlp"))
        p, stack, count, pending, has_pending = res
        if cfg.use_attn_res:
            attn_in = AttnRes(eps, name="self_attention_res")(stack, count, p, pending, has_pending)
            push = layer_idx % cfg.attn_res_block_size == 0
            if self.may_push and self.defer:
                pending, has_pending, p = defer_block(p, push)
            elif self.may_push:
                stack, count, p = push_block(stack, count, p, push)
        else:
            attn_in = p
        x = RMSNorm(eps, name="input_layernorm")(attn_in)
        update = None
        if cache is None:
            a = attn(x, segment_ids)
        elif self.attn_kind == "kda":
            a, update = attn(x, cache=cache, n_new=pos[1])
        else:
            a, entries = attn(x, cache=cache, lengths=pos[0])
            update = {"kv": entries}
        p = p + a
        mlp_in = AttnRes(eps, name="mlp_res")(stack, count, p, pending, has_pending) if cfg.use_attn_res else p
        p = p + ffn(RMSNorm(eps, name="post_attention_layernorm")(mlp_in))
        p = constrain(p, ("batch", "length", "embed"))
        return Residual(p, stack, count, pending, has_pending), update


def _remat(cls, cfg: ModelConfig):
    if cfg.runtime.remat == "none":
        return cls
    policy = (jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
              if cfg.runtime.remat == "dots" else None)
    return nn.remat(cls, policy=policy, static_argnums=())


class LayerGroup(nn.Module):
    """One repeated group; the scan body. Its sublayers are named by position in the group;
    `pushes[j]`: whether slot j starts an AttnRes block in any of the groups."""
    cfg: ModelConfig
    kinds: tuple[tuple[str, str], ...]
    pushes: tuple[bool, ...] = ()

    @nn.compact
    def __call__(self, res: Residual, segment_ids, first_layer_idx, cache=None, pos=None):
        layer_cls = _remat(DecoderLayer, self.cfg)
        updates = None if cache is None else {}
        if cache is not None:   # the group's stacked caches, whole: this group's place in them
            plan = layer_plan(self.cfg)
            cache = {name: _group_view(c, (first_layer_idx - plan.group_start) // plan.group_size)
                     for name, c in cache.items()}
        pushes = self.pushes or (True,) * len(self.kinds)
        for j, (attn_kind, ffn_kind) in enumerate(self.kinds):
            name = slot_name(j)
            if pushes[j] and res.pending is not None:   # a second push in one group: write the first
                res = Residual(res.p, *flush_block(res.stack, res.count, res.pending, res.has_pending))
            res, u = layer_cls(self.cfg, attn_kind, ffn_kind, pushes[j], True, name=name)(
                res, segment_ids, first_layer_idx + j, None if cache is None else cache[name], pos)
            if cache is not None:
                updates[name] = u
        if res.pending is not None:
            res = Residual(res.p, *flush_block(res.stack, res.count, res.pending, res.has_pending))
        return res, updates


def _group_view(layer_cache: dict, g):
    """One scanned layer's cache from its stacks: the MLA latents ('kv') as a StackedPast
    its two products slice themselves, the rest (KDA state, conv tails: one reader each)
    sliced here."""
    return {k: StackedPast(v, g) if k == "kv" else jax.lax.dynamic_index_in_dim(v, g, 0, keepdims=False)
            for k, v in layer_cache.items()}


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------
class K3Model(nn.Module):
    """`apply({'params': p}, tokens, segment_ids=None) -> logits [B, T, V] fp32`.

    segment_ids [B, T] marks packed documents (equal ids = one document, contiguous): KDA
    state and conv tails reset at each boundary and MLA never attends across one.

    `apply(..., tokens, cache=layers, pos=(lengths, n_new))` continues cached sequences
    (k3jax.infer): `layers` holds each layer's past cache under its param name (scanned
    groups stacked on a leading axis), lengths [B] the tokens already cached per row and
    n_new [B] the real tokens of this call per row (the rest is right padding). Returns
    (logits [B, V] at each row's last real token, per-layer updates named likewise).

    `image_features` [N, D] with `feature_rows` [B, T] int32 (k3jax.model.multimodal):
    position (b, t) takes feature row `feature_rows[b, t]` instead of its token embedding
    where that is >= 0. The vision tower runs outside, so its params and the text params
    stay separate trees and a chunked prefill can hand each piece the rows it covers.
    """
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, cache=None, pos=None, image_features=None, feature_rows=None):
        cfg = self.cfg
        validate_inputs(cfg, tokens, segment_ids)
        plan = layer_plan(cfg)
        emb = _embedding(cfg)
        h = emb(tokens)
        if image_features is not None:
            h = splice_features(h, image_features, feature_rows)
        h = constrain(h, ("batch", "length", "embed"))
        B, T, D = h.shape
        n_blocks = cfg.max_attn_res_blocks
        res = Residual(h, jnp.zeros((n_blocks, B, T, D), h.dtype), jnp.zeros((), jnp.int32))
        updates = None if cache is None else {}

        def unrolled(res, i):
            name = unrolled_name(i)
            may_push = cfg.use_attn_res and i % cfg.attn_res_block_size == 0
            res, u = layer_cls(cfg, cfg.layer_kinds[i], cfg.ffn_kinds[i], may_push, name=name)(
                res, segment_ids, i, None if cache is None else cache[name], pos)
            if cache is not None:
                updates[name] = u
            return res

        layer_cls = _remat(DecoderLayer, cfg)
        for i in plan.head:
            res = unrolled(res, i)
        if plan.n_groups:
            Scanned = nn.scan(LayerGroup, variable_axes={"params": 0, "intermediates": 0, LORA_KEY: 0},
                              split_rngs={"params": True, LORA_KEY: True},
                              in_axes=(nn.broadcast, 0, nn.broadcast, nn.broadcast),
                              length=plan.n_groups, metadata_params={nn.PARTITION_NAME: "layers"})
            firsts = plan.group_start + plan.group_size * jnp.arange(plan.n_groups, dtype=jnp.int32)
            res, u = Scanned(cfg, plan.group, slot_pushes(cfg, plan), name=GROUPS)(
                res, segment_ids, firsts, None if cache is None else cache[GROUPS], pos)
            if cache is not None:
                updates[GROUPS] = u
        for i in plan.tail:
            res = unrolled(res, i)

        h = res.p
        if cache is not None:  # only each row's last real token is needed from here on
            last = jnp.maximum(pos[1] - 1, 0)[:, None, None]
            h = jnp.take_along_axis(h, last, axis=1)
            stack = jnp.take_along_axis(res.stack, last[None], axis=2) if res.stack.shape[0] else res.stack
            res = Residual(h, stack, res.count)
        # rematerialised with the layers: left alone it would save fp32 copies of the whole stack
        h = _output_attn_res(cfg)(res.stack, res.count, res.p) if cfg.use_attn_res else res.p
        h = _final_norm(cfg)(h)
        logits = emb.attend(h) if cfg.tie_word_embeddings else _lm_head(cfg)(h)
        if cache is not None:
            return logits[:, 0].astype(jnp.float32), updates
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


def splice_features(h, features, rows):
    """h [B, T, D] with (b, t) replaced by features[rows[b, t]] wherever rows[b, t] >= 0."""
    if rows is None or tuple(rows.shape) != tuple(h.shape[:2]):
        raise InputError(f"feature_rows must be [batch, length] = {tuple(h.shape[:2])} next to image_features, "
                         f"got {None if rows is None else tuple(rows.shape)}")
    if features.ndim != 2 or features.shape[1] != h.shape[-1]:
        raise InputError(f"image_features must be [rows, hidden_size={h.shape[-1]}], got {tuple(features.shape)}")
    return splice_rows(h, features, rows)


def validate_inputs(cfg: ModelConfig, tokens, segment_ids=None):
    """Shape checks always (shapes are static); value checks when the ids are concrete,
    i.e. before anything is traced or compiled."""
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 2:
        raise InputError(f"tokens must be [batch, length] integer ids, got shape {shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise InputError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if shape[1] > cfg.max_position_embeddings:
        raise InputError(f"input length {shape[1]} exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(shape):
        raise InputError(f"segment_ids shape {tuple(segment_ids.shape)} != tokens shape {tuple(shape)}")
    if not isinstance(tokens, jax.core.Tracer) and tokens.size:
        check_token_ids(tokens, cfg.vocab_size, "tokens")


# The params outside the decoder layers, each declared once: K3Model builds them here, and
# `init_params` (which initialises the layers apart, per kind) through _TopLevel.
def _embedding(cfg: ModelConfig) -> TokenEmbed:
    return TokenEmbed(cfg.vocab_size, cfg.hidden_size, dtype=compute_dtype(cfg), param_dtype=param_dtype(cfg),
                      embedding_init=logical(nn.initializers.normal(1.0), ("vocab", "embed")), name="embed_tokens")


def _output_attn_res(cfg: ModelConfig):
    # rematerialised with the layers: left alone it would save fp32 copies of the whole stack
    cls = nn.remat(AttnRes) if cfg.runtime.remat != "none" else AttnRes
    return cls(cfg.rms_norm_eps, name="output_attn_res")


def _final_norm(cfg: ModelConfig) -> RMSNorm:
    return RMSNorm(cfg.rms_norm_eps, name="norm")


def _lm_head(cfg: ModelConfig):
    return dense(cfg, cfg.vocab_size, ("embed", "vocab"), "lm_head")


class TopLevel(nn.Module):
    """The params outside the decoder layers (K3Model's own declarations): `init_params`
    initialises them apart from the layers."""
    cfg: ModelConfig

    @nn.compact
    def __call__(self, h):
        cfg = self.cfg
        _embedding(cfg)(jnp.zeros(h.shape[:2], jnp.int32))
        if cfg.use_attn_res:
            _output_attn_res(cfg)(None, 0, h)
        h = _final_norm(cfg)(h)
        if not cfg.tie_word_embeddings:
            _lm_head(cfg)(h)


def forward(cfg: ModelConfig, params, tokens, segment_ids=None):
    """fp32 logits for concrete inputs, validated before anything is compiled."""
    validate_inputs(cfg, tokens, segment_ids)
    return _forward_jit(cfg, params, tokens, segment_ids)


@functools.partial(jax.jit, static_argnums=0)
def _forward_jit(cfg, params, tokens, segment_ids):
    return K3Model(cfg).apply(variables_of(params), tokens, segment_ids)
