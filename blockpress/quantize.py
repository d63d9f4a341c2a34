"""Weight quantization as a model transform: int8 weights, or FP8 (e4m3) weights and activations.

`quantize(model, scheme)` swaps, in place, every projection of the layers (attention, dense MLP, experts) and
of the self-conditioning MLP for a quantized twin; the embedding (which is also the tied LM head), the norms and
the router stay in the model's dtype. The swap is the whole transform (model.py only calls check_cast before
a cast).

- "int8": weight-only, symmetric, one scale per output channel. Activations stay in the model's dtype. On a CPU
  in bfloat16 the packed int8 kernel reads a quarter of the bytes: for one-token (AR) passes it is faster than
  a bf16 GEMM; for a 64-token canvas it is slower (see README). In float32 rows of up to INT8_FLOAT32_MAX_ROWS take
  it too, in bfloat16 at inference (CPU_KERNEL_DTYPES). Elsewhere weights are dequantized per call.
- "fp8": e4m3 weights with one scale per output channel, activations quantized per row on the fly (W8A8
  dynamic, as vLLM serves DiffusionGemma), multiplied by `torch._scaled_mm` (FP8 tensor cores on Hopper). A CPU
  runs the same arithmetic, slowly: it is there so that the numerics are tested without a GPU.

- "int4": weights only, symmetric 4-bit, two to a byte, one bfloat16 scale per group of 32 inputs (4.5 bits a
  weight: the 26B-A4B fits in 18 GB, as published). Where 32 does not divide the input size the group is
  gcd(in, 32), which costs more (12 bits a weight for an input size of 2 x odd, more than int8): `quantize`
  warns, naming the shapes. On a CPU in bfloat16 or float32 each weight torch's CPU int4 GEMM takes is held in that
  GEMM's layout and multiplied by it (to_cpu_int4, fit_cpu_kernels; float32 rows in bfloat16): an AR token reads a
  quarter of bf16's bytes. Elsewhere, and for inputs of many rows, weights are dequantized per call (on a GPU the
  experts' all at once, or one weight per row for fewer rows than experts; in chunks, see dequantize_weight).

int8 and fp8 halve the bytes of bf16 weights (int8 quarters float32 ones).

A quantized model saves as it is held (`lm.save`, checkpoint.save_model): each projection's codes under the name the
plain checkpoint gives its weight, its scales under that name + "_scale", and config.json's `quantization_config`
(quantization_config below) saying how to read them; `blockpress.load` assigns them back as stored (see
read_quantization_config), so the model it gives is the one saved, bit for bit.

A quantized model is frozen but differentiable in its inputs, for LoRA adapters over it (QLoRA, train.add_lora):
the backward multiplies by each weight dequantized on the spot, so the base stays quantized while training.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .checks import outside_inference_mode, warn_user
from .config import SCHEMES
from .model import (
    DiffusionGemma,
    ExpertRows,
    Experts,
    Router,
    _grouped_linear,
    expert_groups,
    lora_wrapped_layer,
)

INT8_MAX = 127.0
INT4_GROUP = 32  # inputs sharing one int4 scale
DEQUANTIZE_CHUNK = 1 << 24  # weights dequantized at a time (float32 temporaries of 64 MB each), see dequantize_weight
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# scheme -> (its scales' dtype, its codes' dtype), whatever the model's dtype
QUANTIZED_DTYPES = {"int8": (torch.float32, torch.int8), "fp8": (torch.float32, FP8), "int4": (torch.bfloat16, torch.uint8)}
# config.json's quantization_config of a saved quantized model names blockpress as its `quantizer`, and holds no
# `quant_method` on purpose: transformers (5.x) skips a quant_method it does not know with a warning and then loads
# int8 / fp8 codes as if they were the weights (garbage logits), while a quantization_config without one is refused
# outright. Other tools' configs (gptq, bitsandbytes, fbgemm_fp8: a quant_method) are refused by name, their codes
# being laid out otherwise. The format version changes whenever the stored layout does, so that a folder written in
# a later layout is refused rather than misread.
QUANTIZER = "blockpress"
QUANT_FORMAT = 1
SCALE_SUFFIX = "_scale"  # a stored weight's scales: its name + this (the buffers' own names)
# int4 on a CPU in bfloat16 or float32 holds its codes as torch's CPU int4 GEMM reads them ("int4-cpu", see to_cpu_int4),
# and that GEMM takes inputs of up to this many rows: it dequantizes the weights afresh for each block of 4 rows, so past about
# 128 rows one dequantization and a bf16 GEMM are faster (the 26B-A4B's [4096, 2816] q_proj on one thread: 17 against
# 31 ms at 64 rows, 35 against 37 at 128, 69 against 50 at 256; at one row 0.85 ms against 95 for [5632, 2816])
INT4_CPU_MAX_ROWS = 128
# The model dtypes whose quantized weights take torch's CPU kernels: that int4 GEMM, and the packed int8 one. Both are
# vectorized for bfloat16 rows alone: float32 rows run about 27x slower than dequantizing through the int4 one, and
# int8's float32 path converts the codes to float32 on every call (over 10x the packed GEMM in bf16). So at inference
# a float32 model's rows go through them in bfloat16 and come back in float32 (in training mode or with grad enabled
# they stay float32: quantized_matmul's `exact`). The rounding, 2^-9 of each activation and output, is far below
# int4's own error (a weight off by up to half its group's step, 1/14 of the group's largest) and below int8's (a
# step is 1/127 of a row's largest); on blockpress-code it moves the logits about as far as a bf16 model's own
# rounding does.
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# int8 in float32 takes the packed GEMM for up to this many rows: past it the bf16 detour gains nothing (the [4096, 2816]
# projection at 256 rows: 129 against 130 ms converting the codes; at 128, 57 against 82)
INT8_FLOAT32_MAX_ROWS = 128


def check_scheme(scheme: Any) -> str:
    """`scheme` if it is one of SCHEMES; the error names `quantize`, the argument users pass it as everywhere."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"quantize: unknown quantization {scheme!r}; expected one of {', '.join(SCHEMES)}")
    return scheme


def quantize_weight(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, float32 scale per output channel) of weight [..., out, in]: w ~ q * scale[..., None].

    Stacked weights (experts) go one matrix at a time, so the float32 temporaries are one expert's, not all
    of them (a layer of the 26B-A4B's experts is 2 GB in float32)."""
    check_scheme(scheme)
    if weight.device.type == "meta":
        return _meta_layout(weight.shape, scheme)
    if weight.dim() > 2:
        parts = [quantize_weight(w, scheme) for w in weight]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    w = weight.detach().float()
    if scheme == "int4":
        return _quantize_int4(w)
    top = INT8_MAX if scheme == "int8" else FP8_MAX
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / top  # an all-zero row keeps a finite scale
    scaled = w / scale[..., None]
    if scheme == "int8":
        return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _meta_layout(shape: torch.Size, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight's codes and scales for a meta weight of `shape`: their shapes and dtypes alone (a load plans
    its model on the meta device, `info --device meta` counts bytes). Computed like a real weight, each op went
    through torch's Python meta kernels, whose first use imports torch._dynamo: blockpress-code's quantized load took
    3.8 s against 0.34 s plain (a fresh process, one thread)."""
    scale_dtype, code_dtype = QUANTIZED_DTYPES[scheme]
    if scheme == "int4":
        check_quantizable(shape, scheme)
        codes, scales = (*shape[:-1], shape[-1] // 2), (*shape[:-1], shape[-1] // int4_group(shape[-1]))
    else:
        codes, scales = tuple(shape), tuple(shape[:-1])
    return (torch.empty(codes, dtype=code_dtype, device="meta"), torch.empty(scales, dtype=scale_dtype, device="meta"))


def check_quantizable(shape: torch.Size | tuple[int, ...], scheme: str, name: str = "a projection") -> None:
    """Refuse a weight `scheme` cannot hold, before anything is changed. `name`: the layer, for the message."""
    if scheme == "int4" and shape[-1] % 2:
        raise ValueError(f"quantize: int4 packs two weights a byte and needs even input sizes; {name} has "
                         f"shape {list(shape)}")


def check_runs(scheme: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a scheme whose kernels do not run on `device` in `dtype`, before any module is swapped or any weight
    read: otherwise the first forward fails with torch's own error, after the whole model was loaded.

    Only fp8 can fail: int8 and int4 fall back to plain GEMMs, which run wherever the model does. Whether
    torch._scaled_mm runs (a GPU below SM89, a torch without the CPU fp8 kernel) is not knowable from torch's
    attributes, so one tiny product goes through the path the layers use."""
    if scheme != "fp8" or device.type == "meta":  # a meta model never runs; its real device is checked on load
        return
    _check_fp8_dtype(device, dtype)
    if not hasattr(torch, "_scaled_mm"):
        raise ValueError("quantize='fp8': needs torch._scaled_mm, which this torch lacks; use 'int8' or 'int4'")
    q, scale = quantize_weight(torch.ones(16, 16, device=device), "fp8")  # CUDA's FP8 GEMM wants sizes of 16s
    try:
        quantized_matmul(torch.ones(1, 16, device=device, dtype=dtype), q, scale, "fp8")
    except (RuntimeError, NotImplementedError) as err:
        reason = (str(err).splitlines() or [""])[0][:300]
        raise ValueError(f"quantize='fp8': torch._scaled_mm does not run on {device} in "
                         f"{str(dtype).removeprefix('torch.')} with this GPU / torch build ({type(err).__name__}: "
                         f"{reason}); use 'int8' or 'int4'") from err


def _check_fp8_dtype(device: torch.device, dtype: torch.dtype) -> None:
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"quantize='fp8': on CUDA it computes in bfloat16 (row-wise scaled GEMM); this model is "
                         f"{str(dtype).removeprefix('torch.')}: load it with dtype='bfloat16'")


def int4_group(in_features: int) -> int:
    """The inputs sharing one int4 scale: INT4_GROUP, or gcd(in_features, INT4_GROUP) for input sizes that 32 does
    not divide (groups must tile the row; dequantizing reads the group off the shapes)."""
    return math.gcd(in_features, INT4_GROUP)


def int4_bits(in_features: int) -> float:
    """Bits a weight takes in int4 at this input size: its 4-bit code and its share of the group's bf16 scale."""
    return 4 + 16 / int4_group(in_features)


def warn_small_int4_groups(weights: list[tuple[str, tuple[int, ...]]]) -> None:
    """Warn when int4's groups fall below 32 inputs for any of `weights` (name, shape [..., out, in]): the scales then
    cost more, up to 12 bits a weight (more than int8) for input sizes of 2 x odd, which a user choosing int4 to
    save memory must hear of. Quiet when 32 divides every input size (every released DiffusionGemma)."""
    small: dict[int, dict[tuple[int, ...], list[str]]] = {}  # input size -> shape -> names
    for name, shape in weights:
        if int4_group(shape[-1]) < INT4_GROUP:
            small.setdefault(shape[-1], {}).setdefault(tuple(shape), []).append(name)
    if not small:
        return
    total = sum(math.prod(shape) for _, shape in weights)
    overall = sum(math.prod(shape) * int4_bits(shape[-1]) for _, shape in weights) / total
    shown = "; ".join(
        f"input size {size} ({'shape' if len(shapes) == 1 else 'shapes'} {', '.join(str(list(s)) for s in shapes)}; "
        f"e.g. {next(iter(shapes.values()))[0]}): groups of {int4_group(size)}, {int4_bits(size):g} bits a weight"
        for size, shapes in small.items())
    count = sum(len(names) for shapes in small.values() for names in shapes.values())
    warn_user(f"quantize: int4 shares a scale among {INT4_GROUP} inputs, and {INT4_GROUP} does not divide the "
              f"input size of {count} of the {len(weights)} projection weights, so their groups are smaller: "
              f"{shown}. The quantized projections take {overall:.2f} bits a weight overall (groups of "
              f"{INT4_GROUP}: {int4_bits(INT4_GROUP):g}; int8: about 8)")


def _quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [..., out, in/2]: two 4-bit codes each, bfloat16 scales [..., out, in/group]), group int4_group(in)."""
    check_quantizable(w.shape, "int4")
    groups = w.unflatten(-1, (-1, int4_group(w.shape[-1])))
    # The scale is rounded to bf16 first and the codes use the rounded scale, so |error| <= scale / 2.
    scale = (groups.abs().amax(dim=-1).clamp(min=1e-12) / 7).to(torch.bfloat16)
    codes = (groups / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int16) + 8  # 0..15
    codes = codes.flatten(-2).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight q * scale in `dtype`, taken in float32 a chunk of DEQUANTIZE_CHUNK weights at a time into the result.
    In one piece, with its float32 temporaries, it peaked at 4x the bytes of a bf16 result (5x for int4): the 26B-A4B's
    int4 experts, dequantized all at once, took 5 GB for a 1 GB result, on a GPU holding 15.3 GB of weights. Compiled, inductor
    fuses the whole of it into one kernel with no temporaries, and the loop would only unroll into the graph."""
    if torch.compiler.is_compiling() or q.numel() <= DEQUANTIZE_CHUNK:
        return _dequantize(q, scale, dtype)
    in_features = q.shape[-1] * 2 if q.dtype == torch.uint8 else q.shape[-1]
    out = torch.empty(*q.shape[:-1], in_features, dtype=dtype, device=q.device)
    rows_out, rows_q = out.view(-1, in_features), q.reshape(-1, q.shape[-1])
    rows_scale = scale.reshape(rows_q.shape[0], *scale.shape[q.dim() - 1:])  # [rows] or, int4, [rows, groups]
    step = max(1, DEQUANTIZE_CHUNK // in_features)
    for start in range(0, rows_q.shape[0], step):
        rows_out[start:start + step] = _dequantize(rows_q[start:start + step], rows_scale[start:start + step], dtype)
    return out


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if q.dtype == torch.uint8:  # int4, packed
        # In bfloat16 or float32 the arithmetic runs in `dtype` itself: (code - 8) * scale is exact in float32 (3 bits
        # times the scale's 8), so rounding it once to the result's dtype gives the same bits as via float32, with a
        # third of the temporaries' bytes (7x faster on a CPU). float16 cannot hold a bfloat16 scale: float32 first.
        work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        codes = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2).to(work).sub_(8)
        return codes.unflatten(-1, (scale.shape[-1], -1)).mul_(scale.to(work)[..., None]).flatten(-2).to(dtype)
    return (q.float() * scale[..., None]).to(dtype)


@functools.cache
def cpu_int4_layout() -> tuple[int, bool] | None:
    """How torch's CPU int4 GEMM (torch._weight_int4pack_mm_for_cpu, the kernel gpt-fast and torchao call) wants its
    codes laid out, found by packing a probe with torch's own packer: (rows a block, whether a full block pairs row j
    with row j + block / 2 in a byte rather than rows 2j and 2j + 1). The layout follows the CPU's vector width (64
    rows with AVX-512, 32 with AVX2) and is torch's own business; None when this torch packs otherwise or has no
    such kernel, and int4 then dequantizes per call on a CPU as elsewhere."""
    pack = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if pack is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    codes = torch.randint(0, 16, (208, 4), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        packed = pack(codes, 1)
    except (RuntimeError, NotImplementedError):
        return None
    for layout in ((64, True), (32, True), (32, False), (64, False)):
        if torch.equal(_pack_rows(codes.to(torch.uint8), layout), packed):
            return layout
    return None


def _pack_rows(codes: torch.Tensor, layout: tuple[int, bool]) -> torch.Tensor:
    """codes [..., N, K] (uint8, 0..15) as torch's CPU int4 packing lays them out: per block of rows, [K, rows / 2]
    bytes, each byte two rows' codes of one input. A last block shorter than the layout's pairs neighbours."""
    block, halves = layout
    *lead, n, k = codes.shape
    full = n - n % block
    parts = []
    for rows, size in ((codes[..., :full, :], block), (codes[..., full:, :], n - full)):
        if size == 0:
            continue
        rows = rows.unflatten(-2, (-1, size))  # [..., blocks, size, K]
        low, high = ((rows[..., :size // 2, :], rows[..., size // 2:, :]) if halves and size == block
                     else (rows[..., 0::2, :], rows[..., 1::2, :]))
        parts.append((low | (high << 4)).transpose(-1, -2).reshape(*lead, -1))  # each block [K, size / 2]
    return torch.cat(parts, dim=-1).view(*lead, n, k // 2)


def _codes_by_input(packed: torch.Tensor, layout: tuple[int, bool]) -> torch.Tensor:
    """_pack_rows undone, transposed: the codes (uint8, 0..15) of packed [N, K / 2] as [K, N], the order its blocks hold
    them in (each block's bytes give an input's codes for the block's rows), so no copy goes against the grain."""
    block, halves = layout
    n, half = packed.shape
    full = n - n % block
    flat = packed.reshape(-1)
    parts = []
    for bytes_, size in ((flat[:full * half], block), (flat[full * half:], n - full)):
        if size == 0:
            continue
        pairs = bytes_.view(-1, 2 * half, size // 2)  # [blocks, K, size / 2]
        low, high = pairs & 15, pairs >> 4
        codes = torch.cat([low, high], -1) if halves and size == block else torch.stack([low, high], -1).flatten(-2)
        parts.append(codes.transpose(0, 1).reshape(2 * half, -1))  # [K, the rows of these blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def int4_cpu_fits(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether torch's CPU int4 GEMM takes an int4 weight of `shape` [..., out, in] (its rows a multiple of 16, its
    groups of INT4_GROUP inputs) on this torch."""
    return cpu_int4_layout() is not None and shape[-2] % 16 == 0 and int4_group(shape[-1]) == INT4_GROUP


def to_cpu_int4(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes and scales as stored (q uint8 [..., out, in / 2], two codes a byte, the even input low; scale bf16
    [..., out, groups]) as torch's CPU int4 GEMM reads them: the codes re-laid in its layout (same bytes), and the
    scales beside a zero per group ([..., groups, out, 2]: that GEMM computes (code - 8) * scale + zero). One matrix
    at a time, so the temporaries are one expert's. The inverse is from_cpu_int4."""
    layout = cpu_int4_layout()
    assert layout is not None and int4_cpu_fits((*q.shape[:-1], 2 * q.shape[-1]))  # set_cpu_int4 checked it
    if q.device.type == "meta":  # the layout alone (a load's plan, info): torch's meta kernels would import dynamo
        return torch.empty_like(q), scale.new_empty(*scale.shape[:-2], scale.shape[-1], scale.shape[-2], 2)
    if q.dim() > 2:
        parts = [to_cpu_int4(w, s) for w, s in zip(q, scale)]
        return torch.stack([p for p, _ in parts]), torch.stack([z for _, z in parts])
    codes = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)
    scale_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1).contiguous()
    return _pack_rows(codes, layout), scale_zeros


def from_cpu_int4(packed: torch.Tensor, scale_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """to_cpu_int4 undone: the codes and scales as stored, bit for bit."""
    layout = cpu_int4_layout()
    assert layout is not None
    if packed.device.type == "meta":
        return torch.empty_like(packed), scale_zeros.new_empty(*scale_zeros.shape[:-3], scale_zeros.shape[-2],
                                                               scale_zeros.shape[-3])
    if packed.dim() > 2:
        parts = [from_cpu_int4(p, z) for p, z in zip(packed, scale_zeros)]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    codes = _codes_by_input(packed, layout).t()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), scale_zeros[..., 0].t().contiguous()


def quantized_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: str, *,
                     exact: bool = False) -> torch.Tensor:
    """x [N, in] times the quantized weight q [out, in] transposed, in x's dtype. Differentiable in x (LoRA over a
    quantized base, see _QuantizedMatmul); the weight is frozen. `scheme` is the weight's layout: a scheme, or
    "int4-cpu" for int4 codes laid out by to_cpu_int4. `exact`: float32 rows stay float32 where torch's CPU kernels
    would take them in bfloat16 (CPU_KERNEL_DTYPES): the quantized modules pass it in training mode (all of a training
    step, its no_grad self-conditioning pass too), and grad mode implies it (a LoRA's gradient depends on the base's
    outputs even where x needs none). Inference (eval mode, no_grad) takes the kernels."""
    if x.requires_grad and torch.is_grad_enabled():
        return _QuantizedMatmul.apply(x, q, scale, scheme)
    return _quantized_matmul(x, q, scale, scheme, exact or torch.is_grad_enabled())


class _QuantizedMatmul(torch.autograd.Function):
    """quantized_matmul with x's gradient, grad @ the dequantized weight, dequantized again in the backward. Only the
    codes and scales are kept for it: autograd through F.linear(x, dequantize_weight(...)) would keep every layer's
    full-precision copy alive until the backward, the memory a quantized base is there to save (and the packed int8
    and FP8 kernels have no backward). fp8's rounding of the activations passes the gradient straight through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        ctx.x_dtype, ctx.scheme = x.dtype, scheme
        return _quantized_matmul(x, q, scale, scheme, exact=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        q, scale = ctx.saved_tensors
        return (grad @ _dequantize_as(q, scale, ctx.scheme, grad.dtype)).to(ctx.x_dtype), None, None, None


def _dequantize_as(q: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_weight of codes held in `scheme`'s layout (quantized_matmul's)."""
    if scheme == "int4-cpu":
        return _dequantize_cpu_int4(q, scale, dtype).t()
    return dequantize_weight(q, scale, dtype)


def _dequantize_cpu_int4(packed: torch.Tensor, scale_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight of to_cpu_int4's layout, transposed ([in, out]), in `dtype`: dequantized where it lies, with no
    unpacking to the stored layout first (81 -> 71 ms for a [4096, 2816] projection at 256 rows, one thread). The same
    bits as dequantize_weight."""
    layout = cpu_int4_layout()
    assert layout is not None
    codes = _codes_by_input(packed, layout)
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32  # as _dequantize, for the same bits
    scales = scale_zeros[..., 0].to(work).contiguous()  # [groups, out]
    weight = codes.to(work).sub_(8).view(scales.shape[0], -1, codes.shape[1]).mul_(scales[:, None, :])
    return weight.view(codes.shape).to(dtype)


def _quantized_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: str,
                      exact: bool = False) -> torch.Tensor:
    if scheme == "int4-cpu":
        if x.shape[0] <= INT4_CPU_MAX_ROWS and _rows_in_bf16(x, exact, INT4_CPU_MAX_ROWS):
            return _int4_cpu_mm(x.to(torch.bfloat16), q, scale).to(x.dtype)
        return x @ _dequantize_cpu_int4(q, scale, x.dtype)
    if scheme == "int4":
        return F.linear(x, dequantize_weight(q, scale, x.dtype))
    if scheme == "int8":
        if x.device.type == "cpu" and x.shape[-1] % 16 == 0 and _rows_in_bf16(x, exact, INT8_FLOAT32_MAX_ROWS):
            # The packed kernel exists for bf16 activations; its float32 path is far slower than a plain GEMM.
            # It reads its input in blocks of 16 columns: other widths crash the process (segfault, torch 2.13).
            return _int8pack_mm(x.to(torch.bfloat16), q, scale.to(torch.bfloat16)).to(x.dtype)
        if x.dtype == torch.float16:
            # Scaling after the GEMM would leave x @ codes ~1/scale (about 1,000x) too large first: past
            # float16's 65,504 on real activations. bf16 and float32 have float32's range.
            return F.linear(x, dequantize_weight(q, scale, x.dtype))
        return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    _check_fp8_dtype(x.device, x.dtype)  # quantize() refused such a model already; this guards direct calls
    xq, x_scale = _fp8_rows(x)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale[:, None], scale_b=scale[None, :], out_dtype=x.dtype)


def _rows_in_bf16(x: torch.Tensor, exact: bool, float32_rows: int) -> bool:
    """Whether x's rows take a CPU kernel made for bfloat16 rows (CPU_KERNEL_DTYPES): bfloat16 ones, and float32 ones of
    up to `float32_rows` rows at inference (not `exact`)."""
    return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not exact and x.shape[0] <= float32_rows)


# torch's CPU kernels for quantized weights run as opaque custom ops under torch.compile, and as themselves in eager:
# there a custom op's dispatch costs about 15 us a call on one thread, more than the kernel itself for a small model's
# projection, enough to make a small model's int8 through the packed GEMM slower than converting its codes.


def _int4_cpu_mm(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 GEMM (to_cpu_int4's layout)."""
    return (_int4_cpu_mm_op if torch.compiler.is_compiling() else _int4_cpu_gemm)(x, packed, scale_zeros)


def _int4_cpu_gemm(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, INT4_GROUP, scale_zeros)


@torch.library.custom_op("blockpress::int4_cpu_mm", mutates_args=())
def _int4_cpu_mm_op(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """_int4_cpu_gemm as one opaque op under torch.compile, as int8pack_mm is."""
    return _int4_cpu_gemm(x, packed, scale_zeros)


@_int4_cpu_mm_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def _int8pack_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's packed int8 GEMM (bf16 rows) where it is safe to call, x times the codes q [out, in] transposed, scaled.

    That GEMM crashes the process (a segfault, torch 2.13 on AVX-512) on codes off a 16-byte boundary or inputs off a
    32-byte one: an input is copied to one (its rows are few), and codes off one, which fit_cpu_kernels copies away
    on every model, take the plain GEMM rather than crash."""
    return (_int8pack_mm_op if torch.compiler.is_compiling() else _int8pack_gemm)(x, q, scale)


def _int8pack_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if q.data_ptr() % 64:
        return F.linear(x, q.to(x.dtype)) * scale
    x = x.contiguous()
    return torch._weight_int8pack_mm(x if x.data_ptr() % 64 == 0 else x.clone(), q, scale)


@torch.library.custom_op("blockpress::int8pack_mm", mutates_args=())
def _int8pack_mm_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """_int8pack_gemm as one opaque op: inductor cannot lower the aten op on a fused input (an InductorError under
    `lm.compile()`, torch 2.13), and gains nothing from seeing inside it."""
    return _int8pack_gemm(x, q, scale)


@_int8pack_mm_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, in] as e4m3 with one float32 scale per row (dynamic activation quantization)."""
    xf = x.float()
    x_scale = xf.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (xf / x_scale[:, None]).to(FP8), x_scale


class _CodedWeights(nn.Module):
    """A module holding quantized weights (buffers `{name}` and `{name}_scale` for each of `coded_names`), whose int4
    codes may be laid out for torch's CPU int4 GEMM (to_cpu_int4) while the model runs on a CPU in bfloat16 or float32
    (fit_cpu_kernels decides). Its state dict holds them as stored whatever the layout held, so a save, a load_state_dict
    or a copy never sees the CPU's layout."""

    scheme: str
    coded_names: tuple[str, ...]
    cpu_int4 = False  # the int4 codes and scales are held as to_cpu_int4 lays them out

    @property
    def kernel(self) -> str:
        """The layout quantized_matmul is given: the scheme, or "int4-cpu"."""
        return "int4-cpu" if self.cpu_int4 else self.scheme

    def _cpu_int4_misfit(self) -> str | None:
        """The first of this module's weights torch's CPU int4 GEMM does not take (int4_cpu_fits; the codes' shape is
        the same in either layout), or None when it takes them all."""
        return next((name for name in self.coded_names if self.scheme != "int4" or not int4_cpu_fits(
            (*getattr(self, name).shape[:-1], 2 * getattr(self, name).shape[-1]))), None)

    def fits_cpu_int4(self) -> bool:
        """Whether torch's CPU int4 GEMM takes every weight of this module."""
        return self._cpu_int4_misfit() is None

    def set_cpu_int4(self, on: bool) -> None:
        """Hold the int4 codes in the CPU GEMM's layout (on) or as stored (off); bit for bit either way."""
        if on == self.cpu_int4:
            return
        misfit = self._cpu_int4_misfit() if on else None
        if misfit is not None:
            raise ValueError(f"set_cpu_int4: torch's CPU int4 GEMM does not take this {self.scheme} weight "
                             f"{misfit} (codes {list(getattr(self, misfit).shape)}): it needs int4, out sizes of 16s "
                             f"and groups of {INT4_GROUP} inputs, and a torch whose CPU int4 layout is known")
        convert = to_cpu_int4 if on else from_cpu_int4
        for name in self.coded_names:
            codes, scales = convert(getattr(self, name), getattr(self, name + SCALE_SUFFIX))
            setattr(self, name, codes)
            setattr(self, name + SCALE_SUFFIX, scales)
        self.cpu_int4 = on

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.cpu_int4:
            for name in self.coded_names:
                codes, scales = from_cpu_int4(getattr(self, name), getattr(self, name + SCALE_SUFFIX))
                destination[prefix + name], destination[prefix + name + SCALE_SUFFIX] = codes, scales

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        held = self.cpu_int4
        self.set_cpu_int4(False)  # the state dict holds them as stored
        super()._load_from_state_dict(*args, **kwargs)
        if held and all(getattr(self, name).device.type == "cpu" for name in self.coded_names):
            self.set_cpu_int4(True)


class QuantizedLinear(_CodedWeights):
    """A bias-free nn.Linear whose weight is stored quantized (buffers `weight` and `weight_scale`)."""

    weight: torch.Tensor  # buffers, registered in __init__
    weight_scale: torch.Tensor
    in_features: int
    out_features: int
    coded_names = ("weight",)

    def __init__(self, linear: nn.Linear, scheme: str):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("quantize: projections with a bias are not supported (DiffusionGemma has none)")
        self.scheme = scheme
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_weight(linear.weight, scheme)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = quantized_matmul(flat, self.weight, self.weight_scale, self.kernel, exact=self.training)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}"


class QuantizedExperts(_CodedWeights, Experts):
    """Experts with quantized 3-D weights: the routing of Experts, each expert's rows through its own weight."""

    coded_names = ("gate_up_proj", "down_proj")

    def __init__(self, experts: Experts, scheme: str):
        nn.Module.__init__(self)
        self.scheme = scheme
        self.num_experts = experts.num_experts
        self.act = experts.act
        self.grouped_fp8 = hasattr(torch, "_scaled_grouped_mm")  # tried on CUDA; off for good after one failure
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_weight(getattr(experts, name), scheme)
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)

    def project(self, x: torch.Tensor, name: str, rows: ExpertRows) -> torch.Tensor:
        q, scale = getattr(self, name), getattr(self, f"{name}_scale")
        # quantized_matmul's `exact`, read here: the compiled op's forward may run with grad mode off
        exact = self.training or torch.is_grad_enabled()
        if x.requires_grad and torch.is_grad_enabled():
            # LoRA training over a frozen quantized base: one expert at a time, whose backward keeps the codes alone
            # (the grouped paths below would keep every expert's dequantized weight, or have no backward).
            if torch.compiler.is_compiling():
                return torch.ops.blockpress.quantized_experts(x, q, scale, rows.offsets, self.kernel, exact)
            return _quantized_experts(x, q, scale, rows, self.kernel, exact=exact)
        if self._dequantizes_without_sync(x):
            # Inside a CUDA graph, which cannot hold the loop's host syncs, and for int4 on a GPU (not measured there
            # otherwise). The loop below dequantizes the experts that have rows alone: on a CPU, dequantizing all of the
            # 26B-A4B's 128 int4 experts at once makes an AR token several times slower than the 8 it routes to.
            if x.shape[0] < self.num_experts:  # fewer rows than experts (an AR step): each row's weight alone
                return _dequantized_per_row(x, q, scale, rows)
            return _grouped_linear(x, dequantize_weight(q, scale, x.dtype), rows)  # all at once, one transient copy
        if self.scheme == "fp8" and x.is_cuda and x.dtype == torch.bfloat16 and self.grouped_fp8:
            try:  # one FP8 grouped GEMM for all experts (CUTLASS, SM90): no per-expert launches, no host sync
                xq, x_scale = _fp8_rows(x)
                return torch._scaled_grouped_mm(xq, q.transpose(1, 2), x_scale, scale, offs=rows.offsets, out_dtype=x.dtype)
            except (RuntimeError, NotImplementedError) as err:
                self.grouped_fp8 = False
                warn_user(f"quantize: FP8 grouped GEMM unavailable here ({type(err).__name__}: "
                          f"{(str(err).splitlines() or [''])[0][:200]}); experts run one GEMM each")
        if torch.compiler.is_compiling():  # the loop's host sync would split the compiled graph at every layer
            return torch.ops.blockpress.quantized_experts(x, q, scale, rows.offsets, self.kernel, exact)
        return _quantized_experts(x, q, scale, rows, self.kernel, exact=exact)

    def _dequantizes_without_sync(self, x: torch.Tensor) -> bool:
        """Whether the experts dequantize on the device with no host sync (the per-expert loop syncs once a layer)."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        return (self.scheme == "int4" and x.is_cuda) or (self.scheme == "int8" and capturing)


def _dequantized_per_row(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """Each row of x (sorted by expert) through its own expert's weight, dequantized for that row alone: with fewer
    rows than experts, fewer weights than all the experts', and no host sync (the shapes are the rows'). An AR token of
    the 26B-A4B routes 8 rows a layer to its 128 experts. A row's expert is the number of groups ending at or before it."""
    row = torch.arange(x.shape[0], dtype=rows.offsets.dtype, device=x.device)
    expert = torch.searchsorted(rows.offsets, row, right=True)
    weight = dequantize_weight(q[expert], scale[expert], x.dtype)  # [rows, out, in]
    return torch.bmm(weight, x[:, :, None])[:, :, 0]


def _quantized_experts(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rows: ExpertRows, scheme: str,
                       exact: bool = False) -> torch.Tensor:
    """Each expert's rows of x (sorted by expert, grouped as `rows` says) through its own quantized weight (`exact`:
    quantized_matmul's)."""
    out = x.new_empty(x.shape[0], q.shape[1])
    for e, start, end in rows.groups:  # experts without rows cost nothing
        out[start:end] = quantized_matmul(x[start:end], q[e], scale[e], scheme, exact=exact)
    return out


@torch.library.custom_op("blockpress::quantized_experts", mutates_args=())
def _quantized_experts_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                          scheme: str, exact: bool) -> torch.Tensor:
    """_quantized_experts as one opaque op; `exact`: the caller's training or grad mode (see quantized_matmul)."""
    return _quantized_experts(x, q, scale, ExpertRows(offsets), scheme, exact)


@_quantized_experts_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, scheme: str,
      exact: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[1])


def _quantized_experts_grad(grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                            in_features: int, scheme: str) -> torch.Tensor:
    """The gradient of _quantized_experts in x: each expert's rows of `grad` times its dequantized weight."""
    out = grad.new_zeros(grad.shape[0], in_features)
    for e, start, end in expert_groups(offsets):
        out[start:end] = grad[start:end] @ _dequantize_as(q[e], scale[e], scheme, grad.dtype)
    return out


@torch.library.custom_op("blockpress::quantized_experts_grad", mutates_args=())
def _quantized_experts_grad_op(grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                               in_features: int, scheme: str) -> torch.Tensor:
    return _quantized_experts_grad(grad, q, scale, offsets, in_features, scheme)


@_quantized_experts_grad_op.register_fake
def _(grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, in_features: int,
      scheme: str) -> torch.Tensor:
    return grad.new_empty(grad.shape[0], in_features)


def _quantized_experts_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, q, scale, offsets, scheme, _ = inputs
    ctx.save_for_backward(q, scale, offsets)
    ctx.x_dtype, ctx.in_features, ctx.scheme = x.dtype, x.shape[-1], scheme


def _quantized_experts_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
    q, scale, offsets = ctx.saved_tensors
    grad_x = torch.ops.blockpress.quantized_experts_grad(grad, q, scale, offsets, ctx.in_features, ctx.scheme)
    return grad_x.to(ctx.x_dtype), None, None, None, None, None


_quantized_experts_op.register_autograd(_quantized_experts_backward, setup_context=_quantized_experts_setup)


@outside_inference_mode  # the codes outlive the call (a QLoRA backward saves them)
def quantize(model: DiffusionGemma, scheme: str, *, warn_groups: bool = True) -> DiffusionGemma:
    """Quantize `model` in place (see the module docstring) and return it. Every refusal comes before the first
    module is swapped, and a failure after it (out of memory, Ctrl-C) puts back the modules swapped so far: a model
    left half quantized would call itself quantized and fail in every pass. `warn_groups=False` keeps int4's
    small-group warning back: a load laying out a folder saved int4 (its groups chosen when it was quantized, and
    said then) is not the user choosing int4."""
    _check_quantizable(model, scheme)
    roots = [("self_conditioning", model.self_conditioning), *((f"layers.{i}", m) for i, m in enumerate(model.layers))]
    targets = [(parent, name, child, f"{path}.{name}") for root, module in roots
               for path, parent in module.named_modules(prefix=root) for name, child in parent.named_children()
               if (isinstance(child, nn.Linear) and not isinstance(parent, Router))  # routing stays exact
               or type(child) is Experts]
    weights = [(f"{qualified}.{weight_name}", tuple(weight.shape)) for _, _, child, qualified in targets
               for weight_name, weight in child.named_parameters()]  # named as in the state dict
    for name, shape in weights:
        check_quantizable(shape, scheme, name)
    check_runs(scheme, model.device, model.dtype)
    if scheme == "int4" and warn_groups:  # after every refusal: a refused model is not worth a warning
        warn_small_int4_groups(weights)
    before = model.weights_version, model.values_changes
    model.weights_changed()  # before too: a pass that another thread runs meanwhile can tell why it failed
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    undone = False
    try:
        for parent, name, child, _ in targets:
            twin = QuantizedLinear(child, scheme) if isinstance(child, nn.Linear) else QuantizedExperts(child, scheme)
            # in the mode of the module it replaces (a new module starts in training mode): its kernels read it
            setattr(parent, name, twin.train(child.training))
            swapped.append((parent, name, child))
        fit_cpu_kernels(model)
    except BaseException:
        # All or nothing: a failure part-way (out of memory, Ctrl-C) puts the modules swapped so far back, rather than
        # leave a half-quantized model that calls itself quantized and fails in every pass. `targets` holds the
        # originals until the end anyway, so this costs no memory.
        for parent, name, original in reversed(swapped):
            setattr(parent, name, original)
        undone = True
        raise
    finally:
        if undone:  # the weights of before, whole: caches filled before continue (they were refused once here)
            model.weights_restored(*before)
        else:
            model.weights_changed()
    return model


def _check_quantizable(model: DiffusionGemma, scheme: str) -> None:
    """Refuse, before anything changes, a scheme blockpress lacks, a model already quantized, and one holding LoRA
    adapters: peft's LoRA layers hold nn.Linear modules (base_layer, lora_A, lora_B) that quantize's swap would
    quantize too (merging them afterwards failed deep inside peft), and quantized_copy's twin has no place for them
    (torch's 4,500-character strict-load error)."""
    check_scheme(scheme)
    if quantization_of(model) is not None:
        raise ValueError(f"quantize: the model is already quantized ({quantization_of(model)})")
    lora = lora_wrapped_layer(model)
    if lora is not None:
        raise ValueError(f"quantize: the model holds LoRA adapters (layer {lora!r}); merge them first "
                         "(blockpress.train.merge_lora), or add them after quantizing (QLoRA)")


@outside_inference_mode
def quantized_copy(model: DiffusionGemma, scheme: str) -> DiffusionGemma:
    """A quantized twin of `model` built beside it, as `quantize` would make of a copy, bit for bit: each projection is
    quantized straight from `model`'s weight (one matrix at a time), so no full-precision copy is ever made, and the
    tensors quantize leaves as they are (embedding, norms, router, layer scalars) are `model`'s own, shared. `model`
    is unchanged. For a benchmark's quantized engine beside the unquantized one: a copy then quantize peaked at twice
    the model (the 26B-A4B's first 6 layers: 22.6 GB in bf16, more than a 24 GB machine)."""
    _check_quantizable(model, scheme)
    check_runs(scheme, model.device, model.dtype)
    with torch.device("meta"):
        twin = DiffusionGemma(model.config).to(model.dtype)
    quantize(twin, scheme)  # on the meta device: the layout, quantize's refusals and its warning about int4's groups
    coded = coded_tensors(twin)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name not in coded:
            state[name] = tensor
            continue
        codes, scales = quantize_weight(tensor, scheme)
        state[name], state[name + SCALE_SUFFIX] = codes, scales
    twin.load_state_dict(state, strict=True, assign=True)
    twin.reset_buffers()
    fit_cpu_kernels(twin)
    return twin.eval()


def cpu_layout_bytes(model: DiffusionGemma, device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """What fit_cpu_kernels will allocate for `model` (on the meta device or not, in either layout) laid out on `device`
    in `dtype`: (bytes copied afresh, of which bytes beyond the stored layout). int4 weights taken into the CPU GEMM's
    layout are copied whole, codes and scales, and their scales carry a zero each; a load checks them (check_fits)
    where the weights would otherwise stay views of the file."""
    copied = added = 0
    if device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES:
        return copied, added
    for module in model.modules():
        if isinstance(module, _CodedWeights) and module.fits_cpu_int4():
            for codes, scales in ((getattr(module, n), getattr(module, n + SCALE_SUFFIX)) for n in module.coded_names):
                # the stored scales' bytes (held in the CPU layout, they carry their zeros already)
                scale_bytes = scales.numel() * scales.element_size() // (2 if module.cpu_int4 else 1)
                copied += codes.numel() * codes.element_size() + 2 * scale_bytes
                added += scale_bytes
    return copied, added


def fit_cpu_kernels(model: DiffusionGemma, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
    """Lay the quantized weights out for the CPU kernels that run them where the model computes (`device` and `dtype`,
    the model's own unless given: a load's plan describes a model not yet there). quantize calls it, and
    DiffusionGemma._apply after every move (a load ends with one).

    - int4 on a CPU in bfloat16 or float32 (CPU_KERNEL_DTYPES): each weight whose shape torch's CPU int4 GEMM takes
      (int4_cpu_fits) is held in that GEMM's layout, and as stored everywhere else. An AR token then reads a quarter
      of bf16's bytes: the 26B-A4B's [5632, 2816] projection took 0.85 ms a token against 95 ms dequantized per call.
    - int8 on a CPU in bfloat16 or float32: codes not on a 64-byte boundary are copied to one. torch's packed int8
      GEMM crashes the process (a segfault, torch 2.13 on AVX-512) on codes off a 16-byte one, and a quantized
      folder's codes are views of its mapped file wherever the file put them."""
    device = model.device if device is None else device
    dtype = model.dtype if dtype is None else dtype
    on_cpu = device.type == "cpu"
    for module in model.modules():
        if not isinstance(module, _CodedWeights):
            continue
        if module.scheme == "int4":
            module.set_cpu_int4(on_cpu and dtype in CPU_KERNEL_DTYPES and module.fits_cpu_int4())
        elif module.scheme == "int8" and on_cpu and dtype in CPU_KERNEL_DTYPES:
            for name in module.coded_names:
                codes = getattr(module, name)
                if codes.device.type == "cpu" and codes.data_ptr() % 64:
                    setattr(module, name, codes.clone())  # torch's CPU allocator aligns to 64 bytes


def check_cast(model: DiffusionGemma, cast: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Refuse `cast` (what nn.Module._apply runs on every tensor: .to(dtype), .half(), ...) on a quantized model when
    it changes the dtype of any of its tensors: a quantized model changes device, not dtype. Its scales keep the
    dtype quantize gave them whatever the model's (float32 for int8 and fp8, bfloat16 for int4), and fp8's e4m3
    codes count as floating point, so a module cast would cast them too: fp8 then fails inside torch._scaled_mm,
    int8 and int4 run with rounded scales."""
    scheme = quantization_of(model)
    if scheme is None:
        return
    changed = {d: c for d, c in model.dtypes_after(cast).items() if c != d}
    if not changed:
        return
    target = changed.get(model.dtype, next(iter(changed.values())))
    name = {d: str(d).removeprefix("torch.") for d in (model.dtype, target)}
    scales, codes = QUANTIZED_DTYPES[scheme]
    cast_too = [what for dtype, what in ((scales, f"its {str(scales).removeprefix('torch.')} scales"),
                                         (codes, f"its {scheme} codes")) if dtype in changed]
    why = (f": a cast to {name[target]} would also cast {' and '.join(cast_too)}, which keep the dtype quantize gave "
           "them whatever the model's" if cast_too else "")
    way = (f"it computes in {name[target]} already: move it with .to(device) alone" if target == model.dtype else
           f"load it in the dtype wanted: blockpress.load(..., dtype={name[target]!r}, quantize={scheme!r})")
    raise ValueError(f"dtype: the model is quantized ({scheme}) in {name[model.dtype]} and can change device, not "
                     f"dtype{why}; {way}")


def coded_tensors(model: nn.Module) -> dict[str, torch.dtype]:
    """The state-dict names of `model`'s quantized codes and their scales, each with the dtype it is stored in (codes:
    QUANTIZED_DTYPES's; scales: theirs): what a save writes as they are held, and a load assigns as they are stored,
    never casting them to the model's dtype."""
    coded: dict[str, torch.dtype] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, _CodedWeights):
            scales, codes = QUANTIZED_DTYPES[module.scheme]
            for name in module.coded_names:
                coded[f"{prefix}.{name}"] = codes
                coded[f"{prefix}.{name}{SCALE_SUFFIX}"] = scales
    return coded


def quantization_config(scheme: str, quantized_from: str | None = None) -> dict[str, Any]:
    """config.json's `quantization_config` for a model saved quantized with `scheme`: what a load needs to read the
    codes back exactly. int4's `group_size` is the largest group; a weight's own is gcd(its input size, group_size)
    (int4_group), which its scales' shape also says. `quantized_from`: the checkpoint the codes were made from, as a
    LoRA run records its base (train.base_name), where known: adapters trained over that base quantized alike load
    over this folder as over their own (train.check_adapter_pairing); a load never reads it."""
    config: dict[str, Any] = {"quantizer": QUANTIZER, "format_version": QUANT_FORMAT, "scheme": check_scheme(scheme)}
    if scheme == "int4":
        config["group_size"] = INT4_GROUP
    if quantized_from is not None:
        config["quantized_from"] = quantized_from
    return config


def read_quantization_config(raw: Any) -> str:
    """The scheme of a config.json's `quantization_config` that blockpress wrote (quantization_config), checked field
    by field: a ValueError names the field and what was expected. Another tool's (one naming a `quant_method`, or
    no `quantizer` of QUANTIZER) is refused by name."""
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config: expected a JSON object, got {raw!r}")
    if "quant_method" in raw or raw.get("quantizer") != QUANTIZER:
        method = raw.get("quant_method", raw.get("quantizer", "?"))
        raise ValueError(f"a pre-quantized checkpoint (quantization_config: {method}) is not supported: blockpress "
                         f"reads its own quantized saves (quantizer {QUANTIZER!r}) alone; load the unquantized one with "
                         "quantize='int8', 'fp8' or 'int4' instead")
    version = raw.get("format_version")
    if version != QUANT_FORMAT:
        raise ValueError(f"quantization_config.format_version: expected {QUANT_FORMAT} (the layout this blockpress "
                         f"reads), got {version!r}")
    scheme = raw.get("scheme")
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"quantization_config.scheme: expected one of {', '.join(SCHEMES)}, got {scheme!r}")
    group = raw.get("group_size")
    if scheme == "int4" and (group != INT4_GROUP or isinstance(group, bool)):
        raise ValueError(f"quantization_config.group_size: expected {INT4_GROUP} (int4's groups in this blockpress), "
                         f"got {group!r}")
    return scheme


def quantization_of(model: nn.Module) -> str | None:
    """The scheme `model` was quantized with, or None."""
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedExperts)):
            return module.scheme
    return None
