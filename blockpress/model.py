"""The DiffusionGemma text model: one parameter stack, used two ways.

- `encode`: causal attention over clean tokens (prompt, finished canvases); appends keys/values to
  the caller's KVCache.
- `denoise`: bidirectional attention over a canvas, reading the cache plus the canvas' own keys and
  values; never advances the cache. Decoder-only: self-conditioning on the previous step's logits.

The model knows nothing of sampling. Module and parameter names follow the Hugging Face checkpoint
(`model.decoder.*`) so that loading is a rename, not a translation.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from .cache import KVCache
from .checks import is_int
from .config import ACTIVATIONS, PREFILL_CHUNK, LayerSpec, ModelConfig, TextConfig
from .stopping import interrupts_deferred

# (layer index, spec, new keys, new values) -> (all keys, all values) that the new queries may read.
KVSource = Callable[[int, LayerSpec, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_10(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x).clamp(-10.0, 10.0)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def _linear(x: torch.Tensor) -> torch.Tensor:
    return x


def _laplace(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf((x - 0.707107) / (0.282095 * math.sqrt(2.0))))


def _sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


# The gate activations of the dense MLP, the experts and self-conditioning, by the names config.ACTIVATIONS maps
# transformers' names to (the same maths as transformers' ACT2FN: a test checks each against it).
# Module-level functions, not lambdas: a layer holds its activation, and pickle (torch.save(lm.model), an LM sent
# to a multiprocessing worker) finds a function by its name, which a lambda has not.
ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "gelu_10": _gelu_10,
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
    "relu2": _relu2,
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,  # torch's default slope, 0.01, as transformers builds it
    "hardswish": F.hardswish,
    "mish": F.mish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "linear": _linear,
    "laplace": _laplace,
    "sqrtsoftplus": _sqrtsoftplus,
}


def activation(cfg: TextConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function config.json's hidden_activation names (validated by TextConfig)."""
    return ACTIVATION_FUNCTIONS[ACTIVATIONS[cfg.hidden_activation]]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; `with_scale=False` is the scale-free variant (v_norm, router...)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope_inv_freq(spec: LayerSpec, rope: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies for a layer, `head_dim // 2` long, by its `rope_parameters` entry (validated by
    TextConfig).

    "proportional" rotates only the first `partial_rotary_factor` of the angles but keeps the exponent's
    denominator at the full head_dim; the remaining angles get frequency 0 (cos 1, sin 0: no rotation).
    """
    d, theta = spec.head_dim, float(rope["rope_theta"])
    rope_type = rope.get("rope_type", "default")
    if rope_type == "proportional":
        rotated = int(rope.get("partial_rotary_factor", 1.0) * d // 2)
        inv = 1.0 / theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / d)
        inv = torch.cat([inv, torch.zeros(d // 2 - rotated)])
        return inv / float(rope.get("factor", 1.0))
    # "dynamic" (NTK) grows the base only once a call's longest position passes max_position_embeddings, which
    # blockpress never runs past (LM refuses longer contexts): within it the frequencies are the default ones.
    powers = theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    inv = 1.0 / powers
    if rope_type == "linear":
        return inv / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv, rope)
    if rope_type == "yarn":
        return _yarn_inv_freq(powers, d, theta, rope)
    return inv


def _llama3_inv_freq(inv: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths above original/low_freq_factor are divided by `factor`, those below
    original/high_freq_factor kept, and those between blended linearly in original/wavelength."""
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = rope["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    long = wavelength > original / low
    middle = ~long & ~(wavelength < original / high)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(middle, blended, torch.where(long, inv / factor, inv))


def _yarn_inv_freq(powers: torch.Tensor, d: int, theta: float, rope: dict[str, Any]) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by `factor`) or kept, by how many turns it makes within the
    original context, with a linear ramp between beta_fast and beta_slow turns. The reference reads `truncate` from
    the outer rope_parameters, which for DiffusionGemma holds only layer types: it always rounds the ramp's ends."""
    factor, original = float(rope["factor"]), rope["original_max_position_embeddings"]

    def index_of(turns: float) -> float:  # the (fractional) frequency index that makes `turns` turns in `original`
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(index_of(rope.get("beta_fast") or 32)), 0)
    hi: float = min(math.ceil(index_of(rope.get("beta_slow") or 1)), d - 1)
    if lo == hi:
        hi += 0.001  # a ramp of width zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp
    return 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep


def rope_attention_scaling(rope: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or from `factor` and the mscales);
    1 for every other rope type."""
    if rope.get("rope_type", "default") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope["factor"])

    def mscale(k: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])
    return mscale(1.0)


@dataclass
class Rope:
    cos: torch.Tensor  # [B, L, 1, D] in the activation dtype
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, L, H, D]
        return x * self.cos + rotate_half(x) * self.sin


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        h, d = cfg.hidden_size, spec.head_dim
        self.num_heads = cfg.num_attention_heads
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.v_proj = None if spec.values_from_keys else nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(d, cfg.rms_norm_eps, with_scale=False)
        # config.json's attention_dropout (DiffusionGemma sets it): dropped attention probabilities in train mode only,
        # where the reference drops them (after the softmax, before the values); eval and generation keep them all
        self.dropout = 0.0
        # attention_bias: q, k, v and o get a bias. The reference ties the encoder's projection weights to the
        # decoder's but not their biases, so each side has a set of its own (kept out of the nn.Linears, which
        # quantizing and LoRA replace, so that both sides share one weight whatever holds it).
        self.bias = self.encoder_bias = None
        if cfg.attention_bias:
            sizes = {"q_proj": self.num_heads * d, "k_proj": spec.num_kv_heads * d, "o_proj": h}
            if self.v_proj is not None:
                sizes["v_proj"] = spec.num_kv_heads * d
            self.bias = nn.ParameterDict({name: nn.Parameter(torch.zeros(n)) for name, n in sizes.items()})
            self.encoder_bias = nn.ParameterDict({name: nn.Parameter(torch.zeros(n)) for name, n in sizes.items()})

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None, kv: KVSource, layer_idx: int, encoder: bool
    ) -> torch.Tensor:
        b, length, _ = x.shape
        d = self.spec.head_dim
        bias = self.encoder_bias if encoder else self.bias
        q = rope.apply(self.q_norm(self.project("q_proj", x, bias).view(b, length, -1, d))).transpose(1, 2)
        k_raw = self.project("k_proj", x, bias).view(b, length, -1, d)
        v_raw = k_raw if self.v_proj is None else self.project("v_proj", x, bias).view(b, length, -1, d)
        k = rope.apply(self.k_norm(k_raw)).transpose(1, 2)
        v = self.v_norm(v_raw).transpose(1, 2)
        k, v = kv(layer_idx, self.spec, k, v)
        # Gemma 4 attention is unscaled: q/k norms already fix the logit scale.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=1.0, enable_gqa=k.shape[1] != q.shape[1],
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.project("o_proj", out.transpose(1, 2).reshape(b, length, -1), bias)

    def project(self, name: str, x: torch.Tensor, bias: nn.ParameterDict | None) -> torch.Tensor:
        """x through the projection `name`, plus its bias from `bias` (the encoder's or the decoder's set, or None)."""
        y = getattr(self, name)(x)
        return y if bias is None else y + bias[name]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root = cfg.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] un-normed residual -> (weights [T, k] float32, expert indices [T, k])."""
        scores = self.proj(self.norm(x) * self.scale * self.root)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


# torch's grouped GEMM: F.grouped_mm where public, else the private op of the same signature, else None (torch 2.6
# and 2.7, which have neither).
GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# torch 2.8's has no CPU kernel ("Could not run 'aten::_grouped_mm' with arguments from the 'CPU' backend", any shape
# or dtype): a CPU's experts take it from torch 2.9 on.
GROUPED_MM_ON_CPU = GROUPED_MM is not None and TorchVersion(torch.__version__) >= "2.9"


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """rows of x (sorted by expert, grouped as `rows` says) times weight[e].T for their expert e.

    weight: [E, out, in] as stored in the checkpoint. Uses torch's grouped GEMM when the shapes allow it
    (16-byte aligned rows), else one matmul per expert that has tokens. Under torch.compile it is one
    opaque op (the compiler's grouped_mm takes bf16 only, and a float32 GEMM gains nothing from it), except
    when both are bf16: then the compiler takes grouped_mm itself and the custom op's dispatch is saved.
    """
    if torch.compiler.is_compiling():
        if (GROUPED_MM is not None and x.dtype == weight.dtype == torch.bfloat16
                and _grouped_mm_applies(x, weight, *weight.shape[1:])):
            return GROUPED_MM(x, weight.transpose(1, 2), offs=rows.offsets)
        return torch.ops.blockpress.grouped_linear(x, weight, rows.offsets)
    return _grouped_linear_eager(x, weight, rows)


def _grouped_linear_eager(x: torch.Tensor, weight: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    w = weight.transpose(1, 2)  # [E, in, out], a view
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        # Autocast has no rule for grouped_mm: cast as it would for a matmul (CUDA's kernel is bf16-only).
        dtype = torch.get_autocast_dtype("cuda")
        x, w = x.to(dtype), w.to(dtype)
    if GROUPED_MM is not None and _grouped_mm_applies(x, w, weight.shape[1], weight.shape[2]):
        return GROUPED_MM(x, w, offs=rows.offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    for e, start, end in rows.groups:
        out[start:end] = x[start:end] @ w[e]
    return out


def _grouped_mm_applies(a: torch.Tensor, b: torch.Tensor, *sizes: int) -> bool:
    """Can torch's grouped GEMM take these operands: one dtype it supports on this device (CUDA: bf16 only),
    and the given row sizes 16-byte aligned?"""
    if a.device.type not in ("cpu", "cuda", "meta") or (a.device.type == "cpu" and not GROUPED_MM_ON_CPU):
        # (MPS and others: torch's kernel is CUDA's and, from 2.9, the CPU's; the loop runs anywhere. meta runs
        # shapes alone, where the loop's offsets would have to be read on the host)
        return False
    supported = (torch.bfloat16,) if a.is_cuda else (torch.float32, torch.bfloat16)
    return (GROUPED_MM is not None and a.dtype == b.dtype and a.dtype in supported
            and all((n * a.element_size()) % 16 == 0 for n in sizes))


def expert_groups(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows, from the group ends `offsets` (one host sync)."""
    ends = offsets.tolist()
    return [(e, start, end) for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)) if end > start]


@dataclass(eq=False)
class ExpertRows:
    """Where each expert's rows lie among the tokens sorted by expert: the group ends `offsets` (on the device,
    what a grouped GEMM takes) and `groups`, the same read on the host for a per-expert loop. Both projections of
    a layer share one, so a layer whose experts loop syncs with the host once, and one whose experts run as
    grouped GEMMs never (groups is read on first use only)."""

    offsets: torch.Tensor

    @functools.cached_property
    def groups(self) -> list[tuple[int, int, int]]:
        return expert_groups(self.offsets)


@torch.library.custom_op("blockpress::grouped_linear", mutates_args=())
def _grouped_linear_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_linear_eager(x, weight, ExpertRows(offsets))


@_grouped_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def _grouped_weight_grad_eager(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    """[E, out, in]: grad[rows of e].T @ x[rows of e] for every expert e (zeros for one without rows)."""
    if GROUPED_MM is not None and _grouped_mm_applies(grad, x, grad.shape[1], x.shape[1]):
        return GROUPED_MM(grad.t(), x, offs=offsets)
    out = x.new_zeros(experts, grad.shape[1], x.shape[1])
    for e, start, end in expert_groups(offsets):
        out[e] = grad[start:end].t() @ x[start:end]
    return out


@torch.library.custom_op("blockpress::grouped_weight_grad", mutates_args=())
def _grouped_weight_grad_op(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    return _grouped_weight_grad_eager(grad, x, offsets, experts)


@_grouped_weight_grad_op.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    return x.new_empty(experts, grad.shape[1], x.shape[1])


def _grouped_linear_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, offsets = inputs
    ctx.save_for_backward(x, weight, offsets)


def _grouped_linear_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    """y = x @ weight[e].T per group: dx = grad @ weight[e] (the same op, weight transposed), dweight[e] =
    grad.T @ x over the group's rows. Under CUDA autocast the forward ran in bf16: grads return in each input's dtype."""
    x, weight, offsets = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        w = weight.to(grad.dtype).transpose(1, 2)
        grad_x = torch.ops.blockpress.grouped_linear(grad, w, offsets).to(x.dtype)
    if ctx.needs_input_grad[1]:
        grad_w = torch.ops.blockpress.grouped_weight_grad(grad, x.to(grad.dtype), offsets, weight.shape[0])
        grad_w = grad_w.to(weight.dtype)
    return grad_x, grad_w, None


_grouped_linear_op.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)


class Experts(nn.Module):
    """All experts' weights as 3-D tensors; tokens are sorted by expert and run as one grouped GEMM."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        if self.gate_up_proj.device.type != "meta":  # built directly (DiffusionGemma(config) on a real device), they
            # would hold whatever memory held: NaN logits at the first pass, where nn.Linear's layers init themselves
            self.gate_up_proj.data.normal_(0.0, cfg.initializer_range)
            self.down_proj.data.normal_(0.0, cfg.initializer_range)
        self.act = activation(cfg)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        tokens, k = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs, sorted by expert
        # Where each expert's rows end: the pairs routed to it or to a lower one. A comparison and a sum, not a
        # scatter-add and a cumsum: torch.compile fuses these, where those run as separate library calls on a CPU.
        experts = torch.arange(self.num_experts, device=flat.device)
        rows = ExpertRows((flat[None, :] <= experts[:, None]).sum(1, dtype=torch.int32))
        gate, up = self.project(x[order // k], "gate_up_proj", rows).chunk(2, dim=-1)
        y = self.project(self.act(gate) * up, "down_proj", rows)
        y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
        # Back to (token, slot) order, then each token's k outputs summed (in place of an index_add into zeros,
        # another library call; for k <= 2 the same bits, as each output is rounded to x's dtype first).
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(tokens, k, -1).sum(1)

    def project(self, x: torch.Tensor, name: str, rows: ExpertRows) -> torch.Tensor:
        """Rows of x (sorted by expert) through their expert's `name` projection (a quantized model overrides it)."""
        return _grouped_linear(x, getattr(self, name), rows)


class Layer(nn.Module):
    layer_scalar: torch.Tensor  # buffers, registered in __init__
    encoder_layer_scalar: torch.Tensor

    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, spec)
        self.mlp = MLP(h, cfg.intermediate_size, activation(cfg))
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
        self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        # The checkpoint stores the decoder's and the encoder's layer scalars separately (buffers are not tied).
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None, kv: KVSource, idx: int, encoder: bool
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, kv, idx, encoder))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.router(flat)  # routed on the un-normed residual
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), weights, index).view_as(x)
        x = x + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(moe))
        return x * (self.encoder_layer_scalar if encoder else self.layer_scalar)


class SelfConditioning(nn.Module):
    """Gated MLP over the soft embedding of the previous step's prediction, added to the canvas embedding."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # zero signal: the MLP of zeros is exactly zero, skip it
            return self.post_norm(embeds)
        s = self.pre_norm(soft)
        return self.post_norm(embeds + self.down_proj(self.act(self.gate_proj(s)) * self.up_proj(s)))


def _check_ids(ids: torch.Tensor, cache: KVCache, name: str) -> tuple[int, int]:
    """[B, L] of a pass of your own (encode / denoise over a cache you hold), B the cache's rows: a mismatch otherwise
    fails deep inside a projection or a mask ("mat1 and mat2 shapes cannot be multiplied"), naming neither."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32):
        got = (f"{ids.dim()}-D {str(ids.dtype).replace('torch.', '')}" if isinstance(ids, torch.Tensor)
               else type(ids).__name__)
        raise ValueError(f"{name}: expected token ids as a 2-D int64 tensor [batch, length], got {got}")
    if ids.shape[0] != cache.batch_size:
        raise ValueError(f"{name}: {ids.shape[0]} rows, but the cache holds {cache.batch_size} (one per row; "
                         f"allocate it with new_cache({ids.shape[0]}, ...))")
    if ids.shape[1] == 0:  # (a projection cannot lay out no tokens: "cannot reshape tensor of 0 elements")
        raise ValueError(f"{name}: no tokens (shape {list(ids.shape)}); a pass needs at least one")
    # (ids past the vocabulary are not looked for: a pass of the denoising loop may not wait for the host)
    return ids.shape[0], ids.shape[1]


def _cache_source(cache: KVCache, start: int, sliding_from: int) -> KVSource:
    """Write new keys/values at `start` and read everything the queries may see, as views (no copy)."""

    def source(i: int, spec: LayerSpec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        cache.keys[i][:, :, start:end] = k
        cache.values[i][:, :, start:end] = v
        lo = sliding_from if spec.is_sliding else 0
        return cache.keys[i][:, :, lo:end], cache.values[i][:, :, lo:end]

    return source


def lora_wrapped_layer(model: nn.Module) -> str | None:
    """The name of the first layer that holds LoRA adapters not merged into it (peft's, with its lora_A), or None:
    such a model can neither be quantized, saved as a checkpoint nor trained afresh until they are merged."""
    return next((name for name, module in model.named_modules() if hasattr(module, "lora_A")), None)


# Each model's own first element of weights_version (itertools.count's next() is atomic under the GIL)
MODEL_SERIALS = itertools.count()


class DiffusionGemma(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        # (this model's serial in the process, the in-place changes of its weights: a cast, a move, quantizing): keys
        # and values encoded under another version are stale, or another model's, so a KVCache records the version it
        # was filled under and a PrefixCache too (LM._check_cache, PrefixCache.check_model). The serial keeps two
        # models apart, so one model's cache cannot continue another's conversation.
        self.weights_version: tuple[int, int] = (next(MODEL_SERIALS), 0)
        # The changes of the weights' values alone (not moves): what the LM says of the values it loaded (its stored
        # dtype) holds while this is unchanged. Kept by a copy, whose values are the copied model's.
        self.values_changes = 0
        cfg = config.text
        # Built on the meta device (every load and random_model), nn.Embedding's own normal_ init runs through torch's
        # Python reference ops, whose first call imports torch._dynamo (seconds of a process's first load), for values
        # a load replaces. So the weight comes empty, initialised only where it is real.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size,
                                                                                             cfg.hidden_size))
        if self.embed_tokens.weight.device.type != "meta":
            self.embed_tokens.reset_parameters()
        self.layers = nn.ModuleList(Layer(cfg, spec) for spec in cfg.layers)
        # each layer's kind, read by every forward (not through self.layers[i].self_attn.spec: ModuleList's items
        # are plain Modules to a type checker, and each attribute read there goes through Module.__getattr__)
        self.layer_kinds = tuple(spec.kind for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.softcap = cfg.final_logit_softcapping
        self.window = cfg.sliding_window
        self.prefill_chunk = PREFILL_CHUNK  # encode's default chunk_size: a memory setting of this engine, not the model's
        for kind, inv_freq in self._inv_freqs().items():  # computed on the CPU (see _inv_freqs), kept where the weights are
            self.register_buffer(f"inv_freq_{kind}", inv_freq.to(self.embed_tokens.weight.device), persistent=False)
        self.rope_scaling = {kind: rope_attention_scaling(cfg.resolved_rope_parameters[kind]) for kind in cfg.kinds}
        try:
            dropout = config.attention_dropout
        except ValueError:
            dropout = 0.0  # inference never reads it; training refuses it by name (Trainer)
        for layer in self.decoder_layers():
            layer.self_attn.dropout = dropout

    # -- building blocks -----------------------------------------------------------------------------
    def decoder_layers(self) -> Iterator[Layer]:
        """self.layers as the Layers they are (LoRA and quantizing replace modules inside a Layer, never one)."""
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"layers[{i}]: expected a Layer, got {type(layer).__name__}")
            yield layer

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _inv_freqs(self) -> dict[str, torch.Tensor]:
        cfg = self.config.text
        # In layer order: a set's order follows the per-process string hash, and DDP pairs buffers across processes
        # by their order (else one process's sliding frequencies are broadcast into another's full ones)
        # On the CPU whatever device is the default: under `with torch.device("meta")` (a load's construction) the
        # arithmetic would run through torch's Python reference ops, which import torch._dynamo (seconds) to do it.
        with torch.device("cpu"):
            return {kind: rope_inv_freq(next(s for s in cfg.layers if s.kind == kind), cfg.resolved_rope_parameters[kind])
                    for kind in cfg.kinds}

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers (after meta-device construction): float32, on the model's device."""
        for kind, inv_freq in self._inv_freqs().items():
            setattr(self, f"inv_freq_{kind}", inv_freq.to(self.device))

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> DiffusionGemma:
        """What nn.Module.to / .cuda() / .half() / .bfloat16() / .to_empty() run on every tensor, then the rotary
        frequencies recomputed. Those casts round every floating buffer, and bf16-rounded frequencies put a
        position's angle off by up to 0.4%, which grows with the position (radians past a few thousand tokens):
        the tables stay float32 on the model's device, as loading in that dtype builds them. A quantized model
        refuses a change of dtype before anything moves (quantize.check_cast), and so does a cast to float16 of a
        weight past its range (checkpoint.check_float16_range): cast, it would be inf."""
        from .checkpoint import check_float16_range  # both import this module
        from .quantize import check_cast, fit_cpu_kernels

        check_cast(self, fn)
        rounds = True  # (meta tensors hold no values; to_empty counts its own)
        if self.device.type != "meta":
            cast_to = self.dtypes_after(fn)
            check_float16_range(((name, t) for name, t in (*self.named_parameters(), *self.named_buffers())
                                 if cast_to[t.dtype] == torch.float16 != t.dtype), "nothing was cast")
            rounds = any(old != new for old, new in cast_to.items())  # a move alone keeps every value
        # before too: a pass that another thread runs meanwhile can tell why it failed
        self.weights_changed(values=rounds)
        with interrupts_deferred():  # a Ctrl-C part-way would leave some weights cast and others not (or
            super()._apply(fn, recurse)  # the tables stale): every later pass would fail in torch, or differ unsaid
            self.reset_buffers()
            fit_cpu_kernels(self)  # quantized weights laid out for the kernels of the device they landed on
            self.weights_changed(values=False)
        return self

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> DiffusionGemma:
        """nn.Module's: every tensor made anew, uninitialised, on `device`. Counted as a change of the values (as
        _apply cannot tell it from a move, which keeps them)."""
        super().to_empty(device=device, recurse=recurse)
        self.values_changes += 1
        return self

    def dtypes_after(self, cast: Callable[[torch.Tensor], torch.Tensor]) -> dict[torch.dtype, torch.dtype]:
        """What `cast` (a function _apply would run on every tensor) makes of each dtype the model's tensors hold,
        asked of an empty tensor of each: a cast can then be judged before any weight moves."""
        dtypes = dict.fromkeys(t.dtype for t in (*self.parameters(), *self.buffers()))
        return {d: cast(torch.empty(0, dtype=d, device=self.device)).dtype for d in dtypes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (copy.deepcopy; pickle, whose serial is another process's, maybe a model's here) is a model of its
        own: it kept the serial of the one copied, and continued that one's caches, or another model's, unrefused."""
        super().__setstate__({"values_changes": 0, **state})  # (0: a model pickled before it was kept)
        self.weights_version = (next(MODEL_SERIALS), 0)

    def weights_changed(self, values: bool = True) -> None:
        """Say that the weights changed in place: keys and values encoded before are stale. `values`: False where
        they were moved (another device) and hold the same values, which `values_changes` then does not count."""
        # past every version this model has had, not the current one + 1: after `weights_restored` went back to an
        # earlier one, the versions a change undone had used are never this model's again
        spent = max(self.weights_version[1], getattr(self, "_versions_spent", 0)) + 1
        self._versions_spent = spent
        self.weights_version = (self.weights_version[0], spent)
        if values:
            self.values_changes += 1

    def weights_restored(self, version: tuple[int, int], values_changes: int) -> None:
        """Say that a change of the weights was undone whole (quantize rolled back part-way): the version they had
        before it is theirs again, so caches filled before it continue, while one filled meanwhile (a version the
        change used) is refused for good."""
        self._versions_spent = max(self.weights_version[1], getattr(self, "_versions_spent", 0))
        self.weights_version, self.values_changes = version, values_changes

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        # a CPU scalar in the weights' dtype (the reference's rounding), named: a CPU scalar meets weights on any
        # device with no copy (a CUDA graph's capture allows none), where torch.set_default_device's would not
        return F.embedding(ids, w) * torch.tensor(self.embed_scale, dtype=w.dtype, device="cpu")

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, tied LM head, float32 soft-capping."""
        logits = F.linear(self.norm(hidden), self.embed_tokens.weight).float()
        if torch.is_grad_enabled():
            return torch.tanh(logits / self.softcap) * self.softcap
        # in place on the fresh float32 logits: out-of-place costs ~2.5x on CPU
        return logits.div_(self.softcap).tanh_().mul_(self.softcap)

    def soft_embedding(self, logits: torch.Tensor | None = None, probs: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(logits) @ E, scaled like a token embedding: the self-conditioning input.

        The decoding loop passes `probs` it already computed for sampling, saving a softmax over the
        vocabulary per step.
        """
        w = self.embed_tokens.weight
        if probs is None:
            if logits is None:
                raise ValueError("soft_embedding: expected logits or probs, got neither")
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return (probs.to(w.dtype) @ w) * torch.tensor(self.embed_scale, dtype=w.dtype, device="cpu")

    def _soft_input(self, logits: torch.Tensor | None, probs: torch.Tensor | None,
                    mask: torch.Tensor | None) -> torch.Tensor | None:
        """The self-conditioning input (None: no signal), zeroed for the rows `mask` [B] switches off."""
        if logits is None and probs is None:
            return None
        soft = self.soft_embedding(logits, probs)
        return soft if mask is None else soft * mask.to(soft.dtype)[:, None, None]

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rope]:
        out = {}
        for kind in self.config.text.kinds:
            freqs = positions[..., None].float() * getattr(self, f"inv_freq_{kind}")
            emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
            scale = self.rope_scaling[kind]  # YaRN's attention factor, else 1 (exact)
            out[kind] = Rope((emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype))
        return out

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        masks: Mapping[str, torch.Tensor | None],
        kv: KVSource,
        encoder: bool,
    ) -> torch.Tensor:
        ropes = self.ropes(positions, x.dtype)
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_kinds)):
            x = layer(x, ropes[kind], masks[kind], kv, i, encoder)
        return x

    def causal_masks(
        self, start: int, end: int, sliding_from: int, valid: torch.Tensor | None
    ) -> dict[str, torch.Tensor | None]:
        """Encoder masks for query slots [start, end) over key slots [lo, end): causal, windowed on sliding
        layers, and (with `valid` [B, slots]) never attending padding."""
        device = self.device
        slots = torch.arange(start, end, device=device)
        masks: dict[str, torch.Tensor | None] = {}
        for kind in self.config.text.kinds:
            lo = sliding_from if kind == "sliding_attention" else 0
            keys = torch.arange(lo, end, device=device)
            allowed = keys[None, :] <= slots[:, None]
            if kind == "sliding_attention":
                # the position vectors compared broadcast, in place: `slots - keys` would make an int64 [P, P]
                # first, 8x the bool mask itself
                allowed &= keys[None, :] > slots[:, None] - self.window
            if valid is not None:
                # Pad queries attend to themselves only, so no row is fully masked (no NaNs anywhere).
                allowed = (allowed[None] & valid[:, None, lo:end]) | (keys[None, None, :] == slots[None, :, None])
                masks[kind] = allowed[:, None]
            elif end - start == 1:
                masks[kind] = None  # a single new query sees every key it is given
            else:
                masks[kind] = allowed[None, None]
        return masks

    # -- the two uses ----------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One model, two passes, so no single forward (nn.Module's own error names neither pass)."""
        raise TypeError("DiffusionGemma has no single forward: it runs as a causal encoder filling a KVCache "
                        "(model.encode) and a bidirectional decoder over a canvas (model.denoise); for logits "
                        "use lm.logits(prompt_ids, canvas_ids), or lm.generate")

    def encode(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        attention_mask: torch.Tensor | None = None,
        logits: str = "none",
        chunk_size: int | None = None,
    ) -> torch.Tensor | None:
        """Causally encode clean tokens into the cache. `logits`: "none", "last" ([B, V]) or "all" ([B, L, V]).

        Runs `chunk_size` queries at a time (default `self.prefill_chunk`): each chunk writes its keys and values,
        then attends to the cache so far and itself, so memory grows with chunk x prompt rather than prompt^2.
        The result is the one-pass result (chunks only split the queries; every query sees the same keys).
        """
        if logits not in ("none", "last", "all"):
            raise ValueError(f'logits: expected "none", "last" or "all", got {logits!r}')
        chunk = self.prefill_chunk if chunk_size is None else chunk_size
        if not is_int(chunk) or chunk <= 0:
            name = "chunk_size" if chunk_size is not None else "prefill_chunk"
            raise ValueError(f"{name}: expected a positive int (queries per encoder pass), got {chunk!r}")
        chunk = int(chunk)
        b, length = _check_ids(input_ids, cache, "input_ids")
        cache.reserve(length)
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
                raise ValueError(f"attention_mask: expected a tensor shaped like input_ids {list(input_ids.shape)} "
                                 f"(1 = token, 0 = padding), got {got}")
            attention_mask = attention_mask.to(device=cache.device, dtype=torch.bool)
            if bool(attention_mask.all()):
                attention_mask = None
        start = cache.length
        positions = cache.positions(length, attention_mask)
        padded = cache.has_padding or attention_mask is not None
        valid = cache.valid
        if attention_mask is not None:
            valid = valid.clone()
            valid[:, start : start + length] = attention_mask
        outs = []
        for lo in range(0, length, chunk):
            hi = min(lo + chunk, length)
            first = start + lo
            # Sliding layers read only the window before this chunk's first query; full layers the whole cache.
            sliding_from = max(0, first - self.window + 1)
            masks = self.causal_masks(first, start + hi, sliding_from, valid if padded else None)
            x = self.run_layers(self.embed(input_ids[:, lo:hi]), positions[:, lo:hi], masks,
                                _cache_source(cache, first, sliding_from), True)
            if logits == "all":
                outs.append(self.head(x))
        cache.commit(attention_mask, length)
        if logits == "none":
            return None
        return self.head(x[:, -1]) if logits == "last" else torch.cat(outs, dim=1)

    def encode_one(self, token_ids: torch.Tensor, cache: KVCache, slot: torch.Tensor) -> torch.Tensor:
        """`encode(token_ids, cache, logits="last")` for one token per row, with every shape fixed: the slot
        to write is a tensor ([1], = cache.length) and attention spans the cache's whole capacity under a mask,
        so one CUDA graph serves every position. The caller commits the slot afterwards. Returns [B, V]."""
        keys = torch.arange(cache.capacity, device=cache.device)
        seen = (keys <= slot) & cache.valid  # [B, capacity]; slots past `length` are valid, so the token sees itself
        near = slot - keys < self.window
        masks = {kind: (seen & near if kind == "sliding_attention" else seen)[:, None, None, :]
                 for kind in self.config.text.kinds}

        def source(i: int, spec: LayerSpec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cache.keys[i].index_copy_(2, slot, k)
            cache.values[i].index_copy_(2, slot, v)
            return cache.keys[i], cache.values[i]

        x = self.run_layers(self.embed(token_ids), cache.next_pos[:, None], masks, source, True)
        return self.head(x[:, -1])

    def denoise(
        self,
        canvas_ids: torch.Tensor,
        cache: KVCache,
        self_conditioning_logits: torch.Tensor | None = None,
        self_conditioning_mask: torch.Tensor | None = None,
        self_conditioning_probs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bidirectional pass over the canvas, reading (never advancing) the cache. Returns float32 logits.

        Self-conditioning comes from the previous step's logits, or directly from their softmax
        (`self_conditioning_probs`).
        """
        b, length = _check_ids(canvas_ids, cache, "canvas_ids")
        cache.reserve(0, scratch=length)
        start = cache.length
        positions = cache.positions(length)
        # Sliding layers see the last window-1 encoded tokens and the whole canvas.
        sliding_from = max(0, start - self.window + 1)
        masks: dict[str, torch.Tensor | None] = {}
        for kind in self.config.text.kinds:
            if cache.has_padding:
                lo = sliding_from if kind == "sliding_attention" else 0
                seen = torch.cat([cache.valid[:, lo:start], cache.valid.new_ones(b, length)], dim=1)
                masks[kind] = seen[:, None, None, :]
            else:
                masks[kind] = None
        soft = self._soft_input(self_conditioning_logits, self_conditioning_probs, self_conditioning_mask)
        x = self.self_conditioning(self.embed(canvas_ids), soft)
        x = self.run_layers(x, positions, masks, _cache_source(cache, start, sliding_from), False)
        return self.head(x)

    # -- training: every canvas of a sequence in one forward ----------------------------------------------
    def encode_sequence(
        self, ids: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Causal pass over a whole clean sequence, no cache (training).

        Returns (hidden [B, S, H] before the final norm, per-layer (keys, values) for the decoder,
        positions [B, S]). `valid` [B, S] bool masks padding.
        """
        length = ids.shape[1]
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        masks = self.causal_masks(0, length, 0, valid)
        store: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(self.layers)  # type: ignore[list-item]

        def source(i: int, spec: LayerSpec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            store[i] = (k, v)
            return k, v

        hidden = self.run_layers(self.embed(ids), positions, masks, source, True)
        return hidden, store, positions

    def denoise_blocks(
        self,
        noisy: torch.Tensor,
        encoded: list[tuple[torch.Tensor, torch.Tensor]],
        valid: torch.Tensor,
        positions: torch.Tensor,
        prompt_length: int,
        self_conditioning_logits: torch.Tensor | None = None,
        self_conditioning_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder pass over all noisy canvases at once with a block-causal mask (training).

        noisy [B, n*C]: canvas b sits at slots prompt_length + b*C of the clean sequence. It sees the clean
        prompt and clean canvases before it (the last window-1 of them on sliding layers, as at inference),
        plus itself bidirectionally; never its own clean tokens nor later canvases.
        """
        b, total = noisy.shape
        c = self.config.canvas_length
        if total % c:
            raise ValueError(f"noisy: length {total} is not a multiple of canvas_length {c}")
        seq = valid.shape[1]
        device = noisy.device
        block = torch.arange(total, device=device) // c
        start = prompt_length + block * c  # first slot of each query's canvas
        keys = torch.arange(seq, device=device)
        own = block[:, None] == block[None, :]
        masks: dict[str, torch.Tensor] = {}
        for kind in self.config.text.kinds:
            seen = keys[None, :] < start[:, None]
            if kind == "sliding_attention":
                seen = seen & (keys[None, :] > start[:, None] - self.window)
            enc = seen[None] & valid[:, None, :]
            masks[kind] = torch.cat([enc, own[None].expand(b, -1, -1)], dim=2)[:, None]

        def source(i: int, spec: LayerSpec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ek, ev = encoded[i]
            return torch.cat([ek, k], dim=2), torch.cat([ev, v], dim=2)

        soft = self._soft_input(self_conditioning_logits, None, self_conditioning_mask)
        x = self.self_conditioning(self.embed(noisy), soft)
        # The canvases are numbered on from the prompt's last token, as inference numbers a canvas (the cache's next
        # position onwards), padding included: a running-text window that ends inside its last canvas leaves a
        # padded tail there, and a running count of valid slots would give each padded slot the last token's
        # position, putting the tail the scored positions attend to at the wrong place.
        after = positions[:, prompt_length - 1 : prompt_length] + 1 if prompt_length else positions.new_zeros(b, 1)
        x = self.run_layers(x, after + torch.arange(total, device=device), masks, source, False)
        return self.head(x)

    # -- initialisation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        std = self.config.text.initializer_range
        for name, p in self.named_parameters():
            if ".bias." in name or ".encoder_bias." in name:  # attention biases (attention_bias: true) start at zero
                p.zero_()
            elif p.dim() == 1:  # norm scales, router scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
        for layer in self.decoder_layers():
            layer.layer_scalar.fill_(1.0)
            layer.encoder_layer_scalar.fill_(1.0)
