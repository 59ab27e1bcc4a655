"""The name map between the released checkpoint layouts and k3jax's param tree.

One entry per checkpoint tensor: where it lands in the tree (path + index along stacked
leading axes) and how it is transformed. Everything that reads or writes checkpoints goes
through `tensor_map`, so the two directions cannot drift apart.

Layouts: K3 (`language_model.model.…`, `language_model.lm_head`) and Kimi-Linear
(`model.…`, `lm_head`). Routed experts are either `experts.E.wN.weight` (unquantized) or
`experts.E.wN.weight_packed` + `.weight_scale` (MXFP4); the map names the expert base and
the reader picks whichever is present.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3jax.checkpoint.vision_names import vision_tensor_map
from k3jax.config import EXPERT_ROLES, ConfigError, ModelConfig, VisionConfig
from k3jax import layout
from k3jax.layout import layer_plan

# transforms (checkpoint -> tree):
#   copy    same array
#   T       [out, in] -> [in, out]
#   conv    [C, 1, W] -> [W, C]
#   row     [1, D] -> [D]
#   a_log   [H] | [1, 1, H, 1] | [>= H] zero-padded -> [H]
#   expertT [out, in] -> [in, out], placed at index (..., e)
TRANSFORMS = ("copy", "T", "conv", "row", "a_log", "expertT")


@dataclass(frozen=True)
class TensorEntry:
    hf: str                      # checkpoint name (for experts: the base without .weight*)
    path: tuple[str, ...]        # param tree path
    index: tuple[int, ...]       # index along the leaf's stacked leading axes
    transform: str
    is_expert: bool = False

    @property
    def hf_names(self) -> tuple[str, ...]:
        """Names this entry may appear under in a checkpoint."""
        if self.is_expert:
            return (f"{self.hf}.weight", f"{self.hf}.weight_packed", f"{self.hf}.weight_scale")
        return (self.hf,)


def hf_prefixes(layout: str) -> tuple[str, str]:
    """(model prefix, lm_head name) of a layout: 'k3' or 'kimi_linear'."""
    if layout == "k3":
        return "language_model.model.", "language_model.lm_head.weight"
    if layout == "kimi_linear":
        return "model.", "lm_head.weight"
    raise ConfigError(f"unknown checkpoint layout {layout!r} (expected 'k3' or 'kimi_linear')")


def layer_location(cfg: ModelConfig, layer: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Tree prefix and stacked index of 0-based decoder layer `layer`."""
    return layout.layer_location(layer_plan(cfg), layer)


def _linear(hf_base, path, index):
    return TensorEntry(f"{hf_base}.weight", path + ("kernel",), index, "T")


def _layer_entries(cfg: ModelConfig, layer: int, pre: str, dense_mlp_name: str):
    loc, idx = layer_location(cfg, layer)
    hp = f"{pre}layers.{layer}."
    out = []

    def lin(name, *tree):
        out.append(_linear(hp + name, loc + tree, idx))

    def leaf(name, transform, *tree):
        out.append(TensorEntry(hp + name, loc + tree, idx, transform))

    leaf("input_layernorm.weight", "copy", "input_layernorm", "weight")
    leaf("post_attention_layernorm.weight", "copy", "post_attention_layernorm", "weight")
    if cfg.use_attn_res:
        for site in ("self_attention_res", "mlp_res"):
            leaf(f"{site}_norm.weight", "copy", site, "norm")
            leaf(f"{site}_proj.weight", "row", site, "proj")

    a = "self_attn."
    if cfg.layer_kinds[layer] == "kda":
        for n in ("q", "k", "v"):
            lin(f"{a}{n}_proj", "self_attn", f"{n}_proj")
            leaf(f"{a}{n}_conv1d.weight", "conv", "self_attn", f"{n}_conv1d")
        for n in ("f_a_proj", "f_b_proj", "b_proj", "o_proj"):
            lin(a + n, "self_attn", n)
        for n in (("g_proj",) if cfg.use_full_rank_gate else ("g_a_proj", "g_b_proj")):
            lin(a + n, "self_attn", n)
        leaf(f"{a}A_log", "a_log", "self_attn", "A_log")
        leaf(f"{a}dt_bias", "copy", "self_attn", "dt_bias")
        leaf(f"{a}o_norm.weight", "copy", "self_attn", "o_norm", "weight")
    else:
        if cfg.q_lora_rank is not None:
            lin(f"{a}q_a_proj", "self_attn", "q_a_proj")
            leaf(f"{a}q_a_layernorm.weight", "copy", "self_attn", "q_a_layernorm", "weight")
            lin(f"{a}q_b_proj", "self_attn", "q_b_proj")
        else:
            lin(f"{a}q_proj", "self_attn", "q_proj")
        lin(f"{a}kv_a_proj_with_mqa", "self_attn", "kv_a_proj_with_mqa")
        leaf(f"{a}kv_a_layernorm.weight", "copy", "self_attn", "kv_a_layernorm", "weight")
        lin(f"{a}kv_b_proj", "self_attn", "kv_b_proj")
        if cfg.mla_use_output_gate:
            lin(f"{a}g_proj", "self_attn", "g_proj")
        lin(f"{a}o_proj", "self_attn", "o_proj")

    if cfg.ffn_kinds[layer] == "dense":
        for n in ("gate_proj", "up_proj", "down_proj"):
            lin(f"{dense_mlp_name}.{n}", "mlp", n)
    else:
        m = "block_sparse_moe."
        out.append(TensorEntry(f"{hp}{m}gate.weight", loc + ("block_sparse_moe", "gate"), idx, "T"))
        leaf(f"{m}gate.e_score_correction_bias", "copy", "block_sparse_moe", "e_score_correction_bias")
        if cfg.use_latent_moe:
            lin(f"{m}routed_expert_down_proj", "block_sparse_moe", "routed_expert_down_proj")
            lin(f"{m}routed_expert_up_proj", "block_sparse_moe", "routed_expert_up_proj")
            if cfg.latent_moe_use_norm:
                leaf(f"{m}routed_expert_norm.weight", "copy", "block_sparse_moe", "routed_expert_norm", "weight")
        if cfg.num_shared_experts:
            for n in ("gate_proj", "up_proj", "down_proj"):
                lin(f"{m}shared_experts.{n}", "block_sparse_moe", "shared_experts", n)
        for e in range(cfg.num_experts):
            for w in EXPERT_ROLES:
                out.append(TensorEntry(f"{hp}{m}experts.{e}.{w}", loc + ("block_sparse_moe", w), idx + (e,),
                                       "expertT", is_expert=True))
    return out


def tensor_map(cfg: ModelConfig, layout: str = "k3", dense_mlp_name: str = "mlp") -> list[TensorEntry]:
    """Every checkpoint tensor of the text model, in checkpoint order.

    `dense_mlp_name`: the released files call layer 0's dense MLP `mlp`; transformers'
    `save_pretrained` writes `block_sparse_moe` — pass that name to read or write those.
    """
    pre, head = hf_prefixes(layout)
    out = [TensorEntry(f"{pre}embed_tokens.weight", ("embed_tokens", "embedding"), (), "copy")]
    for layer in range(cfg.num_hidden_layers):
        out += _layer_entries(cfg, layer, pre, dense_mlp_name)
    out.append(TensorEntry(f"{pre}norm.weight", ("norm", "weight"), (), "copy"))
    if cfg.use_attn_res:
        out.append(TensorEntry(f"{pre}output_attn_res_norm.weight", ("output_attn_res", "norm"), (), "copy"))
        out.append(TensorEntry(f"{pre}output_attn_res_proj.weight", ("output_attn_res", "proj"), (), "row"))
    if not cfg.tie_word_embeddings:
        out.append(TensorEntry(head, ("lm_head", "kernel"), (), "T"))
    return out


def stored_shape(entry: TensorEntry, slot_shape: tuple[int, ...], cfg: ModelConfig, layout: str) -> tuple[int, ...]:
    """The checkpoint shape of an entry whose tree slot has `slot_shape` (experts unpacked)."""
    t = entry.transform
    if t in ("T", "expertT"):
        return tuple(reversed(slot_shape))
    if t == "conv":
        return (slot_shape[1], 1, slot_shape[0])
    if t == "row":
        return (1, slot_shape[0])
    if t == "a_log":  # K3 zero-pads the per-head vector to head_dim; Kimi-Linear keeps [1, 1, H, 1]
        return (max(slot_shape[0], cfg.kda_head_dim),) if layout == "k3" else (1, 1, slot_shape[0], 1)
    return tuple(slot_shape)


# ---------------------------------------------------------------------------------------
# Vision tower and projector (SPEC §6/§7): their one name list is checkpoint.vision_names.
# ---------------------------------------------------------------------------------------
def vision_names(vision: VisionConfig | None) -> list[str]:
    """Every vision-tower and projector tensor a config implies, in checkpoint order."""
    return [] if vision is None else [e.hf for e in vision_tensor_map(vision)]


# Tensors the released checkpoint keeps in float32; every other float tensor is bf16.
_FP32_SUFFIXES = ("self_attn.A_log", "self_attn.dt_bias", "_conv1d.weight", "self_attn.o_norm.weight",
                  "gate.e_score_correction_bias")


def release_dtype(name: str) -> str:
    """safetensors dtype the released checkpoint uses for a (non-MXFP4) tensor name."""
    return "F32" if name.endswith(_FP32_SUFFIXES) else "BF16"
