"""config.py and checks.py at their edges, and against the reference's config class: the defaults a config.json
may leave out (rope entries, the layer pattern), the older rope spelling beside the new, token ids and windows at their
bounds, and how text that is not valid UTF-8 is named (from a mutation hunt: each test kills a mutant the rest of the
suite let live)."""
import json
import warnings

import numpy as np
import pytest

from blockpress.checks import utf8_problem
from blockpress.config import FULL, SLIDING, ConfigError, ModelConfig


def test_a_config_without_rope_parameters_draws_the_references_defaults():
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = DiffusionGemmaTextConfig(num_hidden_layers=3, layer_types=[SLIDING, SLIDING, FULL])
    assert ModelConfig.tiny().text.resolved_rope_parameters == ref.rope_parameters


@pytest.mark.parametrize("layers", [1, 5, 6, 7, 12, 13])
def test_a_config_without_layer_types_draws_the_references_pattern(layers):
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = DiffusionGemmaTextConfig(num_hidden_layers=layers)
        ours = ModelConfig.tiny(num_hidden_layers=layers, layer_types=None)
    assert ours.text.resolved_layer_types == ref.layer_types


def test_rope_type_beside_the_older_type_wins_as_in_transformers():
    """transformers reads `type` only where no `rope_type` is given (rope_parameters.setdefault("rope_type", ...))."""
    rope = {SLIDING: {"type": "linear", "factor": 4.0, "rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"type": "linear", "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    text = ModelConfig.tiny(rope_parameters=rope).text
    assert [text.resolved_rope_parameters[k]["rope_type"] for k in (SLIDING, FULL)] == ["default", "proportional"]
    only_type = {SLIDING: {"type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    assert ModelConfig.tiny(rope_parameters=only_type).text.resolved_rope_parameters[SLIDING]["rope_type"] == "linear"


@pytest.mark.parametrize("name, value", [("pad_token_id", 128), ("bos_token_id", 128), ("eos_token_id", 128),
                                         ("eos_token_id", [1, 128])])
def test_a_token_id_of_vocab_size_is_refused(name, value):
    # (nn.Embedding's padding_idx, and any id the model emits, lie in [0, vocab_size): tiny's vocab is 128)
    with pytest.raises(ConfigError, match=f"^text_config.{name}: expected a token id"):
        ModelConfig.tiny(**{name: value})
    assert ModelConfig.tiny(**{name: 127 if name != "eos_token_id" or not isinstance(value, list) else [1, 127]})


def test_a_one_token_window_is_refused_only_where_a_layer_slides():
    with pytest.raises(ConfigError, match="sliding_window: expected at least 2"):
        ModelConfig.tiny(sliding_window=1)
    assert ModelConfig.tiny(sliding_window=1, layer_types=[FULL] * 3)  # nothing reads it, as in the reference


def test_a_proportional_rope_may_rotate_no_angle():
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.0, "rope_theta": 1e6}}
    assert ModelConfig.tiny(rope_parameters=rope)
    rope["full_attention"]["partial_rotary_factor"] = -0.01
    with pytest.raises(ConfigError, match="partial_rotary_factor: expected a fraction"):
        ModelConfig.tiny(rope_parameters=rope)


def test_a_top_level_partial_rotary_factor_of_one_loads_beside_a_default_entry():
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=6,
                num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                layer_types=["sliding_attention", "full_attention"], partial_rotary_factor=1.0,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                 "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}})
    rope = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": text}).text.resolved_rope_parameters
    assert rope["sliding_attention"]["partial_rotary_factor"] == rope["full_attention"]["partial_rotary_factor"] == 1.0


def test_surrogates_are_named_as_bytes_only_where_surrogateescape_made_them():
    assert utf8_problem("ab\udcff") == "byte 0xff at character 2"
    assert utf8_problem("ab\udc80") == "byte 0x80 at character 2"
    assert utf8_problem("ab\udc41") == "lone surrogate U+DC41 at character 2"
    assert utf8_problem("ab\ud800") == "lone surrogate U+D800 at character 2"


def test_a_config_saves_into_a_folder_as_its_config_json(tmp_path):
    """ModelConfig.save took a file only: a folder (what lm.save and save_pretrained take) was an IsADirectoryError."""
    cfg = ModelConfig.tiny()
    cfg.save(tmp_path)
    assert ModelConfig.from_file(tmp_path / "config.json").to_dict() == cfg.to_dict()
    cfg.save(tmp_path / "other.json")
    assert ModelConfig.from_file(tmp_path / "other.json").to_dict() == cfg.to_dict()
    cfg.save(f"{tmp_path / 'new' / 'model'}/")  # a folder not there yet, as save_pretrained("new_model/") makes it
    assert ModelConfig.from_file(tmp_path / "new" / "model" / "config.json").to_dict() == cfg.to_dict()


def test_numpy_numbers_are_taken_as_the_python_numbers_they_are():
    """np.int64(128) was refused as "text_config.vocab_size: expected a positive integer, got np.int64(128)" and
    np.float32(1e-6) as "rms_norm_eps: expected a positive finite number"; taken, they are kept as Python numbers,
    which config.json is written with."""
    cfg = ModelConfig.tiny(vocab_size=np.int64(128), rms_norm_eps=np.float32(1e-6), canvas_length=np.int32(8))
    assert (type(cfg.text.vocab_size), type(cfg.text.rms_norm_eps), type(cfg.canvas_length)) == (int, float, int)
    assert cfg.text.vocab_size == 128 and cfg.text.rms_norm_eps == float(np.float32(1e-6))
    assert json.loads(json.dumps(cfg.to_dict()))["text_config"]["vocab_size"] == 128
    with pytest.raises(ConfigError, match="text_config.tie_word_embeddings: expected true or false"):
        ModelConfig.tiny(tie_word_embeddings=np.int64(1))  # a number is no flag
