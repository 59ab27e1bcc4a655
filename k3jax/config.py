"""Model configuration: the real `config.json` keys, validated, and back again.

`ModelConfig.from_hf` accepts a top-level `kimi_k3` config (with `text_config` and
`vision_config`) or a bare `kimi_linear` one. Layer lists stay 1-based as in the checkpoint;
`layer_kinds` turns them into 0-based kinds. Keys that transformers' `PretrainedConfig`
writes on every model (generation defaults and the like) are carried through untouched so
`to_hf()` round-trips; any other unknown key is an error that names it, because a
silently ignored architecture key is a silently wrong model.

Runtime choices (dtypes, which KDA / MoE implementation, scanning) are not part of the
checkpoint and live in `RuntimeOptions`, attached to the config as `cfg.runtime`.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from k3jax.configfiles import deep_merge, read_json_or_dict
from k3jax.errors import ConfigError

def _config_dir() -> str:
    """The presets: the repository's configs/ in a source tree, else the copy the wheel
    installs as k3jax/presets (setup.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(os.path.dirname(here), "configs")
    return source if os.path.isdir(source) else os.path.join(here, "presets")


CONFIG_DIR = _config_dir()


# Keys every transformers PretrainedConfig serialises; they do not change the architecture.
_HF_GENERIC_KEYS = frozenset("""
_name_or_path add_cross_attention architectures auto_map bad_words_ids begin_suppress_tokens
chunk_size_feed_forward cross_attention_hidden_size decoder_start_token_id diversity_penalty
do_sample dtype torch_dtype early_stopping encoder_no_repeat_ngram_size exponential_decay_length_penalty
finetuning_task forced_bos_token_id forced_eos_token_id id2label label2id initializer_range
is_decoder is_encoder_decoder length_penalty max_length min_length no_repeat_ngram_size
num_beam_groups num_beams num_return_sequences output_attentions output_hidden_states
output_scores prefix problem_type pruned_heads remove_invalid_values repetition_penalty
return_dict return_dict_in_generate sep_token_id suppress_tokens task_specific_params
temperature tf_legacy_loss tie_encoder_decoder tokenizer_class top_k top_p torchscript
transformers_version typical_p use_bfloat16 use_cache quantization_config head_dim
rope_theta rope_scaling model_max_length _attn_implementation ignore_index
image_placeholder media_placeholder_token_id
""".split())

# Keys transformers' own `kimi_linear` config writes that restate other keys or fixed
# defaults. They are accepted (and written back) only when they agree with what they restate.
_TRANSFORMERS_RESTATED = {
    "layer_types": lambda c: ["linear_attention" if k == "kda" else "full_attention" for k in c.layer_kinds],
    "mlp_layer_types": lambda c: ["sparse" if k == "moe" else "dense" for k in c.ffn_kinds],
    "linear_conv_kernel_dim": lambda c: c.short_conv_kernel_size,
    "linear_head_dim": lambda c: c.kda_head_dim,
    "linear_num_heads": lambda c: c.kda_num_heads,
    "qk_head_dim": lambda c: c.q_head_dim,
    "attention_bias": lambda c: False,
    "attention_dropout": lambda c: 0.0,
    "pretraining_tp": lambda c: 1,
    "output_router_logits": lambda c: False,
}

_LINEAR_ATTN_KEYS = {"kda_layers", "full_attn_layers", "head_dim", "num_heads",
                     "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate"}


KDA_IMPLS = ("auto", "recurrent", "chunk", "assoc", "pallas")
MOE_DISPATCHES = ("auto", "dense", "ragged", "ep", "gather")
DECODE_ATTENTIONS = ("auto", "xla", "pallas")
EP_EXCHANGES = ("auto", "padded", "ragged", "emulated")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")
EXPERT_FORMATS = ("bf16", "mxfp4")
LORA_EXPERT_MODES = ("per_expert", "shared_a")
OBJECTIVES = ("sft", "dpo", "grpo")   # a train config's `objective` (k3jax.train.objectives)


@dataclass(frozen=True)
class LoraSpec:
    """Which projections carry low-rank adapters and their size (resolved from the train
    config's `lora:` section by `k3jax.lora`; never part of config.json).

    `targets` are module paths inside a decoder layer ('self_attn/q_proj',
    'block_sparse_moe/w1', 'block_sparse_moe/shared_experts/up_proj', ...): scanned layers
    share one structure, so a target holds for every layer of a kind. A dense target adds
    W + (alpha/rank)·A·B; a routed-expert target (w1/w2/w3) adds per expert
    (alpha/expert_rank)·A_e·B_e, with one A for all experts under 'shared_a'.
    """
    rank: int
    alpha: float
    targets: frozenset = frozenset()
    expert_rank: int | None = None          # None: `rank`
    expert_mode: str = "per_expert"         # 'per_expert' | 'shared_a'

    def __post_init__(self):
        _check(isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank > 0,
               "lora.rank", self.rank, "must be a positive integer (0 turns LoRA off)")
        _check(self.alpha > 0, "lora.alpha", self.alpha, "must be positive")
        er = self.expert_rank
        _check(er is None or (isinstance(er, int) and not isinstance(er, bool) and er > 0),
               "lora.expert_rank", er, "must be a positive integer or null (= rank)")
        _check(self.expert_mode in LORA_EXPERT_MODES, "lora.expert_mode", self.expert_mode,
               f"expected one of {LORA_EXPERT_MODES}")

    def rank_of(self, target: str) -> int:
        return (self.expert_rank or self.rank) if is_expert_target(target) else self.rank

    def scale_of(self, target: str) -> float:
        return self.alpha / self.rank_of(target)


EXPERT_ROLES = ("w1", "w2", "w3")   # the routed experts' stacked weights, under block_sparse_moe


def expert_role(path) -> str | None:
    """Which routed-expert weight (w1 | w2 | w3) a param path lies in, None for any other
    param: the one place "is this a routed expert?" is answered. `path`: 'a/b/c' or a key
    path (jax's tree path or strings); the leaf may be the stack, its MXFP4 parts or an
    adapter of it ('.../block_sparse_moe/w1/weight_packed', '.../w2/lora_a')."""
    keys = path.split("/") if isinstance(path, str) else [str(getattr(k, "key", k)) for k in path]
    for a, b in zip(keys, keys[1:]):
        if a == "block_sparse_moe" and b in EXPERT_ROLES:
            return b
    return None


def is_expert_target(target: str) -> bool:
    """A LoRA target naming a stacked routed-expert weight itself ('.../block_sparse_moe/w1')."""
    return expert_role(target) is not None and target.split("/")[-1] in EXPERT_ROLES


@dataclass(frozen=True)
class RuntimeOptions:
    """How to run the model; never written to config.json."""
    dtype: str = "float32"            # activations / compute
    param_dtype: str = "float32"      # bf16 for real checkpoints; fp32-only params stay fp32
    # 'auto' (the fastest measured for the backend and shape: ops.kda.resolve_impl) |
    # 'recurrent' | 'chunk' | 'assoc' | 'pallas' (k3jax.ops.kda)
    kda_impl: str = "auto"
    kda_chunk_size: int = 64
    # 'auto' ('ep' on a mesh with an expert axis, else 'ragged'; 'gather' for fewer pairs than
    # a device's experts and for inference calls of at most 128 tokens) | 'dense' | 'ragged' |
    # 'ep' | 'gather' (decode): k3jax.ops.moe_dispatch
    moe_dispatch: str = "auto"
    # how 'ep' moves pairs: 'auto' (ragged_all_to_all on TPU/GPU, a padded all_to_all on
    # CPU, which has no ragged one) | 'padded' | 'ragged' | 'emulated' (ragged's bookkeeping
    # through a padded all_to_all: what CPU tests check the ragged exchange with)
    ep_exchange: str = "auto"
    # 'ep' receive buffers: 0 = dropless (sized for the worst case, expert-axis × the mean);
    # c > 0 = at most ceil(c · tokens · k) pairs per device and layer, the rest dropped
    ep_capacity_factor: float = 0.0
    # c > 0: dropless 'ep' (ep_capacity_factor 0) exchanges a first round whose receive
    # buffer is c x the mean (the expected load), then overflow windows as large, each run
    # only when some device received more (ops.moe_dispatch.ep_rounds): exact, and under
    # balanced routing the capacity step's work and buffers. 0 (default) = one round sized
    # for the worst case. The v5p-1024-cp4 preset sets 1.25: K3's step 51.4 s -> 10.6 s
    # (docs/performance.md)
    ep_first_round: float = 0.0
    # 'ep' receive buffers above this many MiB per device run the tokens in chunks
    # (layers/moe.py ep_chunks); 0 = one exchange however large
    ep_buffer_mib: float = 1024.0
    # MLA over whole sequences runs its queries in blocks of this many tokens (0 = all at
    # once): the fp32 scores alive at once are [heads, block, T], not [heads, T, T]
    attention_q_block: int = 1024
    # MLA over cached latents (decode, prefill chunks after the first): 'pallas' reads the
    # cache once (k3jax.ops.latent_attention), 'xla' in two products that each read it;
    # 'auto' = 'pallas' on TPU, 'xla' elsewhere (the kernel is interpreted on CPU)
    decode_attention: str = "auto"
    scan_layers: bool = True          # nn.scan over the repeated layer groups
    remat: str = "none"               # 'none' | 'full' | 'dots'
    # routed experts held widened to param_dtype ('bf16') or as the checkpoint's own MXFP4
    # bytes ('mxfp4': E2M1 codes + E8M0 scales, dequantized tile by tile inside the matmul;
    # frozen, as integers have no gradient)
    expert_format: str = "bf16"
    lora: LoraSpec | None = None      # low-rank adapters (k3jax.lora); None = off
    # quantization-aware fine-tuning (the train config's top-level `qat:`): the forward sees
    # every weight as the export stores it (routed experts MXFP4 of W + s·A·B, the rest
    # bf16), gradients straight through (k3jax.ops.qat, k3jax.train.qat)
    qat: bool = False
    # training: the optimizer state kept in the host's pinned memory between updates, on the
    # device only for the update (k3jax/train/offload.py): its HBM is free while the
    # microbatches run
    optimizer_offload: bool = False

    def __post_init__(self):
        _check(self.kda_impl in KDA_IMPLS, "kda_impl", self.kda_impl, f"expected one of {KDA_IMPLS}")
        _check(self.moe_dispatch in MOE_DISPATCHES, "moe_dispatch", self.moe_dispatch,
               f"expected one of {MOE_DISPATCHES}")
        _check(self.ep_exchange in EP_EXCHANGES, "ep_exchange", self.ep_exchange, f"expected one of {EP_EXCHANGES}")
        _check(self.decode_attention in DECODE_ATTENTIONS, "decode_attention", self.decode_attention,
               f"expected one of {DECODE_ATTENTIONS}")
        _check(self.kda_chunk_size > 0, "kda_chunk_size", self.kda_chunk_size)
        _check(isinstance(self.attention_q_block, int) and self.attention_q_block >= 0, "attention_q_block",
               self.attention_q_block, "must be a non-negative integer")
        _check(self.ep_capacity_factor >= 0, "ep_capacity_factor", self.ep_capacity_factor, "must be >= 0")
        _check(self.ep_buffer_mib >= 0, "ep_buffer_mib", self.ep_buffer_mib, "must be >= 0")
        _check(self.ep_first_round >= 0, "ep_first_round", self.ep_first_round, "must be >= 0")
        _check(self.remat in REMAT_POLICIES, "remat", self.remat, f"expected one of {REMAT_POLICIES}")
        _check(self.expert_format in EXPERT_FORMATS, "expert_format", self.expert_format,
               f"expected one of {EXPERT_FORMATS}")
        _check(isinstance(self.qat, bool), "qat", self.qat, "expected true or false")
        _check(isinstance(self.optimizer_offload, bool), "optimizer_offload", self.optimizer_offload,
               "expected true or false")
        _check(self.lora is None or isinstance(self.lora, LoraSpec), "lora", self.lora,
               "expected a LoraSpec (resolve a train config's lora: section with k3jax.lora)")
        for key in ("dtype", "param_dtype"):
            _check(getattr(self, key) in DTYPES, key, getattr(self, key), f"expected one of {DTYPES}")


def _check(ok: bool, key: str, value: Any, why: str = "invalid value"):
    if not ok:
        raise ConfigError(f"config key {key!r}: {why} ({value!r})")


@dataclass(frozen=True)
class ModelConfig:
    """The text tower (K3's `text_config`, or a whole `kimi_linear` config)."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    # KDA (linear_attn_config); layer lists are 1-based as in the checkpoint
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    kda_head_dim: int
    kda_num_heads: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_key_value_heads: int | None = None
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    # MoE
    num_experts: int | None = None
    num_experts_per_token: int | None = None
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    num_expert_group: int = 1
    topk_group: int = 1
    use_grouped_topk: bool = True
    topk_method: str = "noaux_tc"
    # activations, residuals
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "kimi_linear"
    # everything else from the HF dict, kept verbatim for to_hf()
    hf_extra: dict = field(default_factory=dict, compare=False, repr=False)
    hf_linear_attn_extra: dict = field(default_factory=dict, compare=False, repr=False)
    hf_keys: tuple = field(default=(), compare=False, repr=False)  # keys the source dict had
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)

    def __post_init__(self):
        self._validate()

    # ---- derived facts (one source: the fields above) -------------------------------
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """0-based attention kind per layer: 'kda' or 'mla'."""
        kda = set(self.kda_layers)
        return tuple("kda" if i + 1 in kda else "mla" for i in range(self.num_hidden_layers))

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """0-based feed-forward kind per layer: 'dense' or 'moe' (the reference's rule)."""
        def is_moe(i):
            return (self.num_experts is not None and i >= self.first_k_dense_replace
                    and i % self.moe_layer_freq == 0)
        return tuple("moe" if is_moe(i) else "dense" for i in range(self.num_hidden_layers))

    @property
    def use_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def max_attn_res_blocks(self) -> int:
        """Entries the AttnRes stack can hold: one push per block start."""
        if not self.use_attn_res:
            return 0
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    @property
    def use_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def moe_hidden_size(self) -> int:
        return self.routed_expert_hidden_size if self.use_latent_moe else self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return (self.moe_intermediate_size or 0) * self.num_shared_experts

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # Fixed by the reference code, not by config.json: its MLA latent norms are built with
    # the default eps, and the KDA kernels L2-normalise q and k with this eps.
    mla_norm_eps = 1e-6
    kda_qk_l2_eps = 1e-6

    @property
    def mla_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def with_runtime(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, runtime=dataclasses.replace(self.runtime, **changes))

    # ---- validation ------------------------------------------------------------------
    def _validate(self):
        L = self.num_hidden_layers
        _check(L > 0, "num_hidden_layers", L)
        for key in ("vocab_size", "hidden_size", "num_attention_heads", "kda_head_dim",
                    "kda_num_heads", "short_conv_kernel_size", "kv_lora_rank", "v_head_dim",
                    "qk_nope_head_dim", "max_position_embeddings"):
            _check(isinstance(getattr(self, key), int) and getattr(self, key) > 0, key,
                   getattr(self, key), "must be a positive integer")
        _check(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", self.qk_rope_head_dim)
        kda, full = list(self.kda_layers), list(self.full_attn_layers)
        both = sorted(set(kda) & set(full))
        _check(not both, "linear_attn_config.kda_layers", both, "layers listed as both KDA and full attention")
        for key, lst in (("linear_attn_config.kda_layers", kda), ("linear_attn_config.full_attn_layers", full)):
            _check(len(set(lst)) == len(lst), key, lst, "duplicate layers")
            bad = [i for i in lst if not (isinstance(i, int) and 1 <= i <= L)]
            _check(not bad, key, bad, f"layers are 1-based and must lie in 1..{L}")
        missing = sorted(set(range(1, L + 1)) - set(kda) - set(full))
        _check(not missing, "linear_attn_config", missing, "layers in neither kda_layers nor full_attn_layers")
        _check(self.hidden_act in ("situ", "silu"), "hidden_act", self.hidden_act)
        if self.hidden_act == "situ":
            for key in ("activation_situ_beta", "activation_situ_linear_beta"):
                v = getattr(self, key)
                _check(v is None or v > 0, key, v, "must be positive")
        _check(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func",
               self.moe_router_activation_func, "only the sigmoid router is implemented")
        if self.attn_res_block_size is not None:
            _check(isinstance(self.attn_res_block_size, int) and self.attn_res_block_size > 0,
                   "attn_res_block_size", self.attn_res_block_size, "must be a positive integer")
        nkv = self.num_key_value_heads or self.num_attention_heads
        _check(self.num_attention_heads % nkv == 0, "num_key_value_heads", nkv,
               f"must divide num_attention_heads={self.num_attention_heads}")
        _check(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", self.q_lora_rank)
        _check(self.mla_use_nope, "mla_use_nope", self.mla_use_nope, "only NoPE MLA exists in Kimi models")
        if self.gate_lower_bound is not None:
            _check(self.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound", self.gate_lower_bound,
                   "must be negative")
        if self.num_experts is not None:
            E, k = self.num_experts, self.num_experts_per_token
            _check(isinstance(E, int) and E > 0, "num_experts", E)
            _check(isinstance(k, int) and 0 < k <= E, "num_experts_per_token", k,
                   f"must lie in 1..num_experts={E}")
            _check(self.moe_intermediate_size is not None and self.moe_intermediate_size > 0,
                   "moe_intermediate_size", self.moe_intermediate_size)
            _check(self.moe_layer_freq > 0, "moe_layer_freq", self.moe_layer_freq)
            _check(E % self.num_expert_group == 0, "num_expert_group", self.num_expert_group,
                   f"must divide num_experts={E}")
            _check(self.num_expert_group == 1 or self.topk_group >= self.num_expert_group,
                   "num_expert_group", self.num_expert_group, "grouped top-k routing is not used by Kimi models")
            _check(self.num_shared_experts >= 0, "num_shared_experts", self.num_shared_experts)
        if self.routed_expert_hidden_size is not None:
            _check(self.routed_expert_hidden_size > 0, "routed_expert_hidden_size", self.routed_expert_hidden_size)
        for key, derive in _TRANSFORMERS_RESTATED.items():
            if key in self.hf_extra:
                _check(self.hf_extra[key] == derive(self), key, self.hf_extra[key],
                       f"disagrees with the keys it restates (expected {derive(self)!r})")
        _check(self.num_nextn_predict_layers == 0, "num_nextn_predict_layers", self.num_nextn_predict_layers,
               "multi-token-prediction heads are not part of the released models")

    # ---- HF dict <-> config -----------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict, runtime: RuntimeOptions | None = None) -> "ModelConfig":
        """From a `config.json` path, a directory holding one, or its dict."""
        hf = read_json_or_dict(path_or_dict)
        if hf.get("model_type") == "kimi_k3":
            text = hf.get("text_config")
            _check(isinstance(text, dict), "text_config", type(text).__name__, "kimi_k3 needs a text_config dict")
            return cls._from_text_dict(text, runtime)
        return cls._from_text_dict(hf, runtime)

    @classmethod
    def _from_text_dict(cls, d: dict, runtime: RuntimeOptions | None) -> "ModelConfig":
        d = copy.deepcopy(d)
        mt = d.get("model_type", "kimi_linear")
        _check(mt == "kimi_linear", "model_type", mt, "expected 'kimi_linear' (or a 'kimi_k3' wrapper)")
        lac = d.pop("linear_attn_config", None)
        _check(isinstance(lac, dict), "linear_attn_config", lac, "KDA layers need a linear_attn_config dict")
        unknown = sorted(set(lac) - _LINEAR_ATTN_KEYS)
        _check(not unknown, f"linear_attn_config.{unknown[0] if unknown else ''}", unknown, "unknown key")
        for key in ("kda_layers", "full_attn_layers", "head_dim", "num_heads"):
            _check(key in lac, f"linear_attn_config.{key}", None, "missing")
        names = {f.name for f in dataclasses.fields(cls)} - {
            "kda_layers", "full_attn_layers", "kda_head_dim", "kda_num_heads", "short_conv_kernel_size",
            "gate_lower_bound", "use_full_rank_gate", "hf_extra", "hf_linear_attn_extra", "hf_keys", "runtime"}
        kwargs, extra = {}, {}
        for key, value in d.items():
            if key in names:
                kwargs[key] = value
            elif key in _HF_GENERIC_KEYS or key in _TRANSFORMERS_RESTATED:
                extra[key] = value
            else:
                raise ConfigError(f"config key {key!r}: unknown key (not part of the kimi_linear schema)")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "rms_norm_eps", "hidden_act"):
            _check(key in kwargs, key, None, "missing")
        # the schema's default; configs that only state model_max_length mean that limit
        kwargs.setdefault("max_position_embeddings", extra.get("model_max_length", 4096))
        lac_present = {k: lac[k] for k in ("short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate")
                       if k in lac}
        return cls(
            kda_layers=tuple(lac["kda_layers"]), full_attn_layers=tuple(lac["full_attn_layers"]),
            kda_head_dim=lac["head_dim"], kda_num_heads=lac["num_heads"], **lac_present, **kwargs,
            hf_extra=extra, hf_linear_attn_extra={"_keys": [k for k in lac]}, hf_keys=tuple(d),
            runtime=runtime or RuntimeOptions())

    def to_hf(self) -> dict:
        """The `kimi_linear` dict (the K3 `text_config`); keys as the checkpoint writes them."""
        skip = {"kda_layers", "full_attn_layers", "kda_head_dim", "kda_num_heads", "short_conv_kernel_size",
                "gate_lower_bound", "use_full_rank_gate", "hf_extra", "hf_linear_attn_extra", "hf_keys", "runtime"}
        out = dict(self.hf_extra)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # keys the source left out stay out, unless they now differ from the schema default
            implied = f.name == "max_position_embeddings" and self.hf_keys and f.name not in self.hf_keys
            if f.name not in skip and not implied and (f.name in self.hf_keys or not self.hf_keys
                                                      or f.default is dataclasses.MISSING or value != f.default):
                out[f.name] = value
        lac = {"kda_layers": list(self.kda_layers), "full_attn_layers": list(self.full_attn_layers),
               "head_dim": self.kda_head_dim, "num_heads": self.kda_num_heads,
               "short_conv_kernel_size": self.short_conv_kernel_size,
               "gate_lower_bound": self.gate_lower_bound, "use_full_rank_gate": self.use_full_rank_gate}
        keys = self.hf_linear_attn_extra.get("_keys")
        if keys is not None:  # keep absent keys absent, as the source wrote them
            lac = {k: lac[k] for k in keys}
        out["linear_attn_config"] = lac
        return out


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT-V2 and the projector (K3's `vision_config`)."""
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for key in ("patch_size", "vt_num_attention_heads", "vt_num_hidden_layers", "vt_hidden_size",
                    "vt_intermediate_size", "qkv_hidden_size", "text_hidden_size"):
            _check(isinstance(getattr(self, key), int) and getattr(self, key) > 0,
                   f"vision_config.{key}", getattr(self, key), "must be a positive integer")
        _check(self.qkv_hidden_size % self.vt_num_attention_heads == 0, "vision_config.vt_num_attention_heads",
               self.vt_num_attention_heads, f"must divide qkv_hidden_size={self.qkv_hidden_size}")
        _check(self.mm_hidden_size == self.vt_hidden_size, "vision_config.mm_hidden_size", self.mm_hidden_size,
               "must equal vt_hidden_size")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @classmethod
    def from_hf(cls, d: dict) -> "VisionConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"hf"}
        kwargs = {k: (tuple(v) if k == "merge_kernel_size" else v) for k, v in d.items() if k in names}
        kwargs.setdefault("mm_hidden_size", kwargs.get("vt_hidden_size", 1024))
        return cls(**kwargs, hf=copy.deepcopy(d))

    def to_hf(self) -> dict:
        out = copy.deepcopy(self.hf)
        for f in dataclasses.fields(self):
            if f.name != "hf" and (f.name in out or f.name != "mm_hidden_size"):
                v = getattr(self, f.name)
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class K3Config:
    """A whole `kimi_k3` config: text tower, vision tower and the wrapper's own keys.

    `train` holds a YAML preset's `train:` section (k3jax's own, never in config.json).
    """
    text: ModelConfig
    vision: VisionConfig | None
    top: dict = field(default_factory=dict, compare=False, repr=False)
    train: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, path_or_dict) -> "K3Config":
        hf = read_json_or_dict(path_or_dict)
        if hf.get("model_type") != "kimi_k3":
            return cls(ModelConfig.from_hf(hf), None, {})
        top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
        unknown = sorted(k for k in top if k not in _HF_GENERIC_KEYS | {"model_type", "bos_token_id",
                         "eos_token_id", "pad_token_id", "tie_word_embeddings"})
        _check(not unknown, unknown[0] if unknown else "", unknown, "unknown top-level kimi_k3 key")
        vision = VisionConfig.from_hf(hf["vision_config"]) if hf.get("vision_config") else None
        return cls(ModelConfig.from_hf(hf["text_config"]), vision, copy.deepcopy(top))

    @property
    def layout(self) -> str:
        """Checkpoint name layout: 'k3' (language_model.*) or 'kimi_linear' (model.*)."""
        return "k3" if self.top else "kimi_linear"

    def to_hf(self) -> dict:
        if not self.top:
            return self.text.to_hf()
        out = copy.deepcopy(self.top)
        out["text_config"] = self.text.to_hf()
        if self.vision is not None:
            out["vision_config"] = self.vision.to_hf()
        return out


def preset_path(name: str) -> str:
    return os.path.join(CONFIG_DIR, f"{name}.yaml")


def load_k3(name_or_path) -> K3Config:
    """A preset name (`k3`, `kimi_linear_48b`, `toy`), a YAML preset, a config.json or its folder.
    A preset with `extends: NAME` takes its model from that preset and its own train: section."""
    p = os.fspath(name_or_path)
    if not os.path.exists(p) and os.path.exists(preset_path(p)):
        p = preset_path(p)
    if not os.path.exists(p):
        presets = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
        raise ConfigError(f"no config at {name_or_path!r} and no preset of that name (presets: {presets})")
    d = dict(read_json_or_dict(p))
    if "extends" in d:   # `extends: k3`: another preset (name or path) under this one's keys
        base = d.pop("extends")
        _check(isinstance(base, str), "extends", base, "a preset name or a path")
        near = os.path.join(os.path.dirname(p), base)
        parent = load_k3(near if os.path.exists(near) else base)
        # a partial section changes only the keys it names, at any depth (train.lora.targets
        # alone keeps the parent's rank; text_config.num_experts alone keeps the rest)
        d = deep_merge({**parent.to_hf(), "train": parent.train}, d)
    train = d.pop("train", None) or {}
    _check(isinstance(train, dict), "train", type(train).__name__, "the train section must be a mapping")
    return dataclasses.replace(K3Config.from_hf(d), train=train)


def load(name_or_path, **runtime) -> ModelConfig:
    """The text-model config of a preset or file, with optional RuntimeOptions overrides."""
    cfg = load_k3(name_or_path).text
    return cfg.with_runtime(**runtime) if runtime else cfg
