"""Block-diffusion training: the published objective, and a small trainer around it.

Objective (one optimizer step, per example):
  t ~ U(eps, 1 - eps); each canvas token is replaced by a uniform random token with probability t
  (the prompt never is); with `noise_token_id` set, by that one token instead (absorbing noise).
  Pass 1 denoises every canvas without gradients; pass 2 denoises them again, fed pass-1 logits as
  self-conditioning for a random half of the examples (a zero signal for the rest). Loss: flat
  cross-entropy over every valid canvas token of pass 2 (optionally weighted 1/(1 - t)), plus
  `aux_ar_weight` x next-token cross-entropy on the encoder. All canvases of a sequence
  run in one forward with a block-causal mask (`DiffusionGemma.denoise_blocks`).

Determinism: the batch and every random draw of step k come from a generator seeded by (seed, k), drawn
for the whole global batch and then sliced. So gradient accumulation, several processes (torchrun) and
resuming from a checkpoint all reproduce the losses of one uninterrupted single-process run.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import multiprocessing
import os
import pickle
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .checkpoint import (
    CheckpointError,
    MappedSafetensors,
    checkpoint_files,
    cpu_computes_natively,
    hf_to_local,
    hub_name,
    read_config,
    reference_names,
    resolve_device,
    tied_source,
)
from .checks import is_finite_number, is_int, warn_user
from .config import ModelConfig
from .data import (
    TRAIN_CONFIG_FILE,
    TRAINER_STATE_FILE,
    Batch,
    Example,
    TokenShards,
    check_fits,
    is_examples,
    load_corpus,
    load_jsonl,
    make_batch,
    split_digests,
    split_heldout,
)
from .files import (
    StagedFiles,
    expand_user,
    output_folder,
    parse_json,
    read_json_object,
    same_place,
    staging,
    tag_of,
    temporary_path,
    text_of_file,
)
from .healing import heal
from .lm import LM, MODELS_DIR, resolve_path
from .model import DiffusionGemma, lora_wrapped_layer
from .quantize import QuantizedLinear, check_scheme, quantization_of
from .stopping import STOP_SIGNALS, Stopped, leave_hung_up_terminal, terminal_fds
from .train_config import LORA_MODULES, LORA_TARGETS, TrainConfig, lora_modules

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer  # (peft is the train extra's: imported where it is used)

# A full fine-tune's weights record, in their safetensors headers, the step they were saved at: --resume refuses
# them with a trainer_state.pt of another step (a save killed between the two files' moves, that
# finish_interrupted_save could not complete).
WEIGHTS_STEP_KEY = "blockpress_train_step"
# trainer_state.pt's record of the save it ends (StagedFiles.record): --resume finishes one killed while its files
# were moved into place (finish_interrupted_save).
COMMIT_KEY = "commit"

def check_resumable(out: str | Path) -> Path:
    """The trainer_state.pt of the run in `out` that --resume continues; a clear error where there is none, or where
    it is cut short (callers check before minutes of data preparation; the zip's directory, at its end, is all that
    is read). A save killed while its files were moved into place is finished first (finish_interrupted_save)."""
    if dist.is_initialized():  # one process moves the files; the others wait for them
        if dist.get_rank() == 0:
            finish_interrupted_save(out)
        dist.barrier()
    else:
        finish_interrupted_save(out)
    state = Path(out) / TRAINER_STATE_FILE
    if not state.is_file():
        raise FileNotFoundError(f"--resume: {out} has no {TRAINER_STATE_FILE} to continue from")
    try:
        zipfile.ZipFile(state).close()  # torch.save writes a zip archive
    except (zipfile.BadZipFile, OSError) as exc:
        raise _unreadable_state(state, exc) from None
    return state


def finish_interrupted_save(out: str | Path) -> None:
    """Complete the save of the run in `out` that was killed while its files were moved into place (some moved,
    the weights say at which step; trainer_state.pt, moved last, still the one before, or none yet): its new state
    is whole beside them under its temporary name, with the record of its save. Refused, --resume would drop the run
    although every file of it is there."""
    out = Path(out)
    # its name holds its save's tag (files.new_tag), which names the save's other staged files too; None: the fixed
    # name of saves made before tags
    tags = {tag_of(path.name, ".tmp") for path in out.glob(f".{TRAINER_STATE_FILE}.*.tmp")} - {None}
    found = []  # (step, record, tag) of each whole one with its record; several where several saves were killed
    for tag in [None, *tags]:
        pending = temporary_path(out / TRAINER_STATE_FILE, tag)
        if pending.is_file():  # (the usual case: none to read)
            staged = _state_step(pending)
            if staged is not None and staged[1] is not None:  # (else cut short while written, so its save moved no
                found.append((staged[0], staged[1], tag))  # file, or from before saves kept their record)
    if not found:
        return
    step, record, tag = max(found, key=lambda item: item[0])  # the latest save's
    current = _state_step(out / TRAINER_STATE_FILE)
    if current is not None and current[0] >= step:
        return  # older than the state in place: nothing of it is to be moved
    moved = StagedFiles.finish(out, record, tag)
    print(f"--resume: the save of step {step} in {out} was stopped while its files were moved into place; "
          f"all of them were written, and the {moved} left are moved now", file=sys.stderr)


def _state_step(path: Path) -> tuple[int, list[tuple[str, bool]] | None] | None:
    """The step of the trainer state at `path` and the record of its save (None: saved before records were kept);
    None where there is no state there, or it cannot be read. Its tensors are mapped, not read: only the two
    entries are kept."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - missing, or damaged: a damaged file fails with any of several types
        return None
    if not (isinstance(state, dict) and is_int(state.get("step"))):
        return None
    record = state.get(COMMIT_KEY)
    return state["step"], record if isinstance(record, list) else None


def _unreadable_state(path: Path, exc: BaseException) -> ValueError:
    named = re.search(r"GLOBAL ([\w.]+)", str(exc)) if isinstance(exc, pickle.UnpicklingError) else None
    if named:
        # Read with weights_only: a state holds tensors and plain values only, so a pickle naming a global (a class,
        # a function to call) is not one of ours, and unpickling it could run arbitrary code (torch's own message
        # suggests weights_only=False). A damaged file fails otherwise ("Unsupported operand", a zip error, EOF).
        return ValueError(f"--resume: {path} holds Python objects other than tensors and plain values "
                          f"({named.group(1)}), which a blockpress trainer state never does; it is not unpickled "
                          "(that can run arbitrary code). Resume only from a run blockpress saved, or start a new run "
                          "from the weights beside it")
    why = (str(exc).strip().splitlines() or [""])[0]
    return ValueError(f"--resume: {path} cannot be read ({type(exc).__name__}: {why}); the run's state is damaged "
                      "(a save cut short by a blockpress that wrote it in place, or a damaged disk), so the run cannot "
                      "continue. Weights saved beside it still load: --model with them starts a new run")


def read_trainer_state(path: str | Path, map_location: str | None = None) -> dict[str, Any]:
    """A run's trainer_state.pt, or a clear error naming it where it cannot be read (torch's own is a 15-line
    traceback: PytorchStreamReader, EOFError, UnpicklingError, ... by where the file was cut)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file fails with any of several types
        raise _unreadable_state(path, exc) from None
    if not (isinstance(state, dict) and {"step", "optimizer"} <= state.keys()):
        raise ValueError(f"--resume: {path} is not a blockpress trainer state (expected step and optimizer entries)")
    return state


# -- data sources -------------------------------------------------------------------------------------------
def derived_seed(seed: int, multiplier: int, offset: int) -> int:
    """The seed of one stream of a run's draws (an epoch's order, a step's batch or noise): seed * multiplier +
    offset, taken modulo 2**63 so that any seed in [0, 2**63) gives a Generator seed (unreduced, a seed past about
    9.2e12 overflows int64: 'Overflow when unpacking long long'). Where it fits, as for every small seed, it is the
    plain product, so a run draws as it always did."""
    return (seed * multiplier + offset) % 2**63


class ExampleSource:
    """A fixed list of examples, shuffled per epoch by the seed: the batch of step k is a function of k."""

    def __init__(self, examples: Sequence[Example], seed: int):
        if not examples:
            raise ValueError("ExampleSource: no examples")
        self.examples, self.seed = list(examples), seed
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)  # the last epoch's permutation

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of the examples in `epoch`, a function of (seed, epoch); kept while batches stay in that
        epoch (drawn per example, it would cost seconds a batch at a million examples)."""
        if epoch != self._epoch:
            n = len(self.examples)
            g = torch.Generator().manual_seed(derived_seed(self.seed, 7919, epoch))
            self._order = torch.randperm(n, generator=g)
            self._epoch = epoch
        return self._order

    def batch(self, step: int, size: int) -> list[Example]:
        return self.take(step * size, size)

    def take(self, start: int, size: int) -> list[Example]:
        """`size` examples of the run's stream (every epoch's permutation, one after the other) from its `start`th: a
        run that changes its batch size on --resume reads on from the examples it has consumed (StepBatches)."""
        out = []
        for i in range(start, start + size):
            epoch, j = divmod(i, len(self.examples))
            out.append(self.examples[int(self.order(epoch)[j])])
        return out


def window_canvases(cfg: TrainConfig) -> int:
    """A running-text window's canvases: response_canvases, at most max_canvases (a longer window would be drawn, then
    cut by make_batch: the start-up line's coverage would count the cut part, and text long enough for the kept part
    would be refused)."""
    return min(cfg.response_canvases, cfg.max_canvases or cfg.response_canvases)


def window_fits(cfg: TrainConfig, room: int, canvas_length: int) -> list[str]:
    """The settings that would make running-text windows fit `room` tokens, for a message: a smaller prompt_max
    (when prompt_min allows it) or fewer response_canvases."""
    prompt_room = room - window_canvases(cfg) * canvas_length
    canvas_room = (room - cfg.prompt_max) // canvas_length
    return ([f"prompt_max {prompt_room}"] if prompt_room >= cfg.prompt_min else []) + \
        ([f"response_canvases {canvas_room}"] if canvas_room >= 1 else [])


class ShardSource:
    """Windows of running text from token shards: a random-length prompt and whole canvases of response. `bos`: the
    token put before each window's prompt, the tokenizer's BOS, as generation puts it before every text prompt
    (Tokenizer.encode_prompt): trained on bare windows, a model would meet BOS first at inference, and even one that
    has learned its corpus well can garble it after a BOS it has never seen. None: the bare window (a model
    without a tokenizer is prompted with ids as given)."""

    def __init__(self, shards: TokenShards, cfg: TrainConfig, canvas_length: int, bos: int | None = None):
        self.shards, self.cfg, self.c, self.bos = shards, cfg, canvas_length, bos

    @property
    def canvases(self) -> int:
        return window_canvases(self.cfg)

    @property
    def positions(self) -> int:
        """The most positions a window takes in a batch: its BOS, the longest prompt, then its canvases."""
        return (self.bos is not None) + self.cfg.prompt_max + self.canvases * self.c

    def check_length(self, where: str) -> None:
        """Refuse text shorter than the longest window up front: else the run dies at the first draw of a prompt too
        long for it, mid-run and with nothing saved. `where`: the text, as the message names it ("--data FILE")."""
        cfg, c, canvases = self.cfg, self.c, self.canvases
        need = cfg.prompt_max + canvases * c  # a window never crosses from one file into the next
        longest = int(self.shards.sizes.max())
        if longest >= need:
            return
        fits = window_fits(cfg, longest, c)
        holds = f"its longest file holds {longest}" if len(self.shards.arrays) > 1 else f"holds {longest}"
        raise ValueError(f"prompt_max/response_canvases: {where} {holds} tokens, fewer than the longest window of "
                         f"running text, {need} (a prompt of up to {cfg.prompt_max} tokens, then "
                         f"{canvases} canvas{'es' if canvases > 1 else ''} of {c}); "
                         + (f"{' or '.join(fits)} fits it" if fits else "give more text"))

    def batch(self, step: int, size: int) -> list[Example]:
        g = torch.Generator().manual_seed(derived_seed(self.cfg.seed, 1_000_003, step))
        examples = [self.shards.sample(g, (self.cfg.prompt_min, self.cfg.prompt_max),
                                       self.canvases * self.c) for _ in range(size)]
        if self.bos is not None:
            for e in examples:
                if e.prompt[:1] != [self.bos]:  # not twice, as encode_prompt: shards may hold BOS themselves
                    e.prompt = [self.bos, *e.prompt]
        return examples


# -- the objective --------------------------------------------------------------------------------------------
@dataclass
class Noise:
    """Every random choice of one step for the global batch (sliced by rows like the batch)."""

    t: torch.Tensor  # [B]
    corrupt: torch.Tensor  # [B, N*C] bool
    tokens: torch.Tensor  # [B, N*C] replacement tokens
    self_condition: torch.Tensor  # [B] bool

    def rows(self, index: slice) -> Noise:
        return Noise(self.t[index], self.corrupt[index], self.tokens[index], self.self_condition[index])

    def to(self, device: torch.device | str) -> Noise:
        return Noise(self.t.to(device), self.corrupt.to(device), self.tokens.to(device), self.self_condition.to(device))


def draw_noise(batch: Batch, vocab_size: int, cfg: TrainConfig, generator: torch.Generator) -> Noise:
    b, n = batch.canvas_ids.shape
    # float32 whatever the process's torch.set_default_dtype: a float64 default drew other noise (a resumed run is
    # exact only where the draws are the same), a bfloat16 one rounded the noise levels
    t = cfg.t_eps + (1 - 2 * cfg.t_eps) * torch.rand(b, generator=generator, dtype=torch.float32)
    corrupt = torch.rand(b, n, generator=generator, dtype=torch.float32) < t[:, None]
    tokens = torch.randint(0, vocab_size, (b, n), generator=generator)
    if cfg.noise_token_id >= 0:  # drawn anyway, so the other draws stay the same whichever noise is used
        tokens = torch.full_like(tokens, cfg.noise_token_id)
    sc = torch.rand(b, generator=generator, dtype=torch.float32) < cfg.self_conditioning_prob
    return Noise(t, corrupt, tokens, sc)


class Objective(nn.Module):
    """The training forward as a module, so DDP can wrap it. Returns summed losses; the caller normalises."""

    def __init__(self, model: DiffusionGemma, cfg: TrainConfig):
        super().__init__()
        self.model = model
        self.cfg = cfg

    def forward(self, batch: Batch, noise: Noise) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        noisy = torch.where(noise.corrupt & batch.scored, noise.tokens, batch.canvas_ids)
        hidden, kv, positions = m.encode_sequence(batch.ids, batch.valid)
        if not self.cfg.diffusion_weight:  # AR baseline: the decoder passes would be wasted work
            return hidden.new_zeros((), dtype=torch.float32), self._ar_sum(hidden, batch)
        with torch.no_grad():
            detached = [(k.detach(), v.detach()) for k, v in kv]
            first = m.denoise_blocks(noisy, detached, batch.valid, positions, batch.prompt_length)
        logits = m.denoise_blocks(noisy, kv, batch.valid, positions, batch.prompt_length,
                                  self_conditioning_logits=first, self_conditioning_mask=noise.self_condition)
        ce = F.cross_entropy(logits.flatten(0, 1), batch.canvas_ids.flatten(), reduction="none").view_as(noisy)
        weight = batch.scored.float()
        if self.cfg.reweight:
            weight = weight / (1 - noise.t)[:, None]
        diffusion_sum = (ce * weight).sum()
        ar_sum = self._ar_sum(hidden, batch) if self.cfg.aux_ar_weight else diffusion_sum.new_zeros(())
        return diffusion_sum, ar_sum

    def _ar_sum(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The encoder's next-token loss, summed over the scored positions. Unscored targets are ignored rather
        than selected out, so every shape is static and torch.compile keeps the step in one graph."""
        targets = batch.ids[:, 1:].masked_fill(~batch.ar_scored[:, :-1], -100)
        logits = self.model.head(hidden[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


def lr_at(cfg: TrainConfig, step: int, time_fraction: float = 0.0) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio over the steps, or over the wall-clock budget
    (`time_fraction` of it spent) when that ends first: a run cut short by max_minutes still anneals, its warmup
    included (the clock's cosine caps the ramp: a budget spent within --warmup-steps ended at the ramp's top)."""
    ramp = (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else 1.0
    # the last step (steps - 1) is at the floor, as the help says the schedule ends there (over steps - warmup it
    # would end above it)
    progress = max(max(0, step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps), time_fraction)
    floor = cfg.lr * cfg.min_lr_ratio
    return min(cfg.lr * ramp, floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# -- LoRA ----------------------------------------------------------------------------------------------------
_Model = TypeVar("_Model", bound=nn.Module)


def add_lora(model: _Model, rank: int, alpha: float, seed: int = 0, targets: Sequence[str] = LORA_TARGETS
             ) -> _Model:
    """LoRA adapters (peft) on `targets` (module names or their ends; default attention q/k/v/o and the dense MLP),
    in float32 whatever the base's dtype; everything else frozen. `seed` draws lora_A (peft draws it from torch's
    global generator, which nothing seeds: two runs of one command would differ from step 2 on); the caller's global
    generator is left as it was. A quantized base (QLoRA) keeps its quantized projections, wrapped as peft wraps an
    nn.Linear: the adapters' output is added to theirs, and the gradient reaches the adapters through them."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import Linear as LoraLinear

    if (adapted := lora_wrapped_layer(model)) is not None:  # (its layers are wrapped: peft would say "no q_proj layer")
        raise ValueError(f"add_lora: the model holds LoRA adapters already (layer {adapted!r}); merge them first "
                         "(merge_lora), then add others")
    check_lora_targets(model, targets)
    # (peft annotates lora_alpha as an int, but scales by lora_alpha / r and takes any number: the stub is too narrow)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)  # type: ignore[arg-type]
    # peft's dense LoRA layer only calls its base layer and reads in/out_features, which a QuantizedLinear has.
    cfg._register_custom_module({QuantizedLinear: LoraLinear})
    # peft makes the adapters on the CPU, then moves them to the base's device
    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Unsupported layer type .*QuantizedLinear")  # it is, by the above
        torch.default_generator.manual_seed(seed)
        # peft draws lora_A in torch's default dtype: under a caller's float64 or bfloat16 default the same seed drew
        # other adapters (0.3 apart); the default is put back as fork_rng puts back the generator
        torch.set_default_dtype(torch.float32)
        try:
            injected = inject_adapter_in_model(cfg, model)
        finally:
            torch.set_default_dtype(default)
    if injected is not model:  # peft adapts the model in place and returns it (as an nn.Module)
        raise RuntimeError("add_lora: peft returned another model than the one it adapted")
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
        if p.requires_grad:
            # peft creates them in the base layer's dtype: AdamW on bf16 adapters rounds small updates away. Its
            # forward casts the input to the adapters' dtype and the sum back to the base output's.
            p.data = p.data.float()
    return model


def lora_weights(module: LoraLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The A and B weights of a peft LoRA layer's adapter (add_lora's, named "default") over a linear layer."""
    a, b = module.lora_A["default"], module.lora_B["default"]
    if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)):
        raise TypeError(f"lora: expected the adapter's A and B to be linear layers, got {type(a).__name__}")
    return a.weight, b.weight


def check_lora_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Refuse a LoRA target (a module name or its end) that names no linear layer of `model` (peft's own error lists
    every target, found or not). The names are the same before and after quantization, so a Trainer checks them
    before it changes the model."""
    linear = [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, QuantizedLinear))]
    absent = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in linear)]
    if absent:
        raise ValueError(f"lora_targets: this model has no {absent[0]} layer to adapt (e.g. its values are its keys: "
                         "no v_proj)")


def check_lora_rank(model: nn.Module, rank: int, targets: Sequence[str] = LORA_TARGETS) -> None:
    """Refuse a LoRA rank above any adapted layer's full rank, min(in_features, out_features): B @ A of a larger rank
    is no more than a full-rank update there, and its adapters only cost memory (peft builds them without a check:
    a huge --lora-rank on a small hidden size would be killed for memory while the adapters are made, without a
    word).
    A rank above some layers' full rank and not others' is taken, as peft takes it."""
    sizes = {name: min(module.in_features, module.out_features) for name, module in model.named_modules()
             if isinstance(module, (nn.Linear, QuantizedLinear)) and any(name == t or name.endswith(f".{t}")
                                                                          for t in targets)}
    if not sizes:
        return  # (check_lora_targets names the target that is absent)
    name = max(sizes, key=sizes.__getitem__)
    if rank > sizes[name]:
        layer = model.get_submodule(name)
        raise ValueError(f"lora_rank: {rank} is more than any adapted layer can use: an update of rank min(in, out "
                         f"features) is already full-rank, and the largest among the adapted layers is {sizes[name]} "
                         f"({name}: "
                         f"{layer.in_features} -> {layer.out_features}); expected 1 to {sizes[name]}")


def merge_lora(model: _Model, dtype: torch.dtype = torch.float32) -> _Model:
    """Fold the adapters into the base weights and restore plain nn.Linear layers; the model comes back in
    `dtype`. The sum is taken in float32 whatever the base's dtype: folded into bf16 weights, the update is
    rounded to the weights' own step (blockpress-code after 10 LoRA steps: 34% of it lost on average), so a bf16
    base gives a float32 model unless `dtype` asks to round it. Refused over a quantized base: folded into its
    codes the update would be rounded to the quantization step (keep the adapters apart, or merge them into the
    unquantized base)."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and isinstance(quantized := module.get_base_layer(), QuantizedLinear):
            raise ValueError(f"merge_lora: the adapters sit on a quantized base ({name}: {quantized.scheme}); folded "
                             "into its codes the update would be rounded away. Keep them unmerged, or merge them into "
                             "the unquantized base (blockpress.load(base, adapter=...))")
    merged = False
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            base.weight.data = base.weight.data.float()  # exact; peft's merge then adds the update in float32
            module.merge()
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, name.rsplit(".", 1)[1], module.get_base_layer())
            merged = True
    if merged and isinstance(model, DiffusionGemma):
        # the weights' values changed in place: caches filled before are stale, and the LM must not take them for
        # the checkpoint's own any more (a save in the stored dtype, quantized_from naming the unmerged folder)
        model.weights_changed()
    model.to(dtype)  # layer scalars follow the weights; the RoPE frequencies stay float32 (DiffusionGemma._apply)
    for p in model.parameters():
        p.requires_grad = True
    # peft's record of the adapters goes with them: left, the next add_lora warned of "multiple adapters"
    if "peft_config" in vars(model):
        del model.peft_config
    return model


ADAPTER_DIR = "adapter"  # a finished LoRA run's adapters, unmerged, as a PEFT folder inside its --out
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# What blockpress records of the base beyond adapter_config.json's base_model_name_or_path (its name): its shape and
# the quantization the adapters were trained over. peft warns about keys its config does not know, so they live in a
# file of their own, as BLOCKPRESS_GENERATION_FILE's do beside generation_config.json.
ADAPTER_RECORD = "blockpress_adapter.json"
# The base's config fields that decide the adapted layers' shapes: another base that differs in one is refused by name.
# (per_layer_config, not global_head_dim: config.json stores the full layers' shapes only there)
BASE_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "per_layer_config", "layer_types", "num_experts",
                     "moe_intermediate_size", "attention_bias")
# Generation settings a run may change that an adapter records (ADAPTER_RECORD) and a load puts over its base's:
# token_healing false, where the run trained on prompts ending in whitespace (Trainer.prompts_healed), and the noise
# the run corrupted with (Trainer sets or drops noise_token_id; -1: uniform noise, as SamplerConfig spells it), which
# decoding must re-noise with: else a run with uniform noise on blockpress-code (absorbing token 5) decoded over its
# base with token 5, unlike its merged checkpoint.
ADAPTER_GENERATION_KEYS = ("token_healing", "noise_token_id")
_PEFT_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")  # peft's saved names, adapter name left out
# LoRA options that change what an adapter computes, at their plain values: an adapter setting another is refused.
_PLAIN_LORA = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
               "modules_to_save": None, "fan_in_fan_out": False, "lora_bias": False, "layer_replication": None}


def base_shape(model: DiffusionGemma | ModelConfig) -> dict[str, Any]:
    """The BASE_SHAPE_FIELDS of a model (or of its config)."""
    text = (model.config if isinstance(model, nn.Module) else model).text
    return {name: copy.deepcopy(getattr(text, name)) for name in BASE_SHAPE_FIELDS}


def shape_differences(recorded: dict[str, Any], model: DiffusionGemma, this: str = "this base") -> list[str]:
    """The fields of a recorded base_shape that `model` has otherwise, each as "name recorded (`this`: model's)"."""
    own = base_shape(model)
    return [f"{name} {value!r} ({this}: {own[name]!r})" for name, value in recorded.items()
            if name in own and own[name] != value]


def _lora_scale_given(rank: Any, alpha: Any) -> bool:
    """Whether an adapter's r and lora_alpha are what LoRA scales by (alpha / r): a positive integer and a positive
    finite number."""
    return is_int(rank) and rank > 0 and is_finite_number(alpha) and alpha > 0


def save_adapter(model: DiffusionGemma, path: str | Path, rank: int, alpha: float, base: str | None, *,
                 quantize: str | None = None, files: StagedFiles | None = None,
                 generation: dict[str, Any] | None = None) -> None:
    """`model`'s LoRA adapters (add_lora's) as a PEFT folder, its modules named as the reference model names them,
    so `peft.PeftModel.from_pretrained(DiffusionGemmaForBlockDiffusion, path)` runs them. The reference's encoder
    has modules of its own sharing the decoder's weights (blockpress runs both on one): each adapter is written for
    both (checkpoint.reference_names). The folder names `base` (None: not loaded from a folder), and ADAPTER_RECORD
    beside it the base's shape and `quantize`, the scheme the base was quantized with while they trained: the folder
    alone loads (blockpress.load(path)). The files are written under temporary names and moved into place
    together (files.StagedFiles); `files`: stage them there instead, for its owner to commit with the rest of a larger
    save (a training run's). `generation`: generation settings the run changed (ADAPTER_GENERATION_KEYS), recorded
    too, so the adapter over its base generates as the run's merged checkpoint does."""
    # as lm.save's: else "~/a" makes a folder named ~, and a NUL byte fails as Python's bare 'embedded null byte'
    path = output_folder(path, "save_adapter")
    if not _lora_scale_given(rank, alpha):  # (what apply_adapter refuses)
        raise ValueError(f"save_adapter: rank={rank!r}, alpha={alpha!r}; expected positive numbers (the adapters' r "
                         "and lora_alpha, as add_lora took them)")
    rank, alpha = int(rank), float(alpha)  # (numpy's: the config is JSON)
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import save_file

    tensors, targets = {}, []
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for reference in reference_names(f"{name}.weight"):
                target = reference.removesuffix(".weight")
                targets.append(target)
                for side, weight in zip("AB", lora_weights(module)):
                    # a copy each: safetensors refuses tensors that share memory
                    tensors[f"base_model.model.{target}.lora_{side}.weight"] = weight.detach().float().cpu().clone()
    if not tensors:  # (an adapter of no tensors, written over a run's real one, loads as its base alone)
        raise ValueError("save_adapter: the model holds no LoRA adapters to save (add_lora's; merge_lora folds them "
                         "into the weights)")
    held = next(t.shape[0] for name, t in tensors.items() if name.endswith("lora_A.weight"))
    if held != rank:  # (written, the folder would load nowhere: its r against its tensors' shapes)
        raise ValueError(f"save_adapter: rank={rank}, but the model's adapters are of rank {held}")
    # A base from the Hugging Face cache at another commit than main's (base_name: "owner/name@commit") is written as
    # peft writes one: the repo id, and the commit as `revision` (AutoPeftModel loads the base from both).
    revision = None
    if base is not None and "@" in base and not Path(base).is_absolute():
        base, _, revision = base.partition("@")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(targets), lora_dropout=0.0,  # type: ignore[arg-type]
                        base_model_name_or_path=base, revision=revision)  # (lora_alpha: see add_lora)
    with tempfile.TemporaryDirectory() as made:  # peft writes its config into a folder: its own, then staged
        config.save_pretrained(made)
        config_text = (Path(made) / ADAPTER_FILES[0]).read_text(encoding="utf-8")
    record: dict[str, Any] = {"base_shape": base_shape(model), "quantize": quantize}
    if generation is not None:
        record["noise_token_id"] = -1  # unless the run's settings name a noise token: uniform noise
    record.update({k: v for k, v in (generation or {}).items() if k in ADAPTER_GENERATION_KEYS})
    with staging(files) as staged:
        staged.make_folder(path)  # (one this save made is removed again if it fails)
        staged.write_text(path / ADAPTER_FILES[0], config_text)
        staged.write(path / ADAPTER_FILES[1], lambda file: save_file(tensors, str(file), metadata={"format": "pt"}))
        staged.write_text(path / ADAPTER_RECORD, json.dumps(record, indent=2) + "\n")


def is_adapter_folder(path: Path) -> bool:
    """A PEFT adapter folder rather than a checkpoint: adapter_config.json, no config.json."""
    return (path / ADAPTER_FILES[0]).is_file() and not (path / "config.json").is_file()


def _read_adapter_config(path: Path) -> dict[str, Any]:
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"adapter: {path} has no {' or '.join(missing)} (expected a PEFT LoRA folder, as "
                              f"`blockpress train --lora-rank` writes in <out>/{ADAPTER_DIR})")
    try:
        cfg = parse_json(text_of_file((path / ADAPTER_FILES[0]).read_bytes()))  # (a BOM read past)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"adapter: {path / ADAPTER_FILES[0]}: not valid JSON ({exc})") from None
    return cfg if isinstance(cfg, dict) else {}


def adapter_record(path: str | Path) -> dict[str, Any]:
    """What an adapter folder says of its base: {"base": its name or None (adapter_config.json's
    base_model_name_or_path), "base_shape": config fields or None, "quantize": scheme or None}, and the generation
    settings its run changed (ADAPTER_GENERATION_KEYS), where it records any. Folders written before ADAPTER_RECORD
    (and peft's own) record no shape or quantization."""
    path = Path(path)
    cfg = _read_adapter_config(path)
    base = cfg.get("base_model_name_or_path")
    if base is not None and not (isinstance(base, str) and base.strip()):
        raise CheckpointError(f"adapter: {path / ADAPTER_FILES[0]}: base_model_name_or_path: expected a model folder "
                              f"or name, got {base!r}")
    revision = cfg.get("revision")
    if base is not None and isinstance(revision, str) and revision and not Path(base).is_absolute():
        base = f"{base}@{revision}"  # a repo id at a revision: as blockpress.load names it
    record: dict[str, Any] = {"base": base, "base_shape": None, "quantize": None}
    file = path / ADAPTER_RECORD
    if not file.is_file():
        return record
    saved = read_json_object(file, CheckpointError, where="adapter: ")
    record.update({k: saved[k] for k in ("base_shape", "quantize", *ADAPTER_GENERATION_KEYS) if k in saved})
    if record.get("token_healing") is not None and not isinstance(record["token_healing"], bool):
        raise CheckpointError(f"adapter: {file}: token_healing: expected true or false, got {record['token_healing']!r}")
    noise = record.get("noise_token_id")
    if noise is not None and not (isinstance(noise, int) and not isinstance(noise, bool) and noise >= -1):
        raise CheckpointError(f"adapter: {file}: noise_token_id: expected -1 (uniform noise) or a token id >= 0, got "
                              f"{noise!r}")
    if record["base_shape"] is not None and not isinstance(record["base_shape"], dict):
        raise CheckpointError(f"adapter: {file}: base_shape: expected an object of config fields, got "
                              f"{record['base_shape']!r}")
    if record["quantize"] is not None:
        try:
            check_scheme(record["quantize"])
        except ValueError as exc:
            raise CheckpointError(f"adapter: {file}: {exc}") from None
    return record


def adapter_generation(path: str | Path) -> dict[str, Any]:
    """The generation settings the adapter folder's run changed (ADAPTER_GENERATION_KEYS), to put over its base's."""
    record = adapter_record(path)
    return {key: record[key] for key in ADAPTER_GENERATION_KEYS if record.get(key) is not None}


def check_adapter_pairing(path: str | Path, base: str | Path, quantize: str | None = None) -> None:
    """Refuse the adapters in `path` over the merged checkpoint of their own run (`--model OUT --adapter
    OUT/adapter`: OUT already holds them, so their update would count twice), and warn, naming both, where `base`
    (loaded with `quantize`) is another folder than the base they record (the shapes may fit, and the update then
    lands on weights it was not learned for). A folder saved quantized stands for the checkpoint it was quantized
    from in its scheme (quantization_config.quantized_from): QLoRA adapters trained over it load over that checkpoint
    quantized alike, and the other way round, without a word; quantized otherwise, the warning names both schemes."""
    path, base = Path(path), Path(base)
    if path.name == ADAPTER_DIR and path.resolve().parent == base.resolve() and (base / "config.json").is_file():
        raise CheckpointError(f"adapter {str(path)!r}: {str(base)!r} is the merged checkpoint of the run that trained "
                              f"it, which holds its update already (applied again it counts twice); give --model "
                              f"{shell_word(base)} alone, or the adapter folder alone (--model {shell_word(path)}: its "
                              "base with it)")
    record = adapter_record(path)
    recorded = record["base"]
    if recorded is None:
        return
    try:
        trained_on = resolve_path(recorded).resolve()
    except (FileNotFoundError, ValueError):
        trained_on = None
    if trained_on == base.resolve():  # its own base, quantized as asked (quantize="none" merges, as documented)
        return
    if trained_on is not None:
        (origin, scheme, stored), (here, here_scheme, here_stored) = (_weights_source(trained_on, record["quantize"]),
                                                                      _weights_source(base, quantize))
        if origin is not None and origin == here:
            if scheme == here_scheme:  # the same codes: what the adapters trained over
                return
            way = (f"load it with quantize={scheme!r} (--quantize {scheme}), or give" if not here_stored and scheme
                   else "give")
            warn_user(f"adapter {str(path)!r}: trained over {_described(recorded, origin, scheme, stored)}, and "
                      f"applied to {_described(base, here, here_scheme, here_stored)}, another quantization; its "
                      f"update is added to weights it was not learned on ({way} the adapter folder alone, --model "
                      f"{shell_word(path)}, to load it over its own base as it trained)")
            return
    warn_user(f"adapter {str(path)!r}: trained on {recorded!r}, and applied to {str(base)!r}, another model; its "
              "update is added to weights it was not learned on (give the adapter folder alone, --model "
              f"{shell_word(path)}, to load it over its own base)")


def _weights_source(folder: Path, quantize: str | None) -> tuple[Path | None, str | None, bool]:
    """(the checkpoint whose weights `folder` loaded with `quantize` computes with, the scheme they are quantized with,
    whether the folder is saved quantized): a folder saved quantized stands for the checkpoint named by its
    quantization_config.quantized_from (None where it names none: random weights, or a folder gone), in its own
    scheme; any other folder for itself, quantized as asked."""
    try:
        stored = read_json_object(folder / "config.json").get("quantization_config")
    except (OSError, ValueError):
        stored = None
    if not isinstance(stored, dict) or not isinstance(stored.get("scheme"), str):
        return folder.resolve(), quantize, False
    origin = stored.get("quantized_from")
    try:
        return (resolve_path(origin).resolve() if isinstance(origin, str) else None), stored["scheme"], True
    except (OSError, ValueError):  # (a hand-edited record: no folder, a name too long for one)
        return None, stored["scheme"], True


def _described(folder: str | Path, origin: Path, scheme: str | None, stored: bool) -> str:
    """A base as check_adapter_pairing's warning names it: the folder, and the weights it computes with."""
    if stored:
        return f"{str(folder)!r} (saved {scheme} from {str(origin)!r})"
    return f"{str(folder)!r} ({f'quantized {scheme}' if scheme else 'unquantized'})"


def shell_word(path: str | Path) -> str:
    """`path` as a flag's value in a command a message suggests: as a shell takes it (quoted where it holds a
    space or a quote), so it can be copied as it reads."""
    return shlex.quote(str(path))


def check_adapter_base(path: str | Path, model: DiffusionGemma) -> None:
    """Refuse, naming the fields, a base whose shape is not the one the adapters in `path` were trained on (as
    their ADAPTER_RECORD has it; folders without one are checked layer by layer in apply_adapter)."""
    record = adapter_record(path)
    if not record["base_shape"]:
        return
    differ = shape_differences(record["base_shape"], model)
    if differ:
        trained_on = f" ({record['base']})" if record["base"] else ""
        raise CheckpointError(f"adapter {str(path)!r}: trained on a base of another shape{trained_on}: {', '.join(differ)}; load it onto "
                              "the base it was trained on")


def _local_module(target: str) -> str | None:
    """blockpress's module for a reference module an adapter names (None: none): an encoder module's name maps to
    its decoder twin's (tied), as checkpoint loading does."""
    try:
        local = hf_to_local(f"{target}.weight") or hf_to_local(tied_source(f"{target}.weight"))
    except KeyError:
        return None
    return local.removesuffix(".weight") if local else None


def _targeted(cfg: dict[str, Any]) -> Callable[[str], bool]:
    """Whether peft applies the adapter of a (reference) module, by adapter_config.json's target_modules,
    exclude_modules, layers_to_transform and layers_pattern: peft adapts the modules they select and loads their
    weights alone, leaving the file's others out without a word. Its own matcher, so blockpress applies what it
    applies. No target_modules (or "all-linear"): every module the file holds."""
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists

    modules = cfg.get("target_modules")
    if modules is None or modules == "all-linear":
        return lambda target: True
    config = SimpleNamespace(target_modules=modules, exclude_modules=cfg.get("exclude_modules"), modules_to_save=None,
                             target_parameters=cfg.get("target_parameters"),
                             layers_to_transform=cfg.get("layers_to_transform"), layers_pattern=cfg.get("layers_pattern"))
    return lambda target: bool(check_target_module_exists(config, target))


def describe_adapter(path: str | Path) -> dict[str, Any]:
    """An adapter folder as `blockpress info` shows it, read from its config and its safetensors header (no tensor
    data): rank, alpha, the kinds of layer it adapts, its parameters as blockpress holds them (the reference's
    encoder and decoder twins share one adapter), and its record of the base."""
    path = Path(path)
    cfg = _read_adapter_config(path)
    stored = MappedSafetensors(path / ADAPTER_FILES[1])
    modules: dict[str, int] = {}  # blockpress's module -> its adapter's parameters
    targeted = _targeted(cfg)
    for key in stored.keys():
        match = _PEFT_KEY.fullmatch(key)
        if match is None or not targeted(match.group(1)):
            continue  # (not applied: see apply_adapter)
        module = _local_module(match.group(1))
        if module is not None and stored.shape(key) and f"{module}.{match.group(2)}" not in modules:
            modules[f"{module}.{match.group(2)}"] = math.prod(stored.shape(key))
    # "layers.3.self_attn.q_proj" -> "self_attn.q_proj": the kinds of layer adapted, not each one
    targets = sorted({re.sub(r"^.*?layers\.\d+\.", "", name.rsplit(".", 1)[0]) for name in modules})
    record = adapter_record(path)
    return {"path": str(path), "rank": cfg.get("r"), "alpha": cfg.get("lora_alpha"), "targets": targets,
            "parameters": sum(modules.values()), "base": record["base"], "trained_quantization": record["quantize"]}


# why apply_adapter refuses an encoder module adapted unlike (or without) its decoder twin
_TWINS_ALIKE = ("the reference's encoder and decoder share these weights and blockpress runs both on one module, so "
                "both must change alike")


def apply_adapter(model: DiffusionGemma, path: str | Path) -> DiffusionGemma:
    """Merge a PEFT LoRA folder into `model`: adapter_config.json and adapter_model.safetensors, the modules named
    as the reference model names them (save_adapter's, or peft's own on DiffusionGemmaForBlockDiffusion). The sum
    is taken in float32 (merge_lora) and the model keeps its dtype; over a quantized `model` the adapters stay
    unmerged, in float32 (as QLoRA trained them: folded into the codes they would be rounded away). Refused before
    any weight changes: another peft method or LoRA variant, a module that is not a linear layer of this base, shapes
    of another rank or base, an encoder module adapted unlike its decoder twin (blockpress runs both on one set of
    weights)."""
    path = Path(path)
    cfg = _read_adapter_config(path)
    check_adapter_base(path, model)
    base = cfg.get("base_model_name_or_path")

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"adapter {str(path)!r}: {why}" + (f" (it was trained on {base})" if base else ""))

    if cfg.get("peft_type") != "LORA":
        raise refuse(f"peft_type {cfg.get('peft_type')!r}; blockpress applies LoRA adapters only")
    variants = [key for key, plain in _PLAIN_LORA.items() if cfg.get(key) not in (plain, None, False, [], {})]
    if variants:
        raise refuse(", ".join(f"{key}={cfg[key]!r}" for key in variants) + ": blockpress applies plain LoRA only "
                     "(W + lora_alpha / r * B @ A)")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if rank is None or alpha is None or not _lora_scale_given(rank, alpha):  # (None: for the type checker too)
        raise refuse(f"r={rank!r}, lora_alpha={alpha!r} in {ADAPTER_FILES[0]}; expected positive numbers")
    linear = {name for name, module in model.named_modules() if isinstance(module, (nn.Linear, QuantizedLinear))}
    stored = MappedSafetensors(path / ADAPTER_FILES[1])
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # local module -> reference module -> A, B
    targeted, untargeted = _targeted(cfg), set()
    for key in stored.keys():
        match = _PEFT_KEY.fullmatch(key)
        if match is None:
            raise refuse(f"tensor {key!r} is not a LoRA weight (base_model.model.<module>.lora_A/lora_B.weight)")
        target, side = match.groups()
        module = _local_module(target)
        if module not in linear and "experts" in target.split("."):
            raise refuse(f"it adapts the routed experts ({target!r}: peft's target_parameters, one 3-D weight for all "
                         "experts), which blockpress does not support: it applies LoRA to linear layers only, "
                         f"attention's and the dense MLP's ({', '.join(LORA_MODULES)})")
        if module is None or module not in linear:
            raise refuse(f"it adapts {target!r}, which is not a linear layer of this base ({model.config.describe()})")
        if not targeted(target):  # as peft: adapter_config.json's target_modules choose (a folder edited by hand)
            untargeted.add(target)
            continue
        found.setdefault(module, {}).setdefault(target, {})[side] = stored.tensor(key)
    if untargeted:
        kept = f"applied to the {sum(map(len, found.values()))} it selects" if found else "none applied"
        warn_user(f"adapter {str(path)!r}: {ADAPTER_FILES[1]} holds the adapters of {len(untargeted)} module(s) that "
                  f"{ADAPTER_FILES[0]}'s target_modules does not select (e.g. {min(untargeted)!r}); they are left "
                  f"out, as peft leaves them out ({kept})")
    if not found:
        raise refuse("no LoRA weights in it" + (" that its target_modules selects" if untargeted else ""))
    for module, by_target in found.items():
        twins = [name.removesuffix(".weight") for name in reference_names(f"{module}.weight")]
        absent = [twin for twin in twins if twin not in by_target]
        if absent:
            raise refuse(f"it adapts {next(iter(by_target))!r} but not {absent[0]!r}: {_TWINS_ALIKE}")
        layer = model.get_submodule(module)
        for target, tensors in by_target.items():
            for side, shape in (("A", (rank, layer.in_features)), ("B", (layer.out_features, rank))):
                got = tuple(tensors[side].shape) if side in tensors else None
                if got != shape:
                    raise refuse(f"{target}.lora_{side}.weight: shape {list(got) if got else 'missing'}; r={rank} on "
                                 f"this base needs {list(shape)}")
        first = by_target[twins[0]]
        unlike = [target for target, tensors in by_target.items()
                  if not all(torch.equal(tensors[side], first[side]) for side in "AB")]
        if unlike:
            raise refuse(f"{unlike[0]!r} is adapted unlike {twins[0]!r}: {_TWINS_ALIKE}")
    dtype = model.dtype
    model = add_lora(model, rank, alpha, targets=sorted(found))
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module, by_target in found.items():
            layer, tensors = model.get_submodule(module), next(iter(by_target.values()))  # the twins are equal
            if not isinstance(layer, LoraLayer):
                raise RuntimeError(f"apply_adapter: {module} is no LoRA layer after add_lora")
            lora_a, lora_b = lora_weights(layer)
            lora_a.copy_(tensors["A"])
            lora_b.copy_(tensors["B"])
    if quantization_of(model) is not None:
        for p in model.parameters():
            p.requires_grad = False  # an inference model, as a merged one is
        return model
    return merge_lora(model, dtype)


def prompts_healed(lm: LM, source: Any) -> int:
    """How many of `source`'s prompts token healing would change: JSONL examples (not a chat template's rendering,
    whose end is the template's) whose last token is whitespace a longer token could have merged into (healing.heal).
    0 for running text, cut from text tokenized whole, and for a model without a tokenizer."""
    if not isinstance(source, ExampleSource) or lm.tokenizer is None:
        return 0
    return sum(1 for e in source.examples if not e.templated and heal(lm.tokenizer, e.prompt).prefix)


class StepBatches(torch.utils.data.Dataset):
    """The training batch of step k, as a dataset indexed by k: the examples of the source, padded into canvases,
    with every random draw of the step (seeded by the run's seed and k).

    `start` = (step s, examples n): the run had consumed n examples of an ExampleSource's stream when it reached step
    s (a run resumed there with another batch size: its part before ran at another), so step k reads on from example
    n + (k - s) x batch_size; (0, 0), every step at this batch size, is example k x batch_size."""

    def __init__(self, source: ExampleSource | ShardSource, cfg: TrainConfig, *, canvas_length: int, vocab_size: int,
                 pad: int, eos: int, start: tuple[int, int] = (0, 0)):
        self.source, self.cfg, self.canvas_length, self.vocab_size = source, cfg, canvas_length, vocab_size
        self.pad, self.eos, self.start = pad, eos, start

    def __len__(self) -> int:
        return self.cfg.steps

    def __getitem__(self, step: int) -> tuple[Batch, Noise]:
        size = self.cfg.batch_size
        if isinstance(self.source, ExampleSource):
            examples = self.source.take(self.start[1] + (step - self.start[0]) * size, size)
        else:  # running text: each step's windows are drawn afresh from its own seed, none of them a place in a stream
            examples = self.source.batch(step, size)
        batch = make_batch(examples, self.canvas_length, self.pad, self.eos, self.cfg.max_canvases or None)
        g = torch.Generator().manual_seed(derived_seed(self.cfg.seed, 1_000_033, step * 2 + 1))
        return batch, draw_noise(batch, self.vocab_size, self.cfg, g)


def check_data_workers(workers: int, name: str) -> None:
    """Refuse data workers where Python has no fork start method (Windows: spawn alone). The workers get the batch
    builder by fork; spawn would pickle it to each of them, the examples and the token shards whole (a
    memory-mapped shard copied into every worker). `name`: the setting as the caller knows it."""
    if workers and "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError(f"{name}: needs the fork start method, which Python lacks on this platform ({sys.platform}: "
                         f"{', '.join(multiprocessing.get_all_start_methods())}); use 0 (batches built in the "
                         "training loop)")


def _one_thread(_worker: int) -> None:
    torch.set_num_threads(1)  # batch building is light; the optimizer's process owns the cores
    # A stop signal sent to the whole process group (timeout, Slurm, docker stop, a closed terminal) reaches the
    # workers too: they leave it to the trainer, which saves the run, instead of dying under it mid-save.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


# -- the trainer ------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # per optimizer step (global mean)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_second: float = 0.0
    compile_error: str | None = None  # set when cfg.compile was on and the run fell back to eager
    stopped: str | None = None  # why the run ended before cfg.steps: "max_minutes" or "interrupted" (Ctrl-C)
    stop_signal: int | None = None  # an interrupted run's signal: SIGINT (Ctrl-C) or SIGTERM (timeout, Slurm, docker)


class Diverged(ValueError):
    """Training met a loss or gradient norm that is not finite (a learning rate too high, or bad data): the run
    stops there, and nothing non-finite is saved (unchecked, the loss goes NaN, and the run goes on to save NaN weights
    and exit 0). A ValueError, as the CLI's other refusals are: `train` exits 2 with its message."""


LOSS_KEYS = ("loss", "diffusion_loss", "ar_loss")


def _interval_means(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The losses of a metrics row written after `rows` (its own step last): each the mean over those steps, with
    their count and the last step's own loss."""
    means = {key: sum(row[key] for row in rows) / len(rows) for key in LOSS_KEYS}
    return {**means, "step_loss": rows[-1]["loss"], "steps_averaged": len(rows)}


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The dtype a run's matmuls autocast to on `device` (None: they run in the weights' own). "auto" takes bfloat16
    where the hardware computes it natively, else float16 (with loss scaling, Trainer): a T4 or V100 has no bf16
    matmuls, and torch's bf16 check, which counts emulation, said yes there."""
    if not (cfg.autocast if device.type == "cuda" else cfg.cpu_autocast if device.type == "cpu" else False):
        return None
    if cfg.autocast_dtype == "auto":
        if device.type == "cpu":
            return torch.bfloat16
        with torch.cuda.device(device):  # torch's check reads the current GPU, which need not be the run's
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float16
    return getattr(torch, cfg.autocast_dtype)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    if _world()[1] > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def data_parallel(module: nn.Module, find_unused: bool = False) -> nn.Module:
    """`module` under DDP, its buffers not synced each step: they are constants (RoPE frequencies, layer scalars).
    torch 2.13 calls that forward_sync_buffers=False (its old name, broadcast_buffers, warns once a process on every
    run; the new one still syncs them once at the start, which constants do not mind); older torch knows only the
    old name. `find_unused`: some trained parameters get no gradient (the autoregressive baseline never runs the
    decoder's self-conditioning): DDP, which waits for every one, stopped the next step with "Expected to have
    finished reduction in the prior iteration"; told, it looks for them after each forward (they stay without a
    gradient, so AdamW leaves them as one process does)."""
    ddp = nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(ddp).parameters:
        return ddp(module, forward_sync_buffers=False, find_unused_parameters=find_unused)
    return ddp(module, broadcast_buffers=False, find_unused_parameters=find_unused)


def _source_size(source: Any) -> str | None:
    """How much data a source holds, which resume compares: a source is anything with batch(step, size)
    (scripts/train_sudoku.py's draws augmented puzzles); one of ours also says its size."""
    return (f"{len(source.examples)} examples" if isinstance(source, ExampleSource)
            else f"{source.shards.tokens} tokens" if isinstance(source, ShardSource) else None)


def warn_heldout_none(cfg: TrainConfig, source: Any, heldout: Any, name: str = "heldout") -> None:
    """Say that the heldout fraction, split off a few examples, held none out: the run trains on, with no held-out
    loss. (Applied, not ignored: a larger fraction or more examples would hold some out.) `name`: the setting's, as
    the caller's user writes it (`blockpress train`: --heldout)."""
    if heldout is None and cfg.heldout and isinstance(source, ExampleSource):
        n = len(source.examples)
        warn_user(f"{name} {cfg.heldout}: holds out none of {n} example{'s' if n != 1 else ''} (each is held out by a "
                  "hash of its content), so this run has no held-out loss; a larger fraction or held-out data of its "
                  "own gives one")


def warn_unused_settings(cfg: TrainConfig, device: torch.device, source: Any, heldout: Any) -> None:
    """Say which settings this run cannot apply; each trained exactly as without it, and nothing said so. Warned, not
    refused: a run saved with one (by older code, or on another device) resumes, as does a float16 run resumed with
    --no-autocast."""
    unused = []
    if cfg.autocast_dtype != "auto" and autocast_dtype(cfg, device) is None:
        switch = {"cuda": "--autocast", "cpu": "--cpu-autocast"}.get(device.type)
        unused.append(f"autocast_dtype {cfg.autocast_dtype}: the dtype of a mixed precision this run on {device.type} "
                      "does not use" + (f" (without {switch})" if switch else ""))
    if heldout is None and cfg.eval_batches not in (0, cfg.default("eval_batches")):
        unused.append(f"eval_batches {cfg.eval_batches}: this run has no held-out data to evaluate")
    if not cfg.diffusion_weight:  # the autoregressive baseline's loss reads none of the diffusion objective's
        unused += [f"{name} {getattr(cfg, name)}: a setting of the diffusion loss, which diffusion_weight 0 turns off"
                   for name in ("reweight", "self_conditioning_prob", "t_eps") if getattr(cfg, name) != cfg.default(name)]
    for why in unused:
        warn_user(f"{why}; ignored")


def _settings_heldout(lm: LM, cfg: TrainConfig, source: Any, heldout: Any) -> tuple[Any, Any]:
    """(source, heldout) with the held-out data the settings name read where no `heldout` is given, as `blockpress
    train` reads it: heldout_data, JSONL examples (chat_turns alike) beside examples, running text or token shards
    beside running text; or the heldout fraction of the examples split off the ones trained on (split_heldout). A
    `heldout` given is the caller's reading of them (`blockpress train` gives its own)."""
    if heldout is not None or not (cfg.heldout or cfg.heldout_data):
        return source, heldout
    if cfg.heldout and cfg.heldout_data:
        raise ValueError("heldout/heldout_data: the held-out examples are a fraction of the training examples or "
                         "the examples of heldout_data; give one of them")
    if isinstance(source, ExampleSource):
        if cfg.heldout:
            train, held = split_heldout(source.examples, cfg.heldout)
            # (none held out of a few examples: nothing to evaluate, which warn_heldout_none says)
            return (ExampleSource(train, source.seed), ExampleSource(held, cfg.seed)) if held else (source, None)
        assert cfg.heldout_data is not None
        if not is_examples(cfg.heldout_data):
            raise ValueError(f"heldout_data {cfg.heldout_data}: not JSONL examples; with JSONL examples to train on, "
                             "held-out examples are a JSONL file of them (or the heldout fraction of the examples)")
        text = lm.config.text
        try:
            held = load_jsonl(cfg.heldout_data, lm.tokenizer, text.vocab_size, chat_turns=cfg.chat_turns,
                              context=(lm.config.canvas_length, text.max_position_embeddings, cfg.max_canvases or None))
        except (ValueError, OSError) as exc:  # their messages start with the path
            raise type(exc)(f"heldout_data {exc}") from None
        return source, ExampleSource(held, cfg.seed)
    if isinstance(source, ShardSource):
        if cfg.heldout:  # running text has no examples to split
            raise ValueError("heldout: a fraction of JSONL examples; with running text to train on, give the "
                             "held-out text or shards as heldout_data")
        assert cfg.heldout_data is not None
        corpus = load_corpus(cfg.heldout_data, "heldout_data", lm.tokenizer, lm.config.text.vocab_size)
        return source, ShardSource(corpus, cfg, lm.config.canvas_length, source.bos)
    # a source of its own (anything with batch(step, size)): which of its data is held out is its own to say
    name = "heldout" if cfg.heldout else "heldout_data"
    raise ValueError(f"{name}: read beside an ExampleSource's or ShardSource's data, and this run's source is a "
                     f"{type(source).__name__}; give its held-out data as Trainer(..., heldout=...)")


def _check_evaluation(cfg: TrainConfig, source: Any, heldout: Any) -> None:
    """The settings of the examples, and of the evaluation: held-out data and evaluating settings go together."""
    if isinstance(source, ExampleSource):
        cfg.check_examples()
    if heldout is not None and cfg.eval_batches < 1:  # it would average over no batches, after the whole run
        raise ValueError("eval_batches: expected a positive integer with held-out data, got 0")
    if heldout is None and cfg.eval_every:  # it would never evaluate, without a word
        raise ValueError(f"eval_every: evaluates the held-out data every {cfg.eval_every} steps, and this run has "
                         "none (with JSONL examples, a --heldout fraction that holds some out, or --heldout-data; "
                         "with running text, --heldout-data)")


def _check_trainable(lm: LM, cfg: TrainConfig, world: int) -> None:
    """The model can be trained as the settings say: its batch splits over the processes, and its weights are ones
    this run can update (not float16 ones, not quantized ones but under adapters, no adapters over adapters)."""
    if cfg.batch_size % world:
        raise ValueError(f"batch_size: {cfg.batch_size} is not divisible by the {world} processes")
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else lm.dtype  # the weights trained (_trained_model casts them)
    if dtype != lm.dtype and lm.quantization is not None:  # (its scales keep their own dtype: lm.to refuses a cast)
        raise ValueError(f"dtype: the model is quantized ({lm.quantization}) in {str(lm.dtype).removeprefix('torch.')}, "
                         f"and a quantized model's dtype cannot change; load it with dtype={cfg.dtype!r} (blockpress."
                         f"load(..., dtype={cfg.dtype!r}, quantize={lm.quantization!r})), or leave dtype out")
    if dtype == torch.float16 and not cfg.lora_rank:
        # AdamW's updates of float16 weights overflow or round away (a full fine-tune goes NaN at its first update,
        # which reads as a divergence to cure with a lower lr). Adapters over a float16 base train in float32,
        # their gradient brought through the base's float16 activations by loss scaling (below).
        raise ValueError("dtype: the model's weights are float16, which a full fine-tune cannot update (AdamW's "
                         "float16 steps overflow or round away); train float32 weights (dtype='float32' in the settings; "
                         "blockpress train: --dtype float32), whose matmuls can still run in "
                         "float16 with loss scaling (--autocast-dtype float16, the default on a GPU without "
                         "bfloat16), or bfloat16 ones, or LoRA adapters over the float16 base (--lora-rank R)")
    if lm.quantization is not None and lm.quantization != cfg.quantize:
        # its projections are frozen buffers: only adapters over them train (QLoRA), and the config records the
        # scheme so that --resume quantizes the base alike
        raise ValueError(f"train: the model is quantized ({lm.quantization}); train LoRA adapters over it with "
                         f"lora_rank > 0 and quantize={lm.quantization!r} (--lora-rank R --quantize "
                         f"{lm.quantization}), or the unquantized weights (load without quantize)")
    adapted = lora_wrapped_layer(lm.model)
    if adapted is not None:  # (peft would wrap its layers again, and the optimizer train both sets)
        over = f" over its quantized base ({lm.quantization})" if lm.quantization is not None else ""
        fold = ("fine-tune it unquantized, where they are merged into the base" if over else
                "fold them into the weights first (blockpress.train.merge_lora(lm.model)), as a LoRA run that was "
                "stopped before its final save did not")
        raise ValueError(f"train: the model holds LoRA adapters, unmerged{over} (layer {adapted!r}); {fold}, or "
                         "train new adapters over the base alone")
    if cfg.lora_rank and lm.adapter is not None:
        # The new adapters' folder could name no base: theirs is the base and these adapters together, and nothing
        # loads an adapter over another (the folder written would name base null, and load nowhere).
        raise ValueError(f"lora_rank: the model is the LoRA adapters in {lm.adapter} merged into their base; "
                         "new adapters over it would name no base that they can be loaded onto. Train them "
                         "over a checkpoint of the merged model: that LoRA run's --out holds one (unless it was "
                         f"QLoRA), or write one with blockpress.load({str(lm.adapter)!r}).save(FOLDER) and give "
                         "--model FOLDER")


def _check_data_fits(lm: LM, cfg: TrainConfig, source: Any, heldout: Any, data: str | None) -> None:
    """The data fits the model's context: each example, and each window of running text, which must also be
    shorter than the text it is cut from."""
    text = lm.config.text
    # Examples longer than the context would train positions the model never uses (load_jsonl refuses them for
    # the CLI; a list built in Python comes here unchecked).
    context = (lm.config.canvas_length, text.max_position_embeddings, cfg.max_canvases or None)
    for name, s in (("example", source), ("held-out example", heldout)):
        if isinstance(s, ExampleSource):
            for i, example in enumerate(s.examples):
                check_fits(example, f"{name} {i}", context, flag="max_canvases")
    # Running text is cut into windows of the settings' length: one past the context trains positions the model
    # is never allowed to use (JSONL examples that long are refused by load_jsonl).
    windows = [s for s in (source, heldout) if isinstance(s, ShardSource)]
    positions = max((s.positions for s in windows), default=0)
    if positions > text.max_position_embeddings:
        bos = any(s.bos is not None for s in windows)
        fits = window_fits(cfg, text.max_position_embeddings - bos, lm.config.canvas_length)
        raise ValueError(f"prompt_max/response_canvases: windows of running text take up to {positions} "
                         f"positions ({'BOS and ' if bos else ''}a prompt of up to {cfg.prompt_max} tokens, then "
                         f"{window_canvases(cfg)} canvases of {lm.config.canvas_length}), more than the model's "
                         f"context of {text.max_position_embeddings}"
                         + (f"; {' or '.join(fits)} fits" if fits else "; a model of a longer context is needed"))
    # Running text shorter than its longest window: refused now, not at the first step that draws one that long
    if isinstance(source, ShardSource):
        source.check_length(f"--data {data}" if data else "the training text")
    if isinstance(heldout, ShardSource):
        heldout.check_length(f"--heldout-data {cfg.heldout_data}" if cfg.heldout_data else "the held-out text")


def _set_noise(lm: LM, cfg: TrainConfig) -> None:
    """The run's noise token checked, and made the model's: the saved model must decode with the noise it was
    trained on (a model that decoded with another is warned of)."""
    text = lm.config.text
    if cfg.noise_token_id >= text.vocab_size:
        raise ValueError(f"noise_token_id: {cfg.noise_token_id} is outside the vocabulary (size {text.vocab_size})")
    trained_on = lm.generation_config.get("noise_token_id")
    if trained_on is not None and trained_on != cfg.noise_token_id:  # fine-tuning an absorbing-noise model
        warn_user(f"noise_token_id: the model decodes with noise_token_id {trained_on} and this run corrupts "
                  f"with {cfg.noise_token_id} ({'uniform noise' if cfg.noise_token_id < 0 else 'that token'}); "
                  "the saved model will decode with the run's. To continue the model's own recipe, set "
                  f"noise_token_id={trained_on}")
    if cfg.noise_token_id >= 0:
        lm.generation_config["noise_token_id"] = cfg.noise_token_id
    else:
        lm.generation_config.pop("noise_token_id", None)


def _trained_model(lm: LM, cfg: TrainConfig) -> DiffusionGemma:
    """The model, cast, quantized and given LoRA adapters as the settings say, its trained weights each in memory of its
    own (in train mode at each step alone: Trainer.train_step)."""
    if cfg.dtype is not None and lm.dtype != getattr(torch, cfg.dtype):  # (blockpress train loads it in that dtype)
        lm.to(dtype=cfg.dtype)  # before it is quantized: the base's dtype is the one it is quantized from
    if cfg.quantize is not None and lm.quantization is None:  # (blockpress train quantizes while loading)
        lm.quantize(cfg.quantize)
    model = lm.model
    if cfg.lora_rank:
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed, targets=lora_modules(cfg.lora_targets))
    # The weights training updates are its own, each in memory of its own: a checkpoint loads as zero-copy views
    # of its mmapped file, placed at offsets its header's length sets, and CPU kernels round differently on data
    # placed otherwise. A run resumed from its own folder (whose header records the step) would drift from the
    # run it continues, however its weights were copied back. (On a GPU, loading copies them already; a copy
    # there would leave CUDA graphs captured before, lm.cuda_graphs(), reading the old ones.)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.device.type == "cpu":
                p.data = p.data.clone()
    return model


def _warn_slow_autocast(dtype: torch.dtype | None, device: torch.device) -> None:
    """A warning where autocast to `dtype` on this CPU runs without native matmuls, many times slower."""
    if device.type == "cpu" and dtype is not None and not cpu_computes_natively(dtype):
        name = str(dtype).removeprefix("torch.")
        warn_user(f"cpu_autocast: this CPU has no native {name} matmuls (AVX512-BF16 / AVX512-FP16 / AMX), so "
                  f"{name} autocast runs a scalar fallback: training steps on an AVX2 EPYC measured 8x "
                  "(bfloat16) and 12x (float16) slower than float32")


def _pad_and_eos(lm: LM) -> tuple[int, int]:
    """The ids a batch pads with and ends an example with: the model's own EOS (a generation config may list
    end-of-turn ids before it)."""
    text = lm.config.text
    pad = text.pad_token_id if text.pad_token_id is not None else 0
    stops = lm._eos_ids()
    eos = [i for i in text.eos_token_ids if i in stops] or stops
    return pad, eos[0] if eos else pad


def _optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trained parameters in two groups, the matrices and the vectors (each group's weight decay and
    the betas: Trainer._set_optimizer_settings)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay}, {"params": rest}], lr=cfg.lr,
        fused=device.type == "cuda",  # one kernel for every parameter: a small model's step is launch-bound
    )


@contextlib.contextmanager
def _labelled(bar: Any, phase: str) -> Iterator[None]:
    """The training bar labelled "train (`phase`)" while the phase runs: a large model's save or evaluation takes
    minutes, during which the bar would stand still at its last step, as if the run had hung. None: no bar."""
    if bar is None:
        yield
        return
    bar.set_description(f"train ({phase})")
    try:
        yield
    finally:
        bar.set_description("train")


class Trainer:
    def __init__(
        self,
        lm: LM,
        source: ExampleSource | ShardSource,
        cfg: TrainConfig,
        out_dir: str | Path,
        heldout: ExampleSource | ShardSource | None = None,
        progress: bool = True,
        on_step: Callable[[int, float], None] | None = None,
        merged_dtype: torch.dtype | None = None,
        data: str | None = None,
        heldout_name: str = "heldout",
    ):
        """`cfg` is applied whole, as `blockpress train` applies it: its dtype casts `lm` (after every refusal), and
        where no `heldout` is given, its heldout_data is read, or its heldout fraction split off `source`'s examples
        (_settings_heldout). `merged_dtype`: LoRA, the dtype of the final checkpoint, the adapters merged in float32
        (see merge_lora); None: cfg.dtype's, else float32 (another than cfg.dtype is refused: the settings' dtype is
        the saved checkpoint's). `data`: where `source` was read from (`blockpress train`:
        --data), saved with the run with the source's size: `resume` warns when a run continues on other data. Where
        the heldout fraction splits the examples, the run records which it holds out (split_digests): `resume` warns
        when it holds out others. `heldout_name`: the heldout setting's name in the warning that its fraction held none
        out (`blockpress train`: --heldout)."""
        source, heldout = _settings_heldout(lm, cfg, source, heldout)
        if cfg.heldout_data:  # recorded with the run as --data is, whole: --resume from another folder reads it too
            cfg = replace(cfg, heldout_data=str(Path(cfg.heldout_data).resolve()))
        self.lm, self.source, self.cfg, self.heldout = lm, source, cfg, heldout
        if merged_dtype is not None and cfg.dtype is not None and merged_dtype != getattr(torch, cfg.dtype):
            raise ValueError(f"merged_dtype: {str(merged_dtype).removeprefix('torch.')} is not the run's dtype "
                             f"{cfg.dtype} (the settings' dtype is the saved checkpoint's); give one of them")
        self.merged_dtype = merged_dtype or (getattr(torch, cfg.dtype) if cfg.dtype else torch.float32)
        check_data_workers(cfg.data_workers, "data_workers")  # (torch's DataLoader refused it at the first step)
        self.data: dict[str, Any] = {"path": data, "size": _source_size(source)}
        if cfg.heldout and isinstance(source, ExampleSource) and (heldout is None or isinstance(heldout, ExampleSource)):
            # the split the run starts with, made by a hash of each example's tokens: other data, or another
            # blockpress's tokenization of the same data, changes it without a word (Trainer.resume checks it)
            self.data["heldout"] = split_digests(heldout.examples if heldout is not None else [])
        _check_evaluation(cfg, source, heldout)
        self.out = expand_user(out_dir, "out_dir")  # as load reads a model at ~/...
        self.progress, self.on_step = progress, on_step
        self.rank, self.world = _world()
        _check_trainable(lm, cfg, self.world)
        # Every refusal before anything changes the LM (its noise token, token_healing, dropout): a Trainer refused
        # for a LoRA rank must not leave the model decoding with another noise.
        if cfg.lora_rank:  # a rank far too large is a silent OOM where the adapters are built
            # (a target the model lacks was refused by add_lora, after the noise was set and the model quantized)
            check_lora_targets(lm.model, lora_modules(cfg.lora_targets))
            check_lora_rank(lm.model, cfg.lora_rank, lora_modules(cfg.lora_targets))
        _check_data_fits(lm, cfg, source, heldout, data)
        if self.rank == 0:  # (once a run, after its refusals: under torchrun each process would say it)
            warn_heldout_none(cfg, source, heldout, heldout_name)
            warn_unused_settings(cfg, lm.device, source, heldout)
        # config.json's attention_dropout, applied as the reference applies it, in train mode: a config of 0.1 must
        # not train without dropout, and without a word. A value outside [0, 1) is refused by name before anything
        # runs.
        self.attention_dropout = lm.config.attention_dropout
        for layer in lm.model.decoder_layers():
            layer.self_attn.dropout = self.attention_dropout
        _set_noise(lm, cfg)
        # A prompt/response record's prompt is tokenized alone, so a prompt that ends in whitespace ("A: ", "return ")
        # ends in a lone whitespace token, and the model learns to answer after it. Token healing (the CLI's
        # generate heals by default) drops that token and makes the answer start with it: a state the fine-tune
        # never saw, which garbles the answer's start. The saved model then says so in its generation settings
        # (token_healing false: the CLI's default follows it, its flags still win); else the model's own setting stays.
        self.prompts_healed = prompts_healed(lm, source)
        if self.prompts_healed:
            lm.generation_config["token_healing"] = False
        self.autocast_dtype = autocast_dtype(cfg, lm.device)
        _warn_slow_autocast(self.autocast_dtype, lm.device)
        self.pad, self.eos = _pad_and_eos(lm)
        model = self.model = _trained_model(lm, cfg)
        # What trains, and of how much (peft's print_trainable_parameters): a LoRA run's adapters are a small share.
        # The total is the base's parameters (a quantized base's codes counted as the weights they stand for) plus
        # the adapters.
        self.trainable_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total_parameters = lm.num_parameters(active=False) + (self.trainable_parameters if cfg.lora_rank else 0)
        objective: nn.Module = Objective(model, cfg)
        if self.world > 1:
            # diffusion_weight 0 returns before the decoder passes, whose own parameters (self-conditioning) then get
            # no gradient. They stay trained parameters rather than frozen: a run may resume with another
            # diffusion_weight, and the optimizer state must keep fitting it (and runs saved before).
            objective = data_parallel(objective, find_unused=not cfg.diffusion_weight)
        self.eager_objective: Callable[[Batch, Noise], tuple[torch.Tensor, torch.Tensor]] = objective
        self.objective: Callable[[Batch, Noise], tuple[torch.Tensor, torch.Tensor]] = objective
        if cfg.compile:
            # A small model's step is bound by per-op overhead, on a GPU as on a CPU: fused kernels pay.
            self.objective = torch.compile(self.objective)
        self.compile_error: str | None = None  # why compilation failed, when the run fell back to eager
        self.optimizer = _optimizer(model, cfg, lm.device)
        self._set_optimizer_settings()  # each group's weight decay and the betas
        # Dynamic loss scaling wherever the backward runs through float16 (float16 autocast, or adapters over a float16
        # base): the loss is multiplied up so that small gradients do not underflow to zero there, and a step whose
        # gradient overflowed is skipped while the scale comes down. Disabled, the scaler passes everything through.
        self.scaler = torch.amp.GradScaler(lm.device.type, enabled=self.autocast_dtype == torch.float16
                                           or lm.dtype == torch.float16)
        self.step = 0
        # (step, training examples consumed before it) where this part of the run starts: StepBatches reads on from
        # there (Trainer.resume sets it from the saved state: a resumed run may take another batch size)
        self.data_start = (0, 0)
        self.minutes = 0.0  # training time of the run so far, resumed parts included: max_minutes is the whole run's
        self.saved_step: int | None = None  # the step of the run's last save in `out` (None: none yet)
        # (step, steps) where a LoRA run's final save merged its adapters into lm.model (None: not merged): the
        # optimizer holds adapters the model no longer has, so a later save() or train() is refused (_check_not_merged)
        self.merged_at: tuple[int, int] | None = None
        self.merge_saved = False  # that save was made whole (else the merged model is in lm.model alone)
        self.staged_state: Path | None = None  # where the last save staged trainer_state.pt (None: no save yet)
        # Train mode is each step's alone (train_step): a Trainer made and never run (a refused resume, train() refused
        # under inference mode) must not leave the model dropping attention in every generation after.
        model.eval()

    def _set_optimizer_settings(self) -> None:
        """AdamW's betas and weight decay as the settings say, when it is built and over those a saved state brought
        back: decay on the matrices (the first group), none on the vectors (norm scales, layer scalars)."""
        for group, decay in zip(self.optimizer.param_groups, (self.cfg.weight_decay, 0.0), strict=True):
            group["weight_decay"], group["betas"] = decay, (self.cfg.beta1, self.cfg.beta2)

    # -- one step ------------------------------------------------------------------------------------------
    def _batches(self, source: ExampleSource | ShardSource) -> StepBatches:
        # the training data reads on from where the run's examples stand; held-out batches are fixed by their index
        start = self.data_start if source is self.source else (0, 0)
        return StepBatches(source, self.cfg, canvas_length=self.lm.config.canvas_length,
                           vocab_size=self.lm.config.text.vocab_size, pad=self.pad, eos=self.eos, start=start)

    @property
    def examples_seen(self) -> int:
        """The training examples the run has consumed: its batches so far, at the batch size of each part of it."""
        return self.data_start[1] + (self.step - self.data_start[0]) * self.cfg.batch_size

    def _batch(self, source: ExampleSource | ShardSource, step: int) -> tuple[Batch, Noise]:
        return self._batches(source)[step]

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast(self.lm.device.type, enabled=False)
        return torch.autocast(self.lm.device.type, dtype=self.autocast_dtype)

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """The model in eval mode (no attention dropout) inside, then in the mode it found: set to train mode
        whatever it found, a call after train() (which ends in eval mode) would leave every later generation
        dropping attention at random; left in train mode, an on_step callback that generates (a sample each step)
        would too."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def _dropout_draws(self, step: int) -> Any:
        """Attention dropout draws from torch's global generator: seeded here by (seed, step, process), so a resumed
        run drops what the run it continues would have dropped at that step (the rest of a step's randomness is seeded
        by its step already, StepBatches), and the caller's generator is left as it was. Without dropout nothing is
        drawn, and nothing is seeded."""
        if not self.attention_dropout:
            yield
            return
        device = self.lm.device
        seed = derived_seed(self.cfg.seed, 1_000_037, step * self.world + self.rank)
        # The generator the run's dropout draws from alone, forked and seeded: torch.manual_seed reseeds every
        # device's, so a run on the CPU (or on one GPU) left the caller's GPU (or other GPUs', MPS's) reseeded.
        accelerator = device.type not in ("cpu", "meta")
        with torch.random.fork_rng(devices=[device] if accelerator else [],
                                   device_type=device.type if accelerator else None):
            if not accelerator:
                torch.default_generator.manual_seed(seed)
            elif device.type == "cuda":
                with torch.cuda.device(device):  # (cuda's manual_seed seeds the current device's)
                    torch.cuda.manual_seed(seed)
            else:
                torch.get_device_module(device.type).manual_seed(seed)
            yield

    def _losses(self, batch: Batch, noise: Noise, train: bool) -> tuple[float, float, int]:
        """Forward (and backward when training) over this process' rows, in micro-batches."""
        per_rank = self.cfg.batch_size // self.world
        rows = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        mine, my_noise = batch.rows(rows), noise.rows(rows)
        # Normalise by global token counts so that accumulation and processes change nothing.
        n_diff = float(batch.scored.sum())
        n_ar = float(batch.ar_scored[:, :-1].sum())
        micro = self.cfg.micro_batch_size or per_rank
        device = self.lm.device
        # on the run's device: nccl all-reduces CUDA tensors alone (a CPU one raises "No backend type associated
        # with device type cpu"), and no micro-batch waits for the GPU to copy its sums back
        sums = torch.zeros(2, device=device, dtype=torch.float32)  # (not the process's default dtype)
        for lo in range(0, per_rank, micro):
            part = slice(lo, min(lo + micro, per_rank))
            b, nz = mine.rows(part).to(device), my_noise.rows(part).to(device)
            with self._autocast(), torch.set_grad_enabled(train):
                diff_sum, ar_sum = self.objective(b, nz)
                loss = (self.cfg.diffusion_weight * diff_sum / max(n_diff, 1)
                        + self.cfg.aux_ar_weight * ar_sum / max(n_ar, 1))
            if train:  # out of autocast, with grad on as in the forward (under a caller's no_grad the scaled loss
                with torch.enable_grad():  # has no grad: "element 0 of tensors does not require grad")
                    self.scaler.scale(loss * self.world).backward()  # DDP averages gradients over processes
            sums += torch.stack([diff_sum.detach().float(), ar_sum.detach().float()])
        sums = _all_sum(sums).cpu()
        return float(sums[0]) / max(n_diff, 1), float(sums[1]) / max(n_ar, 1), int(batch.valid.sum())

    def train_step(self, prepared: tuple[Batch, Noise] | None = None, time_fraction: float = 0.0) -> dict[str, Any]:
        """One optimizer step on the batch of `self.step` (`prepared`: that batch, built ahead by a worker), in train
        mode, the model in eval mode after it (see __init__)."""
        self._check_not_merged("train_step")
        self.model.train()
        try:
            return self._train_step(prepared, time_fraction)
        finally:
            self.model.eval()

    def _train_step(self, prepared: tuple[Batch, Noise] | None, time_fraction: float) -> dict[str, Any]:
        cfg = self.cfg
        batch, noise = prepared if prepared is not None else self._batch(self.source, self.step)
        lr = lr_at(cfg, self.step, time_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with self._dropout_draws(self.step):
                diff, ar, tokens = self._losses(batch, noise, train=True)
        except Exception as err:  # noqa: BLE001 - any compiler failure; eager errors are re-raised below
            if self.objective is self.eager_objective:
                raise
            # A compiler bug must not cost the run: say so once, then train the same step eagerly.
            self.compile_error = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            warn_user(f"compile: torch.compile failed ({self.compile_error}); training continues eagerly")
            self.objective = self.eager_objective
            self.optimizer.zero_grad(set_to_none=True)
            with self._dropout_draws(self.step):
                diff, ar, tokens = self._losses(batch, noise, train=True)
        loss = cfg.diffusion_weight * diff + cfg.aux_ar_weight * ar
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.scaler.unscale_(self.optimizer)  # the true gradient, for the clip and the norm (a no-op unscaled)
        if cfg.grad_clip:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        else:  # not clipped, but measured all the same: logged as it is, and a gradient
            # that is not finite is caught before the update (not a step later, on the NaN loss of NaN weights)
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        # Checked on the host floats the step makes anyway (no sync of its own), before the update: a non-finite
        # gradient would make every weight NaN. Every process holds the same all-reduced values, so all stop. Under
        # loss scaling a gradient that overflowed float16 is the scale's fault, not the run's: the step is skipped
        # and the scale halved, until even a scale below 1 overflows (float16 cannot hold the gradient itself).
        scaled = self.scaler.is_enabled()
        scale = self.scaler.get_scale() if scaled else 1.0
        overflow = scaled and math.isfinite(loss) and not math.isfinite(grad_norm)
        if overflow and scale < 1:
            raise Diverged(f"step {self.step + 1}: the gradient overflows float16 at a loss scale of {scale:g}, "
                           f"below 1: training in float16 cannot hold it, and the run stops here without saving "
                           f"({self._kept()}); train with --autocast-dtype bfloat16 or in "
                           f"float32 (--no-autocast), or with a lower --lr than {cfg.lr:g}")
        if not overflow and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
            raise Diverged(f"step {self.step + 1}: the {what}: training diverged, and the run stops here without "
                           f"saving ({self._kept()}); start again with a lower --lr than "
                           f"{cfg.lr:g}, or check the data")
        self.scaler.step(self.optimizer)  # optimizer.step(), unless the gradient overflowed
        self.scaler.update()
        self.lm.model.weights_changed()  # a cache filled before this step holds keys of the old weights
        self.step += 1
        row = {"step": self.step, "loss": loss, "diffusion_loss": diff, "ar_loss": ar,
               "lr": lr, "grad_norm": None if overflow else grad_norm, "tokens": tokens}  # (JSON has no inf)
        if scaled:  # the scale this step's backward ran at, and whether its update was skipped for an overflow
            row |= {"loss_scale": scale, "skipped": overflow}
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.heldout is None:
            raise ValueError("evaluate: no held-out data was given")
        total = 0.0
        with self._eval_mode():
            for i in range(self.cfg.eval_batches):
                batch, noise = self._batch(self.heldout, 1_000_000 + i)  # fixed held-out batches
                diff, ar, _ = self._losses(batch, noise, train=False)
                total += self.cfg.diffusion_weight * diff + self.cfg.aux_ar_weight * ar
        return total / self.cfg.eval_batches

    def _prefetch(self) -> Any:
        """Batches of steps self.step, self.step + 1, ... built by `data_workers` processes, a few steps ahead.
        Each is a pure function of its step, so the run is the same as with batches built in the loop."""
        steps = range(self.step, self.cfg.steps)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(self._batches(self.source), steps), batch_size=None, num_workers=self.cfg.data_workers,
            prefetch_factor=4, worker_init_fn=_one_thread, multiprocessing_context="fork", persistent_workers=False,
            # the loader draws its workers' base seed (unused: batches are seeded by step) from `generator`, by
            # default torch's global one: the caller's next torch.rand would depend on data_workers
            generator=torch.Generator())
        return iter(loader)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save(self, final: bool = False) -> None:
        """The run in `out_dir`, resumable while steps remain; a LoRA run's adapter folder each time. `final`: the run
        ends here, so a LoRA run also writes its merged checkpoint (an interrupted one only saves, to be resumed), and
        the Trainer is done: a later save() or train() is refused."""
        self._check_not_merged("save")
        if self.rank != 0:  # rank 0 writes the run's saves: the others say what `out` keeps as it does
            self.saved_step = self.step
            if final and self.cfg.lora_rank and self.cfg.quantize is None:  # (refused as rank 0, which merged)
                self.merged_at, self.merge_saved = (self.step, self.cfg.steps), True
            return
        # An update that overflowed (finite loss, weights grown to inf) is met by the next step's loss check; the last
        # step has none, so the weights are checked here (one sync, per save), never saved over the run's last save.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        if trained and not bool(torch.stack([torch.isfinite(p).all() for p in trained]).all()):
            raise Diverged(f"step {self.step}: the trained weights hold values that are not finite: training diverged, "
                           f"and they are not saved ({self._kept()}); start again with a "
                           f"lower --lr than {self.cfg.lr:g}, or check the data")
        self.out.mkdir(parents=True, exist_ok=True)
        state = {"step": self.step, "minutes": self.minutes, "optimizer": self.optimizer.state_dict(),
                 "scaler": self.scaler.state_dict(),  # the loss scale reached ({} unscaled)
                 "config": asdict(self.cfg), "base_shape": base_shape(self.model),  # (--resume checks the model's)
                 "data": self.data, "examples_seen": self.examples_seen}
        # Every file is staged under a temporary name in one StagedFiles (the weights, the tokenizer, the adapters:
        # lm.save and save_adapter stage into it), and all are moved into place together once all are written,
        # trainer_state.pt last: a save killed part-way leaves the previous save to resume (a file written in place
        # would be left truncated, and the run lost), and one killed while its files were moved leaves its own
        # whole state beside them, which --resume moves into place too (finish_interrupted_save).
        try:
            self._save_files(state, final)
        except OSError as exc:  # a full disk, a quota: what the folder holds now, since this save is not in it
            kept = (f"its files were being moved into place in {self.out}; --resume finishes the save"
                    if self.staged_state is not None and self.staged_state.is_file()  # (kept: files had moved)
                    else self._kept())
            failed = OSError(f"{exc}; step {self.step} is not saved ({kept})")
            failed.errno = exc.errno
            raise failed from None
        self.saved_step = self.step

    def _check_not_merged(self, what: str) -> None:
        """Refuse `what` after a LoRA run merged its adapters (its final save): a save() deleted the merged checkpoint
        and wrote an empty adapter over the run's, and a train() logged losses while it changed no weight."""
        if self.merged_at is None:
            return
        step, steps = self.merged_at
        if not self.merge_saved:  # (the save failed after the merge: the adapters are in lm.model alone)
            raise RuntimeError(f"Trainer.{what}: this LoRA run's final save merged its adapters into lm.model at step "
                               f"{step}, then failed, so {self.out} holds none of the merge: save the merged model "
                               f"with trainer.lm.save({str(self.out)!r})")
        # (a run its clock stopped kept its adapters in trainer_state.pt to be resumed; a finished one did not). This
        # lm.model holds them merged: a resume over it would add them a second time
        on = (f"resume it from {self.out} with a new Trainer over the base loaded again (blockpress train --resume)"
              if step < steps else
              f"fine-tune the merged checkpoint with a new Trainer (blockpress train --model {self.out})")
        raise RuntimeError(f"Trainer.{what}: this LoRA run has ended: its final save merged its adapters into "
                           f"lm.model at step {step}, in {self.out} (the adapters apart in {self.out / ADAPTER_DIR}); "
                           f"to train on, {on}")

    def _kept(self) -> str:
        """What `out` holds of the run where a save is not made (it failed, or training diverged): the last save,
        or no model, the metrics.jsonl of the steps logged alone (a folder that looks like a run's output)."""
        if self.saved_step is not None:
            return f"the run as saved at step {self.saved_step} is kept in {self.out}"
        return (f"{self.out} holds no model, only the metrics.jsonl of the steps logged; a new run with this --out "
                "replaces it")

    def _save_files(self, state: dict[str, Any], final: bool) -> None:
        """save's files, staged together and moved into place at once."""
        done = False  # a LoRA run whose adapters are merged: --resume takes nothing but the merged checkpoint
        with StagedFiles() as files:
            self.staged_state = temporary_path(self.out / TRAINER_STATE_FILE, files.tag)  # (its name is the save's)
            if self.cfg.lora_rank and self.step < self.cfg.steps:
                # LoRA, a run to be resumed (mid-run, interrupted, or stopped by its clock): the adapters live in
                # trainer_state.pt, beside the base they adapt (`--resume` takes it from lora_base.json; null: a base
                # not loaded from a folder, given again by the user)
                state["lora"] = {k: v.detach().clone() for k, v in self.model.state_dict().items() if "lora_" in k}
                files.write_text(self.out / LORA_BASE_FILE, json.dumps({"model": base_name(self.lm)}) + "\n")
            # Saved in the dtype trained or merged in (a float32 fine-tune of a bf16 model is a float32 checkpoint),
            # not the one a load widened from (lm.save's default)
            if self.cfg.lora_rank:
                # LoRA: the adapters apart (a PEFT folder) at every save, as a full fine-tune's weights are: they are
                # small, and a save mid-run then loads (--model OUT/adapter, or OUT) while the run goes on
                save_adapter(self.model, self.out / ADAPTER_DIR, self.cfg.lora_rank, self.cfg.lora_alpha,
                             base_name(self.lm), quantize=self.cfg.quantize, files=files,
                             generation=self.lm.generation_config)
            if not self.cfg.lora_rank:
                self.lm.save(self.out, metadata={WEIGHTS_STEP_KEY: str(self.step)}, dtype=self.lm.dtype, files=files)
            elif final and self.cfg.quantize is None:  # LoRA over an unquantized base, at the end: a plain
                # checkpoint with them merged in too (over a quantized one, merged into its codes they would be
                # rounded away)
                self.lm.model = merge_lora(self.model, self.merged_dtype)
                self.merged_at = (self.step, self.cfg.steps)  # (set at once: the save below may fail, the merge is done)
                self.lm.save(self.out, dtype=self.merged_dtype, files=files)
                done = "lora" not in state
            elif (self.out / "config.json").is_file():
                # A save mid-run after an earlier end (a run its clock stopped, resumed): that end's merged checkpoint
                # is behind the adapters now, and `--model OUT` would load it rather than its base with the adapters
                # so far
                for file in [self.out / "config.json", self.out / "model.safetensors.index.json",
                             *self.out.glob("model*.safetensors")]:
                    files.remove(file)
            # The settings again as JSON: `--resume` reads them without loading the optimizer state.
            files.write_text(self.out / TRAIN_CONFIG_FILE, json.dumps(asdict(self.cfg), indent=2) + "\n")
            # lora_base.json goes after trainer_state.pt: a kill between leaves a finished run, which --resume
            # refuses as such
            removed = [(LORA_BASE_FILE, False)] if done else []
            state[COMMIT_KEY] = [*files.record(self.out), (TRAINER_STATE_FILE, True), *removed]
            files.write(self.out / TRAINER_STATE_FILE, lambda file: torch.save(state, file))
            if done:
                files.remove(self.out / LORA_BASE_FILE)
        self.merge_saved = self.merged_at is not None  # (the files above are in place)

    def resume(self) -> None:
        """Continue from `out_dir`: weights from the checkpoint folder, optimizer state and step from trainer_state.pt."""
        from .checkpoint import load_model

        self._check_not_merged("resume")  # (the saved adapters would load into no layer, without a word)
        state = read_trainer_state(check_resumable(self.out))
        check_continues(self.out, state, self.cfg)
        if self.cfg.lora_rank and self.lm.path is not None:
            check_lora_resume_model(self.out, self.lm.path)
        # A model of another shape than the run's: refused by the fields that differ (torch's size mismatches run to
        # dozens of lines for adapters, a deep traceback for weights). The run's shape: as saved with it (runs saved
        # before it was: a full fine-tune's config.json; a LoRA run's adapters, refused by torch's first line below).
        recorded = state.get("base_shape") or (None if self.cfg.lora_rank else base_shape(read_config(self.out)))
        differ = shape_differences(recorded, self.model, "this model") if recorded else []
        if differ:
            raise self._other_model(", ".join(differ))
        if self.cfg.lora_rank:
            try:
                self.model.load_state_dict(state["lora"], strict=False)
            except RuntimeError as exc:  # adapters of another base: torch's size mismatches, 40 lines of them
                first = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), str(exc))
                raise self._other_model(first) from None
        else:
            self._check_weights_step(state["step"])
            loaded, _ = load_model(self.out, dtype=self.lm.dtype, device=self.lm.device)
            # by name: a run saved before base_shape held every field that adds weights (attention_bias) would pair
            # them off by position, copying one tensor into another of the same shape, or fail deep in torch
            own, saved = dict(self.model.named_parameters()), dict(loaded.named_parameters())
            odd = next((n for n in [*own, *saved] if n not in own or n not in saved
                        or own[n].shape != saved[n].shape), None)
            if odd is not None:
                held = lambda params: tuple(params[odd].shape) if odd in params else "none"  # noqa: E731
                raise self._other_model(f"{odd}: {held(saved)} saved, {held(own)} in this model")
            with torch.no_grad():
                for name, p in own.items():
                    p.copy_(saved[name])
                for mine, theirs in zip(self.model.buffers(), loaded.buffers(), strict=True):
                    mine.copy_(theirs)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except ValueError as exc:  # e.g. another LoRA rank: torch's "parameter group that doesn't match"
            raise ValueError(f"--resume: the saved optimizer state does not fit this run's trained weights (was it "
                             f"trained with another --lora-rank?): {exc}") from None
        # load_state_dict puts the saved groups' hyperparameters back too, which would drop a --weight-decay, --beta1
        # or --beta2 given to --resume (warned about as overriding the run's, and recorded with it) for the saved
        # ones. The moments are the run's; the settings are this one's (lr is set at every step).
        self._set_optimizer_settings()
        if self.scaler.is_enabled() and state.get("scaler"):  # else a fresh scale, as a run that starts scaling
            self.scaler.load_state_dict(state["scaler"])
        saved = state.get("data") or {}  # (runs saved before it was: nothing to compare)
        other = {k: (saved[k], self.data[k]) for k in ("path", "size") if saved.get(k) is not None
                 and self.data.get(k) is not None and saved[k] != self.data[k]}  # (the split: _check_split)
        if other:  # moved or grown data may be meant; the run goes on, but it is not the run it was
            was, now = (f"{d.get('path') or 'data'} ({d.get('size')})" for d in (saved, self.data))
            warn_user(f"--data: the run in {self.out} trained on {was}, and continues on {now}: the batches of "
                      "the steps to come are not those of the run it was (give its own data again to continue "
                      "it exactly)")
        self._check_split(saved)
        self.step = state["step"]
        # Where the data stands: the examples consumed, at the batch size of each part of the run (runs saved before
        # it was recorded consumed step x their batch size). A step's batch is the batch size's next examples of the
        # stream, so a run resumed with another --batch-size reads on from there: indexed by step, its batches
        # would start at step x the new size, over examples the run has seen (a smaller one) or past ones it never
        # saw (a larger one).
        was = (state.get("config") or {}).get("batch_size", self.cfg.batch_size)
        seen = state.get("examples_seen", self.step * was)
        if was != self.cfg.batch_size and not isinstance(self.source, (ExampleSource, ShardSource)):
            raise ValueError(f"--resume: the run in {self.out} ran at batch_size {was} and this one asks for "
                             f"{self.cfg.batch_size}; its data source ({type(self.source).__name__}) draws the batch of "
                             "step k by k alone, so another batch size would read examples the run saw, or skip some. "
                             f"Resume it with batch_size {was}")
        self.data_start = (self.step, seen)
        if self.step >= self.cfg.steps:
            raise ValueError(f"--resume: the run in {self.out} is already at step {self.step} of --steps "
                             f"{self.cfg.steps}; give a larger --steps to train on")
        # The clock goes on where it stopped, as the step does: a time-scheduled lr continues its decay (restarted,
        # it would jump back to the peak on weights already annealed). Runs saved before it was kept start from 0.
        self.minutes = state.get("minutes", 0.0)
        self.saved_step = self.step
        if self.cfg.max_minutes and self.minutes >= self.cfg.max_minutes:
            raise ValueError(f"--resume: the run in {self.out} has trained {self.minutes:.3g} minutes of --max-minutes "
                             f"{self.cfg.max_minutes}, the budget of the whole run; give a larger --max-minutes to "
                             "train on (or --max-minutes 0, without --time-schedule, for no limit)")
        self._forget_metrics_after(self.step)

    def _check_split(self, saved: dict[str, Any]) -> None:
        """Warn where this run holds out other examples than the run it resumes, by the digests it recorded of them
        (`saved`: its data record): the held-out loss would then score examples the run trained on, and it would train
        on ones it held out, without a word. Warned, not refused, as other --data is: the run goes on. A run saved
        before the split was recorded cannot be checked, and says so."""
        held = self.data.get("heldout")
        if held is None:  # this run splits off no fraction of its examples
            return
        recorded = saved.get("heldout")
        if not isinstance(recorded, list):
            warn_user(f"--resume: the run in {self.out} was saved by a blockpress that did not record which examples "
                      "it held out, so whether this resume holds out the same ones cannot be checked (another "
                      "blockpress may read its data into other tokens, and so hold out other examples)")
            return
        if recorded == held:
            return
        # (by content: the split hashes tokens, so the run's examples read into other tokens are other examples)
        kept = sum((Counter(recorded) & Counter(held)).values())
        gone, new = len(recorded) - kept, len(held) - kept
        warn_user(f"--resume: the run in {self.out} held out {len(recorded)} examples, and this resume holds out "
                  f"{len(held)}: {kept} of the run's are among them, so {gone} {'is' if gone == 1 else 'are'} no "
                  "longer held out (trained on from here on, where the data still holds them), and the held-out loss "
                  f"from here on includes {new} example{'' if new == 1 else 's'} the run did not hold out (trained "
                  "on, unless new to the data). Its data changed, or blockpress's reading of it into tokens did (an example is "
                  "held out by a hash of its tokens), and the steps to come draw other batches too; give the run's "
                  "own data to keep its split, or start a new run for a held-out loss of examples it never trained "
                  "on")

    def _other_model(self, why: str) -> ValueError:
        """--resume's refusal of a model that does not fit the run in `out`, `why` saying how."""
        if self.cfg.lora_rank:
            base = lora_base(self.out)
            trained_on = f"; they were trained on --model {base}" if base else ""
            return ValueError(f"--resume: the LoRA adapters in {self.out} do not fit this base model{trained_on} "
                              f"({why})")
        given = f" (--model {self.lm.path})" if self.lm.path is not None else ""
        return ValueError(f"--resume: the weights in {self.out} do not fit this model{given} ({why}); leave --model "
                          "out to continue the run from its own checkpoint")

    def _check_weights_step(self, step: int) -> None:
        """Refuse weights in `out` saved at another step than trainer_state.pt's: a save killed between their moves
        (weights from before WEIGHTS_STEP_KEY record none, and pass)."""
        saved = {file.name: MappedSafetensors(file).metadata.get(WEIGHTS_STEP_KEY) for file in checkpoint_files(self.out)}
        other = {name: at for name, at in saved.items() if at is not None and at != str(step)}
        if other:
            name, at = next(iter(other.items()))
            raise ValueError(f"--resume: the weights in {self.out} ({name}) were saved at step {at}, and "
                             f"{TRAINER_STATE_FILE} at step {step}: the run was stopped while it saved, and its "
                             "optimizer state does not belong to these weights. They still load: --model "
                             f"{self.out} starts a new run from them")

    def _forget_metrics_after(self, step: int) -> None:
        """Drop metrics.jsonl rows past the checkpoint being resumed: those steps run again and log again."""
        path = self.out / "metrics.jsonl"
        if self.rank != 0 or not path.is_file():
            return
        kept = [line for line, row in metrics_rows(path) if row.get("step", 0) <= step]
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    # -- the loop ----------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg = self.cfg
        self._check_not_merged("train")
        # (grad turned off by the caller is turned back on where the run needs it; inference mode cannot be)
        if torch.is_inference_mode_enabled():
            raise RuntimeError("Trainer.train: called under torch.inference_mode(), where no gradient can be "
                               "computed; call it outside that block")
        if any(p.is_inference() for p in self.lm.model.parameters() if p.requires_grad):
            raise RuntimeError("Trainer.train: the weights to train were made under torch.inference_mode() (a "
                               "Trainer made in that block makes its LoRA adapters there), so no gradient reaches "
                               "them; make the Trainer outside it")
        result = TrainResult(steps=cfg.steps)
        metrics = None
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            metrics = (self.out / "metrics.jsonl").open("a", encoding="utf-8")
        bar = self._progress_bar()
        # Without a bar (a log file, nohup), a plain line per metrics row: else nothing between start and end.
        plain = bar is not None and bar.disable
        t0, seen = time.perf_counter(), 0
        # tokens/s is the training steps' own: held-out evaluations and saves take time of their own (counted in,
        # frequent evaluations would hide most of the steps' speed)
        training = 0.0
        interval: list[dict[str, Any]] = []  # the step rows since the last written one
        first = self.step  # (a resumed run's ETA is paced by its own steps)
        clock = t0 - self.minutes * 60  # the run's start, earlier parts of a resumed run included
        prefetched = self._prefetch() if cfg.data_workers else None
        interrupt = _StopOnInterrupt()
        # The run is saved before its last evaluation, which an error or OOM must not cost; but a LoRA run's final
        # save folds its adapters into the weights in place, so that run is evaluated first.
        save_first, saved = not cfg.lora_rank, False
        try:
            while self.step < cfg.steps:
                requested = self._clock_and_signal(clock, interrupt)
                spent = self.minutes / cfg.max_minutes if cfg.max_minutes else 0.0
                if spent > 1:
                    result.stopped = "max_minutes"  # the time budget is spent: save what we have
                    break
                if requested:
                    result.stopped = "interrupted"
                    result.stop_signal = getattr(interrupt, "signum", None)
                    break
                started = time.perf_counter()
                row = self.train_step(next(prefetched) if prefetched else None,
                                      spent if cfg.time_schedule else 0.0)
                training += time.perf_counter() - started
                self.minutes = (time.perf_counter() - clock) / 60  # saved with the run
                seen += row["tokens"]
                if self.compile_error and result.compile_error is None:
                    result.compile_error = row["compile_error"] = self.compile_error
                result.losses.append(row["loss"])
                # A written row's losses are the means over the steps since the row before it (HF Trainer's habit):
                # one step's loss, with a small batch, swings so much that --log-every 10's curve and log lines would
                # show the noise of every tenth step rather than the trend
                interval.append(row)
                tok_s = seen / max(training, 1e-9)
                row["tok_s"] = tok_s
                last = self.step == cfg.steps
                if self.heldout is not None and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                    if last and save_first:
                        with _labelled(bar, "saving"):
                            self.save(final=True)
                        saved = True
                    with _labelled(bar, "evaluating"):
                        row["eval_loss"] = self.evaluate()
                    result.eval_losses.append((self.step, row["eval_loss"]))
                logged = None
                if self.step % cfg.log_every == 0 or last or "eval_loss" in row or "compile_error" in row:
                    logged = {**row, **_interval_means(interval)}
                    interval = []
                if metrics and logged:
                    self._write_row(metrics, logged)
                    if plain:
                        # paced by the wall time of this run's steps so far (evaluations and saves included)
                        pace = (time.perf_counter() - t0) / (self.step - first)
                        print(self._progress_line(logged, tok_s, pace, last), file=sys.stderr, flush=True)
                if bar is not None:  # (a bar without a total has no truth value)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tok_s:.0f}",
                                    **({"min": f"{self.minutes:.1f}/{cfg.max_minutes:g}"} if cfg.max_minutes else {}))
                    bar.update(1)
                if self.on_step:
                    with self._eval_mode():  # (what it generates is generation's, no attention dropout)
                        self.on_step(self.step, row["loss"])
                if cfg.save_every and self.step % cfg.save_every == 0 and not last:
                    with _labelled(bar, "saving"):
                        self.save()
            result.steps = self.step
            # An interrupted run is saved to be resumed; one stopped by its clock is also a usable checkpoint (a
            # LoRA run merged, its adapters kept apart too while steps remain).
            final = result.stopped != "interrupted"
            if save_first and not saved:
                with _labelled(bar, "saving"):
                    self.save(final=final)
                saved = True
            if result.stopped:
                row = self._stopped_row(result, interval)
                if metrics:
                    self._write_row(metrics, row)
            if not saved:
                with _labelled(bar, "saving"):
                    self.save(final=final)
        finally:
            interrupt.restore()
            prefetched = None  # a run cut short: the loader's worker processes end now, not at garbage collection
            if bar is not None:
                bar.close()
            if metrics:
                with contextlib.suppress(OSError):  # (each row was flushed: only a failed one is left to fail again)
                    metrics.close()
            # eval mode whatever ended the run (a Diverged step, an error): under attention_dropout a model left in
            # train mode would drop attention in every generation after
            self.lm.model.eval()
        result.tokens_per_second = seen / max(training, 1e-9)
        return result

    def _write_row(self, metrics: IO[str], row: dict[str, Any]) -> None:
        """A row of metrics.jsonl, on disk at once; a write that fails (a full disk) names the file and what `out`
        keeps (it said "[Errno 28] No space left on device", naming neither)."""
        try:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        except OSError as exc:
            failed = OSError(f"{self.out / 'metrics.jsonl'}: {exc.strerror or exc}; the run stops at step {self.step} "
                             f"({self._kept()})")
            failed.errno = exc.errno
            raise failed from None

    def _progress_bar(self) -> Any:
        """The progress bar of rank 0 (None: no progress asked, or another process); disabled where stderr is not
        a terminal (a log file would fill with its redraws): the loop then writes a plain line per metrics row."""
        if not (self.progress and self.rank == 0) or sys.stderr is None:  # (pythonw, a service: tqdm's AttributeError)
            return None
        from tqdm import tqdm

        cfg = self.cfg
        # a time-scheduled run is measured in minutes: --steps is then only a cap (its default, 1000, unused);
        # else --steps ends the run (and spans its lr schedule) unless --max-minutes ends it first
        return tqdm(total=None if cfg.time_schedule else cfg.steps, initial=self.step, desc="train", unit="step",
                    dynamic_ncols=True, disable=None)

    def _clock_and_signal(self, clock: float, interrupt: _StopOnInterrupt) -> bool:
        """The run's minutes so far (since `clock`, its start) kept in self.minutes, and whether a stop was
        requested: under torchrun, the latest clock and any process's signal, which count for all of them."""
        self.minutes = (time.perf_counter() - clock) / 60
        requested = interrupt.requested
        if self.world > 1:
            # Every process stops at the same step, and anneals by the same clock: each meets the signal (and
            # its clock) at its own moment, and under torchrun a Ctrl-C that reaches one process after its
            # check would leave it in the next step's all-reduce with a peer gone, to die there in a traceback
            # with nothing saved by rank 0.
            agreed = torch.tensor([self.minutes, float(requested)], dtype=torch.float64, device=self.lm.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            self.minutes, requested = float(agreed[0]), bool(agreed[1])
        return requested

    def _progress_line(self, logged: dict[str, Any], tok_s: float, pace: float, last: bool) -> str:
        """A metrics row as the plain line a log gets where there is no bar, with the bar's ETA, which a log
        otherwise lacks: `pace` seconds a step, or the clock's budget where that ends the run first."""
        cfg = self.cfg
        held = f", eval loss {logged['eval_loss']:.4f}" if "eval_loss" in logged else ""
        of = ("" if cfg.time_schedule else f"/{cfg.steps}") + (
            f", {self.minutes:.2f}/{cfg.max_minutes:g} min" if cfg.max_minutes else "")
        left = [(cfg.steps - self.step) * pace]
        left += [(cfg.max_minutes - self.minutes) * 60] if cfg.max_minutes else []
        eta = "" if last else f", ETA {duration(min(left))}"
        return f"train: step {self.step}{of}, loss {logged['loss']:.4f}{held}, {tok_s:.0f} tok/s{eta}"

    def _stopped_row(self, result: TrainResult, interval: list[dict[str, Any]]) -> dict[str, Any]:
        """The metrics row of a run stopped before its last step, with the losses of the steps since the last row
        (which the curve would otherwise end before); a run its clock stopped is evaluated where it ends."""
        row = {"step": self.step, "stopped": result.stopped, **(_interval_means(interval) if interval else {})}
        if result.stopped == "max_minutes" and self.heldout is not None:
            if result.eval_losses and result.eval_losses[-1][0] == self.step:
                # its last step was evaluated (--eval-every) just before the clock ran out: the same held-out
                # batches on the same weights, whose second pass would cost a whole evaluation and list the
                # step twice in eval_losses
                row["eval_loss"] = result.eval_losses[-1][1]
            else:
                row["eval_loss"] = self.evaluate()
                result.eval_losses.append((self.step, row["eval_loss"]))
        return row


def duration(seconds: float) -> str:
    """`seconds` as the progress bar writes a time: m:ss, or h:mm:ss from an hour."""
    minutes, secs = divmod(max(0, round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def metrics_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) of each readable row of a metrics.jsonl, skipping a line cut short when a run was killed
    mid-write."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = parse_json(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append((line, row))
    return rows


def plot_metrics(metrics: str | Path, path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Draw a run's metrics.jsonl: training losses (and held-out loss) over the steps above, the learning rate
    below. Returns the series drawn, by label. Needs matplotlib (the `train` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for _, row in metrics_rows(metrics) if "step" in row]
    series = {label: [(r["step"], r[key]) for r in rows if key in r]
              for key, label in (("loss", "total"), ("diffusion_loss", "diffusion"), ("ar_loss", "encoder AR"),
                                 ("eval_loss", "held-out total"), ("lr", "learning rate"))}
    series = {label: points for label, points in series.items() if points}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for label, points in series.items():
        if label == "learning rate":
            bottom.plot(*zip(*points), color="gray", linewidth=1, marker="." if len(points) <= 50 else None)
        elif label == "held-out total":
            top.plot(*zip(*points), marker="o", linestyle="--", label=label)
        else:  # markers while there are few points: one logged row is otherwise no line at all
            top.plot(*zip(*points), label=label, linewidth=1, marker="." if len(points) <= 50 else None)
    top.set_ylabel("loss")
    top.grid(alpha=0.3)
    if top.lines:
        top.legend()
    bottom.set_ylabel("learning rate")
    bottom.xaxis.get_major_locator().set_params(integer=True)  # steps are whole
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series


LORA_BASE_FILE = "lora_base.json"  # a LoRA run cut short: the base model its adapters belong to


def base_name(lm: LM) -> str | None:
    """The base model as a LoRA run records it: its absolute folder (as typed, a relative path would break --resume
    from another folder), a shipped model's name (its folder moves on reinstall), or a Hugging Face cache snapshot's
    repo id (hub_name: its folder is a hash path no other machine has); None when not loaded from a folder, or loaded
    with an adapter (its weights are not the folder's)."""
    if lm.path is None or lm.adapter is not None:
        return None
    if lm.path.resolve().parent == MODELS_DIR.resolve():
        return lm.path.name
    return hub_name(lm.path) or str(lm.path.resolve())


def check_continues(out: str | Path, state: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse to continue the run in `out`, whose trainer state is `state`, with `cfg` where it cannot go on: it
    trained another set of weights (the optimizer state fits only its own: another lora_rank or lora_targets), its
    adapters would compute another update (lora_alpha scales what they learned), or it is a LoRA run that finished
    (its adapters were saved apart, and merged unless its base was quantized). The CLI checks a LoRA run before loading
    its base (its state is the adapters and their moments, small to read), Trainer.resume every run."""
    config = state.get("config", {})
    rank = config.get("lora_rank", 0)
    if rank != cfg.lora_rank:
        ran = f"LoRA adapters of rank {rank} (give --lora-rank {rank})" if rank else "all weights (no --lora-rank)"
        raise ValueError(f"--resume: the run in {out} trained {ran}; lora_rank={cfg.lora_rank} cannot continue it")
    if rank and "lora" not in state:
        done = (f"finished; its adapters are in {Path(out) / ADAPTER_DIR}" if config.get("quantize") else
                f"finished and merged its adapters into the checkpoint; fine-tune that with --model {out} instead")
        raise ValueError(f"--resume: the LoRA run in {out} {done}")
    if rank:
        alpha = config.get("lora_alpha", TrainConfig.default("lora_alpha"))
        if alpha != cfg.lora_alpha:  # the trained adapters' update would be rescaled at once
            raise ValueError(f"--resume: the run in {out} trained its adapters with lora_alpha {alpha:g}; "
                             f"lora_alpha={cfg.lora_alpha:g} would rescale what they learned (give --lora-alpha "
                             f"{alpha:g}, or start a new run)")
        targets = config.get("lora_targets", TrainConfig.default("lora_targets"))  # (older runs: LORA_TARGETS)
        if set(lora_modules(targets)) != set(lora_modules(cfg.lora_targets)):
            raise ValueError(f"--resume: the run in {out} trained adapters on {targets}; lora_targets="
                             f"{cfg.lora_targets!r} cannot continue it (give --lora-targets {targets})")


def recorded_data(out: str | Path) -> str | None:
    """The --data the run in `out` trained on, as its trainer_state.pt records it (the Trainer's `data`); None when
    it records none. The state is mapped, not read: its tensors stay on disk."""
    try:
        state = torch.load(Path(out) / TRAINER_STATE_FILE, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - damaged: check_resumable has said so already
        return None
    data = state.get("data") if isinstance(state, dict) else None
    path = data.get("path") if isinstance(data, dict) else None
    return path if isinstance(path, str) and path else None


def lora_base(out: str | Path) -> str | None:
    """The base model a LoRA run in `out` was adapting, as saved with its adapters; None if not recorded."""
    try:
        return json.loads((Path(out) / LORA_BASE_FILE).read_text(encoding="utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_lora_resume_model(out: str | Path, model: str | Path) -> None:
    """Refuse `model` as the base of the LoRA run in `out` to be resumed (`--resume --out OUT --model MODEL`) where it
    is not the base the run's adapters train over, naming both: the run's own folder or its adapter folder (their
    weights hold the adapters' update already, which would count twice, and the run would then
    record itself as its own base), or another model than the recorded base, while that one is there (one
    of another shape would fail on whatever it lacks first, e.g. "text records need a tokenizer"). A base recorded as
    none, or gone, lets `model` stand in for it; Trainer.resume checks its shape."""
    from .lm import resolve_path

    try:
        given = resolve_path(model).resolve()
    except (FileNotFoundError, ValueError):
        return  # (loading it says what is wrong)
    run, recorded = Path(out).expanduser().resolve(), lora_base(out)
    trains = f"; its adapters train over {recorded}, which --resume loads when --model is left out" if recorded else ""
    if any(same_place(folder, run) for folder in (given, *given.parents)):  # (by inode: another case, a bind mount)
        raise ValueError(f"--model {model}: the LoRA run in {out} itself, whose weights hold the update of the "
                         f"adapters being trained (it would count twice){trains}")
    if recorded is None:
        return
    try:
        base = resolve_path(recorded).resolve()
    except (FileNotFoundError, ValueError):
        return  # moved or deleted: the model given stands in
    if given != base:
        raise ValueError(f"--model {model}: not the base of the LoRA run in {out}, whose adapters train over "
                         f"{recorded}; leave --model out to continue on it (or start a new run on {model})")


class _StopOnInterrupt:
    """The first Ctrl-C, SIGTERM (`timeout`, docker stop, Slurm) or SIGHUP (the terminal closed: an ssh session that
    dropped, without nohup or tmux) asks the loop to stop after the step it is in (the run is then saved,
    resumable); a second one interrupts at once. Only the main thread can take signals; elsewhere they keep their
    usual effect."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None  # the first signal's: the CLI exits 128 + it, as a shell reports it
        self.previous: dict[int, Any] = {}
        self.terminal = terminal_fds()  # what a SIGHUP leaves for /dev/null
        if threading.current_thread() is threading.main_thread():
            # a signal the process ignores stays ignored: `nohup blockpress train` stopped when its terminal closed
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS
                             if signal.getsignal(sig) != signal.SIG_IGN}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # the second: stop at once, with this signal's exit status (143 for a SIGTERM)
            raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)
        self.requested, self.signum = True, signum
        if signum == getattr(signal, "SIGHUP", None):
            leave_hung_up_terminal(self.terminal)
        what = "interrupted" if signum == signal.SIGINT else f"{signal.Signals(signum).name} received"
        again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"
        print(f"\n{what}: finishing this step and saving ({again} to stop at once, unsaved)",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(sig, handler)
        self.previous = {}


def init_distributed(device: str = "cpu") -> str:
    """Join the torchrun process group when launched by torchrun, and return the device this process trains on.

    The backend follows the run's device, not the machine: nccl takes CUDA tensors alone, so a --device cpu run on
    a GPU machine under nccl would fail at its first all-reduce. On CUDA each process takes the GPU of its LOCAL_RANK
    (and makes it current, as NCCL needs): "cuda" without an index is the current GPU, GPU 0 in every process, so
    all of them would load onto one GPU, which NCCL refuses ("Duplicate GPU detected")."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    dev = resolve_device(device)
    if dev.type != "cuda":
        dist.init_process_group("gloo")
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.index is not None and dev.index != local:
        raise ValueError(f"device: {device!r} under torchrun, where each process takes the GPU of its LOCAL_RANK "
                         f"(this one: {local}); give --device cuda, with no index")
    if local >= torch.cuda.device_count():
        raise ValueError(f"device: torchrun's LOCAL_RANK {local} needs GPU {local}, but only "
                         f"{torch.cuda.device_count()} CUDA GPU(s) are visible; start at most that many processes a node")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    return f"cuda:{local}"
