"""Speed harness: engines side by side on the same random checkpoint, JSON out, optional plot.

Engines: blockpress `generate` (block diffusion), blockpress `generate_ar` (the same backbone, one token
at a time) and, when transformers is installed, the reference `generate`. Adaptive stopping is off and
EOS is disabled, so every engine does a fixed amount of work and runs compare engines, not luck.

What each figure of an engine's entry means, per engine, is FIGURES, and ROW_FIGURES a row's own (both written
into the JSON, as "figures"). The
harness itself times each engine's first encoder call (its prefill) and, for block diffusion, the encoder calls
over the committed canvases, the device synchronised around each, so the per-step figures mean the same for
every diffusion engine.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .cache import KVCache
from .checkpoint import available_bytes, cpu_computes_natively, resolve_device
from .checks import compile_failure, is_int
from .config import ModelConfig, TextConfig
from .files import new_tag, release_tag, remove_killed_writes
from .generate import canvas_positions, device_sync
from .lm import LM, random_model
from .sampling import MAX_COUNT

# What each figure of an engine's entry in a row means. "Diffusion engines": blockpress `generate`, its variants
# (the AR ones excepted) and the reference. "After the prefill": from the end of the first encoder call to the end of the run.
FIGURES = {
    "seconds": "wall time of one generate call, the device synchronised (each engine's fastest of --repeats runs)",
    "new_tokens": "new tokens asked for, all rows together (EOS is off, so all are made)",
    "tok_s": "new_tokens / seconds",
    "forward_passes": "diffusion engines: decoder passes per row (canvases x steps; the reference's counted over "
                      "every canvas it denoised); AR: one pass per token, the prefill counted (its logits give each "
                      "row's first token)",
    "tokens_per_forward": "new tokens per forward pass and row",
    "prefill_ms": "the prompt's encoder pass: the engine's first encoder call, timed by the harness",
    "canvas_encode_ms": "diffusion engines: the encoder passes over the committed canvases (all but the last), in all",
    "ms_per_step": "diffusion engines: (time after the prefill - canvas_encode_ms) / forward_passes, one decoder "
                   "pass with its sampler step; AR: time after the prefill / (forward_passes - 1), one one-token "
                   "encoder pass with its sampling (null for one new token)",
    "tok_s_without_prefill": "tokens made after the prefill / time after the prefill; diffusion engines: every new "
                             "token; AR: all but each row's first (null for one new token)",
    "peak_memory_growth_gb": "the most memory one more untimed run held beyond what was in use at its start: its "
                             "caches, logits and work, not weights (every engine's stay resident on the device "
                             "throughout). CUDA: the allocator's; CPU: the C heap's, sampled every 2 ms (null without glibc, or "
                             "for a run over before its first sample)",
}
# What a row's own figures mean (beside its batch, canvas and one entry per engine).
ROW_FIGURES = {
    "speedup_vs_reference": "blockpress tok_s / the reference's tok_s",
    "step_speedup_vs_reference": "the reference's ms_per_step / blockpress's ms_per_step",
    "diffusion_over_ar": "blockpress tok_s / blockpress_ar tok_s (AR has no canvas: it is timed, and its entries "
                         "shown, in the first canvas's rows alone; the later canvases' rows use those)",
    "<variant>_over_eager": "blockpress_<variant> tok_s / blockpress tok_s (variants: compiled, cuda_graphs, the "
                            "--quantize scheme)",
    "<variant>_speedup_vs_reference": "blockpress_<variant> tok_s / the reference's tok_s",
    "<scheme>_weights_bytes": "bytes of the quantized model's weights",
    "gemm_ms_per_step": "CPU: time inside matrix multiplications per blockpress decoder pass (profiler, the least "
                        "of --repeats)",
    "speedup_bound_at_this_precision": "CPU: the reference's ms_per_step / gemm_ms_per_step, both a decoder pass "
                                       "alone (the prefill and canvas encodes left out): the most any engine doing "
                                       "blockpress's arithmetic at this precision could beat the reference's "
                                       "denoising steps by",
}


@dataclass
class BenchSettings:
    preset: str = "small"
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    new_tokens: int = 256
    steps: int = 48
    prompt_length: int = 32
    repeats: int = 2
    reference: bool = True
    ar: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    compile: bool = False  # also time blockpress through torch.compile (the first repeat pays the compile)
    cuda_graphs: bool = False  # also time blockpress with its passes replayed from CUDA graphs (CUDA only)
    canvas_lengths: list[int] | None = None  # sweep these canvas lengths (None: the preset's)
    quantize: str | None = None  # also time blockpress with the projections quantized ("int8", "fp8", "int4")
    layers: int | None = None  # the preset's first this many layers alone (ModelConfig.first_layers; None: all)

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "canvas_lengths"):
            values = getattr(self, name)
            # (is_int: not a bool, which ran as 1 and was written to the JSON as "batch": true)
            if values is not None and (not values or not all(is_int(v) and v > 0 for v in values)):
                raise ValueError(f"{name}: expected positive integers, got {values!r}")
            if values is not None:  # ascending, each once: the plot joins rows in order, and a repeat is re-timed
                setattr(self, name, sorted({int(v) for v in values}))
        for name in ("new_tokens", "steps", "prompt_length", "repeats"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
            setattr(self, name, int(getattr(self, name)))
        if self.steps > MAX_COUNT:  # the sampler's own bound, checked now, not as the first row is timed
            raise ValueError(f"steps: expected an integer in [1, {MAX_COUNT}], got {self.steps}")
        self._check_context(self.model_config())  # an unknown preset or layer count: a clear error now
        if self.quantize is not None:
            from .quantize import check_scheme

            check_scheme(self.quantize)
        # a device this torch lacks: a clear error now, not an assertion inside torch; meta (shapes only) would be
        # refused only by the first row's generate, after the model is built and "warming up and timing" said
        device = resolve_device(self.device)
        if device.type == "meta":
            raise ValueError(f"device: {self.device!r} holds shapes only, so nothing runs there to time; give cpu or "
                             f"cuda (`blockpress info --model random-{self.preset} --device meta` counts the preset "
                             "without allocating)")
        # torch's spelling ("AUTO" and "auto" resolved): machine() and the engines pass it on to torch.device
        self.device = str(device)

    def model_config(self) -> ModelConfig:
        """The shape timed: the preset's, cut to its first `layers` layers when given."""
        cfg = ModelConfig.preset(self.preset)
        return cfg if self.layers is None else cfg.first_layers(self.layers)

    def shape_name(self) -> str:
        """The preset as the run's messages name it: with the layers kept, when cut."""
        if self.layers is None:
            return self.preset
        return f"{self.preset} (its first {self.layers} of {ModelConfig.preset(self.preset).text.num_hidden_layers} layers)"

    def _check_context(self, cfg: ModelConfig) -> None:
        """Refuse, before any model is built, a run past the preset's context: the prompt and, for each canvas
        length, the whole canvases the new tokens take (what block diffusion denoises; AR takes fewer)."""
        limit = cfg.text.max_position_embeddings
        for canvas in self.canvas_lengths or [cfg.canvas_length]:
            taken = canvas_positions(self.new_tokens, canvas)
            if self.prompt_length + taken <= limit:
                continue
            # what to shorten: the prompt when it fills the context, the new tokens when they do not fit, else
            # (they fit, their last canvas does not) the canvas swept, or the prompt before the preset's canvas
            blame = ("prompt_length" if self.prompt_length >= limit
                     else "new_tokens" if self.prompt_length + self.new_tokens > limit
                     else "canvas_lengths" if self.canvas_lengths
                     else "prompt_length" if self.prompt_length + canvas > limit else "new_tokens")
            raise ValueError(f"{blame}: {self.prompt_length} prompt + {self.new_tokens} new tokens in whole "
                             f"{canvas}-token canvases ({taken} positions) exceed the {self.shape_name()} preset's context "
                             f"of {limit} tokens (max_position_embeddings)")

    def long_canvas(self) -> str | None:
        """What run_bench says when the new tokens end partway through a canvas (the preset's, or one swept): a
        canvas denoises all its positions, kept or not. That is what a model of that canvas pays for such replies,
        so it is timed, but the comparison with AR, which makes only what it keeps, needs saying. None when every
        canvas length divides the new tokens."""
        canvases = self.canvas_lengths or [self.model_config().canvas_length]
        # a partly used last canvas, not only a canvas longer than the new tokens: 20 in 16-token canvases denoise 32
        dropped = {c: canvas_positions(self.new_tokens, c) - self.new_tokens for c in canvases}
        if not any(dropped.values()):
            return None
        what = (f"canvas lengths {self.canvas_lengths} (--canvas-lengths)" if self.canvas_lengths
                else f"the {self.preset} preset's {canvases[0]}-token canvas")
        counts = ", ".join(f"{d} of the {self.new_tokens + d} denoised at canvas {c}" for c, d in dropped.items() if d)
        # whole canvases of every length swept: a multiple of each (their lcm), the first at or above the new tokens;
        # advised only where it is a run of about this size that the context holds (7, 11, 13 and 256: 256,256)
        common = math.lcm(*canvases)
        whole = -(-self.new_tokens // common) * common
        fits = (whole <= 4 * self.new_tokens
                and self.prompt_length + whole <= self.model_config().text.max_position_embeddings)
        multiple = (f"--new-tokens {whole} (a multiple of "
                    f"{'every canvas length' if len(canvases) > 1 else 'the canvas length'}) or " if fits else "")
        return (f"{self.new_tokens} new token{'s' if self.new_tokens != 1 else ''} (--new-tokens) with {what}: "
                "a canvas denoises all its positions, kept or not, so the diffusion figures include positions that "
                f"are dropped ({counts}; AR's do not); to time only what is kept: {multiple}--canvas-lengths that "
                f"divide {self.new_tokens}")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader() -> Callable[[], int] | None:
    """Bytes the C heap has handed out and not taken back (glibc's mallinfo2: torch's CPU tensors live there),
    or None where there is no glibc. Unlike the resident size it falls when memory is freed, so a run that
    reuses what an earlier one freed is still counted."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


class PeakMemory:
    """Peak memory of one engine run: `peak_memory_growth_gb`, the most the run held beyond what was in use when
    it started (caches, logits, the step's work; None without glibc on a CPU, or for a run over before the first
    sample). Not the peak itself: every engine's weights (blockpress's, the reference's copy, a quantized twin) stay
    on the device during each engine's run, so the device-wide peak would count all of them in every engine's
    figure. CUDA: the allocator's peak since the start;
    on a CPU a thread samples the C heap's bytes in use every `interval` s."""

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device, self.interval = device, interval
        self.read = None if device.type == "cuda" else _heap_reader()
        self.start = self.peak = self.samples = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        elif self.read is not None:
            self.start = self.peak = self.read()
            self._thread = threading.Thread(target=self._sample, args=(self.read,), daemon=True)
            self._thread.start()
        return self

    def _sample(self, read: Callable[[], int]) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, read())
            self.samples += 1

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def figures(self) -> dict[str, float | None]:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.read is None or self.samples == 0:  # (a run over before the thread's first sample: not a 0)
            return {"peak_memory_growth_gb": None}
        return {"peak_memory_growth_gb": (self.peak - self.start) / 1e9}


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at the null device: torch's profiler (kineto) writes "USDT: ...
    SyncActivityProfilerHandler profiler_start/stop" lines there from C++ on every start and stop, and no setting
    turns them off (KINETO_LOG_LEVEL does not). Python's own sys.stderr is flushed first and works again after."""
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def quiet_profile(activities: list[Any]) -> Iterator[Any]:
    """torch's profiler without its start and stop lines on stderr. Only the start and the stop are
    silenced, not the profiled code between them: its warnings and errors still show.

    The kineto profiler that torch.profiler.profile wraps, taken directly: torch.profiler.profile's start asks
    `hasattr(torch, "_inductor")`, which imports torch._inductor and torch._dynamo (3.7 s on a loaded 2-core CPU,
    each process's first profile: `blockpress bench`, gpu_bench, profile_train_step) only to read a CUDA-graph
    setting of compiled code. Same events, same key_averages()."""
    from torch.autograd.profiler import profile
    from torch.profiler import ProfilerActivity

    prof = profile(use_cpu=ProfilerActivity.CPU in activities,
                   use_device="cuda" if ProfilerActivity.CUDA in activities else None, use_kineto=True)
    with _native_stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _native_stderr_silenced():
            prof.__exit__(None, None, None)


def profile_ops(fn: Any, device: torch.device, top: int = 15) -> dict[str, Any]:
    """One call of fn under torch.profiler: its busiest ops (device time on a GPU, CPU time otherwise), its most
    frequent ones, and the counts of aten ops, host syncs and kernel launches. What the next speed change
    should go after."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with quiet_profile(activities) as prof:
        fn()
        device_sync(device)
    events = prof.key_averages()

    def own_ms(e: Any) -> float:
        if device.type == "cuda":
            return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) / 1e3
        return e.self_cpu_time_total / 1e3

    def row(e: Any) -> dict[str, Any]:
        return {"op": e.key, "count": e.count, "self_ms": round(own_ms(e), 3),
                "cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}

    counts = {e.key: e.count for e in events}
    return {
        "by_time": [row(e) for e in sorted(events, key=lambda e: -own_ms(e))[:top]],
        "by_count": [row(e) for e in sorted(events, key=lambda e: -e.count)[:top]],
        "aten_ops": sum(n for k, n in counts.items() if k.startswith("aten::")),
        "host_syncs": counts.get("aten::item", 0) + counts.get("cudaStreamSynchronize", 0)
        + counts.get("cudaDeviceSynchronize", 0),
        "kernel_launches": counts.get("cudaLaunchKernel", 0) + counts.get("cuLaunchKernel", 0),
    }


def _warm_up(engines: dict[str, Callable[..., dict[str, Any]]]) -> None:
    """One untimed run of each engine: a first run pays one-time setup (the reference's first took ~3.7 s more on
    a CPU, so with --repeats 1 the first batch size's figure was ~20x too low; compilation, graph capture)."""
    for fn in engines.values():
        fn()


def _best_interleaved(repeats: int, engines: dict[str, Callable[..., dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each engine's fastest of `repeats` runs, the engines taking turns (A B C A B C ...): on a shared machine
    a slow minute then costs every engine a run rather than all the runs of one, so ratios stay fair. Then one
    more untimed run each for peak memory: on a CPU its sampling thread would slow a timed run by ~10%."""
    best: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for name, fn in engines.items():
            row = fn()
            if name not in best or row["seconds"] < best[name]["seconds"]:
                best[name] = row
    for name, fn in engines.items():
        best[name].update({k: v for k, v in fn(memory=True).items() if k.startswith("peak_memory")})
    return best


def machine(device: str) -> dict[str, Any]:
    """What the figures depend on beyond the settings: a CPU's vector ISA decides whether bf16 is native
    (a bf16 matmul measured 33x slower than float32 on an AVX2-only CPU)."""
    dev = torch.device(device)
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(dev), "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    else:
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["native_bf16"] = cpu_computes_natively(torch.bfloat16)
    return info


def run_bench(s: BenchSettings, on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (canvas length, batch size) pair: one row with each engine's best of `repeats` runs. `on_row`: called
    with the result so far after each row (the CLI writes it then, so a sweep cut short keeps what it measured)."""
    long_canvas = s.long_canvas()
    if long_canvas is not None:
        _note(long_canvas)
    if s.cuda_graphs and torch.device(s.device).type != "cuda":
        raise ValueError(f"cuda_graphs: needs a CUDA device, got device {s.device!r}")
    base = s.model_config()
    _refuse_what_cannot_fit(base, s)
    canvases = s.canvas_lengths or [base.canvas_length]
    out: dict[str, Any] = {"settings": asdict(s), "machine": machine(s.device), "params": base.num_parameters(),
                           "active_params": base.num_parameters(active=True), "canvases": canvases,
                           "figures": {"engine": FIGURES, "row": ROW_FIGURES}, "rows": []}
    if len(canvases) == 1:  # several: each row has its own (the first alone read as the run's canvas)
        out["canvas"] = canvases[0]
    names = [name for name, on in (("compiled", s.compile), ("cuda_graphs", s.cuda_graphs)) if on]
    if s.quantize:
        names.append(s.quantize)
    ar_rows: dict[int, dict[str, Any]] = {}  # batch size -> the row whose AR entries it uses
    for canvas in canvases:
        cfg = s.model_config()
        cfg.canvas_length = canvas  # no weight depends on it: the same seed gives the same checkpoint
        cfg.text.eos_token_id = None  # fixed work: random weights would otherwise end at random
        _note(f"canvas {canvas}: building the {s.shape_name()} model ({s.dtype}, {s.device})"
              + (" and the reference, where transformers can build it" if s.reference else ""))
        lm = random_model(cfg, seed=0, dtype=s.dtype, device=s.device)
        ref = _reference(lm) if s.reference else None
        out["reference_available"] = ref is not None
        variants = {name: _variant(name, lm) for name in names}
        # AR has no canvas: it is timed with the first canvas alone (each canvas re-timed it, warm-up, repeats and
        # memory run, for the same figures), and the later canvases' rows compare with that row's.
        ar = s.ar and canvas == canvases[0]
        for b in s.batch_sizes:
            _note(f"batch {b}, canvas {canvas}: warming up and timing each engine ({s.repeats} "
                  f"run{'s' if s.repeats != 1 else ''} each)")
            started = time.perf_counter()
            row = _bench_row(lm, ref, variants, b, s, ar)
            rates = ", ".join(f"{name} {entry['tok_s']:.1f}" for name, entry in row.items()
                              if isinstance(entry, dict) and "tok_s" in entry)
            _note(f"batch {b}, canvas {canvas}: done in {time.perf_counter() - started:.0f} s (tok/s: {rates})")
            if ar:
                ar_rows[row["batch"]] = row
            if s.ar:
                row["diffusion_over_ar"] = row["blockpress"]["tok_s"] / ar_rows[row["batch"]]["blockpress_ar"]["tok_s"]
            for name in names:
                row[f"{name}_over_eager"] = row[f"blockpress_{name}"]["tok_s"] / row["blockpress"]["tok_s"]
            if ref is not None:
                _add_ratios(row, names)
            out["rows"].append(row)
            if on_row is not None:
                on_row(out)
        del variants
    return out


def _refuse_what_cannot_fit(cfg: ModelConfig, s: BenchSettings) -> None:
    """Refuse, with the figures, weights that cannot fit on the device (random_model refuses them too, but its
    advice, device='meta' to count without allocating, is no way to time a model), and then a run whose cache and
    logits cannot fit beside them: the largest batch with each canvas, before any model is built (it was the
    allocator's traceback once the weights were made, `--batch-sizes 100000000` on a 23 GB machine)."""
    device = resolve_device(s.device)
    free = available_bytes(device)
    meta = random_model(cfg, dtype=s.dtype, device="meta")
    needed = meta.weights_bytes()
    if free is not None and needed > free:
        raise ValueError(f"preset: {s.shape_name()} in {s.dtype} needs {needed / 1e9:.1f} GB of weights on {device} "
                         f"but {free / 1e9:.1f} GB are available; bench times a model it holds: a smaller --preset, "
                         f"--dtype or --layers (`blockpress info --model random-{s.preset} --device meta` counts it without "
                         "allocating)")
    if free is None:
        return
    room, batch = free - needed, max(s.batch_sizes)
    for canvas in s.canvas_lengths or [cfg.canvas_length]:
        row = run_memory(cfg.text, meta.dtype, 1, s.prompt_length, s.new_tokens, canvas)
        if batch * sum(row.values()) <= room:
            continue
        # what to lower: the batch when one row fits, else what one row's memory is mostly
        blame = ("batch_sizes" if sum(row.values()) <= room
                 else "prompt_length/new_tokens" if row["kv_cache"] >= row["logits"]
                 else "canvas_lengths" if s.canvas_lengths else "preset")
        fits = f"; at most {room // sum(row.values())} rows fit" if blame == "batch_sizes" else ""
        raise ValueError(f"{blame}: batch {batch} with a {canvas}-token canvas needs at least "
                         f"{describe_run_memory(run_memory(cfg.text, meta.dtype, batch, s.prompt_length, s.new_tokens, canvas))} "
                         f"on {device}, beside {needed / 1e9:.1f} GB of {s.shape_name()} weights in {s.dtype}, but "
                         f"{free / 1e9:.1f} GB are available{fits}")


def run_memory(text: TextConfig, dtype: torch.dtype, batch: int, prompt_length: int, new_tokens: int,
               canvas: int) -> dict[str, int]:
    """Bytes one block-diffusion generate call of this size holds beyond the weights, at least: the KV cache it
    allocates (prompt, new tokens and a canvas of scratch, each row; KVCache.bytes_per_token, `blockpress info`'s
    kv_cache_bytes_per_token) and one canvas's float32 logits. AR's cache (prompt, new tokens and one) is smaller,
    and its logits are one position's. The step's other work comes on top: a floor, not a forecast."""
    return {"kv_cache": batch * (prompt_length + new_tokens + canvas) * KVCache.bytes_per_token(text, dtype),
            "logits": batch * canvas * text.vocab_size * 4}


def describe_run_memory(parts: dict[str, int]) -> str:
    """run_memory's figures for a message: '12.3 GB (KV cache 10.1 GB + float32 logits 2.2 GB)'."""
    return (f"{sum(parts.values()) / 1e9:.1f} GB (KV cache {parts['kv_cache'] / 1e9:.1f} GB + float32 logits "
            f"{parts['logits'] / 1e9:.1f} GB)")


def _note(message: str) -> None:
    """A progress line on stderr (stdout carries the JSON)."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _variant(name: str, lm: LM) -> LM:
    """A variant as its own LM beside the eager one, so the eager engines can take turns with it: compiled or
    graphed steps over the same weights, or a quantized twin of them built beside them (quantize.quantized_copy: a
    second random model quantized after it peaked at twice the weights)."""
    if name == "compiled":
        return copy.copy(lm).compile()
    if name == "cuda_graphs":
        return copy.copy(lm).cuda_graphs()
    return lm.quantized_copy(name)


def _add_ratios(row: dict[str, Any], variants: list[str]) -> None:
    """Each engine's tok/s over the reference's best run, and (on a CPU) the bound no engine at this precision
    can pass: the reference's step time over blockpress's time inside matrix multiplications."""
    ref = row["reference"]
    row["speedup_vs_reference"] = row["blockpress"]["tok_s"] / ref["tok_s"]
    if "ms_per_step" in ref:
        row["step_speedup_vs_reference"] = ref["ms_per_step"] / row["blockpress"]["ms_per_step"]
    for name in variants:
        row[f"{name}_speedup_vs_reference"] = row[f"blockpress_{name}"]["tok_s"] / ref["tok_s"]
    if "gemm_ms_per_step" in row and ref.get("ms_per_step"):
        row["speedup_bound_at_this_precision"] = speedup_bound(ref["ms_per_step"], row["gemm_ms_per_step"])


def speedup_bound(reference_ms_per_step: float, gemm_ms_per_step: float) -> float:
    """The GEMM bound: the reference's time per denoising step (a decoder pass with its sampler step, the prefill
    and canvas encodes left out, as measured by the harness) over blockpress's time inside matrix multiplications
    per decoder pass. It was the reference's whole run over its passes, prefill and canvas encodes included,
    which the prompt's length then inflated (tiny preset: 34.1x for 28.6x at a 32-token prompt, 313x for 11.4x
    at a 4,096-token one)."""
    return reference_ms_per_step / gemm_ms_per_step


def _prompt(cfg: ModelConfig, batch: int, s: BenchSettings) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, cfg.text.vocab_size, (batch, s.prompt_length), generator=g)


def _blockpress_engines(lm: LM, prompt: torch.Tensor, s: BenchSettings, ar: bool,
                        suffix: str = "") -> dict[str, Callable[[], dict[str, Any]]]:
    """blockpress diffusion, and AR when `ar`, as named zero-argument runs (names end in `suffix`)."""
    engines: dict[str, Callable[[], dict[str, Any]]] = {f"blockpress{suffix}": partial(_diffusion, lm, prompt, s)}
    if ar:
        engines[f"blockpress_ar{suffix}"] = partial(_ar, lm, prompt, s)
    return engines


def _bench_row(lm: LM, ref: Any, variants: dict[str, LM], b: int, s: BenchSettings, ar: bool) -> dict[str, Any]:
    """One row: every engine (blockpress, AR when `ar`, the reference, each variant) warmed up, then all of them
    taking turns for `repeats` runs each. One round for all: each engine gets the same tries (when each variant
    had its own round with the eager engines, those got (1 + variants) x repeats, the variants `repeats`), and a
    slow (or quiet) spell of a shared machine falls on every engine alike."""
    device = lm.device
    prompt = _prompt(lm.config, b, s)
    row: dict[str, Any] = {"batch": b, "canvas": lm.config.canvas_length}
    engines = _blockpress_engines(lm, prompt, s, ar)
    if ref is not None:
        engines["reference"] = partial(_reference_run, ref, prompt, s, device)
    _warm_up(engines)
    for name, variant in variants.items():
        own = _blockpress_engines(variant, prompt, s, ar, suffix=f"_{name}")
        if name == "compiled":  # silent minutes otherwise: a user cannot tell compiling from stuck
            _note(f"compiling blockpress with torch.compile for batch {b}, canvas {lm.config.canvas_length} "
                  "(minutes on a CPU, even for the tiny preset)...")
        started = time.perf_counter()
        try:
            _warm_up(own)  # the first run compiles or captures
        except Exception as err:  # noqa: BLE001 - any compiler failure; the eager engines ran this prompt just now
            if name != "compiled":
                raise
            # No C++ compiler (a Windows install without MSVC's cl, a slim container), an unsupported platform or
            # Python: torch._dynamo says it in the last line of a page of traceback.
            raise compile_failure(err, "compile") from None
        if name == "compiled":
            _note(f"compiled in {time.perf_counter() - started:.0f} s")
        engines.update(own)
    row.update(_best_interleaved(s.repeats, engines))
    if s.quantize in variants:
        row[f"{s.quantize}_weights_bytes"] = variants[s.quantize].weights_bytes()
    if device.type == "cpu":
        row["gemm_ms_per_step"] = _gemm_ms_per_step(lm, prompt, rounds=s.repeats)
    return row


@dataclass
class Timed:
    """One timed engine run: fn's result, its wall seconds with the device synchronised, when it ended
    (time.perf_counter), and its peak-memory figures (empty unless asked for)."""

    out: Any
    seconds: float
    end: float
    memory: dict[str, float | None]


def _timed(fn: Callable[[], Any], device: torch.device, memory: bool) -> Timed:
    with PeakMemory(device) if memory else contextlib.nullcontext() as mem, torch.no_grad():
        device_sync(device)
        t0 = time.perf_counter()
        out = fn()
        device_sync(device)
        end = time.perf_counter()
    return Timed(out, end - t0, end, mem.figures() if mem is not None else {})


@dataclass
class EncoderCalls:
    """When each encoder call of one run started and ended (time.perf_counter), the device synchronised around
    each: the first encodes the prompt (the prefill), a diffusion engine's later ones the canvases it committed.
    `first_only` times the prefill alone: AR's later encoder calls are its decode steps, and synchronising
    around each would stall the GPU work that overlaps the host's."""

    device: torch.device
    first_only: bool = False
    spans: list[tuple[float, float]] = field(default_factory=list)
    calls: int = 0
    _start: float = 0.0

    def before(self) -> None:
        self.calls += 1
        if not self.first_only or self.calls == 1:
            device_sync(self.device)
            self._start = time.perf_counter()

    def after(self) -> None:
        if not self.first_only or self.calls == 1:
            device_sync(self.device)
            self.spans.append((self._start, time.perf_counter()))

    def prefill(self) -> tuple[float, float]:
        """(seconds of the prefill, the moment it ended)."""
        if not self.spans:
            raise RuntimeError("bench: the run made no encoder call to time as its prefill")
        start, end = self.spans[0]
        return end - start, end

    def canvas_seconds(self) -> float:
        return sum(end - start for start, end in self.spans[1:])


@contextlib.contextmanager
def _encoder_timed(model: Any, calls: EncoderCalls) -> Iterator[EncoderCalls]:
    """blockpress's `model.encode` timed into `calls` while the block runs. The decoding loops look it up on the
    model for each call (the prefill, committed canvases, eager AR steps), so an instance attribute catches them;
    step functions compiled or graphed before keep their own reference to the method and are not timed."""
    own = model.__dict__.get("encode")
    inner = model.encode

    def encode(*args: Any, **kwargs: Any) -> Any:
        calls.before()
        try:
            return inner(*args, **kwargs)
        finally:
            calls.after()

    model.encode = encode
    try:
        yield calls
    finally:
        if own is None:
            del model.encode
        else:
            model.encode = own


def _diffusion(lm: LM, prompt: torch.Tensor, s: BenchSettings, memory: bool = False) -> dict[str, Any]:
    calls = EncoderCalls(lm.device)
    with _encoder_timed(lm.model, calls):
        run = _timed(lambda: lm.generate(prompt, max_new_tokens=s.new_tokens, max_denoising_steps=s.steps, seed=0,
                                         adaptive_stopping=False), lm.device, memory)
    o = run.out
    n = int(o.num_new_tokens.sum())
    passes = int(o.forward_passes.max())
    return {"seconds": run.seconds, "new_tokens": n, "forward_passes": passes,
            "tokens_per_forward": float(o.tokens_per_forward.mean()), "tok_s": n / run.seconds,
            **diffusion_step_figures(n, passes, run.end, calls), **run.memory}


def diffusion_step_figures(new_tokens: int, decoder_passes: int, end: float, calls: EncoderCalls) -> dict[str, float]:
    """A diffusion engine's prefill, canvas encodes, time per step and tokens/s after the prefill (see FIGURES)."""
    prefill_s, prefill_end = calls.prefill()
    after = end - prefill_end
    canvases = calls.canvas_seconds()
    return {"prefill_ms": prefill_s * 1e3, "canvas_encode_ms": canvases * 1e3,
            "ms_per_step": (after - canvases) * 1e3 / decoder_passes, "tok_s_without_prefill": new_tokens / after}


_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::baddbmm")


def _gemm_ms_per_step(lm: LM, prompt: torch.Tensor, passes: int = 4, rounds: int = 1) -> float:
    """Time inside matrix multiplications per decoder pass with self-conditioning (CPU profiler, own time), the
    least of `rounds` profiles (a shared machine's slow spell doubled a single one): the floor that overhead
    work cannot lower at this precision. Encoder passes (prefill, committed canvases) are left out, as they are
    from the reference's ms_per_step that speedup_bound divides by it."""
    from torch.profiler import ProfilerActivity

    cache = lm.new_cache(prompt.shape[0], prompt.shape[1] + lm.config.canvas_length)
    canvas = torch.randint(3, lm.config.text.vocab_size, (prompt.shape[0], lm.config.canvas_length),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lm.model.encode(prompt, cache)
        probs = torch.softmax(lm.model.denoise(canvas, cache), dim=-1).to(lm.dtype)
        best = float("inf")
        for _ in range(rounds):
            with quiet_profile([ProfilerActivity.CPU]) as prof:
                for _ in range(passes):
                    lm.model.denoise(canvas, cache, self_conditioning_probs=probs)
            best = min(best, sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in _GEMMS))
    return best / 1e3 / passes


def _ar(lm: LM, prompt: torch.Tensor, s: BenchSettings, memory: bool = False) -> dict[str, Any]:
    calls = EncoderCalls(lm.device, first_only=True)
    with _encoder_timed(lm.model, calls):
        run = _timed(lambda: lm.generate_ar(prompt, max_new_tokens=s.new_tokens), lm.device, memory)
    o = run.out
    n = int(o.num_new_tokens.sum())
    passes = int(o.forward_passes.max())
    prefill_s, prefill_end = calls.prefill()
    after = run.end - prefill_end
    # The prefill's logits give each row its first token: the passes after it are one fewer than the tokens.
    steps = passes - 1
    return {"seconds": run.seconds, "new_tokens": n, "forward_passes": passes, "tokens_per_forward": 1.0,
            "tok_s": n / run.seconds, "prefill_ms": prefill_s * 1e3,
            "ms_per_step": after * 1e3 / steps if steps else None,
            "tok_s_without_prefill": (n - prompt.shape[0]) / after if steps else None, **run.memory}


# The oldest transformers whose DiffusionGemma loads the folder lm.save writes: 5.15-5.19 cannot build a model whose
# config has no vision_config, and blockpress saves none for a text-only one
REFERENCE_SINCE = (5, 20)


def _reference(lm: LM) -> Any:
    """The reference model of lm's weights, or None where transformers is not installed, too old, or fails to build
    or run (said: the blockpress engines are still timed)."""
    try:
        import transformers
    except ImportError:  # (--help says "when installed")
        return None
    since = ".".join(map(str, REFERENCE_SINCE))
    try:
        from transformers import DiffusionGemmaForBlockDiffusion
        from transformers.utils import logging as hf_logging
    except ImportError:  # a transformers 4 (peft's loose requirements pull one in) is left out by name
        _note(f"the reference is left out: transformers {transformers.__version__} has no DiffusionGemma; it needs "
              f"{since} or later")
        return None
    version = tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    if version < REFERENCE_SINCE:  # (it would fail inside from_pretrained, and the whole run with it)
        _note(f"the reference is left out: transformers {transformers.__version__} cannot load the checkpoint "
              f"blockpress saves; it needs {since} or later")
        return None
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report lists the vision tower we do not save: noise in a benchmark
    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lm.save(tmp, dtype=lm.dtype)  # the very weights lm computes with (not the dtype a load widened from)
            # transformers declares PreTrainedModel.to as @wraps(nn.Module.to), which typeshed's functools.wraps
            # types as the unbound nn.Module.to (self first): the stub, not this call, is wrong
            model = _reference_or_note(lambda: _own_weights(DiffusionGemmaForBlockDiffusion.from_pretrained(
                tmp, dtype=lm.dtype).to(lm.device).eval()))  # type: ignore[arg-type]
            # A step of one token, as the timed runs call it: a failure only they would meet (python -W error
            # turning a torch DeprecationWarning inside it into an error) leaves the reference out here, not the run
            if model is not None and _reference_or_note(lambda: model.generate(
                    torch.ones(1, 2, dtype=torch.long, device=lm.device), max_new_tokens=1, max_denoising_steps=1)) is None:
                return None
            return model
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _own_weights(model: Any) -> Any:
    """`model` with its CPU weights copied out of the file they were loaded from: transformers loads them as views
    of the mapped safetensors file, and that file is in a temporary folder removed as _reference returns. Windows
    refuses to delete a mapped file: the folder's cleanup raised there, outside _reference_or_note, and the whole
    run ended at its first canvas. Each tensor is replaced, not its .data: a buffer loaded as a view (layer_scalar)
    keeps its base, and with it the whole mapping, through a .data swap. A weight tied to another is one tensor,
    copied once: the tie stays."""
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor.device.type != "cpu":
                    continue
                if id(tensor) not in copies:
                    copy = tensor.detach().clone()
                    copies[id(tensor)] = (nn.Parameter(copy, requires_grad=tensor.requires_grad)
                                          if isinstance(tensor, nn.Parameter) else copy)
                setattr(module, name, copies[id(tensor)])
    return model


def _reference_or_note(build: Callable[[], Any]) -> Any:
    """What `build` gives, or None with a note where the reference fails in it: any error of transformers' (python
    -OO strips the docstrings it reads; an unwritable compile cache) left the whole run with a traceback that never
    said it was the reference's, nor that --no-reference runs without it."""
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - the reference's own failure, whatever it is: blockpress is still timed
        first = (str(exc).splitlines() or [""])[0]
        _note(f"the reference is left out: transformers failed ({type(exc).__name__}: {first}); "
              "--no-reference leaves it out without trying")
        return None


@dataclass
class DecoderPasses:
    """The reference's decoder calls in one run, each one pass over every row of the batch."""

    count: int = 0

    def add(self) -> None:
        self.count += 1


@contextlib.contextmanager
def _reference_hooked(ref: Any, calls: EncoderCalls) -> Iterator[DecoderPasses]:
    """The reference's encoder module timed into `calls`, and its decoder's passes counted, by forward hooks while
    the block runs: it encodes the prompt, then each committed canvas, as blockpress does. The passes are counted,
    not inferred from its tokens_per_forward, which leaves pad tokens out (random weights make the pad id now and
    then: 33 passes were reported for the 32 run)."""
    encoder, passes = ref.model.encoder, DecoderPasses()
    hooks = (encoder.register_forward_pre_hook(lambda module, args: calls.before()),
             encoder.register_forward_hook(lambda module, args, output: calls.after()),
             ref.model.decoder.register_forward_hook(lambda module, args, output: passes.add()))
    try:
        yield passes
    finally:
        for hook in hooks:
            hook.remove()


def _reference_run(ref: Any, prompt: torch.Tensor, s: BenchSettings, device: torch.device,
                   memory: bool = False) -> dict[str, Any]:
    calls = EncoderCalls(device)
    with _reference_hooked(ref, calls) as counted:
        run = _timed(lambda: ref.generate(prompt.to(device), max_new_tokens=s.new_tokens, max_denoising_steps=s.steps,
                                          confidence_threshold=1e-30),  # never confident: fixed steps
                     device, memory)
    o, total = run.out, run.seconds
    # It denoises whole canvases, as blockpress does, and returns them whole: count the new tokens asked for, as
    # for blockpress (crediting a last canvas only partly used in full would flatter the reference).
    per_row = min(s.new_tokens, o.sequences.shape[1] - prompt.shape[1])
    n = per_row * prompt.shape[0]
    passes = counted.count or None  # over every canvas it denoised; none seen: a compiled reference bypassed the hook
    # the same figures as blockpress's, where its encoder was seen (a compiled reference could bypass the hooks)
    steps = diffusion_step_figures(n, passes, run.end, calls) if passes and calls.spans else {}
    return {"seconds": total, "new_tokens": n, "tokens_per_forward": per_row / passes if passes else None,
            "tok_s": n / total, "forward_passes": passes, **steps, **run.memory}


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp")  # matplotlib writes these without extras


def figure(result: dict[str, Any]) -> Any:
    """tok/s against batch size, diffusion vs AR (and the reference when measured): a matplotlib Figure, its
    ticks at the batch sizes measured and its legend beside the axes (with a variant or a canvas sweep there are
    8+ lines, and a legend inside covered them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    canvases = sorted({r["canvas"] for r in rows})
    lines = [("blockpress", "blockpress diffusion"), ("blockpress_ar", "blockpress AR")]
    variants = (("compiled", "compiled"), ("cuda_graphs", "CUDA graphs"), ("int8", "int8"), ("fp8", "fp8"),
                ("int4", "int4"))
    for name, label in variants:
        lines += [(f"blockpress_{name}", f"blockpress diffusion, {label}"), (f"blockpress_ar_{name}", f"blockpress AR, {label}")]
    for key, label in (*lines, ("reference", "reference diffusion")):
        is_ar = key.startswith("blockpress_ar")
        for canvas in canvases:
            mine = [r for r in rows if r["canvas"] == canvas and key in r]
            if not mine or (is_ar and canvas != canvases[0]):
                continue  # AR does not depend on the canvas: one line
            suffix = f", canvas {canvas}" if len(canvases) > 1 and not is_ar else ""
            ax.plot([r["batch"] for r in mine], [r[key]["tok_s"] for r in mine], marker="o", label=label + suffix)
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])  # the sizes measured, not powers of two
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("batch size")
    ax.set_ylabel("new tokens / s")
    s = result["settings"]
    threads = result.get("machine", {}).get("threads")
    where = (f"{s['device']}, {threads} thread{'s' if threads != 1 else ''}" if s["device"] == "cpu" and threads
             else s["device"])
    layers = f", {s['layers']} layers" if s.get("layers") else ""  # (a JSON of older versions holds no "layers")
    ax.set_title(f"{s['preset']}{layers} ({result['params'] / 1e6:.2g}M, {s['dtype']}), {s['new_tokens']} new tokens, "
                 f"{s['steps']} step{'s' if s['steps'] != 1 else ''} a canvas, {where}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize=8)
    return fig


def plot(result: dict[str, Any], path: str | Path) -> None:
    """`figure(result)` written to `path`, in the format its suffix names (PLOT_FORMATS; a ValueError for a path
    ending otherwise, or not at all). Written beside it first and then moved into place, so a run killed while it
    draws leaves the previous plot whole."""
    path = Path(path)
    # checked here too, not only by `blockpress bench --plot`: a path without a suffix failed in matplotlib with
    # "Format 'partial' is not supported", the staging name's own ending taken for the format
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in PLOT_FORMATS:
        raise ValueError(f"path: expected a file ending in one of {', '.join('.' + f for f in PLOT_FORMATS)}, "
                         f"got {str(path)!r}")
    import matplotlib.pyplot as plt

    fig = figure(result)
    # a name of this plot's own, as StagedFiles' are (files.new_tag); the format given, not read from that name
    tag = new_tag()
    drawn = path.with_name(f".{path.stem}.{tag}.partial{path.suffix}")
    try:
        remove_killed_writes(path.parent, path.stem, f".partial{path.suffix}")
        fig.savefig(drawn, format=fmt, dpi=120, bbox_inches="tight")  # "tight": the legend beside the axes is kept
        os.replace(drawn, path)
    finally:
        plt.close(fig)
        drawn.unlink(missing_ok=True)
        release_tag(tag)
