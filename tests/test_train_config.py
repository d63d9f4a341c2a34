"""TrainConfig's bounds at their edges (test_bad_train_config pins values far outside them), each window setting
refused on examples alone, and LoRA targets named twice (from a mutation hunt: each case kills a mutant of
train_config.py that moved one bound by one)."""
import json
from dataclasses import asdict

import numpy as np
import pytest

from blockpress.train_config import TrainConfig, lora_modules


@pytest.mark.parametrize("kwargs, field", [
    (dict(t_eps=0.5), r"t_eps: expected in \(0, 0.5\)"),           # U(0.5, 0.5): every example at one noise level
    (dict(t_eps=0.0), r"t_eps: expected in \(0, 0.5\)"),
    (dict(lr=0.0), "lr: expected > 0"),
    (dict(noise_token_id=-2), "noise_token_id: expected -1"),
    (dict(heldout=1.0), r"heldout: expected a fraction in \[0, 1\)"),  # everything held out: nothing to train on
    (dict(heldout_data=""), "heldout_data: expected a path"),
    (dict(prompt_min=0), "prompt_min/prompt_max: need 0 < prompt_min"),
    (dict(prompt_min=9, prompt_max=8), "prompt_min/prompt_max"),
    (dict(response_canvases=0), "response_canvases: expected a positive integer"),
    (dict(beta1=1.0), "beta1"),
    (dict(max_minutes=-1.0), "max_minutes"),
    (dict(diffusion_weight=0.0, aux_ar_weight=0.0), "diffusion_weight/aux_ar_weight: must be >= 0 and not both 0"),
    (dict(quantize="int8"), "quantize: 'int8' trains LoRA adapters .* needs lora_rank > 0"),
])
def test_train_config_bounds_refused_at_their_edge(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(t_eps=0.499), dict(noise_token_id=-1), dict(noise_token_id=0), dict(heldout=0.0), dict(heldout=0.999),
    dict(prompt_min=1, prompt_max=1), dict(seed=2**63 - 1), dict(seed=0), dict(min_lr_ratio=1.0), dict(min_lr_ratio=0.0),
    dict(self_conditioning_prob=1.0), dict(self_conditioning_prob=0.0), dict(batch_size=4, micro_batch_size=4),
    dict(eval_batches=0), dict(grad_clip=0.0), dict(weight_decay=0.0), dict(beta1=0.0),
    dict(diffusion_weight=0.0), dict(aux_ar_weight=0.0), dict(max_minutes=0.5, time_schedule=True),
    dict(lora_rank=4, quantize="int4"), dict(lora_rank=4, lora_targets="q_proj,q_proj"),
])
def test_train_config_bounds_taken_at_their_edge(kwargs):
    assert TrainConfig(**kwargs)


def test_window_settings_each_refused_on_examples():
    for name, value in (("prompt_min", 4), ("prompt_max", 32), ("response_canvases", 2)):
        with pytest.raises(ValueError, match=f"^{name}: for running text"):
            TrainConfig(**{name: value}).check_examples()
    TrainConfig().check_examples()  # the defaults are no setting


def test_a_target_named_twice_is_adapted_once():
    assert lora_modules("q_proj, q_proj,down_proj") == ["q_proj", "mlp.down_proj"]


def test_numpy_floats_are_kept_as_python_floats():
    """np.float32 passes a float field's check, and was kept: a run trained up to its first metrics row and then
    failed there, "Object of type float32 is not JSON serializable" (train_config.json would have too)."""
    sweep = np.linspace(1e-4, 1e-3, 3, dtype=np.float32)
    cfg = TrainConfig(lr=sweep[1], heldout=np.float16(0.25), t_eps=np.float32(0.01), lora_rank=4,
                      lora_alpha=np.float32(8))
    for name in ("lr", "heldout", "t_eps", "lora_alpha"):
        assert type(getattr(cfg, name)) is float, name
    assert cfg.lr == float(sweep[1]) and json.loads(json.dumps(asdict(cfg)))["heldout"] == 0.25


def test_numpy_integers_are_taken_as_python_ints():
    """np.int64 (an array's arithmetic) was refused with "steps: expected an integer, got np.int64(10)", though the
    generation API takes numpy integers everywhere; taken, it is kept as the Python int train_config.json writes."""
    cfg = TrainConfig(steps=np.int64(10), seed=np.uint32(1), micro_batch_size=np.int8(2), lr=np.int64(1))
    assert (cfg.steps, cfg.seed, cfg.micro_batch_size) == (10, 1, 2)
    assert all(type(getattr(cfg, name)) is int for name in ("steps", "seed", "micro_batch_size", "lr"))
    json.dumps(asdict(cfg))
    with pytest.raises(ValueError, match="steps: expected an integer, got np.True_"):  # not a bool for a number
        TrainConfig(steps=np.True_)


def test_an_integer_past_a_floats_range_is_refused_by_name_not_overflowerror():
    """math.isfinite(10**400) raises OverflowError: a settings file with a 400-digit lora_alpha ended in a bare
    traceback, from TrainConfig as from SamplerConfig's top_p and the penalties (is_finite_number under them all)."""
    from blockpress.sampling import SamplerConfig

    for field in ("heldout", "lora_alpha"):
        with pytest.raises(ValueError, match=rf"^{field}: expected a finite number"):
            TrainConfig(**{field: 10**400})
    for field in ("top_p", "presence_penalty", "t_max"):
        with pytest.raises(ValueError, match=rf"^{field}: "):
            SamplerConfig(**{field: 10**400})
