"""Hugging Face checkpoints in and out: safetensors (single file or sharded), the reference's tensor names.

Loading builds the model on the meta device and assigns each tensor as it is read, so a checkpoint is
never held twice. Vision-tower tensors are not used (text-only) but are remembered by file, so `save`
can copy them through and a saved checkpoint keeps its vision tower.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import mmap
import os
import re
import struct
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors.torch import save_file

from .checks import warn_user
from .config import ModelConfig
from .files import (
    KeyTwice,
    StagedFiles,
    lfs_pointer_problem,
    one_value_a_key,
    parse_json,
    read_json_object,
    staging,
)
from .model import DiffusionGemma

DECODER = "model.decoder."
ENCODER_TEXT = "model.encoder.language_model."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
DECODER_ONLY = ("self_conditioning.",)  # decoder weights the encoder has no copy of, even untied
# Rotary tables older transformers saved as buffers (per layer or per model, per layer type): derived from the
# config, which blockpress recomputes its own from, so a checkpoint holding them loads without them.
_ROTARY_BUFFER = re.compile(r"^(model\.decoder|model\.encoder\.language_model)\.(.+\.)?rotary_emb\.(\w+_)?inv_freq$")
_ENCODER_SCALAR = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")
# Attention biases (attention_bias: true): the reference ties the encoder's weights to the decoder's but not these,
# so both sides store a set. blockpress keeps them beside the projections, as self_attn.{bias,encoder_bias}.<proj>.
_HF_BIAS = re.compile(r"^(model\.decoder\.|model\.encoder\.language_model\.)layers\.(\d+)\.self_attn\.(\w+)\.bias$")
_LOCAL_BIAS = re.compile(r"^layers\.(\d+)\.self_attn\.(bias|encoder_bias)\.(\w+)$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the config; the message names the tensor."""


class NoWeights(FileNotFoundError):
    """A folder with no weight files at all (a config fetched alone, or with the index of shards not fetched yet):
    what `blockpress info` can still describe."""


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
if hasattr(torch, "float8_e8m0fnu"):  # torch 2.7 on; named unconditionally, no model loaded on 2.6 (pyproject's floor)
    _ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
# A safetensors dtype past these (F4, F6_*: packed, several values a byte) is valid but not read here.
_INT64_MAX = 2**63 - 1


# A mapping keeps a duplicate of its file's descriptor for as long as it lives, unless told not to (Python 3.13 on,
# off Windows, whose mmap takes trackfd from 3.15): a model of many shards held one each (57 for 57 shards) and a load
# past `ulimit -n` failed with EMFILE.
_UNTRACKED: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) and os.name != "nt" else {}


def _descriptors_problem(path: Path, exc: OSError) -> OSError:
    """`exc` with what to do, where it is the process's limit on open files (EMFILE) or the system's (ENFILE)."""
    if exc.errno not in (errno.EMFILE, errno.ENFILE):
        return exc
    try:
        import resource

        limit = f"; now {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    except (ImportError, OSError, ValueError):  # (Windows has no resource module)
        limit = ""
    held = "" if _UNTRACKED else "; here (Python before 3.13, or Windows) each weight file holds one while it is loaded"
    return OSError(exc.errno, f"{path}: cannot open it: too many open files{held}; raise the limit of open files "
                              f"(ulimit -n{limit}) or use fewer, larger shards")


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise _descriptors_problem(path, exc) from None
    with f:
        yield f


class MappedSafetensors:
    """A safetensors file memory-mapped copy-on-write: tensors are views of the file, read on first touch.

    CPU loading in the file's dtype therefore costs no copy at all, and the weights stay reclaimable
    page cache until the model writes to them (training), when only the written pages are copied.
    """

    def __init__(self, path: Path):
        size = path.stat().st_size
        if (pointer := lfs_pointer_problem(path)) is not None:
            raise CheckpointError(pointer)
        with _opened(path) as f:
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:  # checked before reading: a damaged length would ask for exabytes
                    raise ValueError(f"its header claims {n} bytes but the file has {size}")
                # a key given twice is damage (json.loads keeps the last: a second entry for a tensor would be read
                # silently), as the safetensors library, and so transformers, refuses it
                self.header = parse_json(f.read(n), object_pairs_hook=one_value_a_key)
                if not isinstance(self.header, dict):
                    raise ValueError("its header is not a JSON object")
            except KeyTwice as exc:
                raise CheckpointError(f"{path}: not a safetensors file (its header gives {exc.args[0]!r} twice); the "
                                      "file is damaged") from None
            except (struct.error, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
            self.data_start = 8 + n
            try:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY, **_UNTRACKED)
            except OSError as exc:
                raise _descriptors_problem(path, exc) from None
        metadata = self.header.pop("__metadata__", None)
        self.metadata: dict[str, Any] = metadata if isinstance(metadata, dict) else {}  # e.g. save_model's `metadata`
        self.path = path
        for name, info in self.header.items():
            self._check_entry(name, info, size - self.data_start)
        self._check_layout(size - self.data_start)

    def _check_entry(self, name: str, info: Any, data_bytes: int) -> None:
        """Every entry names a dtype, a shape and offsets that lie in the file and match dtype x shape: a damaged
        or truncated file is refused here, naming the tensor, not by torch on first touch."""
        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"{self.path}: tensor {name!r}: {why}; the file is damaged or truncated")

        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise bad("expected dtype, shape and data_offsets in its header entry")
        dtype, shape, offsets = _ST_DTYPES.get(info["dtype"]), info["shape"], info["data_offsets"]
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r}: safetensors dtype {info['dtype']!r}, which blockpress "
                                  f"does not read (it reads {', '.join(_ST_DTYPES)})")
        # (a bool is an int to Python; a size past int64, or sizes whose product is, overflowed inside torch)
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                and math.prod(max(d, 1) for d in shape) <= _INT64_MAX):
            raise bad(f"shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"data_offsets {offsets!r} are not [begin, end]")
        if offsets[1] > data_bytes:
            raise bad(f"its data ends at byte {offsets[1]} but the file holds {data_bytes} bytes of data")
        expected = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != expected:
            raise bad(f"{offsets[1] - offsets[0]} bytes of data, but {info['dtype']} {shape} needs {expected}")

    def _check_layout(self, data_bytes: int) -> None:
        """The tensors' data lie one after another from the data's first byte to its last, as the safetensors library
        checks: two entries whose bytes overlapped loaded silently (a damaged header giving the final norm a layer's
        norm's bytes: logits 5 off the intact file's), where transformers refuses the file."""
        end = 0
        for name, info in sorted(self.header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
            begin = info["data_offsets"][0]
            if begin != end:
                why = (f"its data starts at byte {begin}, inside the tensor before it (which ends at {end})"
                       if begin < end else f"its data starts at byte {begin}, leaving bytes {end}-{begin} to no tensor")
                raise CheckpointError(f"{self.path}: tensor {name!r}: {why}; the file is damaged")
            end = info["data_offsets"][1]
        if end != data_bytes:
            raise CheckpointError(f"{self.path}: its tensors' data ends at byte {end} of {data_bytes}; the file is "
                                  "damaged (or holds bytes past its tensors)")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _ST_DTYPES[self.header[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        begin, end = self.header[name]["data_offsets"]
        return end - begin

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]  # checked on opening
        dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = end - begin
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self.map, dtype=torch.uint8, count=count, offset=self.data_start + begin)
        return flat.view(dtype).view(shape)

    def release(self, name: str) -> None:
        """Drop this process's pages of a tensor that was read and converted (cast or quantized, the copy kept): the
        mapping would keep them resident, and counted against the process (by the OOM killer too), for as long as any
        tensor of the file is still a view of it, as a quantized load's embedding is. A page it shares with a
        neighbour is read back from the file when touched. Only for a load, before any page is written: a written
        page of this copy-on-write mapping would be thrown away."""
        begin, end = self.header[name]["data_offsets"]
        if end == begin or not hasattr(mmap, "MADV_DONTNEED"):  # (Windows has no madvise)
            return
        start = (self.data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE  # the pages it touches, whole
        try:
            self.map.madvise(mmap.MADV_DONTNEED, start, self.data_start + end - start)
        except OSError:  # locked (mlockall) or huge pages: they stay, as they did before; the load goes on
            pass


@dataclass
class Passthrough:
    """Tensors blockpress does not use but must not lose on save (the vision tower): name -> tensor, a view of the
    loaded file's mapping (read on saving alone). Held, not re-read by path: a path read again at save time may be
    another file by then (a relative one after a chdir, one another save has replaced, the shards a save over the
    folder has removed), so a save would write another model's vision weights or fail. A mapping outlives its file
    being replaced or deleted."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def hf_to_local(name: str) -> str | None:
    """Map a checkpoint tensor name to ours; None for names that are tied copies (nothing to load)."""
    m = _HF_BIAS.match(name)
    if m:
        side = "bias" if m.group(1) == DECODER else "encoder_bias"
        return f"layers.{m.group(2)}.self_attn.{side}.{m.group(3)}"
    if name.startswith(DECODER):
        return name[len(DECODER):]
    m = _ENCODER_SCALAR.match(name)
    if m:
        return f"layers.{m.group(1)}.encoder_layer_scalar"
    if name.startswith(ENCODER_TEXT) or name == "lm_head.weight":
        return None  # encoder weights and the LM head are tied to the decoder's
    raise KeyError(name)


def tensor_kind(name: str) -> tuple[str, str | None]:
    """What a checkpoint tensor is to blockpress: ("vision", None) kept for saving, ("derived", None) a rotary table
    recomputed from the config, ("copy", None) a tied copy, or ("weight", local name). KeyError: none of these."""
    if name.startswith(VISION_PREFIXES):
        return "vision", None
    if _ROTARY_BUFFER.match(name):
        return "derived", None
    local = hf_to_local(name)
    return ("copy", None) if local is None else ("weight", local)


def check_headers(files: list[MappedSafetensors], shapes: dict[str, tuple[int, ...]],
                  coded: dict[str, torch.dtype] | None = None) -> None:
    """Every text tensor the headers list is a weight of the config's model (`shapes`: the unquantized model's names,
    so a stray `*.weight_scale` is refused too), in its shape and a float dtype. Read off the headers before any data,
    and before quantizing: int4's refusal of an odd input size would otherwise quote the config's shape as the
    stored weight's when the real fault is that the two disagree. A folder stored quantized: `shapes` is the quantized
    model's layout, and `coded` its codes' and scales' names (quantize.coded_tensors), each in exactly its dtype."""
    coded = coded or {}
    if not coded:  # a quantized save whose config.json lost its quantization_config (edited out for transformers):
        # its codes would be refused one by one as a weight's wrong shape or dtype, or its scales as unknown tensors
        from .quantize import SCALE_SUFFIX

        for f in files:
            names = set(f.keys())
            scale = next((name for name in sorted(names) if name.endswith(SCALE_SUFFIX)
                          and name.removesuffix(SCALE_SUFFIX) in names), None)
            if scale is not None:
                raise CheckpointError(f"{f.path.name}: unexpected tensor {scale!r}: the scales of a quantized "
                                      f"{scale.removesuffix(SCALE_SUFFIX)!r} (a folder saved quantized), but "
                                      "config.json has no quantization_config naming the scheme; put back the one "
                                      "it was saved with, or load the unquantized checkpoint")
    for f in files:
        for name in f.keys():
            try:
                kind, local = tensor_kind(name)
            except KeyError:
                raise CheckpointError(f"{f.path.name}: unexpected tensor {name!r} (not a DiffusionGemma text weight)") from None
            if kind == "copy":  # a tied copy of a decoder weight the config has (a typo's copy loaded unseen)
                local = hf_to_local(tied_source(name))
            if kind not in ("weight", "copy"):
                continue
            if local not in shapes:
                raise CheckpointError(f"{f.path.name}: unexpected tensor {name!r} for this config")
            if kind == "copy":  # its values (and shape) are compared with the decoder's by check_tied_copies
                continue
            if f.shape(name) != shapes[local]:
                raise CheckpointError(f"{f.path.name}: tensor {name!r}: shape {list(f.shape(name))} in the checkpoint, "
                                      f"config needs {list(shapes[local])}")
            if local in coded:
                if f.dtype(name) != coded[local]:  # read as stored, never cast: another dtype is another layout
                    what = "scales" if local.endswith("_scale") else "codes"
                    raise CheckpointError(f"{f.path.name}: tensor {name!r}: dtype {f.dtype(name)} in the checkpoint, "
                                          f"expected {coded[local]} (the quantized weight's {what})")
            elif not f.dtype(name).is_floating_point:  # every text weight is stored in a float type (quantizing comes after)
                raise CheckpointError(f"{f.path.name}: tensor {name!r}: dtype {f.dtype(name)} in the checkpoint, "
                                      "expected a floating-point type")


def check_complete(path: Path, files: list[MappedSafetensors], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every weight of the config's model (`shapes`, as for check_headers) is stored, read off the headers. Layer
    scalars aside: a missing one loads as 1, with a warning (load_model), as in the reference."""
    stored = set()
    for f in files:
        for name in f.keys():
            kind, local = tensor_kind(name)  # each name was checked by check_headers
            if kind == "weight":
                stored.add(local)
    missing = [local_to_hf(k) for k in shapes if k not in stored and not k.endswith("layer_scalar")]
    if missing:
        shown = _first_few(missing, 5)
        raise CheckpointError(f"{path}: missing tensor(s) {shown}")


def _first_few(names: list[str], shown: int) -> str:
    """The first `shown` of `names`, joined, and how many more there are, for a message."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def tied_source(name: str) -> str:
    """The decoder tensor that a tied copy (an encoder text weight or the LM head) stands for."""
    return DECODER + ("embed_tokens.weight" if name == "lm_head.weight" else name[len(ENCODER_TEXT):])


def check_tied_copies(copies: dict[str, Path], sources: dict[str, Path], tied: bool) -> None:
    """blockpress runs the encoder, the decoder and the LM head on one set of weights, as DiffusionGemma is
    released. A checkpoint may store copies anyway (tie_word_embeddings=false always does); it loads only when
    every copy equals its decoder tensor. A copy that differs is refused whatever the flag says: with the flag
    false it is the checkpoint's own weight, and with it true transformers unties that pair and runs the stored
    copy, so dropping it would silently give other logits than the reference. With the flag false every copy must be
    there: transformers starts an absent one from random weights (a tied checkpoint whose config.json is edited to
    false would otherwise load here, running the decoder's weights, far off the reference's logits)."""
    if not tied:
        inner = [source[len(DECODER):] for source in sources if source.startswith(DECODER)]  # the decoder's own names
        wanted = ["lm_head.weight", *(ENCODER_TEXT + rest for rest in inner if not rest.startswith(DECODER_ONLY)
                                      and tensor_kind(ENCODER_TEXT + rest)[0] == "copy")]
        absent = [repr(name) for name in wanted if name not in copies]
        if absent:
            shown = _first_few(absent, 3)
            raise CheckpointError(
                f"tie_word_embeddings is false, but the checkpoint stores no {shown}: transformers would start "
                f"{'it' if len(absent) == 1 else 'them'} from random weights, and blockpress runs the decoder's; if "
                "the encoder and LM head are the decoder's (as DiffusionGemma is released), set tie_word_embeddings "
                "to true in config.json")
    for name, file in copies.items():
        source = tied_source(name)
        if source not in sources:
            if tied:
                continue  # nothing to compare with; the missing decoder tensor is reported by name afterwards
            raise CheckpointError(f"tie_word_embeddings is false, and {name!r} has no decoder tensor {source!r}")
        copy, original = MappedSafetensors(file).tensor(name), MappedSafetensors(sources[source]).tensor(source)
        if copy.shape == original.shape and torch.equal(copy, original):
            continue
        if not tied:
            raise CheckpointError(
                f"tie_word_embeddings is false and {name!r} differs from {source!r}: this checkpoint's encoder or "
                "LM head has weights of its own, and blockpress runs the encoder, the decoder and the LM head on "
                "the decoder's weights (tied, as DiffusionGemma is released)")
        raise CheckpointError(
            f"tie_word_embeddings is true but the checkpoint stores {name!r}, and it differs from {source!r}: "
            "transformers then unties the pair and runs the stored copy, while blockpress runs the encoder, the "
            "decoder and the LM head on the decoder's weights, so loading would give other logits; if the copy is "
            "stale, remove it from the checkpoint")


def local_to_hf(name: str) -> str:
    m = re.match(r"^layers\.(\d+)\.encoder_layer_scalar$", name)
    if m:
        return f"{ENCODER_TEXT}layers.{m.group(1)}.layer_scalar"
    m = _LOCAL_BIAS.match(name)
    if m:
        return f"{DECODER if m.group(2) == 'bias' else ENCODER_TEXT}layers.{m.group(1)}.self_attn.{m.group(3)}.bias"
    return DECODER + name


def reference_names(local: str) -> list[str]:
    """Every name the reference holds blockpress's tensor `local` under: its own (local_to_hf), and for a layer's
    weight also the encoder's tied copy (the reference's encoder runs modules of its own sharing the decoder's
    weights; tied_source maps the copy back). Layer scalars and attention biases are not tied: each side has its own."""
    name = local_to_hf(local)
    if not name.startswith(DECODER + "layers.") or name.endswith(("layer_scalar", ".bias")):
        return [name]
    return [name, ENCODER_TEXT + name[len(DECODER):]]


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """None, or one of the dtypes the model computes in (float8 is a quantization scheme, not a weights dtype)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        name = DTYPE_ALIASES.get(name, name)
        if name in DTYPES:
            return DTYPES[name]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    eight_bit = isinstance(dtype, torch.dtype) and dtype.itemsize == 1
    hint = "; for 8-bit weights use quantize='fp8' or 'int8'" if eight_bit else ""
    raise ValueError(f"dtype: expected one of {sorted(DTYPES)} (or the torch dtype), got {dtype!r}{hint}")


# float16's largest finite value is 65,504; a cast rounds a magnitude of 65,520 or more (halfway to 65,536, the next
# power of two) to inf, and one between the two down to 65,504.
FLOAT16_OVERFLOW = 65520.0


def check_float16_range(tensors: Iterable[tuple[str, torch.Tensor]], outcome: str) -> None:
    """Refuse casting `tensors` ((name, tensor) pairs) to float16 where a finite value of one would become inf there:
    Gemma-family weights can pass float16's range, and the cast would write inf without a word (NaN logits after, or a
    checkpoint of infs). The ValueError names the first such tensor and its largest magnitude, and ends with
    `outcome` (what was left undone). One reduction per tensor (aminmax: no temporary), launched before any is read
    back; a tensor that holds inf or NaN already (a damaged one, model_logits_fault's to name) is looked at again
    for its finite values alone. Tensors of float16's range or less (float16, fp8) and meta tensors are skipped."""
    named = [(name, t.detach()) for name, t in tensors
             if t.is_floating_point() and torch.finfo(t.dtype).max >= FLOAT16_OVERFLOW and t.device.type != "meta"
             and t.numel()]
    peaks = [torch.maximum(*(x.abs() for x in torch.aminmax(t))) for _, t in named]
    over: list[tuple[str, float]] = []
    for (name, t), peak in zip(named, peaks):
        largest = float(peak)
        if not math.isfinite(largest):  # inf or NaN stored: the largest finite value decides
            largest = float(torch.where(torch.isfinite(t), t.abs(), 0).amax())
        if largest >= FLOAT16_OVERFLOW:
            over.append((name, largest))
    if over:
        name, largest = over[0]
        more = f" ({len(over) - 1} more tensors too)" if len(over) > 1 else ""
        raise ValueError(f"dtype: {name} holds a value of magnitude {largest:,.6g}, past float16's range (65,504 at "
                         f"most), where the cast to float16 makes it inf{more}; {outcome}. Use bfloat16 (float32's "
                         "range in float16's size) or float32")


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here, or a clear error (before any weights are read). "auto": the CUDA GPU where
    torch sees one, else the CPU (MPS and other backends only when named: blockpress is not tested on them)."""
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # ValueError: an index past int64 ('Overflow when unpacking long long')
        raise ValueError(f"device: {device!r} is not a torch device (expected auto, cpu, cuda, cuda:N, mps or meta)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but this torch sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} asked for, but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device: {device!r} asked for, but MPS is not available here")
    backend = getattr(torch, dev.type, None)  # xpu, hpu, ...: torch.<type>.is_available() where torch has one
    if dev.type not in ("cpu", "cuda", "mps", "meta") and not (backend is not None and getattr(
            backend, "is_available", lambda: False)()):
        raise ValueError(f"device: {device!r} asked for, but this torch ({torch.__version__}) has no {dev.type} "
                         "device available")
    return dev


def indexed_device(device: torch.device) -> torch.device:
    """`device` with the index its tensors report (cuda: the current GPU; mps: 0), for comparing a device asked
    for with where a model's weights are: torch.device("cuda") != torch.device("cuda:0")."""
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device.index is None and device.type == "mps":
        return torch.device("mps", 0)
    return device


def _cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), mount: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Room left under the tightest memory limit of this process' cgroups and their parents (a container's: docker
    --memory, a Kubernetes limit), where MemAvailable is the whole host's; None without a limit. v2's memory.max and
    v1's memory.limit_in_bytes, less what the group uses besides page cache (the kernel reclaims that before its OOM
    killer ends the process)."""
    try:
        entries = [line.split(":", 2) for line in proc_cgroup.read_text(encoding="ascii").splitlines()]
    except (OSError, ValueError):
        return None
    rooms = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, where = entry
        if controllers == "":  # the unified (v2) hierarchy
            base, files, cache = mount, ("memory.max", "memory.current"), "file"
        elif "memory" in controllers.split(","):
            base, files, cache = mount / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes"), "total_cache"
        else:
            continue
        group = base / where.lstrip("/")
        # the group and each parent up to the mount (inside a container the mount's root is the container's group)
        for folder in [group, *group.parents][: len(group.relative_to(base).parts) + 1]:
            if folder != group and _reads(folder / "memory.use_hierarchy") == "0":
                break  # (v1) this parent's limit counts its own tasks alone, not its children's, nor do those above
            try:
                limit_text, usage_text = ((folder / name).read_text(encoding="ascii").strip() for name in files)
                if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 writes "no limit" as ~2**63
                    continue
                stat = dict(line.split() for line in (folder / "memory.stat").read_text(encoding="ascii").splitlines())
                rooms.append(int(limit_text) - int(usage_text) + int(stat.get(cache, 0)))
            except (OSError, ValueError):
                continue
    return max(0, min(rooms)) if rooms else None


def _reads(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None


def _address_space_room() -> int | None:
    """Room left under a process limit on address space (`ulimit -v`), past which torch's allocator fails with its
    own error; None without one (or off POSIX)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status", encoding="ascii") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, ValueError, StopIteration):
        return None
    return max(0, soft - size)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on `device` now, or None. On the CPU the least of Linux's MemAvailable, the
    room under the process' cgroup memory limit and under its address-space limit; on CUDA the driver's free memory
    and what torch's caching allocator holds reserved but unused."""
    if device.type == "cuda":
        # The driver's free memory leaves out the blocks torch keeps reserved after earlier work (a server's last
        # batch): a new cache reuses those, so counting only the driver's figure would refuse caches that fit.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + max(0, cached)
    if device.type != "cpu":
        return None
    figures = [room for room in (_mem_available(), _cgroup_room(), _address_space_room()) if room is not None]
    return min(figures) if figures else None


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse, with the figures, an allocation that cannot fit: the alternative is the OOM killer, which ends the
    process without a word."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what}: needs {nbytes / 1e9:.1f} GB on {device} but {free / 1e9:.1f} GB are available "
                         "(a smaller dtype, a quantized load, or device='meta' to count without allocating)")


def stored_dtype(files: list[MappedSafetensors], coded: Iterable[str] = ()) -> torch.dtype:
    """The dtype the text weights are stored in: the one holding most of their bytes. (safetensors lists tensors
    widest dtype first, so a bf16 checkpoint with a few float32 scalars starts with those, and taking the first
    one loaded 26B weights in float32, twice the memory.) A dtype the model does not compute in (float64, fp8
    stored without scales) reads as float32. `coded`: the names of a quantized folder's codes and scales, which keep
    their own dtypes and do not count (its fp8 codes would otherwise read as float32)."""
    skip = frozenset(coded)
    stored: dict[torch.dtype, int] = {}
    for f in files:
        for name in f.keys():
            dtype = f.dtype(name)
            if not name.startswith(VISION_PREFIXES) and dtype.is_floating_point and name not in skip:
                stored[dtype] = stored.get(dtype, 0) + f.nbytes(name)
    most = max(stored, key=stored.__getitem__) if stored else torch.float32
    return most if most in DTYPES.values() else torch.float32


def native_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to compute in when the caller names none: the checkpoint's own, except half precision on a CPU
    that only emulates it. Without AVX512-BF16 / AMX (an AVX2 CPU, say) bf16 matmuls take a scalar fallback:
    measured 33x slower than float32 for a [1024, 256] x [256, 512] product on an AVX2 EPYC, and 8x slower
    training steps. The float32 copy holds the same values; only the rounding of the arithmetic differs."""
    return dtype if device.type != "cpu" or cpu_computes_natively(dtype) else torch.float32


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """Does this CPU have matmul instructions for `dtype` (oneDNN's check: AVX512-BF16 / AVX512-FP16 / AMX)? False
    for half precision where torch is built without oneDNN (PyTorch's macOS arm64 wheels: USE_MKLDNN=OFF), which
    has no check to ask; float32 is the dtype known to run at full speed there."""
    if dtype not in (torch.bfloat16, torch.float16):
        return True
    # torch registers mkldnn::_is_mkldnn_bf16_supported only in builds with oneDNN: asked without it, the op lookup
    # raised AttributeError, and every CPU load of the shipped (bf16) models ended in that traceback on such a Mac
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def hf_hub_cache() -> Path:
    """Where `huggingface_hub` keeps downloads, by its own rules: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.path.expanduser(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]))
    if env.get("HF_HOME"):
        return Path(os.path.expanduser(env["HF_HOME"])) / "hub"
    # os.path.expanduser, as huggingface_hub: with no home (HOME unset and a user id with no passwd entry: docker
    # --user, runAsUser) it leaves "~" as it is, where Path.home() raised "Could not determine home directory"
    xdg = env.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(os.path.expanduser(xdg)) / "huggingface" / "hub"


def hub_name(folder: str | Path) -> str | None:
    """The name `blockpress.load` finds `folder` by when it is a snapshot of the local Hugging Face cache: "owner/name"
    when the cache's main ref points at it, else "owner/name@commit"; None for any other folder. A run that records
    its base by name stays valid when the cache moves or main advances, where the snapshot's path would not."""
    folder = Path(folder)
    repo = folder.parent.parent
    if folder.parent.name != "snapshots" or repo.parent.resolve() != hf_hub_cache().resolve():
        return None
    owner, sep, name = repo.name.removeprefix("models--").partition("--")
    if not repo.name.startswith("models--") or not (sep and owner and name):
        return None
    try:
        on_main = (repo / "refs" / "main").read_text(encoding="utf-8").strip() == folder.name
    except OSError:
        on_main = False
    return f"{owner}/{name}" if on_main else f"{owner}/{name}@{folder.name}"


def hf_cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The folder of a model `hf download` (or transformers) already fetched into the local cache; None when the
    cache holds nothing of that repo, a clear error when it holds the repo but not that revision.

    `repo_id` is "owner/name"; `revision` is a branch or tag the cache holds a ref for, or a commit hash (or
    its unique prefix) of a cached snapshot. Nothing is downloaded.
    """
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(part in (".", "..") for part in parts):
        return None
    repo = hf_hub_cache() / f"models--{parts[0]}--{parts[1]}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    held = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if commit not in held:
            raise FileNotFoundError(f"{repo_id}@{revision}: the cache's {ref} names snapshot {commit!r}, which "
                                    f"{snapshots} does not hold (an interrupted download? fetch it again)")
        return snapshots / commit
    matches = [name for name in held if name.startswith(revision)]
    if revision == "main" and not matches and held:  # a cache copied without its refs: take the newest snapshot
        matches = [max(held, key=lambda name: (snapshots / name).stat().st_mtime)]
    if len(matches) != 1:
        refs = sorted(str(r.relative_to(repo / "refs")) for r in (repo / "refs").rglob("*") if r.is_file()) \
            if (repo / "refs").is_dir() else []
        why = f"matches {len(matches)} snapshots" if matches else "names no ref or snapshot"
        raise FileNotFoundError(f"{repo_id}@{revision}: {why} in the cache ({repo}; refs: {refs}, snapshots: {held}); "
                                f"blockpress never downloads: `hf download {repo_id} --revision {revision}` fetches it")
    return snapshots / matches[0]


def check_links(path: Path) -> None:
    """A Hugging Face cache snapshot is a folder of links into blobs/; a link whose blob is gone (an interrupted
    download) would otherwise read as an absent optional file and change what loads."""
    broken = sorted(p.name for p in path.iterdir() if p.is_symlink() and not p.exists())
    if broken:
        raise FileNotFoundError(f"{path}: {broken} link to files that are not there (an interrupted download? "
                                "fetch the model again)")


TRAINER_PICKLES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.pt")
PICKLE_PATTERNS = ("*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.ckpt")  # torch.save checkpoints, by name


def index_total_size(path: Path) -> int | None:
    """The bytes of tensor data the folder's model.safetensors.index.json says its shards hold (its
    metadata.total_size, as the hub's indexes write it), or None where it has no index or no such number: what
    `blockpress info` reports for a folder whose shards are not fetched yet."""
    try:
        raw = parse_json((path / "model.safetensors.index.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None
    meta = raw.get("metadata") if isinstance(raw, dict) else None
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None


# Each shard of one sharded save holds the same mark in its metadata: a save stopped while it moves its shards into
# place (a Ctrl-C, a kill) leaves a folder of some new shards and some old ones, which must not load without a word.
SAVE_MARK_KEY = "blockpress_save"


def mixed_saves(path: Path, shards: list[MappedSafetensors]) -> None:
    """Refuse shards that are not of one save (SAVE_MARK_KEY); shards that hold no mark (another tool's, or saved
    before marks were written) pass where none holds one."""
    marks = {shard.path.name: shard.metadata.get(SAVE_MARK_KEY) for shard in shards}
    if len(set(marks.values())) > 1:
        a, mark = next(iter(marks.items()))
        b = next(name for name, other in marks.items() if other != mark)
        raise CheckpointError(f"{path}: {a} and {b} are shards of two different saves: a save was stopped while it "
                              "moved its shards into place, so the folder holds some of the new weights and some of "
                              "the old. Save the model there again (a training run's --resume finishes the save it "
                              "was stopped in)")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files holding the folder's weights, picked as transformers' from_pretrained picks them:
    model.safetensors when it is there, else the shards model.safetensors.index.json lists. A folder holding both
    (a stale leftover of one layout) reads model.safetensors, with a warning: reading the index instead would
    silently give other weights, and other logits, than the reference on the same folder."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if single.is_file():
        if index.exists():
            warn_user(f"{path}: holds both model.safetensors and model.safetensors.index.json; reading "
                      "model.safetensors, as transformers does (the index and its shards are ignored: remove "
                      "whichever layout is stale)")
        return [single]
    if index.exists():
        try:
            # UTF-8 whatever the locale (read_text() takes the locale's, cp1252 on Windows), a BOM read past as
            # read_json_object reads the folder's other JSON files
            raw = parse_json(index.read_text(encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise CheckpointError(f"{index}: not a valid safetensors index (expected an object with a "
                                  "\"weight_map\" of tensor name -> shard file name)")
        for name, shard in weight_map.items():
            # A name, not a resolved path, is checked: a folder of links (a cache snapshot, one a user made) keeps
            # loading, while "../other/model.safetensors" or "/abs/x" reads no file outside the folder.
            # A drive ("C:/x", "C:x") is absolute on Windows, whatever the system reading the index.
            parts = PurePosixPath(shard.replace("\\", "/")).parts
            if not parts or shard.startswith(("/", "\\")) or ".." in parts or PureWindowsPath(shard).drive:
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to shard {shard!r}, which is not a file "
                                      f"name inside {path} (an absolute path, a drive or '..'); shards must lie in "
                                      "the folder")
        if not weight_map:  # (no shard to read: the load failed inside torch, every weight missing)
            raise CheckpointError(f"{index}: not a valid safetensors index (its \"weight_map\" lists no tensors)")
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing and len(missing) == len(files):
            # None fetched yet (a download of the repo's JSON files: config, index, tokenizer): a folder without
            # weights, which `blockpress info` describes from config.json as it does one holding config.json alone
            raise NoWeights(f"{index}: none of the {len(files)} shard(s) it lists are in the folder "
                            f"({missing[0]}{', ...' if len(missing) > 1 else ''}); fetch the weights")
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that are not in the folder: {missing}")
        return files
    # trainers leave their own pickles beside the weights (training_args.bin, optimizer.pt): not checkpoints
    pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in path.glob(pattern) if p.name not in TRAINER_PICKLES)
    if pickles:  # say what is there, and why it is not read: "no model.safetensors" alone reads as a wrong folder
        shown = _first_few(pickles, 3)
        raise FileNotFoundError(
            f"{path}: no model.safetensors or model.safetensors.index.json, but a PyTorch pickle checkpoint ({shown}); "
            "blockpress does not load pickles (unpickling can run arbitrary code). If you trust the file, convert it "
            "once with transformers: DiffusionGemmaForBlockDiffusion.from_pretrained(folder).save_pretrained(new_folder) "
            "writes model.safetensors, which blockpress loads")
    raise NoWeights(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_config(path: Path) -> ModelConfig:
    """A checkpoint folder's config.json, refused here when blockpress cannot run its weights whatever they are."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint folder")
    check_links(path)
    config = ModelConfig.from_file(path / "config.json")
    # another tool's codes come with scales blockpress does not read: refused by name here, not tensor by tensor
    stored_quantization(config.extra.get("quantization_config"), path)
    if isinstance(mlx := config.extra.get("quantization"), dict) and "bits" in mlx:  # mlx-lm's key for the same
        raise CheckpointError(f"{path / 'config.json'}: a pre-quantized checkpoint (quantization: {mlx['bits']!r}-bit, "
                              "as mlx-lm writes) is not supported: load the unquantized one with quantize='int8', "
                              "'fp8' or 'int4' instead")
    return config


def stored_quantization(raw: Any, path: Path) -> str | None:
    """The scheme a folder's weights are stored quantized with, read off its config.json's `quantization_config`
    (`raw`; blockpress's quantized save writes one), or None for a plain checkpoint. Another tool's, or a damaged one,
    is a CheckpointError naming the field."""
    if not raw:
        return None
    from .quantize import read_quantization_config

    try:
        return read_quantization_config(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None


def folder_quantization(path: Path) -> str | None:
    """stored_quantization of the folder at `path` read off its config.json alone, or None where there is none to
    read (a load reports a missing or broken config.json itself)."""
    try:
        raw = read_json_object(path / "config.json").get("quantization_config")
    except (OSError, ValueError):
        return None
    return stored_quantization(raw, path)


@dataclass(kw_only=True)  # (12 fields, dtypes and sets side by side: by name, none can swap)
class ModelPlan:
    """What loading a folder will do, decided from config.json and the safetensors headers before any tensor's
    data is read. `load_model` carries it out; `blockpress info` describes it (`meta_model`), so the two cannot
    disagree about the dtype, the device checks or the quantized layout."""

    path: Path
    config: ModelConfig
    files: list[MappedSafetensors]  # headers read, data still on disk; [] for a folder with config.json alone
    stored: torch.dtype | None  # the dtype the text weights are stored in (None: no weights)
    dtype: torch.dtype  # the dtype they load in
    device: torch.device
    quantize: str | None
    model: DiffusionGemma  # on the meta device, quantized modules swapped in; tensors not assigned yet
    shapes: dict[str, tuple[int, ...]]  # each text weight's local name and shape, as the checkpoint stores it
    quantized: frozenset[str]  # the local names whose weight is stored quantized (with a `{name}_scale`)
    # the stored dtype, where dtype=None picked a wider one to compute in on this CPU (native_dtype); else None
    widened_from: torch.dtype | None = None
    # a folder stored quantized (blockpress's quantized save): its codes' and scales' local names and dtypes, read as
    # stored (never cast, never quantized again); empty otherwise
    coded: dict[str, torch.dtype] = field(default_factory=dict)

    def convert(self, local: str, tensor: torch.Tensor, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """A stored weight as the loaded model holds it: quantized on `device` (weight and scale) when its layer
        is, else cast to the plan's dtype there. `device` defaults to the plan's (meta_model passes meta)."""
        device = device or self.device
        if self.dtype == torch.float16:  # read in the file's dtype first: a value past float16's range is refused
            self.check_float16(local, tensor)
        if local in self.coded:  # stored quantized: the codes and scales as saved (their dtypes were checked)
            return {local: tensor.to(device)}
        if self.quantize is not None and local in self.quantized:  # (quantized is empty without a scheme)
            from .quantize import quantize_weight

            weight, scale = quantize_weight(tensor.to(device), self.quantize)
            return {local: weight, f"{local}_scale": scale}
        return {local: tensor.to(device=device, dtype=self.dtype)}

    def check_float16(self, local: str, tensor: torch.Tensor) -> None:
        """Refuse a stored weight that would be inf in a float16 model: cast to it, or, int8 and int4, rebuilt in it
        from codes and scales by the float16 matmuls (a weight of 70,000 loaded with quantize="int8" computed inf on
        every call, and NonFiniteLogits blamed the activations). fp8's weights stay in range (448 x scale at most)."""
        from .quantize import INT8_MAX, SCALE_SUFFIX

        if self.quantize == "fp8" and (local in self.coded or local in self.quantized):
            return
        if local in self.coded:  # a weight's largest magnitude is its scale's times its largest code's
            if not local.endswith(SCALE_SUFFIX):
                return
            top = INT8_MAX if self.quantize == "int8" else 7  # (int4's scale is absmax / 7: its codes run -7..7)
            local, tensor = local.removesuffix(SCALE_SUFFIX), tensor.float() * top
        check_float16_range([(local_to_hf(local), tensor)], f"nothing was loaded from {self.path}")

    def meta_model(self) -> DiffusionGemma:
        """The model as `load_model` would leave it, on the meta device: every tensor's shape and dtype, no memory.
        Assigns into `self.model`, so a plan is either loaded or described."""
        meta = torch.device("meta")
        state: dict[str, torch.Tensor] = {}
        for local, shape in self.shapes.items():
            dtype = self.coded.get(local, self.stored or self.dtype)
            state.update(self.convert(local, torch.empty(shape, dtype=dtype, device=meta), meta))
        self.model.load_state_dict(state, strict=True, assign=True)
        if self.quantize is not None:  # laid out as the load will hold it on its device (int4's CPU layout)
            from .quantize import fit_cpu_kernels

            fit_cpu_kernels(self.model, self.device, self.dtype)
        return self.model


def declared_dtype(config: ModelConfig) -> torch.dtype | None:
    """config.json's own `dtype` (or older `torch_dtype`), None when it names none the model computes in."""
    declared = config.extra.get("dtype") or config.extra.get("torch_dtype")
    try:
        return resolve_dtype(declared) if isinstance(declared, str) else None
    except ValueError:  # "auto", "float64", ...: only a folder without weights reads it, so no refusal
        return None


def plan_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
    quantize: str | None = None, *, weights: bool = True,
) -> ModelPlan:
    """Everything a load of the folder at `path` decides before reading a tensor, with a load's refusals (another
    tool's pre-quantized checkpoint or a pickle one, a tensor the config has no place for or another shape for, a weight it
    lacks, a device that is not here, an fp8 that does not run there): all but check_tied_copies, which compares
    tensors' values.

    `dtype=None`: the stored one, except half precision on a CPU without native matmuls for it (native_dtype).
    `weights=False` also plans a folder with config.json alone, or with an index whose shards are none of them here
    (what `blockpress info` describes before the weights are fetched); with nothing stored, its dtype is config.json's
    declared one. A load needs weights. A folder saved quantized (`quantize.quantization_config`) plans its own scheme,
    its codes and scales read as stored; `quantize` may name that scheme, no other."""
    path = Path(path)
    config = read_config(path)
    saved = stored_quantization(config.extra.get("quantization_config"), path)
    if saved is not None and quantize is not None and quantize != saved:
        raise ValueError(f"quantize: {quantize!r} asked for, but {path} is stored quantized with {saved} (its codes, "
                         f"not the unquantized weights): load it as saved (quantize={saved!r}, or none given; "
                         f"--quantize {saved}), or quantize the unquantized checkpoint with {quantize!r}")
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    try:
        files = checkpoint_files(path)
    except NoWeights:
        if weights:
            raise
        files = []
    opened = [MappedSafetensors(file) for file in files]  # reads each header; the data stays on disk
    mixed_saves(path, opened)
    coded: dict[str, torch.dtype] = {}
    with torch.device("meta"):
        model = DiffusionGemma(config)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # as stored in the checkpoint
        if saved is not None:  # stored quantized: the quantized layout is what the files hold
            from .quantize import coded_tensors
            from .quantize import quantize as quantize_model

            # on the meta device: only the layout (quantized buffers, scales); int4's small groups were said when the
            # folder was quantized, and its scales' shapes hold them: no warning again at every load of an int4 folder
            quantize_model(model, saved, warn_groups=False)
            coded = coded_tensors(model)
            shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
            quantize = saved
        check_headers(opened, shapes, coded)
        if opened:  # a folder with config.json alone is described (weights=False), not refused
            check_complete(path, opened, shapes)
        if quantize is not None and saved is None:
            from .quantize import quantize as quantize_model

            quantize_model(model, quantize)  # on the meta device: only the layout (quantized buffers, scales)
    quantized = frozenset(name.removesuffix("_scale") for name in model.state_dict()
                          if name.endswith("_scale") and name.removesuffix("_scale") in shapes)
    stored = stored_dtype(opened, map(local_to_hf, coded)) if opened else None
    widened_from = None
    if dtype is None:
        own = stored or declared_dtype(config) or torch.float32
        dtype = native_dtype(own, device)
        widened_from = own if dtype != own else None
    if quantize is not None:  # the meta model above could not tell whether the scheme runs where it will live
        from .quantize import check_runs

        check_runs(quantize, device, dtype)
    return ModelPlan(path=path, config=config, files=opened, stored=stored, dtype=dtype, device=device,
                     quantize=quantize, model=model, shapes=shapes, quantized=quantized, widened_from=widened_from,
                     coded=coded)


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
    quantize: str | None = None,
) -> tuple[DiffusionGemma, Passthrough]:
    """The model of an HF-format folder. With `quantize` ("int8", "fp8", "int4"; see blockpress.quantize) each projection
    is quantized as soon as it is read, so the full-precision model never exists at once: the device holds the
    quantized model plus one tensor in transit and its float32 temporaries. On a CPU the pages read are dropped
    from the process and the C heap trimmed at the end (benchmarks/RESULTS.md, Quantization, has figures)."""
    return load_plan(plan_model(path, dtype, device, quantize))


def load_plan(plan: ModelPlan, progress: Callable[[int, int], None] | None = None) -> tuple[DiffusionGemma, Passthrough]:
    """Carry out `plan` (plan_model's): read the tensors, check the tied copies, build the model (see load_model).
    `progress(done, total)`: called after each weight is read, with the stored bytes read so far and in all (a 26B's
    50 GB take minutes from a network disk; on a CPU in the file's own dtype nothing is read until first use)."""
    path, config, model, dtype, device, quantize = (plan.path, plan.config, plan.model, plan.dtype, plan.device,
                                                    plan.quantize)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    passthrough = Passthrough()
    derived: list[str] = []  # rotary tables stored as tensors: recomputed from the config, so skipped
    copies: dict[str, Path] = {}  # tied copies the checkpoint stores anyway (encoder text weights, LM head)
    sources: dict[str, Path] = {}
    read_into_copies: list[tuple[MappedSafetensors, str]] = []  # (cast or quantized: their file pages are done with)
    copied, added = (0, 0)
    if quantize is not None:  # int4 on a CPU in bf16 or float32 is copied into the CPU GEMM's layout, scales doubled
        from .quantize import cpu_layout_bytes

        copied, added = cpu_layout_bytes(model, device, dtype)
    what = f"load: {path} ({config.describe()}) in {str(dtype).removeprefix('torch.')}{f', {quantize}' if quantize else ''}"
    if device.type != "cpu" or dtype != plan.stored or (quantize is not None and not plan.coded):
        # Read in the file's own dtype on a CPU, weights stay views of the mapped file: nothing to allocate (a folder
        # stored quantized too: its codes and scales are read as stored), but for int4's CPU layout.
        params = {name for name, _ in model.named_parameters()}
        nbytes = sum(t.numel() * (dtype.itemsize if name in params else t.element_size())
                     for name, t in expected.items())
        check_fits(nbytes + added, device, what)
    elif copied:
        check_fits(copied, device, what)
    total = sum(f.nbytes(name) for f in plan.files for name in f.keys() if tensor_kind(name)[0] == "weight")
    done = 0
    for f in plan.files:
        file = f.path
        for name in f.keys():
            kind, local = tensor_kind(name)  # names, shapes and dtypes were checked by plan_model (check_headers)
            if kind == "vision":
                passthrough.tensors[name] = f.tensor(name)
            elif kind == "derived":
                derived.append(name)
            elif kind == "copy":
                copies[name] = file
            else:
                assert local is not None  # tensor_kind names every "weight"
                sources[name] = file
                stored = f.tensor(name)
                converted = plan.convert(local, stored)  # a quantized projection drops its float copy here
                state.update(converted)
                if all(t.untyped_storage().data_ptr() != stored.untyped_storage().data_ptr() for t in converted.values()):
                    read_into_copies.append((f, name))
                done += f.nbytes(name)
                if progress is not None:
                    progress(done, total)
    # The top-level flag alone: transformers ties on the config of the whole model, so a text_config flag false
    # under a top-level true loads tied there (and lm.save writes such a pair back as it read it)
    tied = config.extra.get("tie_word_embeddings", True) is not False
    check_tied_copies(copies, sources, tied)  # copies are checked whatever the flag: a differing one is never dropped
    # Dropped once all is read: the kernel maps a faulting page's cached neighbours with it, so pages dropped earlier
    # came back as the next tensors were read (a tiny model kept 75% of them)
    for f, name in read_into_copies:
        f.release(name)
    if passthrough.tensors:
        warn_user(
            f"{path}: {len(passthrough.tensors)} vision tensors ignored (blockpress is text-only); "
            "they are kept when the model is saved")
    if derived:
        warn_user(f"{path}: {len(derived)} derived rotary buffer(s) skipped (e.g. {derived[0]!r}); blockpress "
                  "computes the rotary tables from the config")
    scalars = [local for local in expected if local not in state and local.endswith("layer_scalar")]
    for local in scalars:
        state[local] = torch.ones(1, dtype=dtype, device=device)  # a fresh layer's value (the reference's, decoder)
    # transformers reports them missing (and sets a decoder one to 1, an encoder one to whatever memory held):
    # a checkpoint that lost its trained scalars must not pass unseen
    if scalars:
        warn_user(f"{path}: {len(scalars)} layer_scalar tensor(s) missing (e.g. {local_to_hf(scalars[0])!r}); "
                  "each is set to 1, the value a fresh layer starts with (transformers reports them missing)")
    model.load_state_dict(state, strict=True, assign=True)  # every weight is there: plan_model's check_complete
    model.reset_buffers()
    model.to(device)
    del state
    if quantize is not None:
        return_freed_heap(device)
    return model, passthrough


def return_freed_heap(device: torch.device) -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). Quantizing frees a
    float32 temporary or two per weight; glibc keeps most of what they held, so a quantized CPU load otherwise stays
    resident well above the codes it holds (benchmarks/RESULTS.md, Quantization, has the figures)."""
    if device.type != "cpu":
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
        return
    trim(0)


# The names a save gives its weights: one file, or numbered shards with their index (transformers' layout)
WEIGHTS_FILE = re.compile(r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json")


def _indexed_shards(path: Path) -> set[str]:
    """The file names the folder's model.safetensors.index.json maps tensors to, where it reads (none otherwise):
    shards named otherwise than WEIGHTS_FILE ('model-00001-of-000163.safetensors', a hub repo's) are the old
    layout's files too."""
    try:
        weight_map = parse_json((path / "model.safetensors.index.json").read_text(encoding="utf-8-sig"))["weight_map"]
        return {f for f in weight_map.values() if isinstance(f, str) and "/" not in f and "\\" not in f}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # (no index, or not one: nothing it names)
        return set()


def save_model(
    model: DiffusionGemma,
    path: str | Path,
    passthrough: Passthrough | None = None,
    *,
    max_shard_bytes: int = 4 << 30,
    metadata: dict[str, str] | None = None,
    files: StagedFiles | None = None,
    dtype: torch.dtype | None = None,
    quantized_from: str | None = None,
) -> None:
    """Write config.json and safetensors in the reference's layout (sharded above `max_shard_bytes`); `metadata`:
    string entries added to each safetensors file's header (`MappedSafetensors.metadata` reads them back). `dtype`:
    the one the text weights are written in (default: the model's), cast one shard at a time as it is written, so
    the model itself is left as it is and the copies never take more than a shard's bytes. A quantized model's codes
    and scales are written as they are held, whatever `dtype` (which then applies to its unquantized tensors:
    embedding, norms, router), under the plain names (a scale: its weight's name + "_scale"), and config.json records
    the scheme (`quantization_config`, quantize.quantization_config, with `quantized_from` where given).

    Everything is read and checked before the first file is written, and the files are written under temporary
    names and moved into place together (StagedFiles), so a save that cannot complete, or is killed, leaves the
    destination as it was. `files`: stage them there instead, for its owner to commit with the rest of a larger
    save (a training run's)."""
    from .quantize import coded_tensors, quantization_config, quantization_of

    path = Path(path)
    dtype = dtype or model.dtype
    scheme = quantization_of(model)
    coded = {local_to_hf(name) for name in coded_tensors(model)}  # written as held: never cast
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ValueError(f"save: metadata: expected a dict of str -> str (safetensors header entries), got {metadata!r}")
    if path.is_dir():
        links = sorted(p.name for p in path.iterdir() if p.is_symlink())
        if links:  # writing through them would change blobs that other revisions (and their hashes) share
            raise ValueError(f"save: {path} holds links ({', '.join(links[:3])}{', ...' if len(links) > 3 else ''}), "
                             "as a Hugging Face cache snapshot does; save to a folder of your own")
    # left where they are: each shard is copied to the host as it is written, so a GPU model's save holds one
    # shard's bytes in host memory, not the whole model's (50 GB for the 26B)
    tensors = {local_to_hf(k): v.detach() for k, v in model.state_dict().items()}
    cast = {name for name, t in tensors.items()  # text weights only
            if t.is_floating_point() and t.dtype != dtype and name not in coded}
    if dtype == torch.float16:  # before the folder is made: a value past float16's range would be written as inf
        check_float16_range(((name, tensors[name]) for name in sorted(cast)), f"nothing was written to {path}")
    if passthrough:  # the vision tensors, kept in their own dtype
        tensors.update(passthrough.tensors)

    def written(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: (t.to("cpu", dtype) if name in cast else t.cpu()).contiguous() for name, t in shard.items()}

    def nbytes_of(name: str) -> int:
        return tensors[name].numel() * (dtype.itemsize if name in cast else tensors[name].element_size())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = nbytes_of(name)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) > 1:  # one mark for all of one save's shards: a load refuses shards of two (mixed_saves)
        meta[SAVE_MARK_KEY] = uuid.uuid4().hex
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) > 1:
        names.append("model.safetensors.index.json")
    # the other layout's files of an earlier save, and nothing else: a glob's model*.safetensors* also took a
    # user's model.safetensors.bak or model.fp16.safetensors kept beside the checkpoint
    indexed = _indexed_shards(path)
    stale = [old for old in path.glob("model*.safetensors*")
             if old.name not in names and (WEIGHTS_FILE.fullmatch(old.name) or old.name in indexed)]
    with staging(files) as staged:
        staged.make_folder(path)  # (one this save made is removed again if it fails)
        staged.remove_leftovers(path, "model*.safetensors*")  # of an earlier save killed part-way, in another layout
        staged.write(path / "config.json", lambda file: model.config.save(
            file, dtype=dtype, quantization=quantization_config(scheme, quantized_from) if scheme else None))
        for fname, shard in zip(names, shards):
            def write_shard(file: Path, shard: dict[str, torch.Tensor] = shard) -> None:
                save_file(written(shard), str(file), metadata=meta)  # (a full disk: an OSError naming the shard)

            staged.write(path / fname, write_shard)
        if len(shards) > 1:
            weight_map = {name: fname for fname, shard in zip(names, shards) for name in shard}
            total = sum(nbytes_of(name) for name in tensors)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            staged.write_text(path / names[-1], json.dumps(index, indent=2) + "\n")
        for old in stale:  # the other layout's files, left from an earlier save (after: a kill between keeps weights)
            staged.remove(old)
