"""Per-device memory plan for a config on a mesh preset, from abstract shapes only.

Params, gradients and optimizer state are exact for the sharding the preset's rules give
(`k3jax.model.param_specs`, what `param_shardings` places them by). Activations are an
estimate per layer, counted per token from the layer's intermediate tensors, for each remat
policy; caches are exact. Nothing is allocated, so this runs for full K3 on a laptop.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass

import jax
import numpy as np
from flax import linen as nn

from k3jax.config import OBJECTIVES, ConfigError, ModelConfig, expert_role
from k3jax.mesh import MeshPreset, entry_axes, fit_spec, logical_shards, row_axes
from k3jax.model import param_specs

GIB = 1 << 30


@dataclass(frozen=True)
class PlanOptions:
    mode: str = "train"              # 'train' | 'infer'
    batch: int | None = None         # global sequences; default one per batch shard
    grad_accum: int | None = None    # train: microbatches a step (None: the fewest whose plan fits)
    seq: int = 4096
    remat: str = "full"              # 'none' | 'dots' | 'full'
    optimizer: str = "adamw"         # 'adamw' (fp32 m + v) | 'muon' (fp32 momentum on matrices)
    param_dtype: str = "bfloat16"
    expert_format: str = "bf16"      # 'bf16' | 'mxfp4' (routed experts as the checkpoint stores them)
    devices: int | None = None       # resolves a -1 axis in the preset
    hbm_gib: float | None = None
    moe_dispatch: str = "ep"
    ep_capacity_factor: float = 0.0  # RuntimeOptions.ep_capacity_factor: 0 = dropless
    prefill_chunk: int = 2048        # infer: tokens per device per prefill step
    lora_rank: int = 0               # train config lora.rank (0 = full fine-tuning)
    lora_expert_rank: int | None = None
    lora_expert_mode: str = "per_expert"
    lora_targets: tuple[str, ...] | None = None   # None: k3jax.lora.DEFAULT_TARGETS
    lora_optimizer: str = "adamw"
    freeze: tuple[str, ...] = ()     # optimizer.freeze globs
    objective: str = "sft"           # train config objective: 'sft' | 'dpo' | 'grpo' (objective_bytes)
    rollout_slots: int | None = None  # grpo: the rollout engine's slots (None: train's, objective_bytes)
    kl_beta: float = 0.0             # grpo.kl_beta: > 0 without LoRA keeps a copy of the params
    qat: bool = False                # train config qat: the forward sees the export's weights

    def __post_init__(self):
        def need(ok, key, why):   # named as `plan` and `compile` spell the flag
            if not ok:
                flag = {"ep_capacity_factor": "ep-capacity"}.get(key, key.replace("_", "-"))
                raise ConfigError(f"--{flag} {getattr(self, key)!r}: {why}")
        need(self.batch is None or self.batch >= 1, "batch", "global sequences must be >= 1")
        need(self.grad_accum is None or self.grad_accum >= 1, "grad_accum", "microbatches a step must be >= 1")
        need(self.grad_accum is None or self.batch is None or self.batch % self.grad_accum == 0, "grad_accum",
             f"must divide --batch {self.batch} (each microbatch is batch / grad_accum sequences)")
        need(self.seq >= 1, "seq", "tokens per sequence must be >= 1")
        need(self.devices is None or self.devices >= 1, "devices", "must be >= 1")
        need(self.hbm_gib is None or self.hbm_gib > 0, "hbm_gib", "per-device memory must be > 0")
        need(self.ep_capacity_factor >= 0, "ep_capacity_factor", "must be >= 0 (0: dropless)")
        need(self.prefill_chunk >= 1, "prefill_chunk", "must be >= 1")
        need(self.lora_rank >= 0, "lora_rank", "must be >= 0 (0: full fine-tuning)")
        need(self.lora_expert_rank is None or self.lora_expert_rank >= 1, "lora_expert_rank", "must be >= 1")
        need(self.objective in OBJECTIVES, "objective", f"must be one of {', '.join(OBJECTIVES)}")
        need(self.objective == "sft" or self.mode == "train", "objective", "plans a train step: use --mode train")
        need(self.rollout_slots is None or self.rollout_slots >= 1, "rollout_slots", "must be >= 1")
        need(self.kl_beta >= 0, "kl_beta", "must be >= 0 (0: no reference)")


def _sizes(spec, sizes: dict) -> int:
    n = 1
    for axes in spec:
        for a in entry_axes(axes):
            n *= sizes[a]
    return n


def run_config(cfg: ModelConfig, opt: PlanOptions) -> ModelConfig:
    """The model config the planned run uses: param dtype, expert format, LoRA adapters."""
    cfg = cfg.with_runtime(param_dtype=opt.param_dtype, expert_format=opt.expert_format)
    if opt.mode != "train" or not opt.lora_rank:
        return cfg
    from k3jax.model import abstract_params
    from k3jax import lora
    section = {"rank": opt.lora_rank, "expert_rank": opt.lora_expert_rank, "expert_mode": opt.lora_expert_mode,
               "targets": list(opt.lora_targets) if opt.lora_targets is not None else None}
    return cfg.with_runtime(lora=lora.resolve(section, cfg, abstract_params(cfg)))


def state_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions) -> dict:
    """Exact per-device bytes of params, gradients and optimizer state, as the train step
    holds them: params as stored (MXFP4 experts as their uint8 bytes, adapters included),
    fp32 gradients and optimizer state for the trained params only (the groups of
    `k3jax.train.muon`: no frozen param, router bias or MXFP4 byte has either). With
    gradient accumulation (grad_accum > 1) also `accumulation`: the fp32 running sum the
    microbatch loop carries, beside the gradient the optimizer gets. K3 on v5p-1024-cp4, 16 x
    128 sequences: XLA's total grew by 24.2 GiB over one pass of 128 (docs/performance.md),
    this term by 20.3 (one microbatch's gradient, 10.2 in bf16, is mostly within the
    one-pass step's own count)."""
    from k3jax.train import muon
    sizes = preset.shape(opt.devices)
    run = run_config(cfg, opt)
    from k3jax.model import abstract_variables, param_shapes
    boxed = abstract_variables(run)     # traced once per config (model.params._traced_variables)
    mesh_specs = param_specs(boxed, preset.rules, sizes)
    shapes = param_shapes(run, adapters=True)   # the same trace, unwrapped without constraints
    groups = jax.tree.leaves(muon.param_groups(run, shapes, opt.freeze))
    accum = (opt.grad_accum or 1) > 1
    out = dict(params=0, grads=0, optimizer=0, adapters=0, **({"accumulation": 0} if accum else {}))
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    flat_specs = jax.tree.leaves(mesh_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, leaf), spec, group in zip(leaves, flat_specs, groups):
        local = math.prod(leaf.shape) // _sizes(spec, sizes)
        out["params"] += local * np.dtype(leaf.dtype).itemsize
        if getattr(path[0], "key", None) == "lora":
            out["adapters"] += local * np.dtype(leaf.dtype).itemsize
        if opt.mode != "train" or group not in muon.TRAINED:
            continue
        out["grads"] += local * 4
        if accum:   # the fp32 running sum
            out["accumulation"] += local * 4
        momentum_only = (group in muon.MUON_GROUPS and opt.optimizer == "muon") or (
            group == "lora" and opt.lora_optimizer == "muon")
        out["optimizer"] += local * (4 if momentum_only else 8)
    return {k: int(v) for k, v in out.items()}


# What XLA:TPU's allocation of a train step adds to the counted values (activation_bytes),
# per token a device holds. Full fine-tuning: 4.4 GiB per 1,024 tokens (fitted at 1K and 2K
# tokens a chip). A frozen base (LoRA, whose gradients count no more than the adapters'):
# max(0, 1.88 x the exchange buffers counted + 10.8 GiB per 1,024 tokens - 29.6 GiB), a
# least-squares fit to the five LoRA compiles at 1K, 2K and 4K tokens a chip (4K with 256,
# 512 and 1024 MiB exchange chunks; docs/performance.md). XLA's figure steps, not slopes,
# with the chunk: at 4K, 21.5 and 20.8 GiB past the counted values in 256 and 512 MiB
# chunks, 35.5 where the exchange runs in one chunk. TPU presets only: no GPU step has been
# compiled to measure XLA:GPU's
ALLOCATION_PER_TOKEN = {"full": 4.4 * GIB / 1024, "frozen": 10.8 * GIB / 1024}
FROZEN_ALLOCATION_PER_BUFFER = 1.88
FROZEN_ALLOCATION_OFFSET = 29.6 * GIB

# Logical axes a weight is ZeRO-sharded over (its input side, configs/meshes/rules/zero3.yaml):
# gathered whole for the compute. The others (heads, vocab, hidden, experts) stay split.
ZERO_AXES = ("embed", "kda_rank", "q_lora", "kv_lora", "latent")


def gathered_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, keep=None) -> dict:
    """Per-device bytes of weights ZeRO-3 gathers for the compute: one layer's at a time
    (the largest layer), and the lm_head table, which the logits need whole over the model
    dim (found in the compiled K3 train step's peak: gathered q/k/v/o/g, dense-MLP and
    local-expert weights of the layer in flight, and a [D, vocab] lm_head, beside the
    embedding's). A gathered weight keeps its other splits (heads, vocab, experts).
    Training holds each gathered weight's gradient at that size too, until it is
    reduce-scattered. The embedding table is `activation_bytes`' `embed_table`. `keep`: a
    predicate on a leaf's path keys, to count only those leaves."""
    from k3jax.model import abstract_variables
    sizes = preset.shape(opt.devices)
    boxed = abstract_variables(run_config(cfg, opt))
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    specs = jax.tree.leaves(param_specs(boxed, preset.rules, sizes),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    per_layer: dict[str, float] = {}
    lm_head = 0.0
    for (path, box), spec in zip(jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_box), specs):
        keys = [str(getattr(k, "key", k)) for k in path]
        names = box.names if is_box(box) else (None,) * len(spec)
        leaf = box.value if is_box(box) else box
        kept = gathered = 1
        for name, entry in zip(names, tuple(spec) + (None,) * (leaf.ndim - len(spec))):
            n = math.prod(sizes[a] for a in entry_axes(entry))
            if name in ZERO_AXES:
                gathered *= n
            else:
                kept *= n
        if keys[0] in ("lora", "embed_tokens") or gathered == 1 or (keep is not None and not keep(keys)):
            continue
        full = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize / kept
        if keys[0] == "lm_head":
            lm_head += full
        elif keys[0] == "groups":                      # stacked: one slice per layer
            layer = "/".join(keys[:2])
            per_layer[layer] = per_layer.get(layer, 0.0) + full / leaf.shape[0]
        elif keys[0].startswith("layers_"):
            per_layer[keys[0]] = per_layer.get(keys[0], 0.0) + full
    layer = max(per_layer.values(), default=0.0)
    trained = opt.mode == "train" and not opt.lora_rank
    return {"layer": int(layer * (2 if trained else 1)), "lm_head": int(lm_head)}


def layer_values(cfg: ModelConfig, kind: tuple[str, str], T: int, tp: int) -> dict:
    """Values kept per token by one layer: {'dots': matmul outputs, 'all': everything}
    ('all' adds elementwise results, norms, attention probabilities and KDA chunk states).
    Head- and hidden-sized terms are divided by the tensor-parallel degree `tp`."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    attn, ffn = kind
    dots = other = 0.0
    if attn == "kda":
        hd, C, r = cfg.kda_num_heads * cfg.kda_head_dim, cfg.runtime.kda_chunk_size, cfg.kda_head_dim
        dots += (5 * hd + cfg.kda_num_heads) / tp + r + D        # q,k,v,f_b,g_proj, beta, f_a, o_proj
        # conv + SiLU on q,k,v, L2 norms, gate, o, o-norm, gated o; per chunk: A, T [C, C],
        # W, U [C, d] and the carried state [d, d], per head (fp32, counted twice)
        other += 12 * hd / tp + 2 * cfg.kda_num_heads * (2 * C + 2 * cfg.kda_head_dim
                                                         + cfg.kda_head_dim ** 2 / C) / tp
    else:
        hv = H * cfg.v_head_dim
        dots += (cfg.q_lora_rank or 0) + (H * cfg.q_head_dim + H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                                          + hv) / tp + cfg.mla_cache_dim + D
        # q/k concat; fp32 scores + probs of one query block (RuntimeOptions.attention_q_block)
        block = min(T, cfg.runtime.attention_q_block or T)
        other += (H * cfg.q_head_dim * 2 + 2 * hv) / tp + 2 * 2 * H * block / tp
    if ffn == "moe":
        k, F, Hl, Fs = cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.moe_hidden_size, cfg.shared_intermediate_size
        dots += 2 * 2 * cfg.num_experts + Hl + k * (2 * F / tp + Hl) + D + 2 * Fs / tp + D
        other += k * (F / tp + Hl) + 2 * Hl + Fs / tp + k
    else:
        dots += 2 * cfg.intermediate_size / tp + D
        other += cfg.intermediate_size / tp
    other += 4 * D                                               # two RMSNorms, two AttnRes mixes
    return {"dots": dots, "all": dots + other}


def saved_carry_values(cfg: ModelConfig) -> int:
    """Values per token the residual carry leaves saved for the backward whatever the remat
    policy: each layer's input partial sum, and with Block AttnRes the block stacks layers
    read (max_attn_res_blocks × D each). A scanned group's layers share the stack they got
    (pushes are deferred to the group's end, `attn_res.defer_block`), plus one pending block
    per slot that can push, a second push in a group writing the first out (one more
    stack); unrolled layers are counted one stack each."""
    from k3jax.layout import layer_plan, slot_pushes
    D = cfg.hidden_size
    if not cfg.use_attn_res:
        return D * cfg.num_hidden_layers
    plan = layer_plan(cfg)
    pushes = sum(slot_pushes(cfg, plan)) if plan.n_groups else 0
    stacks = len(plan.head) + len(plan.tail) + plan.n_groups * max(1, pushes)
    return D * cfg.num_hidden_layers + cfg.max_attn_res_blocks * D * stacks + D * plan.n_groups * pushes


def ep_rows(cfg: ModelConfig, tokens: float, P: int, width: int) -> int:
    """Rows of one 'ep' exchange's worst-case receive buffer, for the chunk
    `ops.moe_dispatch.ep_chunks` gives a single round. Dropless with a first round and
    overflow windows (`ep_first_round`) is planned the same: its buffers are the first
    round's, but XLA's allocation for K3's compiled step was as large as one worst-case
    round's (84.3 against 83.2 GiB a device, docs/performance.md), not the capacity step's
    (74.2)."""
    from k3jax.ops.moe_dispatch import ep_chunks, ep_receive_rows
    cfg = cfg.replace(runtime=dataclasses.replace(cfg.runtime, ep_first_round=0.0))
    n = max(int(math.ceil(tokens)), 1)
    k, H = cfg.num_experts_per_token, cfg.moe_hidden_size
    chunk = -(-n // ep_chunks(n, k, P, H, width, cfg))
    return ep_receive_rows(chunk * k, P, cfg.runtime.ep_capacity_factor)


def moe_buffer_values(cfg: ModelConfig, tokens: float, P: int, tp: int, width: int, train: bool = False) -> float:
    """Values per device of one 'ep' exchange's worst-case buffers: the receive rows and their
    results ([rows, latent] each) and the expert FFN's gate, up and activation over them
    ([rows, hidden / tp]). In training the backward of a (rematerialised) chunk holds those
    recomputed and their cotangents, twice as many; LoRA on the routed experts adds its
    deltas' outputs ([rows, hidden / tp] for w1 / w3, [rows, latent] for w2). Both were
    read off the compiled K3 train steps' peaks (docs/performance.md, "How the planner was
    calibrated")."""
    rows = ep_rows(cfg, tokens, P, width)
    H, F = cfg.moe_hidden_size, cfg.moe_intermediate_size
    values = rows * (2 * H + 3 * F / tp) * (2 if train else 1)
    spec = cfg.runtime.lora
    if train and spec is not None:
        adapted = {t.rsplit("/", 1)[-1] for t in spec.targets if t.startswith("block_sparse_moe/w")}
        values += rows * (F / tp * len(adapted & {"w1", "w3"}) + H * len(adapted & {"w2"}))
    return values


def activation_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, batch: int) -> dict:
    """Estimated per-device activation bytes: saved for backward plus one layer's peak."""
    sizes = preset.shape(opt.devices)
    rules = preset.rules
    tokens = batch * opt.seq / logical_shards(rules, sizes, ("batch", "length"))
    if opt.mode == "infer":
        tokens = min(tokens, opt.prefill_chunk)     # prefill runs in chunks; decode is 1 token
    tp = logical_shards(rules, sizes, ("heads",))
    T_local = opt.seq / logical_shards(rules, sizes, ("length",))
    kinds = list(zip(cfg.layer_kinds, cfg.ffn_kinds))
    width = np.dtype(cfg.runtime.dtype if opt.param_dtype == "float32" else "bfloat16").itemsize
    per_layer = [layer_values(cfg, kd, T_local, tp) for kd in kinds]
    peak_layer = max(v["all"] for v in per_layer) * tokens * width
    carry = saved_carry_values(cfg)
    saved_per_token = {"full": carry,
                       "dots": sum(v["dots"] for v in per_layer) + carry,
                       "none": sum(v["all"] for v in per_layer) + carry}[opt.remat]
    # 'ep' buffers (layers/moe.py), only where the rules split the experts over `expert`
    # (v5p-256-decode splits each expert's hidden: no exchange): sized by the dropless or
    # capacity rule, in chunks that keep a receive buffer within RuntimeOptions.ep_buffer_mib.
    P = logical_shards(rules, sizes, ("expert",))
    moe_buffer = 0
    if cfg.num_experts and opt.moe_dispatch == "ep" and P > 1:
        run = run_config(cfg, opt).with_runtime(ep_capacity_factor=opt.ep_capacity_factor)
        hidden_tp = logical_shards(rules, sizes, ("expert_mlp",))
        moe_buffer = moe_buffer_values(run, tokens, P, hidden_tp, width, train=opt.mode == "train") * width
    vocab_local = cfg.vocab_size / logical_shards(rules, sizes, ("vocab",))
    logits = 2 * tokens * vocab_local * 4   # fp32 logits + grad
    # TokenEmbed gathers the embed-sharded table for the lookup, and in training the lookup's
    # backward scatter-adds into a whole fp32 table before it reduces onto the shards.
    embed_table = 0
    if logical_shards(rules, sizes, ("embed",)) > 1:
        trained = opt.mode == "train" and not opt.lora_rank and not any(
            fnmatch.fnmatchcase("embed_tokens/embedding", g) for g in opt.freeze)
        embed_table = vocab_local * cfg.hidden_size * (width + (4 if trained else 0))
    gathered = gathered_bytes(cfg, preset, opt)
    # what XLA:TPU allocates for a train step beyond the live values counted above (its
    # temporaries sit at fixed offsets: full K3's 13-layer LoRA step peaked at 9.6 GiB live in
    # an 18.4 GiB allocation), per token a device holds and, over a frozen base, with the
    # exchange's buffers; fitted to the full-K3 compiles at 1K to 4K tokens a chip
    # (ALLOCATION_PER_TOKEN, docs/performance.md)
    base = "frozen" if opt.lora_rank else "full"
    slack = tokens * ALLOCATION_PER_TOKEN[base]
    if base == "frozen":
        slack = max(0.0, slack + FROZEN_ALLOCATION_PER_BUFFER * moe_buffer - FROZEN_ALLOCATION_OFFSET)
    if opt.mode != "train" or not preset.device.startswith("TPU"):
        slack = 0
    qat = qat_bytes(cfg, preset, opt) if opt.mode == "train" and opt.qat else 0
    if opt.mode == "infer":
        return {"saved": 0, "layer_peak": int(peak_layer), "moe_buffer": int(moe_buffer), "logits": int(logits / 2),
                "embed_table": int(embed_table), "gathered_layer": gathered["layer"],
                "lm_head_table": gathered["lm_head"]}
    return {"saved": int(saved_per_token * tokens * width), "layer_peak": int(peak_layer),
            "moe_buffer": int(moe_buffer), "logits": int(logits), "embed_table": int(embed_table),
            "gathered_layer": gathered["layer"], "lm_head_table": gathered["lm_head"],
            "allocation": int(slack), **({"qat": int(qat)} if opt.qat else {})}


def qat_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions) -> int:
    """What quantization-aware fine-tuning adds to a train step (k3jax.ops.qat, train.qat):
    with widened experts, one MoE layer's local experts quantized to MXFP4 bytes (17/32 byte
    a value, the one per-layer copy; an MXFP4-resident base merges tile by tile, no copy);
    with LoRA, one layer's adapted dense projections merged as bf16(W + s·A·B) in fp32 (the
    largest layer's gathered kernels, `gathered_bytes`, at 4 bytes a value), except on TPU:
    XLA:TPU fuses each merge into its projection's operand, and K3's LoRA r16 step over
    MXFP4 at 128 x 4096 on v5p-1024 compiled to 29.2 GiB a chip with QAT against 30.9 without
    (2026-12-08, docs/performance.md); the toy's to 5.8 GiB both."""
    sizes = preset.shape(opt.devices)
    out = 0.0
    if cfg.num_experts and opt.expert_format != "mxfp4":
        local = cfg.num_experts / logical_shards(preset.rules, sizes, ("expert",))
        hidden = logical_shards(preset.rules, sizes, ("expert_mlp",))
        out += local * 3 * cfg.moe_hidden_size * cfg.moe_intermediate_size / hidden * 17 / 32
    if opt.lora_rank and not preset.device.startswith("TPU"):
        dense = gathered_bytes(cfg, preset, opt, keep=lambda keys: expert_role(keys) is None)["layer"]
        out += dense / np.dtype(opt.param_dtype).itemsize * 4
    return int(out)


def cache_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, batch: int) -> dict:
    """Per-device inference caches for `batch` sequences of `seq` tokens."""
    sizes = preset.shape(opt.devices)
    # rows over the batch axes that divide them, as the engine places its caches
    # (caches.cache_shardings; XLA's prefill output agrees where the batch divides them all)
    rows = row_axes(batch, nn.logical_to_mesh_axes(("batch",), preset.rules)[0], sizes)
    seqs = batch / math.prod(sizes[a] for a in rows)
    n_kda, n_mla = cfg.layer_kinds.count("kda"), cfg.layer_kinds.count("mla")
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    # heads over the axes that divide them, as the caches are placed (mesh.fit_spec: 96
    # heads over expert 32 x tensor 4 split 32 ways, not 128 and not 1)
    heads = fit_spec((H,), jax.sharding.PartitionSpec(*nn.logical_to_mesh_axes(("heads",), preset.rules)), sizes)
    tp = _sizes(tuple(heads), sizes)
    kda_state = n_kda * H * d * d * 4 / tp                                     # fp32 S per layer
    conv = n_kda * 3 * (cfg.short_conv_kernel_size - 1) * H * d * 2 / tp       # bf16 conv tails
    mla = n_mla * cfg.mla_cache_dim * opt.seq * 2                              # bf16 latent KV, one shared head
    return {"kda_state": int(seqs * kda_state), "kda_conv": int(seqs * conv), "mla_kv": int(seqs * mla)}


def objective_bytes(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, micro: int, batch: int,
                    params_bytes: int) -> dict:
    """Per-device bytes the objective adds to the SFT step's plan (k3jax.train.objectives).

    - dpo: the reference's per-target fp32 log-probs beside the step's rows (`ref_logp`;
      with LoRA the reference forward runs inside the step without a gradient, before the
      policy's, so its activations are gone when the policy's are saved; without LoRA one
      pass over the pairs before the first step computes them, an inference program).
    - grpo: the rollout batch's `old_logp` (and with grpo.kl_beta `ref_logp`) per target
      (its advantages, one value a row, are not counted); `reference_params`: a full copy of
      the params where kl_beta > 0 without LoRA (the initial params, kept for the KL); and
      the rollout, a separate program run between updates while the params and optimizer
      state stay live but no gradient or activation does: caches for `rollout_slots`
      sequences of `seq` tokens (KDA state, conv tails, MLA latent) plus one decode step's
      activations (`rollout_peak`). Its slots default as train's: grpo.rollout_slots' default,
      at most the step's completions.
    The step's batch holds all its microbatches: per-target values count grad_accum times."""
    if opt.objective == "sft":
        return {}
    from k3jax.train.config import DEFAULTS
    sizes = preset.shape(opt.devices)
    targets = micro * opt.seq / logical_shards(preset.rules, sizes, ("batch", "length")) * (opt.grad_accum or 1)
    if opt.objective == "dpo":
        return {"reference_logps": int(targets * 4)}
    per_target = 2 if opt.kl_beta > 0 else 1            # old_logp, ref_logp
    out = {"rollout_logps": int(targets * 4 * per_target),
           "reference_params": params_bytes if opt.kl_beta > 0 and not opt.lora_rank else 0}
    slots = opt.rollout_slots or min(DEFAULTS["grpo"]["rollout_slots"], batch)
    caches = cache_bytes(cfg, preset, opt, slots)
    decode = dataclasses.replace(opt, mode="infer", objective="sft", prefill_chunk=1, batch=slots, grad_accum=1)
    act = activation_bytes(cfg, preset, decode, slots)
    out["rollout_caches"] = sum(caches.values())
    out["rollout_peak"] = out["rollout_caches"] + sum(act.values())
    return out


def places(preset: MeshPreset, opt: PlanOptions, micro: int) -> bool:
    """Whether a train microbatch of `micro` sequences splits over the batch shards of the
    layout `k3jax train` takes for it."""
    from k3jax.mesh import preset_for
    if preset.train_preset or preset.context_preset:
        preset = preset_for(preset.name, "train", micro, opt.devices)
    return micro % logical_shards(preset.rules, preset.shape(opt.devices), ("batch",)) == 0


def grad_accum_choices(batch: int) -> list[int]:
    """Microbatch counts a global batch of `batch` sequences can run as, fewest first."""
    return [a for a in range(1, batch + 1) if batch % a == 0]


def choose_grad_accum(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, total_params: int) -> int:
    """`opt.grad_accum`, or where it is None (train), the fewest microbatches whose plan fits:
    the largest microbatch, so the per-microbatch fixed costs (ZeRO-3 gathers, the
    exchanges' latency) are paid the fewest times. 1 where nothing fits, HBM is unknown, or
    the mode is infer (the plan then says so)."""
    if opt.grad_accum is not None:
        return opt.grad_accum
    hbm = opt.hbm_gib if opt.hbm_gib is not None else preset.hbm_gib
    if opt.mode != "train" or not opt.batch or not hbm:
        return 1
    for a in grad_accum_choices(opt.batch):
        if places(preset, opt, opt.batch // a) and plan(
                cfg, preset, dataclasses.replace(opt, grad_accum=a), total_params)["fits"]:
            return a
    return 1


def plan(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, total_params: int) -> dict:
    """The per-device plan. In train mode the layout is the one `k3jax train` runs
    (`mesh.preset_for`) for one microbatch: an inference preset's `train_preset` (b300x8 ->
    b300x8_train), and the `context_preset` a microbatch with fewer sequences than batch
    shards needs. `opt.grad_accum` None: `choose_grad_accum`'s."""
    from k3jax.mesh import preset_for
    accum = choose_grad_accum(cfg, preset, opt, total_params) if opt.mode == "train" else 1
    opt = dataclasses.replace(opt, grad_accum=accum)
    micro = opt.batch // accum if opt.batch else None
    if opt.mode == "train" and (preset.train_preset or preset.context_preset):
        preset = preset_for(preset.name, "train", micro, opt.devices)
    sizes = preset.shape(opt.devices)
    shards = logical_shards(preset.rules, sizes, ("batch",))
    micro = micro or shards
    if opt.mode == "train" and micro % shards:   # the train step places whole sequences per shard
        raise ConfigError(f"batch {micro} does not split over the {shards} batch shards of mesh "
                          f"{preset.name}: give a multiple of {shards}" if accum == 1 else
                          f"--grad-accum {accum}: microbatches of {micro} sequences do not split over the "
                          f"{shards} batch shards of mesh {preset.name}")
    batch = micro * accum
    state = state_bytes(cfg, preset, opt)
    act = activation_bytes(cfg, preset, opt, micro)
    caches = cache_bytes(cfg, preset, opt, batch)
    extra = objective_bytes(cfg, preset, opt, micro, batch, state["params"])
    if opt.mode == "train":
        parts = {"params": state["params"], "grads": state["grads"] + state.get("accumulation", 0),
                 "optimizer": state["optimizer"], "activations": sum(act.values())}
    else:
        parts = {"params": state["params"], "caches": sum(caches.values()), "activations": sum(act.values())}
    if extra:   # dpo / grpo: the reference and the rollout batch's log-probs ride with the update
        parts["reference"] = extra.get("reference_params", 0)
        parts["activations"] += extra.get("reference_logps", 0) + extra.get("rollout_logps", 0)
    total = sum(parts.values())
    host = {}
    if opt.mode == "train" and cfg.runtime.optimizer_offload:
        # runtime.optimizer_offload: the state sits in host memory while the microbatches run
        # and comes to the device for the update, when no activation is live
        host["optimizer"] = parts["optimizer"]
        parts["optimizer"] = 0
        total = max(sum(parts.values()), parts["params"] + parts["grads"] + host["optimizer"])
    if "rollout_peak" in extra:
        # the rollout runs between updates: params, optimizer state and the reference stay,
        # the update's gradients and activations give way to the rollout's caches
        rollout_total = parts["params"] + parts["optimizer"] + parts["reference"] + extra["rollout_peak"]
        extra["rollout_total"] = rollout_total
        total = max(total, rollout_total)
    hbm_gib = opt.hbm_gib if opt.hbm_gib is not None else preset.hbm_gib
    hbm = int(hbm_gib * GIB) if hbm_gib else None
    n_kda, n_mla = cfg.layer_kinds.count("kda"), cfg.layer_kinds.count("mla")
    return {
        "mesh": preset.name, "mesh_shape": {a: s for a, s in sizes.items() if s > 1},
        "devices": math.prod(sizes.values()), "mode": opt.mode, "batch": batch, "seq": opt.seq,
        "grad_accum": accum, "microbatch": micro,
        "remat": opt.remat, "optimizer": opt.optimizer, "expert_format": opt.expert_format,
        "lora_rank": opt.lora_rank, "ep_buffer_mib": cfg.runtime.ep_buffer_mib,
        "params": int(total_params),
        "mla_cache_values_per_token": n_mla * cfg.mla_cache_dim,
        "kda_state_values_per_sequence": n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim,
        "objective": opt.objective,
        "bytes_per_device": {**parts, "total": total}, "host_bytes_per_device": host,
        "optimizer_offload": bool(host),
        "detail": {"state": state, "activations": act, "caches": caches, **({"objective": extra} if extra else {})},
        "hbm_bytes": hbm, "fits": bool(hbm is not None and total <= hbm),
    }
