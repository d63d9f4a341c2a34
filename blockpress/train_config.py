"""A training run's settings (TrainConfig) and what they are checked against. Kept apart from train.py, and free of
torch, because `blockpress train --help` lists these fields with their descriptions: building the command line's
parser then imports no torch (seconds of a --help)."""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .checks import is_finite_number, is_int, plain_number
from .config import CHAT_TURNS, SCHEMES

# The linear layers LoRA can adapt, by the names peft's target_modules gives them, and the module suffix each stands
# for here: "mlp." keeps the self-conditioning MLP's namesakes (and the experts' down_proj) out.
LORA_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
                "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
LORA_TARGETS = list(LORA_MODULES.values())
# Names a peft user may try for the routed experts: their weights are 3-D parameters (one tensor for every expert),
# which peft adapts with target_parameters and blockpress does not.
_EXPERT_NAMES = {"experts", "gate_up_proj", "experts.gate_up_proj", "experts.down_proj"}


def lora_modules(targets: str) -> list[str]:
    """The module suffixes add_lora adapts for `targets`, TrainConfig.lora_targets: LORA_MODULES names, comma-separated
    ("q_proj,v_proj"). An unknown name is refused with the list, the routed experts with why."""
    names = [name.strip() for name in targets.split(",") if name.strip()] if isinstance(targets, str) else []
    if not names:
        raise ValueError(f"lora_targets: expected comma-separated names among {', '.join(LORA_MODULES)}, got "
                         f"{targets!r}")
    experts = [name for name in names if name in _EXPERT_NAMES]
    if experts:
        raise ValueError(f"lora_targets: {experts[0]!r}: the routed experts' weights are 3-D parameters (one tensor for "
                         "all experts), not linear layers, and blockpress trains LoRA on linear layers only; choose "
                         f"among {', '.join(LORA_MODULES)}")
    unknown = [name for name in names if name not in LORA_MODULES]
    if unknown:
        raise ValueError(f"lora_targets: unknown module(s) {unknown}; expected comma-separated names among "
                         f"{', '.join(LORA_MODULES)} (attention's projections and the dense MLP's)")
    return [LORA_MODULES[name] for name in dict.fromkeys(names)]


# What a TrainConfig field of each type takes (TrainConfig.check_fields), and how an error names it.
_TYPE_CHECKS: dict[type, Callable[[Any], bool]] = {
    bool: lambda v: isinstance(v, bool), int: is_int,  # (numpy's too: __post_init__ keeps int(value))
    float: is_finite_number, str: lambda v: isinstance(v, str)}
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


# TrainConfig.autocast_dtype's values: "auto" picks bfloat16 where the hardware computes it natively, else float16.
AUTOCAST_DTYPES = ("auto", "bfloat16", "float16")


def setting(default: Any, description: str, choices: Sequence[str] | None = None) -> Any:
    """A TrainConfig field and its description: `blockpress train --help` shows it (field metadata "help"), and the
    values it takes where they are a few names (metadata "choices")."""
    return field(default=default, metadata={"help": description, "choices": choices})


@dataclass
class TrainConfig:
    """Every knob of a training run. `blockpress train --help` lists them with these descriptions."""

    steps: int = setting(1000, "optimizer steps")
    batch_size: int = setting(8, "examples per optimizer step (global, across processes)")
    micro_batch_size: int = setting(0, "examples per forward (0: the whole per-process batch); smaller = accumulation")
    lr: float = setting(3e-4, "peak learning rate")
    min_lr_ratio: float = setting(0.1, "the cosine schedule ends at --lr times this")
    warmup_steps: int = setting(50, "linear warmup steps")
    weight_decay: float = setting(0.01, "AdamW weight decay (matrices only)")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "max gradient norm (0: off)")
    aux_ar_weight: float = setting(1.0, "weight of the encoder's next-token loss")
    diffusion_weight: float = setting(1.0, "weight of the diffusion loss (0: train an autoregressive baseline only)")
    self_conditioning_prob: float = setting(0.5, "fraction of examples trained with self-conditioning")
    t_eps: float = setting(1e-3, "the noise level t is drawn from U(this, 1 - this)")
    noise_token_id: int = setting(-1, "-1: corrupt to uniform random tokens (published recipe); else to this one "
                                  "token (absorbing noise); `blockpress train --model` defaults to the model's own")
    reweight: bool = setting(False, "weight each example's diffusion loss by 1 / (1 - t)")
    max_canvases: int = setting(0, "keep at most this many canvases of a response (0: all)")
    eval_every: int = setting(0, "steps between held-out evaluations (0: only at the end)")
    eval_batches: int = setting(4, "held-out batches per evaluation")
    save_every: int = setting(0, "steps between checkpoints (0: only at the end)")
    log_every: int = setting(10, "steps between metrics.jsonl lines")
    seed: int = setting(0, "seeds data order, corruption and self-conditioning choices")
    autocast: bool = setting(True, "mixed precision on a GPU (CUDA): matmuls in --autocast-dtype, the weights and AdamW "
                             "in their own dtype")
    cpu_autocast: bool = setting(False, "mixed precision on CPU too: pays only with native bf16 (AVX512-BF16, AMX)")
    autocast_dtype: str = setting("auto", "the mixed precision's matmul dtype: bfloat16; float16 with dynamic loss "
                                  "scaling (GPUs without bf16, such as the T4 and V100); auto: bfloat16 where the "
                                  "hardware computes it natively (a GPU from Ampere on, and on CPU), else float16",
                                  choices=AUTOCAST_DTYPES)
    lora_rank: int = setting(0, ">0: train LoRA adapters of this rank (on the layers chosen below; at most their largest "
                             "full rank, min(in, out) features) instead of all weights; "
                             "the final --out holds them merged, and unmerged as a PEFT folder in --out/adapter (each "
                             "save writes that folder, so a save before the end loads too)")
    lora_alpha: float = setting(16, "with --lora-rank: LoRA scaling numerator (the update is alpha / rank * B @ A)")
    lora_targets: str = setting(",".join(LORA_MODULES), "with --lora-rank: the linear layers adapted, separated by commas "
                                "as peft's target_modules names them: attention's q_proj, k_proj, v_proj, o_proj and "
                                "the dense MLP's gate_proj, up_proj, down_proj (not the routed experts)")
    quantize: str | None = setting(None, "with --lora-rank: train the adapters over a frozen base quantized with this "
                                   "scheme (int8, fp8 or int4: QLoRA; the base is quantized as it is read); --out "
                                   "then holds the adapters alone, in --out/adapter, which --model takes to run them "
                                   "(generate, chat, serve, ...) over the base quantized alike", choices=SCHEMES)
    prompt_min: int = setting(8, "raw-text corpora: shortest prompt of a window")
    prompt_max: int = setting(64, "raw-text corpora: longest prompt of a window")
    response_canvases: int = setting(1, "raw-text corpora: canvases of response per window")
    max_minutes: float = setting(0.0, "stop (and save) after this much wall time, in minutes, of the whole "
                                 "run (a resumed run's earlier parts count; 0: no limit)")
    time_schedule: bool = setting(False, "with --max-minutes: the cosine decay follows the elapsed fraction of the budget")
    data_workers: int = setting(0, "processes building batches ahead of the optimizer, forked (not on "
                                   "Windows, whose Python cannot fork; 0: built in the training loop)")
    compile: bool = setting(False, "torch.compile the training forward and backward (the first steps pay the compile)")
    # What `blockpress train` reads of a chat record (load_jsonl), kept with the run so that --resume reads the same
    # (a Trainer reads heldout_data by it; its training examples come read, by load_jsonl(..., chat_turns=) alike).
    chat_turns: str = setting("all", "chat `messages` records: train on every assistant turn that answers a user, "
                              "one example each, prompted with the conversation before it (all: examples, batches and "
                              "epochs count turns, and a chat's turns are held out together), or on its last turn "
                              "alone (last)",
                              choices=CHAT_TURNS)
    # What `blockpress train` holds out of --data for the eval loss, kept with the run so that --resume keeps the
    # split (a Trainer given no heldout= argument reads and splits them alike: _settings_heldout).
    heldout: float | None = setting(None, "JSONL examples: the fraction held out for the eval loss, chosen by "
                                          "content hash (default: 0.02, or none with --heldout-data); not for raw "
                                          "text (give --heldout-data)")
    heldout_data: str | None = setting(None, "held-out data for the eval loss, as --data takes it: with JSONL "
                                             "examples, a JSONL file of examples; with raw text or token shards, "
                                             "held-out text or a glob of held-out shards")
    # The weights' dtype as `blockpress train` loads them (a Trainer casts the model it is given to it, and merges a
    # LoRA run's adapters into it; None there: the model's own dtype), kept with the run so that --resume trains on in
    # it.
    dtype: str | None = setting(None, "weights dtype while training, and of the saved checkpoint (default: float32, "
                                "since AdamW on bf16 weights rounds small updates away; with --lora-rank, the frozen "
                                "base stays in its own dtype while training and the adapters are merged into a "
                                "float32 checkpoint; with --quantize, the base is quantized instead and the adapters "
                                "stay unmerged)", choices=("float32", "bfloat16"))

    def __post_init__(self) -> None:
        self.check_fields({f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(self):
            # a numpy number passes its field's check (np.float32 from a sweep's array, np.int64), but the run's
            # train_config.json and metrics rows failed on it mid-run: kept as the Python number it is
            setattr(self, f.name, plain_number(getattr(self, f.name)))
            value = getattr(self, f.name)
            if f.metadata["choices"] and value is not None and value not in f.metadata["choices"]:
                raise ValueError(f"{f.name}: expected one of {list(f.metadata['choices'])}, got {value!r}")
        for name in ("steps", "batch_size", "log_every", "response_canvases"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
        if self.eval_batches < 0:  # 0: fine where nothing is held out
            raise ValueError(f"eval_batches: expected an integer >= 0, got {self.eval_batches!r}")
        if self.max_minutes < 0:
            raise ValueError(f"max_minutes: expected >= 0, got {self.max_minutes}")
        if self.time_schedule and not self.max_minutes:
            raise ValueError("time_schedule: needs max_minutes > 0 (the budget the schedule spans)")
        for name in ("micro_batch_size", "warmup_steps", "max_canvases", "eval_every", "save_every",
                     "lora_rank", "data_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {getattr(self, name)!r}")
        if self.micro_batch_size > self.batch_size:
            raise ValueError(f"micro_batch_size: {self.micro_batch_size} is more than batch_size {self.batch_size} "
                             "(a micro-batch is a slice of the batch)")
        if self.diffusion_weight < 0 or self.aux_ar_weight < 0 or not (self.diffusion_weight or self.aux_ar_weight):
            raise ValueError("diffusion_weight/aux_ar_weight: must be >= 0 and not both 0")
        if self.lr <= 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        # Alpha scales the adapters' output: 0 trains adapters that change nothing, a negative one flips them.
        if self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha: expected a positive number, got {self.lora_alpha!r}")
        lora_modules(self.lora_targets)
        # A negative clip norm flips the gradients (the loss climbs); a negative decay or end ratio grows weights.
        for name in ("grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected in [0, 1], got {self.min_lr_ratio}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: expected in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.self_conditioning_prob <= 1:
            raise ValueError(f"self_conditioning_prob: expected a probability, got {self.self_conditioning_prob}")
        if not 0 < self.t_eps < 0.5:
            raise ValueError(f"t_eps: expected in (0, 0.5), got {self.t_eps}")
        # As inference seeds (lm.check_seed): -1 refused here as generate refuses it, and 2**64 here, not later.
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: expected an integer in [0, 2**63), got {self.seed!r}")
        if self.noise_token_id < -1:
            raise ValueError(f"noise_token_id: expected -1 (uniform noise) or a token id, got {self.noise_token_id!r}")
        if self.quantize is not None:  # (one of SCHEMES: the field's choices, checked above)
            if not self.lora_rank:  # full fine-tuning updates the weights a quantized base holds as frozen codes
                raise ValueError(f"quantize: {self.quantize!r} trains LoRA adapters over the quantized base; it needs "
                                 "lora_rank > 0 (full fine-tuning needs the unquantized weights)")
        if self.heldout is not None and not 0 <= self.heldout < 1:
            raise ValueError(f"heldout: expected a fraction in [0, 1), got {self.heldout!r}")
        if self.heldout_data is not None and not self.heldout_data:
            raise ValueError(f"heldout_data: expected a path (a JSONL file of examples, a glob of token shards, or raw text: a file, a folder, {{'text'}} JSONL), got "
                             f"{self.heldout_data!r}")
        if not 0 < self.prompt_min <= self.prompt_max:
            raise ValueError(f"prompt_min/prompt_max: need 0 < prompt_min <= prompt_max, got {self.prompt_min}/{self.prompt_max}")
        # Settings that cannot apply are refused, as flags and from a file alike (not ignored silently); a value
        # as its default is no setting: a saved train_config.json holds every field.
        if self.lora_alpha != self.default("lora_alpha") and not self.lora_rank:
            raise ValueError(f"lora_alpha: {self.lora_alpha:g} scales LoRA adapters; it needs lora_rank > 0 (full "
                             "fine-tuning has no adapters to scale)")
        if self.lora_targets != self.default("lora_targets") and not self.lora_rank:
            raise ValueError(f"lora_targets: {self.lora_targets!r} chooses the layers LoRA adapts; it needs "
                             "lora_rank > 0 (full fine-tuning trains every weight)")

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of the field `name`."""
        return next(f.default for f in fields(cls) if f.name == name)

    def check_examples(self) -> None:
        """Refuse the settings of windows cut from running text for a run on JSONL examples, which bring their own
        prompts and responses: they would be ignored silently."""
        windows = [name for name in ("prompt_min", "prompt_max", "response_canvases")
                   if getattr(self, name) != self.default(name)]
        if windows:
            raise ValueError(f"{'/'.join(windows)}: for running text (raw text or token shards), which is cut into "
                             "windows; JSONL examples bring their own prompts and responses")

    @classmethod
    def check_fields(cls, raw: dict[str, Any], where: str = "") -> None:
        """Refuse an unknown name or a value of another type than its field's (`where` first: e.g. the file it was
        read from), as a JSON file may hold them: "false" for a bool read as True, a seed "a" failed at the first
        batch. A float field takes an integer; none takes a bool for a number (True would pass for 1)."""
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(raw) - set(hints))
        if unknown:
            raise ValueError(f"{where}train config: unknown field(s) {unknown}; known: {sorted(hints)}")
        for name, value in raw.items():
            kinds = typing.get_args(hints[name]) or (hints[name],)  # X | None: (X, NoneType)
            if value is None and type(None) in kinds:
                continue
            kind = next(k for k in kinds if k is not type(None))
            if not _TYPE_CHECKS[kind](value):  # (a float must be finite: lr=inf trained to NaN weights silently)
                null = " or null" if type(None) in kinds else ""
                raise ValueError(f"{where}{name}: expected {_TYPE_NAMES[kind]}{null}, got {value!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        cls.check_fields(raw)
        return cls(**raw)
