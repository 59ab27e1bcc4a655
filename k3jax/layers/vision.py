"""MoonViT-V2 (K3's vision tower), the sd2_tpool patch merger and the PatchMergerMLPV2 projector.

SPEC.md §7. Inputs are in the reference's own layout (what the K3 processor emits, see
`k3jax.vision.preprocess`): `pixels` [L, 3, P, P], all images' patches concatenated, each
image's patches in (t, row, col) row-major order, each patch channel-major (c, y, x); and
`grid_thws`, one (t, h, w) per image in patches.

Grids are static (plain Python ints): the position-embedding interpolation, the RoPE table
and the per-image attention blocks all take their shapes from them, so each distinct set
of grids compiles once. Several images of different sizes run packed in one call; the
attention of each image is computed on its own slice of the packed sequence, so nothing can
attend across images and the cost is Σ Lᵢ² rather than (Σ Lᵢ)².
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from k3jax.config import VisionConfig
from k3jax.layers.common import HIGHEST, logical, matrix_init
from k3jax.layers.norms import RMSNorm
from k3jax.errors import InputError

Grid = tuple[tuple[int, int, int], ...]

# The reference precomputes its 2D RoPE table for a 512 × 512 patch grid and asserts every
# image fits it; the K3 processor's `patch_limit_on_one_side` is the same 512.
ROPE_MAX_SIDE = 512
ROPE_THETA = 10000.0


class VisionInputError(InputError):
    """Pixels or grids the vision tower cannot run; the message says which and why. An
    `InputError`, so callers of the multimodal model catch one kind of bad input."""


# ----------------------------------------------------------------------------- input checks

def check_grids(vcfg: VisionConfig, grid_thws) -> Grid:
    """`grid_thws` ([N, 3] array or sequence of (t, h, w)) as a tuple of int triples, validated."""
    g = np.asarray(grid_thws)
    if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] == 0:
        raise VisionInputError(f"grid_thws must be [num_images, 3] (t, h, w) with at least one image, "
                               f"got shape {g.shape}")
    if not np.issubdtype(g.dtype, np.integer):
        raise VisionInputError(f"grid_thws must be integers, got dtype {g.dtype}")
    kh, kw = vcfg.merge_kernel_size
    out = []
    for i, (t, h, w) in enumerate(g.tolist()):
        if min(t, h, w) < 1:
            raise VisionInputError(f"image {i}: grid (t, h, w) = {(t, h, w)} must be positive")
        if t > vcfg.init_pos_emb_time:
            raise VisionInputError(f"image {i}: {t} frames, but the time embedding has only "
                                   f"init_pos_emb_time={vcfg.init_pos_emb_time}")
        if h % kh or w % kw:
            raise VisionInputError(f"image {i}: grid (h, w) = {(h, w)} patches is not divisible by the "
                                   f"merge kernel {tuple(vcfg.merge_kernel_size)} (pad the image to a multiple "
                                   f"of {kh * vcfg.patch_size} x {kw * vcfg.patch_size} pixels)")
        if h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
            raise VisionInputError(f"image {i}: grid (h, w) = {(h, w)} exceeds the 2D RoPE's "
                                   f"{ROPE_MAX_SIDE} patches per side")
        out.append((int(t), int(h), int(w)))
    return tuple(out)


def check_pixels(vcfg: VisionConfig, pixels, grids: Grid):
    """Shape/dtype check of packed patches against the grids; returns `pixels` unchanged."""
    p = vcfg.patch_size
    if not hasattr(pixels, "shape") or not hasattr(pixels, "dtype"):
        raise VisionInputError(f"pixels must be an array [num_patches, 3, {p}, {p}], got {type(pixels).__name__}")
    shape = tuple(pixels.shape)
    want = sum(t * h * w for t, h, w in grids)
    if len(shape) == 4 and shape[1:] == (p, p, 3):
        raise VisionInputError(f"pixels {shape} look channels-last; the reference layout is channel-major "
                               f"[num_patches, 3, {p}, {p}] (patch.transpose(2, 0, 1))")
    if len(shape) == 4 and shape[-1] == 3 and shape[1:3] != (3, p):
        raise VisionInputError(f"pixels {shape} look like whole images [T, H, W, 3]; patchify them first "
                               f"(k3jax.vision.preprocess.patchify) to [num_patches, 3, {p}, {p}]")
    if len(shape) != 4 or shape[1:] != (3, p, p):
        raise VisionInputError(f"pixels must be [num_patches, 3, {p}, {p}] (channel-major patches), got {shape}")
    if shape[0] != want:
        raise VisionInputError(f"pixels hold {shape[0]} patches but grid_thws {list(grids)} need "
                               f"sum(t*h*w) = {want}")
    if not jnp.issubdtype(pixels.dtype, jnp.floating):
        raise VisionInputError(f"pixels must be floating point (already normalised), got {pixels.dtype}")
    return pixels


def rows_per_image(vcfg: VisionConfig, grids: Grid) -> list[int]:
    """Feature rows (= `<|media_pad|>` tokens) of each image: one per merge window."""
    kh, kw = vcfg.merge_kernel_size
    return [(h // kh) * (w // kw) for _, h, w in grids]


# ----------------------------------------------------------------------------- fixed tables

def bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] weights of 1-D linear interpolation as torch's
    `F.interpolate(mode='bilinear', align_corners=False)` computes it, without antialias.

    Source coordinate (i + 0.5)·n_in/n_out − 0.5, clamped below at 0 (torch clamps negative
    sources, it does not reflect them); the upper neighbour is clamped to the last index.
    Bilinear 2-D interpolation is this matrix applied along each axis.
    """
    m = np.zeros((n_out, n_in), np.float64)
    scale = n_in / n_out
    for i in range(n_out):
        src = max((i + 0.5) * scale - 0.5, 0.0)
        i0 = min(int(src), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        m[i, i0] += 1.0 - lam
        m[i, i1] += lam
    return m


def interpolate_pos_emb(table, h: int, w: int):
    """The learned [H0, W0, D] table resized to [h·w, D] (row-major), bilinear, in fp32."""
    h0, w0, d = table.shape
    t = table.astype(jnp.float32)
    if (h, w) != (h0, w0):
        rh = jnp.asarray(bilinear_matrix(h0, h), jnp.float32)
        rw = jnp.asarray(bilinear_matrix(w0, w), jnp.float32)
        t = jnp.einsum("ia,jb,abd->ijd", rh, rw, t, precision=HIGHEST)
    return t.reshape(h * w, d)


def time_embedding(num_frames: int, dim: int) -> np.ndarray:
    """[num_frames, dim] fixed 1-D sin-cos embedding: [sin(p·ω) | cos(p·ω)], ω_k = 10000^(−2k/dim).

    Computed in float32 the way the reference builds its buffer, so frame offsets match bit
    for bit where numpy's sin/cos agree.
    """
    if dim % 2:
        raise VisionInputError(f"the time embedding needs an even width, got {dim}")
    omega = np.arange(dim // 2, dtype=np.float32) / np.float32(dim / 2.0)
    omega = (1.0 / 10000 ** omega).astype(np.float32)
    ang = np.arange(num_frames, dtype=np.float32)[:, None] * omega[None, :]
    return np.concatenate([np.sin(ang), np.cos(ang)], axis=1).astype(np.float32)


def rope_angles(h: int, w: int, head_dim: int, theta: float = ROPE_THETA) -> np.ndarray:
    """[h·w, head_dim/2] rotation angles of MoonViT's 2D RoPE (row-major over the grid).

    Pair j of a head (elements 2j, 2j+1) rotates by pos·θ^(−4i/head_dim) with i = j // 2, where
    pos is the **column** for even j and the row for odd j. (The reference's docstring says
    height for even j; its code, which produced the checkpoint, interleaves x (column) first.)
    """
    if head_dim % 4:
        raise VisionInputError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    freqs = (1.0 / theta ** (np.arange(0, head_dim, 4, dtype=np.float32) / np.float32(head_dim))).astype(np.float32)
    rows, cols = np.divmod(np.arange(h * w), w)
    ang = np.empty((h * w, head_dim // 2), np.float32)
    ang[:, 0::2] = cols[:, None].astype(np.float32) * freqs[None, :]
    ang[:, 1::2] = rows[:, None].astype(np.float32) * freqs[None, :]
    return ang


def packed_rope(grids: Grid, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each [Σ t·h·w, head_dim/2]: positions restart at (0, 0) per image, and
    every frame of a video reuses its image's positions (time is in the additive embedding)."""
    ang = np.concatenate([np.tile(rope_angles(h, w, head_dim), (t, 1)) for t, h, w in grids])
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x, cos, sin):
    """Rotate consecutive pairs (x[2j], x[2j+1]) of x [L, H, hd] by the angles; fp32 math."""
    xf = x.astype(jnp.float32)
    xe, xo = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.stack([xe * c - xo * s, xe * s + xo * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def segment_attention(q, k, v, lengths: Sequence[int]):
    """Bidirectional softmax attention restricted to each segment of the packed sequence.

    q, k, v [L, H, hd]; `lengths` static, summing to L. Each segment (one image or video) is
    sliced out and attended on its own: no mask to get wrong, no (Σ Lᵢ)² score matrix.
    Scores and softmax in fp32, as the reference's eager path.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (a[start:start + n].astype(jnp.float32) for a in (q, k, v))
        s = jnp.einsum("qhd,khd->hqk", qs, ks) * scale
        p = jax.nn.softmax(s, axis=-1)
        outs.append(jnp.einsum("hqk,khd->qhd", p, vs).astype(q.dtype))
        start += n
    return jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


# ----------------------------------------------------------------------------- modules

def _dense(features: int, axes: tuple[str, str], name: str, dtype, param_dtype) -> nn.Dense:
    """Bias-free projection; kernel [in, out] (the checkpoint stores [out, in])."""
    return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                    kernel_init=matrix_init(axes), name=name)


def _vit_norm(dtype, name: str) -> RMSNorm:
    # The ViT's nn.RMSNorm has eps=None, i.e. machine epsilon of the activation dtype
    # (1.2e-7 in fp32, 7.8e-3 in bf16); the projector's post_norm uses projector_ln_eps.
    return RMSNorm(eps=float(jnp.finfo(dtype).eps), name=name)


class PatchEmbed(nn.Module):
    """Conv2d(3, D, kernel = stride = P, no bias) as a matmul on the flattened (c, y, x) patch,
    plus the interpolated learned position grid and, for videos, the sin-cos time embedding."""
    vcfg: VisionConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels, grids: Grid):
        c = self.vcfg
        d = c.vt_hidden_size
        x = pixels.reshape(pixels.shape[0], -1).astype(self.dtype)
        x = _dense(d, (None, "embed"), "proj", self.dtype, self.param_dtype)(x)
        table = self.param("pos_emb", logical(nn.initializers.normal(1.0), (None, None, "embed")),
                           (c.init_pos_emb_height, c.init_pos_emb_width, d), self.param_dtype)
        time = time_embedding(c.init_pos_emb_time, d)
        pos = []
        for t, h, w in grids:
            p2 = interpolate_pos_emb(table, h, w)
            pos.append(p2 if t == 1 else (p2[None] + time[:t, None, :]).reshape(t * h * w, d))
        return x + jnp.concatenate(pos, axis=0).astype(self.dtype)


class MLP2(nn.Module):
    vcfg: VisionConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        c = self.vcfg
        h = _dense(c.vt_intermediate_size, ("embed", "mlp"), "fc0", self.dtype, self.param_dtype)(x)
        h = jax.nn.gelu(h, approximate=True)  # PytorchGELUTanh: the ViT's MLP uses the tanh form
        return _dense(c.vt_hidden_size, ("mlp", "embed"), "fc1", self.dtype, self.param_dtype)(h)


class VisionBlock(nn.Module):
    """Pre-norm block: x += wo(attn(norm0(x))); x += mlp(norm1(x)). `lengths`: per-image segments."""
    vcfg: VisionConfig
    lengths: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin):
        c = self.vcfg
        nh, hd = c.vt_num_attention_heads, c.head_dim
        h = _vit_norm(self.dtype, "norm0")(x)
        qkv = _dense(3 * c.qkv_hidden_size, ("embed", "heads"), "wqkv", self.dtype, self.param_dtype)(h)
        qkv = qkv.reshape(x.shape[0], 3, nh, hd)  # the checkpoint's row order: (q|k|v, head, dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = segment_attention(q, k, v, self.lengths).reshape(x.shape[0], nh * hd)
        x = x + _dense(c.vt_hidden_size, ("heads", "embed"), "wo", self.dtype, self.param_dtype)(o)
        h = _vit_norm(self.dtype, "norm1")(x)
        return x + MLP2(c, self.dtype, self.param_dtype, name="mlp")(h), None


class VisionTower(nn.Module):
    """Patch embedding → `vt_num_hidden_layers` blocks (scanned, params stacked on `layers`)
    → final RMSNorm. Returns [Σ t·h·w, D] in the packed patch order."""
    vcfg: VisionConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels, grids: Grid):
        c = self.vcfg
        x = PatchEmbed(c, self.dtype, self.param_dtype, name="patch_embed")(pixels, grids)
        cos, sin = packed_rope(grids, c.head_dim)
        blocks = nn.scan(VisionBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(nn.broadcast, nn.broadcast), length=c.vt_num_hidden_layers,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        lengths = tuple(t * h * w for t, h, w in grids)
        x, _ = blocks(c, lengths, self.dtype, self.param_dtype, name="blocks")(x, jnp.asarray(cos), jnp.asarray(sin))
        return _vit_norm(self.dtype, "final_layernorm")(x)


def tpool_merge(x, grids: Grid, kernel: tuple[int, int]):
    """sd2_tpool: per image, average over frames and gather each kh×kw window of patches.

    x [Σ t·h·w, D] → [Σ (h/kh)(w/kw), kh·kw·D]; windows row-major over the (h/kh, w/kw) grid,
    the kh·kw patches of a window in (ky, kx) row-major order, concatenated along features.
    """
    kh, kw = kernel
    d = x.shape[-1]
    outs, start = [], 0
    for t, h, w in grids:
        seq = x[start:start + t * h * w].reshape(t, h // kh, kh, w // kw, kw, d)
        seq = seq.transpose(0, 1, 3, 2, 4, 5).mean(axis=0)
        outs.append(seq.reshape((h // kh) * (w // kw), kh * kw * d))
        start += t * h * w
    return jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


class Projector(nn.Module):
    """PatchMergerMLPV2: Linear(4D, 4D) → exact-erf GELU → Linear(4D, text) → RMSNorm(eps)."""
    vcfg: VisionConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, merged):
        c = self.vcfg
        kh, kw = c.merge_kernel_size
        h = _dense(c.mm_hidden_size * kh * kw, ("embed", "mlp"), "proj_0", self.dtype, self.param_dtype)(merged)
        h = jax.nn.gelu(h, approximate=False)  # nn.GELU(): exact, unlike the ViT MLP
        h = _dense(c.text_hidden_size, ("mlp", "embed"), "proj_2", self.dtype, self.param_dtype)(h)
        return RMSNorm(eps=c.projector_ln_eps, name="post_norm")(h)


class KimiVision(nn.Module):
    """Vision tower + merge + projector: packed patches → [Σ rows, text_hidden_size] features,
    image after image, ready to replace the images' `<|media_pad|>` rows."""
    vcfg: VisionConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels, grids: Grid):
        x = VisionTower(self.vcfg, self.dtype, self.param_dtype, name="vision_tower")(pixels, grids)
        merged = tpool_merge(x, grids, tuple(self.vcfg.merge_kernel_size))
        return Projector(self.vcfg, self.dtype, self.param_dtype, name="mm_projector")(merged)


# ----------------------------------------------------------------------------- entry points

def _dummy_inputs(vcfg: VisionConfig):
    kh, kw = vcfg.merge_kernel_size
    grids = ((1, kh, kw),)
    return jnp.zeros((kh * kw, 3, vcfg.patch_size, vcfg.patch_size), jnp.float32), grids


def init_vision_params(vcfg: VisionConfig, rng, param_dtype=jnp.float32) -> dict:
    """Random params {'vision_tower': …, 'mm_projector': …} (logical-axis boxes removed)."""
    pixels, grids = _dummy_inputs(vcfg)
    model = KimiVision(vcfg, jnp.float32, param_dtype)
    # jit: run eagerly, init dispatches the scanned blocks op by op and is ~2x slower.
    return jax.jit(lambda r: nn.meta.unbox(model.init(r, pixels, grids)["params"]))(rng)


def vision_param_shapes(vcfg: VisionConfig, param_dtype=jnp.float32) -> dict:
    """The param tree as ShapeDtypeStructs; nothing is allocated (jax.eval_shape)."""
    return jax.eval_shape(lambda r: init_vision_params(vcfg, r, param_dtype), jax.random.PRNGKey(0))


def count_vision_params(vcfg: VisionConfig) -> dict[str, int]:
    shapes = vision_param_shapes(vcfg)
    n = {k: sum(math.prod(x.shape) for x in jax.tree.leaves(v)) for k, v in shapes.items()}
    return {"vision_tower": n["vision_tower"], "mm_projector": n["mm_projector"],
            "total": n["vision_tower"] + n["mm_projector"]}


def vision_features(vcfg: VisionConfig, params: dict, pixels, grid_thws, dtype=jnp.float32):
    """Projector output rows [Σ rows, text_hidden_size] for packed pixels in the reference layout.

    Validates the inputs, then runs one jitted forward per distinct set of grids.
    """
    grids = check_grids(vcfg, grid_thws)
    pixels = check_pixels(vcfg, pixels, grids)
    return _forward(vcfg, jnp.dtype(dtype), grids, params, jnp.asarray(pixels))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _forward(vcfg, dtype, grids, params, pixels):
    # param_dtype only matters at init; apply casts every kernel to `dtype`.
    return KimiVision(vcfg, dtype).apply({"params": params}, pixels, grids)
