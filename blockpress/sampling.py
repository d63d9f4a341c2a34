"""Samplers: pure tensor functions over one denoising step. No state objects; no host syncs given the canvas's
`CanvasRules.draws` and `numbers` (as the decoding loop passes them).

One step, for every sampler:
  temperature(step)  -> logits / T
  probs_and_entropy  -> the softmax and its entropy, one computation shared by acceptance and the stopping test
  candidates         -> sampled tokens (argmax in greedy mode)
  accept             -> which positions keep their candidate this step (the sampler's rule)
  renoise            -> every other position gets a fresh uniform token (or, for a model trained with
                        absorbing noise, the one noise token: `noise_token_id`)
  stop               -> argmax stable for `stability_threshold` steps and mean entropy below threshold

Steps count down like the reference: `step` = N..1 is the number of steps remaining.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch

from .checks import check_flag, check_keywords, is_finite_number, is_int
from .config import RANKINGS, SAMPLERS, SamplerName

# The samplers compute in float32, so settings past its range are refused: one would become inf there (a t_max of
# 1e308 would make the schedule's temperature inf, flatten every logit to 0, and token 0 would win every position).
# Tiny values are fine: a temperature below MIN_TEMPERATURE is divided as that (greedy).
FLOAT32_MAX = torch.finfo(torch.float32).max
IN_FLOAT32 = f"within float32's range (|x| <= {FLOAT32_MAX:.3g})"


def is_float32(value: Any) -> bool:
    """A finite number (is_finite_number) that float32 holds without becoming inf: what a sampler setting must be."""
    return is_finite_number(value) and abs(value) <= FLOAT32_MAX


def check_temperature(temperature: Any) -> None:
    """One temperature for a whole batch (OpenAI's, generate_ar's): a number >= 0 that float32 holds, 0 greedy."""
    if not is_float32(temperature) or temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy) {IN_FLOAT32}, got {temperature!r}")


# The largest top_k, stability_threshold and max_denoising_steps, counts that meet int32/int64 tensors: a value
# past int64 would be accepted and then fail the step (with top_k, the tensor of a whole batch's values), and a
# step count past int32 would fail the first step's temperature (an int32 tensor) with torch's "cannot be converted
# to type int32", naming no setting. No vocabulary comes near it (any k at or above a vocabulary's size keeps
# every token, as 0 does), nor any canvas's steps (a threshold above max_denoising_steps never stops a canvas
# early, as adaptive_stopping=False).
MAX_COUNT = 2**31 - 1

# The candidate draw's settings, which a batch may hold one per row (RowDraws: a server batches requests that differ
# in them, as real clients' temperatures and top_p do); the rest of a SamplerConfig is the whole batch's.
ROW_SETTINGS = ("draw_temperature", "top_k", "top_p")
# For those who ask for a `temperature` (an argument, or HF's key in a generation config): the setting that is one.
TEMPERATURE_HINT = ("OpenAI's temperature is draw_temperature here (the server maps it there): candidates are drawn "
                    "at the schedule's temperature times it, where the sampler draws them (not sampler='greedy' nor "
                    "candidates='argmax'), while acceptance keeps the schedule from t_max down to t_min; "
                    "sampler='greedy' takes the argmax")
CANDIDATES = ("sample", "argmax")
# The choices of SamplerConfig's string settings, as a typed user's checker reads them (a misspelt "gredy" is an error
# there; at run time, SamplerConfig refuses it naming the choices); SamplerName is config's
RankBy = Literal["entropy", "margin", "position"]
Candidates = Literal["sample", "argmax"]
# The settings that only some samplers read (`denoise_step`): given to another, they would change nothing.
# (rank_by, read by all but confidence, is checked on the config itself: its default is the one value that
# ranks nothing away.)
READ_BY = {"entropy_bound": ("entropy_bound", "greedy"), "confidence": ("confidence",)}


@dataclass(frozen=True)
class SamplerConfig:
    """Everything that decides how a canvas is denoised. Defaults are the reference's."""

    sampler: SamplerName = "entropy_bound"
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    confidence: float = 0.9  # `confidence` sampler: accept tokens whose top probability reaches this
    t_max: float = 0.8
    t_min: float = 0.4
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    adaptive_stopping: bool = True  # False: always run max_denoising_steps (benchmarks)
    # The order in which positions are accepted. "entropy": lowest entropy first. "margin": largest gap between
    # the two most likely tokens first, which puts a near tie between two candidates last however peaked it is
    # (on sudoku, a cell with two possible digits). "position": left to right, so a step accepts the leftmost
    # open position and as many open ones after it as the rule allows, never one past a gap; text then grows
    # in order while still taking several tokens a step where the model is sure.
    # topk takes its count in this order; entropy_bound and greedy add entropies up in it.
    rank_by: RankBy = "entropy"
    # "sample": a candidate is drawn from the tempered softmax (the reference). "argmax": the most likely token
    # (the `greedy` sampler always uses it), while the temperature still shapes ranking and self-conditioning.
    candidates: Candidates = "sample"
    # Candidates are drawn at the schedule's temperature times this; acceptance, ranking, stopping and
    # self-conditioning keep the schedule. This is OpenAI's `temperature` on the server: scaling the whole schedule
    # instead would make every position look certain at a low temperature, so the entropy bound would take a whole
    # canvas of noise in one or two passes.
    draw_temperature: float = 1.0
    # The candidate draw keeps only the top_k most likely tokens (0: all), then, of those, the smallest set of
    # most likely ones whose probability reaches top_p (the nucleus; 1: all), as in HF's and vLLM's samplers.
    # Like draw_temperature they shape the draws alone (`candidate_probs`), so the autoregressive baseline
    # (generate_ar) filters its tokens with the very same settings; argmax candidates are never filtered out.
    # (top_k counts tokens of one position's draw; the `topk` sampler counts the positions a step accepts.)
    top_k: int = 0
    top_p: float = 1.0
    # False: every position is re-decided at every step (DiffusionGemma). True: an accepted token stays, like a
    # given, for the rest of the canvas (masked-diffusion decoding); the topk ramp then counts kept positions.
    keep_accepted: bool = False
    # False: the decoder never sees its previous prediction (as in the share of training examples drawn without
    # self-conditioning). With keep_accepted this is plain masked-diffusion decoding: an unsettled position
    # carries only the noise token, not the last step's full guess, so revealed tokens can change the rest.
    self_conditioning: bool = True
    # None: noise is uniform random tokens (DiffusionGemma's recipe). An id: noise is that one token, for
    # models trained with absorbing ("masked") noise (TrainConfig.noise_token_id); it must match training.
    # -1 (TrainConfig's word for it): uniform noise too, said outright. generate fills a config's None with the
    # checkpoint's noise token (how the model was trained), and only -1 overrides an absorbing one.
    noise_token_id: int | None = None
    # OpenAI's penalties against repeating the text so far: a token's logit drops by presence_penalty once it
    # appears, and by frequency_penalty for each time it appears. The text so far is this generation's
    # committed tokens plus, for each canvas position, the other positions' settled tokens. Given text does not
    # count: neither the prompt (as in OpenAI and vLLM) nor a template's fixed tokens. Applied before the
    # temperature, in [-2, 2] like OpenAI's.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {msg}")

        need(self.sampler in SAMPLERS, "sampler", f"unknown sampler {self.sampler!r}; expected one of {SAMPLERS}")
        need(is_int(self.max_denoising_steps) and 1 <= self.max_denoising_steps <= MAX_COUNT, "max_denoising_steps",
             f"expected an integer in [1, {MAX_COUNT}], got {self.max_denoising_steps!r}")
        for name in ("entropy_bound", "confidence", "t_min", "t_max", "confidence_threshold"):
            value = getattr(self, name)  # a string, a bool or inf would fail later, deep inside the sampler
            need(is_float32(value), name, f"expected a finite number {IN_FLOAT32}, got {value!r}")
        need(self.entropy_bound > 0, "entropy_bound", f"expected > 0, got {self.entropy_bound}")
        for name in ROW_SETTINGS:  # checked as a batch's per-row values are (plain numbers stored)
            object.__setattr__(self, name, check_row_setting(name, getattr(self, name)))
        need(0 < self.confidence <= 1, "confidence", f"expected a probability in (0, 1], got {self.confidence}")
        need(self.rank_by in RANKINGS, "rank_by", f"unknown ranking {self.rank_by!r}; expected one of {RANKINGS}")
        # The confidence sampler takes every position over its threshold, in no order: a ranking would be ignored.
        need(self.sampler != "confidence" or self.rank_by == "entropy", "rank_by",
             f"the confidence sampler accepts by top probability and ranks nothing, so rank_by={self.rank_by!r} would "
             "be ignored; rank with sampler='topk', 'entropy_bound' or 'greedy'")
        need(self.candidates in CANDIDATES, "candidates",
             f"unknown candidate rule {self.candidates!r}; expected one of {CANDIDATES}")
        # Argmax candidates are not drawn, so a draw temperature would be ignored, as a ranking by the confidence
        # sampler. (with_ drops an earlier one when it switches to them: a checkpoint's, set for its draws.)
        need(not self.argmax_candidates or self.draw_temperature == 1.0, "draw_temperature",
             f"{'sampler=' + repr(self.sampler) if self.sampler == 'greedy' else 'candidates=' + repr(self.candidates)}"
             f" takes the most likely candidates and draws none, so draw_temperature={self.draw_temperature} would be "
             "ignored; " + ("draw them with sampler='entropy_bound' (greedy is entropy_bound with argmax candidates; "
                            "a model may decode greedily by default, as blockpress-code does)"
                            if self.sampler == "greedy" else "draw them with candidates='sample'"))
        for name in ("adaptive_stopping", "keep_accepted", "self_conditioning"):
            check_flag(name, getattr(self, name))
        # 0 is allowed, as in the reference: the schedule's last step is still t_max / N (see `temperature`).
        need(self.t_min >= 0, "t_min", f"expected >= 0, got {self.t_min}")
        need(self.t_max >= 0, "t_max", f"expected >= 0, got {self.t_max}")
        need(self.t_max >= self.t_min, "t_max", f"t_max ({self.t_max}) must be >= t_min ({self.t_min})")
        # (bools are ints to Python: True read as 1 here, and as noise token 1 below)
        need(is_int(self.stability_threshold) and 0 <= self.stability_threshold <= MAX_COUNT, "stability_threshold",
             f"expected an integer in [0, {MAX_COUNT}], got {self.stability_threshold!r}")
        need(self.confidence_threshold > 0, "confidence_threshold", f"expected > 0, got {self.confidence_threshold}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(is_finite_number(value) and -2.0 <= value <= 2.0, name, f"expected a number in [-2, 2], got {value!r}")
        need(self.noise_token_id is None or (is_int(self.noise_token_id) and self.noise_token_id >= -1),
             "noise_token_id", f"expected None, -1 (uniform noise) or a token id >= 0, got {self.noise_token_id!r}")
        # numpy numbers pass the checks: store plain ones (they are written as JSON, which has no int64 / float32)
        for name in ("max_denoising_steps", "stability_threshold", "noise_token_id"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, int(value))
        for name in ("entropy_bound", "confidence", "t_min", "t_max", "confidence_threshold", "presence_penalty",
                     "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any]) -> SamplerConfig:
        """Read the relevant keys of a checkpoint's generation_config.json (the reference's layout)."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known and v is not None}  # null: unset, the default holds
        sampler_cfg = raw.get("sampler_config")
        # The reference has one sampler and refuses any other class, other keys or a non-object; falling back to
        # the defaults would run another sampler than the file names. A missing _cls_name can only mean this one.
        if sampler_cfg is not None:
            want = '{"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": <number>}'
            if not isinstance(sampler_cfg, dict):
                raise ValueError(f"sampler_config: expected an object {want}, got {sampler_cfg!r}")
            name = sampler_cfg.get("_cls_name", "EntropyBoundSamplerConfig")
            if name != "EntropyBoundSamplerConfig":
                raise ValueError(f"sampler_config: _cls_name {name!r} is not a sampler DiffusionGemma has; expected "
                                 f"{want}")
            unknown = sorted(set(sampler_cfg) - {"_cls_name", "entropy_bound"})
            if unknown:
                raise ValueError(f"sampler_config: unknown keys {unknown}; expected {want}")
        if isinstance(sampler_cfg, dict) and "entropy_bound" in sampler_cfg and "entropy_bound" not in kwargs:
            # the reference's spelling; blockpress's own top-level key, when set, is the newer word
            kwargs["entropy_bound"] = sampler_cfg["entropy_bound"]  # checked like the rest in __post_init__
        return cls(**kwargs)

    @property
    def argmax_candidates(self) -> bool:
        """Candidates are the most likely tokens, not draws (the greedy sampler always takes them)."""
        return self.sampler == "greedy" or self.candidates == "argmax"

    @property
    def penalizes_repeats(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def batch_wide(self) -> SamplerConfig:
        """This config with the per-row settings (ROW_SETTINGS) at their defaults: what the rows of a batch share."""
        defaults: dict[str, Any] = {f.name: f.default for f in fields(self) if f.name in ROW_SETTINGS}
        return replace(self, **defaults)

    def step_choices(self) -> SamplerConfig:
        """This config with every number at its default, its strings and flags kept: what a denoising step given
        CanvasRules' `numbers` (StepNumbers) and `draws` (RowDraws) reads of it, as the numbers come from those
        tensors and the noise and repeat penalties are applied outside the step. torch 2.6's torch.compile guards on
        every field of a frozen dataclass it is passed, read or not (2.13 on the fields read), so passed the config
        itself, a new t_max or frequency_penalty would compile the step again and, past the recompile limit, run it
        eagerly."""
        defaults: dict[str, Any] = {f.name: f.default for f in fields(self) if not isinstance(f.default, (str, bool))}
        return replace(self, **defaults)

    def with_(self, **changes: Any) -> SamplerConfig:
        check_keywords("SamplerConfig", changes, (), [f.name for f in fields(self)],
                       hints={"temperature": TEMPERATURE_HINT})
        kept = {k: v for k, v in changes.items() if v is not None}  # None: not given (the CLI's unset flags)
        if kept.get("sampler") == "confidence" and "rank_by" not in kept:
            kept["rank_by"] = "entropy"  # the default: a checkpoint's ranking, set for its own sampler, means nothing here
        if kept.get("candidates") == "sample" and kept.get("sampler", self.sampler) == "greedy":
            # greedy is entropy_bound with argmax candidates, so it never read this field: asked for draws over a
            # greedy sampler this config holds (a checkpoint's default, as blockpress-code's), the rule becomes
            # entropy_bound, whose draws they are; asked for together with greedy, the two contradict each other
            if "sampler" in kept:
                raise ValueError("candidates: sampler='greedy' takes the most likely candidates and draws none, so "
                                 "candidates='sample' would be ignored; draw them with sampler='entropy_bound' "
                                 "(greedy is entropy_bound with argmax candidates)")
            kept["sampler"] = "entropy_bound"
        if (kept.get("sampler") == "greedy" or kept.get("candidates") == "argmax") and "draw_temperature" not in kept:
            kept["draw_temperature"] = 1.0  # the default: an earlier one was for draws, which argmax candidates are not
        if "t_min" in kept and "t_max" not in kept and is_float32(kept["t_min"]) and kept["t_min"] > self.t_max:
            # __post_init__'s order check names t_max; where t_min alone was given, t_min is the value to change
            raise ValueError(f"t_min: {kept['t_min']} must be <= t_max ({self.t_max}, the setting here)")
        cfg = replace(self, **kept)
        # Checked here, where the settings given are known from the config's own: a checkpoint may keep an
        # entropy_bound that its topk sampler never reads, but one passed with it is a mistake to say.
        for name, readers in READ_BY.items():
            if name in kept and cfg.sampler not in readers:
                whose = "" if "sampler" in kept else " (the default here)"
                raise ValueError(f"{name}: the {cfg.sampler} sampler{whose} does not read it, so {name}={kept[name]!r} "
                                 f"would be ignored; it is read by sampler={' or '.join(map(repr, readers))}")
        return cfg

    def with_temperature(self, temperature: float | None, sampler_given: bool = False) -> SamplerConfig:
        """OpenAI's `temperature` applied (the server's and `blockpress generate --temperature`'s): None keeps
        this config; 0 takes the most likely candidates under this config's own acceptance rule and its settings
        (candidates='argmax'; the greedy sampler is entropy_bound's rule so already). A checkpoint whose default rule
        is topk or confidence keeps it: swapping in greedy dropped the rule and its knobs unread, whether the caller
        named the sampler or sent 0 by habit. T > 0 draws the candidates at T (draw_temperature). A greedy sampler
        then becomes entropy_bound, since greedy is entropy_bound with argmax candidates (so a model that decodes
        greedily by default, blockpress-code, samples as OpenAI's API would), unless `sampler_given` says the caller
        asked for greedy itself: it takes the argmax and this config stays (OpenAI clients send a temperature by
        habit, so it is not refused as a draw_temperature would be); argmax candidates become draws."""
        if temperature is None:
            return self
        check_temperature(temperature)
        if temperature == 0:
            return self if self.sampler == "greedy" else self.with_(candidates="argmax")
        if self.sampler == "greedy" and sampler_given:
            return self
        # It tempers the draws alone: acceptance keeps the schedule. Scaling the schedule would make every position
        # look certain at a low temperature, so a canvas of noise would be accepted in a pass or two.
        return self.with_(sampler="entropy_bound" if self.sampler == "greedy" else None,
                          candidates="sample", draw_temperature=temperature)


def check_row_setting(name: str, value: Any, label: str | None = None) -> float | int:
    """One of ROW_SETTINGS checked, as a plain number (numpy's are not JSON): a SamplerConfig's, or one row's of a
    batch (`label`, e.g. "top_p[2]", names it in the error; default `name`)."""
    label = label or name
    if name == "draw_temperature":
        if not is_float32(value):  # a string, a bool or inf would fail later, deep inside the sampler
            raise ValueError(f"{label}: expected a finite number {IN_FLOAT32}, got {value!r}")
        if value <= 0:
            raise ValueError(f"{label}: expected > 0, got {value} (for the most likely candidates use "
                             "candidates='argmax')")
        return float(value)
    if name == "top_k":
        if not is_int(value) or not 0 <= value <= MAX_COUNT:
            raise ValueError(f"{label}: expected an integer in [0, {MAX_COUNT}] (0: no top-k filter, as is any k at "
                             f"or above the vocabulary's size), got {value!r}")
        return int(value)
    if name == "top_p":
        if not is_finite_number(value) or not 0 < value <= 1:
            raise ValueError(f"{label}: expected a probability in (0, 1] (1: no nucleus filter), got {value!r}")
        return float(value)
    raise ValueError(f"{label}: not a per-row setting; those are {', '.join(ROW_SETTINGS)}")


# Below this a temperature is greedy for any logits a model gives, and dividing by a smaller one overflows
# float32 (a logit of 30 over 1e-45 is inf, and inf - inf is NaN: every token lost).
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class StepNumbers:
    """The numbers of a SamplerConfig that a denoising step only computes with, as 0-d host tensors made once per
    request (`of`; CanvasRules carries them). torch.compile guards on the value of a Python number it reads, not on a
    tensor's: read from the config, each new value (a notebook's t_max 0.8, 0.9, ...; a server's requests) would compile
    the sampler step again, twice (its first step, then the rest), and a few changed settings would pass torch's
    recompile limit, past which the step runs eagerly. On the host, as the Python numbers are: a device op reads them as
    scalars, with no device sync. Each holds the float32 (or int64) value that the step's float32 (int64) arithmetic
    made of the Python number, so a step computes the same bits from either."""

    max_denoising_steps: torch.Tensor  # int64
    t_min: torch.Tensor  # float32
    t_span: torch.Tensor  # float32: t_max - t_min, subtracted in float64 (the reference's Python floats), then rounded
    entropy_bound: torch.Tensor  # float32
    confidence: torch.Tensor  # float32
    stability_threshold: torch.Tensor  # int64
    confidence_threshold: torch.Tensor  # float32

    @classmethod
    def of(cls, cfg: SamplerConfig) -> StepNumbers:
        def f32(x: float) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.float32, device="cpu")

        def i64(x: int) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device="cpu")

        return cls(max_denoising_steps=i64(cfg.max_denoising_steps), t_min=f32(cfg.t_min),
                   t_span=f32(cfg.t_max - cfg.t_min), entropy_bound=f32(cfg.entropy_bound),
                   confidence=f32(cfg.confidence), stability_threshold=i64(cfg.stability_threshold),
                   confidence_threshold=f32(cfg.confidence_threshold))


def temperature(cfg: SamplerConfig | StepNumbers, step: int) -> torch.Tensor:
    """Linear in the remaining steps: t_max at the first step (step = N), t_min + (t_max - t_min)/N at the last;
    never below MIN_TEMPERATURE. A 0-d float32 tensor computed in float32 (step / N, then the schedule), as the
    reference computes it: a float64 temperature differs from it in the last bit at some steps (12 of 48), and
    self-conditioning feeds that bit back until whole generations part (a host tensor: no device sync)."""
    n = cfg if isinstance(cfg, StepNumbers) else StepNumbers.of(cfg)
    fraction = torch.tensor(step, dtype=torch.int32, device="cpu") / n.max_denoising_steps
    return (n.t_min + n.t_span * fraction).clamp_min(MIN_TEMPERATURE)


def probs_and_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities, entropy in nats, argmax) of softmax(logits), float32, from one exponential and one max.

    The probabilities are torch.softmax's, bit for bit what the reference feeds back for self-conditioning in
    float32: a hand-written softmax differs in the last bit, and over a canvas of steps that feedback grows it into
    other tokens. (With bf16 weights the reference rounds the scaled logits to bf16 before its softmax, an error
    of up to 17-37% on probabilities above 1e-3 at temperatures 0.8-0.4; these are computed from the float32
    logits and rounded once, so bf16 runs do not match it bit for bit.) The entropy reuses them: the top token's shifted logit is 0, so log Z = -log(max p), and
    H = log Z - E_p[shifted logit] (log_softmax then exp would cost ~3x on CPU). Banned tokens (-inf logits) are
    clamped to a finite floor: probability 0, entropy term 0, no NaN.
    One max gives the largest logit and the argmax (the first in a tie, as argmax); the largest probability is the
    one at the argmax (softmax keeps the order), bit for bit what amax of the probabilities gives.
    """
    lf = logits.float()
    probs = torch.softmax(lf, dim=-1)
    top, argmax = lf.max(dim=-1, keepdim=True)
    shifted = (lf - top).clamp_(min=-1e30)
    # float32 under a caller's torch.autocast too, which runs vecdot in its lower dtype: the entropy, and the tokens
    # accepted with it, would move where the model's logits are the same bit for bit. (Entered only under one:
    # the block would cost Python calls every step where none is on.)
    calm = torch.autocast(lf.device.type, enabled=False) if torch.is_autocast_enabled(lf.device.type) else nullcontext()
    with calm:
        # E_p[shifted]: vecdot of more than one dim is the product, then its sum; made here in `shifted`'s own memory,
        # bit for bit the same, as vecdot's product would be another [B, C, V] float32 tensor at the step's peak
        # (one dim: vecdot is a BLAS dot, kept)
        dot = torch.linalg.vecdot(probs, shifted) if lf.dim() == 1 else shifted.mul_(probs).sum(-1)
        ent = -probs.gather(-1, argmax).squeeze(-1).log() - dot
    return probs, ent, argmax.squeeze(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits) over the last dim, float32."""
    return probs_and_entropy(logits)[1]


def sample(probs: torch.Tensor, uniforms: torch.Tensor, own_probs: bool = False) -> torch.Tensor:
    """One draw per position from `probs` [..., V] given uniforms [...] in [0, 1): inverse CDF, no host sync.
    `own_probs`: `probs` may be overwritten (the caller reads them no more): the CDF is summed in place.

    (Drawing V exponentials per position for a Gumbel-style race costs ~10x more on CPU.)
    """
    cdf = probs.cumsum_(-1) if own_probs else torch.cumsum(probs, dim=-1)
    total = cdf[..., -1:]
    # u strictly below the total (u * total can round up to it), and the first index whose cdf exceeds u
    # (right=True): a token of probability 0 never has its cdf step above u, so it is never drawn, also at u = 0.
    u = torch.minimum(uniforms.to(cdf.dtype)[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def top_filter(probs: torch.Tensor, top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0,
               k_range: tuple[int, int] | None = None, nucleus: bool | None = None) -> torch.Tensor:
    """`probs` [B, ..., V] with every token outside the top_k most likely (0: no limit) and then outside the nucleus
    of those zeroed: the fewest most likely tokens whose probability reaches top_p of what top_k left (1: no limit).
    `top_k`, `top_p`: one value for every row, or one per row ([B] tensors, RowDraws'); a row at 0 and 1 comes back
    exactly as it was, so it draws what it would unfiltered.
    `k_range`, `nucleus`: the smallest and the largest of the rows' top_k values above 0 ((0, 0): none) and whether
    any row's top_p is below 1, known on the host (RowDraws keeps them); None reads them from `top_k` and `top_p` (a
    device sync when those are device tensors).

    Not renormalised (`sample` draws in proportion to what is left). The most likely token always stays, and ties
    are ranked by token id, as argmax ranks them: top_k=1 keeps exactly the argmax token. What stays is a prefix of
    that order (ending at the first token the nucleus drops), so it is told apart by its last token alone: a
    threshold in vocabulary order, with no scatter back. top_k alone takes torch.topk's k-th value as that
    threshold (no sort of the vocabulary); top_p needs one stable sort and one running sum.
    """
    v = probs.shape[-1]

    def per_row(x: int | float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, ..., 1] against probs (a number: 0-d), so a row's value meets its positions and tokens."""
        x = torch.as_tensor(x, dtype=dtype, device=probs.device)
        return x.view(-1, *[1] * (probs.dim() - 1)) if x.dim() else x

    if k_range is None:
        ks = [x for x in torch.as_tensor(top_k, device="cpu").reshape(-1).tolist() if x > 0]
        k_range = (min(ks), max(ks)) if ks else (0, 0)
    if nucleus is None:
        nucleus = bool((torch.as_tensor(top_p, device="cpu") < 1.0).any())
    k, p = per_row(top_k, torch.long), per_row(top_p, probs.dtype)
    k = torch.where((k > 0) & (k < v), k, v)  # how many tokens top_k leaves (0, or k >= V: all)
    ids = torch.arange(v, device=probs.device)
    if nucleus:
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        ordered = ordered.masked_fill(ids >= k, 0.0)
        # a token stays while the more likely ones before it hold less than top_p of the mass, the first always (by
        # position: a top_p below float32's smallest, 1e-320, is 0 here, and 0 >= 0 would drop every token). At top_p
        # 1 nothing goes: the sum's rounding could otherwise drop the least likely tokens of an unfiltered row.
        before = torch.cumsum(ordered, dim=-1) - ordered
        past = (before >= p * ordered.sum(-1, keepdim=True)) & (ids > 0) & (p < 1.0)
        # The nucleus ends at the first token past it (the running sum's rounding can wobble by an ulp in a long
        # tail of tiny probabilities; a token after the first one dropped never stays).
        n = torch.minimum(torch.where(past.any(-1, keepdim=True), past.byte().argmax(-1, keepdim=True), v), k)
        last = order.gather(-1, n - 1)  # the least likely token kept, and its probability
        cut = ordered.gather(-1, n - 1)
        keep = (probs > cut) | ((probs == cut) & (ids <= last))
    else:
        least, most = k_range
        if least == 0 or least >= v:  # every row's top_k is 0 or reaches V: each keeps every token
            return probs
        # torch.topk's k: the largest top_k, or V where a row's reaches it (that row keeps everything; the others'
        # cut-offs are the same values of a longer top)
        kmax = most if most < v else v
        top = probs.topk(kmax, dim=-1).values  # sorted, most likely first
        cut = top.gather(-1, (k.clamp(max=kmax) - 1).expand(*probs.shape[:-1], 1))
        cut = torch.where(k < v, cut, float("-inf"))  # rows without a top_k keep everything
        # Tokens tied at the cut-off stay by token id, as many as the k leave after the likelier ones.
        # (the running count in int32, which holds any vocabulary's: an int64 one cost a [B, C, V] copy twice the
        # size, each step; a search of the few blocks that can hold ties was 1.2-1.5x faster again at 262k tokens,
        # for 30 lines more: not kept)
        n = k - (top > cut).sum(-1, keepdim=True)
        tied = probs == cut
        keep = (probs > cut) | (tied & (tied.cumsum(-1, dtype=torch.int32) <= n.int()))
    return torch.where(keep, probs, 0.0)


@dataclass(frozen=True)
class RowDraws:
    """Each row's candidate-draw settings (ROW_SETTINGS) as [B] tensors, made once per request: the same values for
    every row (a SamplerConfig's), or each row's own (a server's batch of requests at different temperatures). One
    draw serves both: a scalar setting is the per-row one with every row equal."""

    temperature: torch.Tensor  # [B] float32, > 0: the draw temperature (times the schedule's, in diffusion)
    top_k: torch.Tensor  # [B] int64, 0: no top-k filter
    top_p: torch.Tensor  # [B] float32, 1: no nucleus filter
    # Read on the host once, when made (never inside a step): whether any row tempers its draws, the smallest and
    # the largest top_k above 0 ((0, 0): no row's) and whether any row's top_p is below 1. A batch where none does
    # skips that work, as a single unfiltered request does; one without a nucleus filters by torch.topk, with no
    # sort (`top_filter`). Two numbers, not a row's each nor each value once: torch.compile guards on these, and a
    # tuple as long as the batch (or of the distinct values) would compile the sampler step again for every batch
    # size (or count of values), past torch's recompile limit, after which the step runs eagerly, unsaid.
    tempered: bool
    top_k_range: tuple[int, int]
    nucleus: bool

    @property
    def filtered(self) -> bool:
        return self.nucleus or self.top_k_range[1] > 0

    @classmethod
    def of(cls, cfg: SamplerConfig, batch: int, device: torch.device | str = "cpu",
           draw_temperature: Sequence[float] | None = None, top_k: Sequence[int] | None = None,
           top_p: Sequence[float] | None = None) -> RowDraws:
        """`cfg`'s settings for each of `batch` rows, but where a row has its own (one value per row, or None: cfg's
        for all), each checked as SamplerConfig checks its own."""
        def rows(name: str, given: Sequence[Any] | None) -> list[Any]:
            if given is None:
                return [getattr(cfg, name)] * batch
            if len(given) != batch:
                raise ValueError(f"{name}: expected one per row ({batch}), got {len(given)}")
            return [check_row_setting(name, x, f"{name}[{i}]") for i, x in enumerate(given)]

        temps, ks, ps = rows("draw_temperature", draw_temperature), rows("top_k", top_k), rows("top_p", top_p)
        filtering = [k for k in ks if k > 0]
        return cls(torch.tensor(temps, dtype=torch.float32, device=device),
                   torch.tensor(ks, dtype=torch.long, device=device),
                   torch.tensor(ps, dtype=torch.float32, device=device),
                   tempered=any(t != 1.0 for t in temps),
                   top_k_range=(min(filtering), max(filtering)) if filtering else (0, 0),
                   nucleus=any(p < 1.0 for p in ps))

    def take(self, rows: torch.Tensor) -> RowDraws:
        """The rows `rows` only (a batch that shrank); the host flags stay the batch's (a row they no longer
        concern draws the same either way)."""
        return replace(self, temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows])


def candidate_probs(draws: RowDraws, logits: torch.Tensor, probs: torch.Tensor | None = None,
                    own_logits: bool = False) -> torch.Tensor:
    """What candidates are drawn from (pass to `sample`): softmax(logits / each row's draw temperature), filtered
    by its top_k and top_p. Both engines draw through it: `denoise_step` with the schedule's tempered logits
    [B, C, V], `run_ar` with the raw ones [B, V] (AR has no schedule: its temperature is the draw temperature).
    `probs`: softmax(logits), when the caller has it already (reused where every row draws at temperature 1).
    `own_logits`: `logits` may be overwritten (the caller reads them no more), so the temperature divides them in
    place rather than in another tensor of their size."""
    if probs is None or draws.tempered:
        t = draws.temperature.clamp(min=MIN_TEMPERATURE).view(-1, *[1] * (logits.dim() - 1))
        scaled = logits.float()  # (a copy already where the logits are not float32)
        scaled = scaled.div_(t) if own_logits or scaled is not logits else scaled / t
        # clamped: a huge finite logit (a logits processor's way to favour a token) overflows to +inf below
        # t = 1, and a softmax of +inf is NaN, drawn as the vocabulary's last token
        probs = torch.softmax(scaled.clamp_(max=torch.finfo(torch.float32).max), dim=-1)
    if not draws.filtered:
        return probs
    return top_filter(probs, draws.top_k, draws.top_p, k_range=draws.top_k_range, nucleus=draws.nucleus)


def penalize_repeats(cfg: SamplerConfig, logits: torch.Tensor, history: torch.Tensor,
                     canvas: torch.Tensor | None = None, counted: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` [b, C, V] (or [b, V]) less the presence and frequency penalties (a new tensor).

    history: [b, V] float, how often each token appears in the text so far (committed tokens).
    canvas, counted: [b, C] tokens and bool, the canvas positions whose tokens count too; each position sees
    the counts without its own token, so a settled token is not pushed away from itself.
    """
    if not cfg.penalizes_repeats:
        return logits
    counts = history
    if canvas is not None and counted is not None:
        counts = history.scatter_add(-1, canvas, counted.to(history.dtype))

    def penalty(n: torch.Tensor) -> torch.Tensor:
        return cfg.presence_penalty * (n > 0).to(n.dtype) + cfg.frequency_penalty * n

    bias = penalty(counts).to(logits.dtype)
    out = logits - (bias[:, None] if logits.dim() == 3 else bias)
    if canvas is not None and counted is not None:
        own = counts.gather(-1, canvas)  # [b, C]: the count of each position's own token, itself included
        give_back = (penalty(own) - penalty(own - 1.0)) * counted.to(own.dtype)
        out.scatter_add_(-1, canvas[..., None], give_back[..., None].to(out.dtype))
    return out


def accept_entropy_bound(ent: torch.Tensor, bound: float | torch.Tensor, rank: torch.Tensor | None = None,
                         within: torch.Tensor | None = None) -> torch.Tensor:
    """Accept positions in order of `rank` (default: the entropies themselves, lowest first) while the
    entropies taken so far, less the last one, sum to <= bound: the first in order is always accepted.
    `within`: [B, C] bool, the positions that may be accepted (None: all); the others rank last, add nothing to the
    sum and are never accepted."""
    key = ent  # what orders the positions where no rank is given
    if within is not None:  # where every position is within, the keys and the order are the ones without it
        rank = None if rank is None else torch.where(within, rank, torch.inf)
        key = torch.where(within, ent, torch.inf)
        ent = torch.where(within, ent, 0.0)
    if rank is None:
        order = torch.sort(key, dim=-1).indices
    else:  # stable, so equal keys (the decided positions) keep their left-to-right order
        order = torch.argsort(rank, dim=-1, stable=True)
    ordered = ent.gather(-1, order)
    keep_ordered = (torch.cumsum(ordered, dim=-1) - ordered) <= bound
    accept = torch.zeros_like(keep_ordered).scatter(-1, order, keep_ordered)
    return accept if within is None else accept & within


def accept_confidence(top_prob: torch.Tensor, threshold: float | torch.Tensor, free: torch.Tensor,
                      within: torch.Tensor | None = None) -> torch.Tensor:
    """Accept positions whose top probability >= threshold, and always the single most confident free one.
    `within`: [B, C] bool, the positions that may be accepted (None: all)."""
    if within is not None:
        free = free & within
    best = torch.where(free, top_prob, -1.0).argmax(dim=-1, keepdim=True)
    accept = (top_prob >= threshold) | torch.zeros_like(free).scatter(-1, best, True)
    return accept if within is None else accept & within


def accept_topk(uncertainty: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """Accept the `count` least uncertain positions (an int, or [B, 1] per row): a fixed commit schedule."""
    order = torch.argsort(uncertainty, dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank < count


def top2_margin(probs: torch.Tensor) -> torch.Tensor:
    """p(most likely token) - p(second most likely) per position, in [0, 1]."""
    top2 = probs.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def _uncertainty(rank_by: str, ent: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[B, C] sort key, lowest accepted first: entropy, 1 - top-2 margin, or the position itself."""
    if rank_by == "entropy":
        return ent
    if rank_by == "margin":
        return 1.0 - top2_margin(probs)
    return torch.arange(ent.shape[-1], device=ent.device, dtype=ent.dtype).expand_as(ent)


def topk_count(cfg: SamplerConfig | StepNumbers, step: int, free_positions: int | torch.Tensor) -> int | torch.Tensor:
    """How many free positions the topk schedule accepts at `step` (N..1): a linear ramp to all at the end.

    `free_positions` may be a tensor (per row): rows of a constrained canvas have different numbers of holes."""
    n = cfg.max_denoising_steps
    return (free_positions * (n - step + 1) + n - 1) // n


_MASK47 = (1 << 47) - 1


def _hash(seed: torch.Tensor, stream: int, canvas_index: int, step: int, length: int) -> torch.Tensor:
    """Counter-based pseudo-random 47-bit integers [B, length] from (row seed, stream, canvas, step, position).

    Every random number `generate` draws comes from here (only a direct `denoise_step` call without `uniforms`
    uses torch's generator), so a row's output depends on its own seed only:
    never on its neighbours in a batch, nor on how many rows there are.
    """
    pos = torch.arange(length, device=seed.device, dtype=torch.int64)
    # Python ints are unbounded: mask the counter's product before it meets int64, which a long generation's
    # would overflow. Only the low 47 bits matter, and int64 addition keeps them, so the mask changes no draw.
    counter = (((canvas_index * 1_000_003 + step) * 4 + stream) * 0x85EBCA6B) & _MASK47
    # Seeds below 2**47 are themselves; the bits above are spread by an odd multiplier, not xored into the low
    # bits (which would make seed 1 and seed 2**47 draw the same numbers).
    folded = ((seed & _MASK47) + (seed >> 47) * 0x5DEECE66D) & _MASK47
    x = folded[:, None] * 0x9E3779B1 + counter + pos[None, :] * 0xC2B2AE35
    x = x & _MASK47
    for _ in range(3):  # xorshift-multiply rounds; kept inside 47 bits so int64 never overflows
        x = (x ^ (x >> 17)) * 0x2545F49
        x = x & _MASK47
    return x ^ (x >> 23)


def hashed_tokens(seed: torch.Tensor, canvas_index: int, step: int, length: int, vocab: int) -> torch.Tensor:
    """Uniform random tokens [B, length] (initial canvas and re-noising)."""
    return _hash(seed, 0, canvas_index, step, length) % vocab


def noise_tokens(cfg: SamplerConfig, seed: torch.Tensor, canvas_index: int, step: int, length: int,
                 vocab: int) -> torch.Tensor:
    """The noise of one step [B, length]: uniform tokens (noise_token_id None or -1), or the model's one noise token
    (absorbing noise)."""
    if cfg.noise_token_id is None or cfg.noise_token_id < 0:
        return hashed_tokens(seed, canvas_index, step, length, vocab)
    return torch.full((seed.shape[0], length), cfg.noise_token_id, dtype=torch.long, device=seed.device)


def hashed_uniforms(seed: torch.Tensor, canvas_index: int, step: int, length: int) -> torch.Tensor:
    """Uniform floats in [0, 1) [B, length] (one per position: the sampling draw)."""
    # float32 holds these 24-bit fractions exactly; float64 would fail on MPS, which has none
    return (_hash(seed, 1, canvas_index, step, length) >> 23).float() / float(1 << 24)


@dataclass
class CanvasState:
    """The denoising state of one canvas for a batch. Updated functionally by `denoise_step`."""

    canvas: torch.Tensor  # [B, C] tokens fed to the next decoder pass
    argmax: torch.Tensor  # [B, C] current best guess (what gets committed)
    sc_probs: torch.Tensor | None  # [B, C, V] softmax of the last step's temperature-scaled logits (self-conditioning)
    stable_steps: torch.Tensor  # [B] consecutive steps with an unchanged argmax
    done: torch.Tensor  # [B] bool: adaptive stop reached
    # [B] positions the last step's rule accepted (for streaming / stats): with keep_accepted only the new ones (a
    # token held from an earlier step is not accepted again), never a template's given tokens
    accepted: torch.Tensor
    settled: torch.Tensor  # [B, C] bool: positions holding an accepted or fixed token (the rest is noise)


# CanvasState's [B, ...] tensors but sc_probs (which may be None): what take_rows and put_rows move
_ROW_TENSORS = ("canvas", "argmax", "stable_steps", "done", "accepted", "settled")


def take_rows(state: CanvasState, rows: torch.Tensor) -> CanvasState:
    """The state of the rows `rows` only (a sub-batch)."""
    sc = None if state.sc_probs is None else state.sc_probs.index_select(0, rows)
    return CanvasState(sc_probs=sc, **{n: getattr(state, n).index_select(0, rows) for n in _ROW_TENSORS})


def put_rows(state: CanvasState, rows: torch.Tensor, sub: CanvasState) -> CanvasState:
    """`state` with the rows `rows` replaced by the sub-batch state `sub` (a new state; `state` is kept).

    The result carries no self-conditioning probabilities: it is for reading (drafts, the commit), while
    denoising continues on `sub`, which keeps them.
    """
    return CanvasState(sc_probs=None, **{n: getattr(state, n).index_copy(0, rows, getattr(sub, n)) for n in _ROW_TENSORS})


def init_state(canvas: torch.Tensor, fixed: torch.Tensor | None = None) -> CanvasState:
    """The state before the first step: `canvas` is noise, except at the `fixed` positions (>= 0)."""
    b = canvas.shape[0]
    zeros = torch.zeros(b, dtype=torch.long, device=canvas.device)
    settled = torch.zeros_like(canvas, dtype=torch.bool)
    if fixed is not None:
        settled = fixed >= 0
        canvas = torch.where(settled, fixed, canvas)
    # a tensor of its own each: torch.compile guards on which inputs alias, and stable_steps and accepted sharing
    # one zeros tensor here, then coming back from a step as two, would compile the step again
    return CanvasState(canvas=canvas, argmax=canvas.clone(), sc_probs=None, stable_steps=zeros, done=zeros.bool(),
                       accepted=zeros.clone(), settled=settled)


@dataclass(frozen=True)
class CanvasRules:
    """What holds at every step of one canvas beside the sampler's settings: the positions given and kept, each
    row's draws, and how the decoding loop hands over its tensors. The defaults are a free canvas of one request."""

    # [B, C] token ids at constrained positions, -1 at free ones (templates, infilling)
    fixed: torch.Tensor | None = None
    # [B, C] bool, the positions kept (within max_new_tokens): only these are accepted and count for the stop test;
    # the others stay noise
    scored: torch.Tensor | None = None
    draws: RowDraws | None = None  # each row's draw temperature, top_k and top_p (None: cfg's for every row)
    sc_dtype: torch.dtype = torch.float32  # the self-conditioning probabilities' (the model's dtype)
    # A row's next logits may depend on other rows (a logits processor sees the whole batch, as the sudoku ensemble
    # mixes them), so a done row keeps its self-conditioning input. Otherwise a done row's logits are never read
    # (its state is frozen), and the [B, C, V] copy that kept it is skipped.
    rows_mix: bool = True
    # The sampler's numbers as tensors, StepNumbers.of(cfg) of the cfg the step is given, made once per request (None:
    # made at every step): a compiled step then compiles once for every value of them.
    numbers: StepNumbers | None = None


FREE_CANVAS = CanvasRules()


def denoise_step(
    cfg: SamplerConfig,
    state: CanvasState,
    raw_logits: torch.Tensor,
    step: int,
    noise: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    rules: CanvasRules = FREE_CANVAS,
    own_logits: bool = False,
) -> CanvasState:
    """One step of the sampler. Pure: returns a new state.

    noise:  [B, C] what the positions not accepted this step become: random tokens, or the absorbing noise token.
    uniforms: [B, C] in [0, 1), the sampling draws (not needed in greedy mode; fresh torch.rand if None).
    rules:  the canvas's givens, kept positions and per-row draws (CanvasRules).
    own_logits: the step may overwrite `raw_logits` (the decoding loop's own, made for this step): the temperature
            divides them in place instead of making another [B, C, V] tensor.
    """
    fixed, scored, draws = rules.fixed, rules.scored, rules.draws
    # cfg's numbers are read from these tensors alone (see StepNumbers); cfg's strings and flags choose the code
    numbers = StepNumbers.of(cfg) if rules.numbers is None else rules.numbers
    t = temperature(numbers, step)
    logits = raw_logits.div_(t) if own_logits else raw_logits / t
    logits.clamp_(max=torch.finfo(logits.dtype).max)  # see candidate_probs
    free = torch.ones_like(state.canvas, dtype=torch.bool) if fixed is None else fixed < 0
    # Positions already decided: the givens, and with keep_accepted every token accepted at an earlier step.
    held = state.settled | ~free if cfg.keep_accepted else ~free
    kept = held & free
    probs, ent, best = probs_and_entropy(logits)  # one softmax serves sampling, acceptance and stopping
    ent_open = torch.where(held, 0.0, ent)  # decided positions are certain
    argmax = torch.where(kept, state.canvas, best)
    if cfg.argmax_candidates:
        candidates = argmax
    else:
        # The draw temperature and filters shape the draws alone; the schedule's `probs` still rank and condition.
        if draws is None:
            draws = RowDraws.of(cfg, argmax.shape[0], argmax.device)
        # The logits are read no more (the step's own, or its tempered copy): the draw temperature divides them in
        # place. Candidates drawn from another softmax than `probs` (tempered, filtered) are summed in place too.
        drawn_from = candidate_probs(draws, logits, probs, own_logits=True)
        drawn = sample(drawn_from, torch.rand(argmax.shape, device=argmax.device) if uniforms is None else uniforms,
                       own_probs=drawn_from is not probs)
        candidates = torch.where(kept, state.canvas, drawn)

    # Positions past max_new_tokens are cut away: no rule ranks them (they stay noise), so they neither use up a
    # step's acceptance nor push a kept position back (a few new tokens of a long canvas would otherwise take
    # about one pass each). Decided ones stay in.
    within = None if scored is None else scored | held
    if cfg.sampler in ("entropy_bound", "greedy"):
        # Decided positions rank first (-1) and add no entropy, so they never use up the bound.
        rank = None if cfg.rank_by == "entropy" else torch.where(held, -1.0, _uncertainty(cfg.rank_by, ent, probs))
        accept = accept_entropy_bound(ent_open, numbers.entropy_bound, rank, within)
    elif cfg.sampler == "confidence":
        accept = accept_confidence(probs.gather(-1, best[..., None])[..., 0], numbers.confidence, free & ~kept, within)
    elif cfg.sampler == "topk":
        # The ramp runs over each row's free positions it may accept; decided ones sort first (-1) and are always
        # in, the ones it may not sort last and are never reached.
        uncertainty = torch.where(held, -1.0, _uncertainty(cfg.rank_by, ent, probs))
        rankable = free
        if within is not None:
            uncertainty = torch.where(within, uncertainty, torch.inf)
            rankable = free & within
        n_free = rankable.sum(-1, keepdim=True)
        accept = accept_topk(uncertainty, topk_count(numbers, step, n_free) + (free.shape[-1] - free.sum(-1, keepdim=True)))
    else:  # a rule added to SAMPLERS without its branch here would otherwise run as another's without a word
        raise ValueError(f"sampler: {cfg.sampler!r} has no acceptance rule in denoise_step")
    accept = accept | kept  # a kept token stays whatever the rule says

    canvas = torch.where(accept, candidates, noise)
    if fixed is not None:
        canvas = torch.where(free, canvas, fixed)
        argmax = torch.where(free, argmax, fixed)

    # Stable and confident where it counts: positions past max_new_tokens are cut away, so their churn must not
    # hold the canvas (a short answer would wait on the positions it throws away).
    agree = argmax == state.argmax if scored is None else (argmax == state.argmax) | ~scored
    same = agree.all(dim=-1) & (step < numbers.max_denoising_steps)  # the first step has no "before"
    stable_steps = torch.where(same, state.stable_steps + 1, 0)
    weight = (free if scored is None else free & scored).float()
    mean_ent = (ent_open * weight).sum(-1) / weight.sum(-1).clamp(min=1.0)
    stop = (stable_steps >= numbers.stability_threshold) & (mean_ent < numbers.confidence_threshold)
    if not cfg.adaptive_stopping:
        stop = torch.zeros_like(stop)

    # Rows that already stopped keep everything they had (the batch still computes them).
    done = state.done
    keep = done[:, None]
    sc_probs = probs.to(rules.sc_dtype) if cfg.self_conditioning else None  # off: nothing to keep for the next pass
    # rows_mix first: torch.compile guards on what the step reads, and reading state.sc_probs (None at a canvas's
    # first step) would make the compiled step two graphs, the first step's and the rest's, for every choice of code
    if rules.rows_mix and sc_probs is not None and state.sc_probs is not None:
        sc_probs = torch.where(keep[..., None], state.sc_probs, sc_probs)
    return CanvasState(
        canvas=torch.where(keep, state.canvas, canvas),
        argmax=torch.where(keep, state.argmax, argmax),
        sc_probs=sc_probs,
        stable_steps=torch.where(done, state.stable_steps, stable_steps),
        done=done | stop,
        # `accept` holds the kept and the given positions too, which were not accepted at this step; a row that has
        # stopped accepts none (else it repeats its last step's count, and a canvas's Drafts add up past its length)
        accepted=(accept & ~held & ~keep).sum(-1),
        settled=torch.where(keep, state.settled, accept | ~free),
    )


def choice_seed(seed: int, i: int) -> int:
    """The seed of a request's choice i (the server's n, generate's num_return_sequences): the request's own for
    the first; a hash of both for the rest, so that choice 1 of seed 7 is not the answer to seed 8 (clients often
    number their requests' seeds)."""
    if i == 0:
        return seed
    x = (seed ^ (i * 0x9E3779B97F4A7C15)) & (2**64 - 1)  # splitmix64's finaliser
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) % 2**63
