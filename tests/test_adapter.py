"""A LoRA run's PEFT adapter folder: peft runs it on the reference model, blockpress merges it back, and an adapter
that does not fit the base is refused by name."""

import codecs
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockpress
from blockpress.data import Example
from blockpress.train import ExampleSource, TrainConfig, Trainer

pytest.importorskip("peft")
pytest.importorskip("transformers")
TOL = 1e-4  # test_parity's: blockpress against the reference in float32

EXAMPLES = [Example([2, 5 + i], [10 + i, 11 + i, 12 + i, 13 + i, 20, 21 - i]) for i in range(4)]


def load(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference checkpoint's vision tower, kept aside
        return blockpress.load(path, **kwargs)


@pytest.fixture(scope="module")
def run(ref_checkpoint, tmp_path_factory):
    """(base folder, the LoRA run's --out) after a few steps on the reference checkpoint."""
    base, _ = ref_checkpoint
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = TrainConfig(steps=3, batch_size=4, lora_rank=4, lr=1e-2, warmup_steps=1)
    Trainer(load(base), ExampleSource(EXAMPLES, 0), cfg, out, progress=False).train()
    return base, out


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 96, (2, 5), generator=g), torch.randint(0, 96, (2, 8), generator=g)


def test_peft_runs_the_exported_adapter_on_the_reference_as_blockpress_runs_the_merged_checkpoint(run):
    from peft import PeftModel
    from transformers import DiffusionGemmaForBlockDiffusion

    base, out = run
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 4
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(base).eval()
    names = {name for name, _ in reference.named_modules()}
    assert set(config["target_modules"]) <= names  # the reference's own module names, encoder and decoder alike
    assert any(".encoder." in t for t in config["target_modules"]) and any(".decoder." in t for t in config["target_modules"])
    prompt, canvas = inputs()
    with torch.no_grad():
        plain = reference(input_ids=prompt, decoder_input_ids=canvas).logits
        adapted = PeftModel.from_pretrained(reference, out / "adapter").eval()
        with_adapter = adapted(input_ids=prompt, decoder_input_ids=canvas).logits
    merged = load(out).logits(prompt, canvas)
    assert (with_adapter - merged).abs().max() <= TOL
    assert (plain - merged).abs().max() > 100 * TOL  # the adapter did change the model


def test_blockpress_merges_the_adapter_into_its_base_as_the_run_did(run):
    base, out = run
    merged, again = load(out), load(base, adapter=out / "adapter")
    assert again.dtype == merged.dtype == torch.float32
    expected = merged.model.state_dict()
    assert set(again.model.state_dict()) == set(expected)
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    prompt, canvas = inputs()
    assert torch.equal(again.logits(prompt, canvas), merged.logits(prompt, canvas))


def test_a_merge_over_a_bf16_base_widened_for_this_cpu_saves_the_merged_float32_weights(run, tmp_path, monkeypatch):
    """load(bf16 base, adapter=...) on a CPU without native bf16 merges in float32; save wrote the stored bf16 back
    (the load's widened_from), rounding the update to the base weights' step (blockpress-code after 4 LoRA steps:
    33% of the updated entries equal to the base again). The merged weights are not the checkpoint's: save writes
    them as the model holds them, as a LoRA run's merged checkpoint is float32."""
    from saved import saved_dtype

    from blockpress import checkpoint

    base, out = run
    bf16 = tmp_path / "bf16"
    load(base, dtype="bfloat16").save(bf16)
    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: False)
    lm = load(bf16, adapter=out / "adapter")
    assert lm.dtype == torch.float32
    lm.save(tmp_path / "merged")
    assert saved_dtype(tmp_path / "merged") == torch.float32
    saved = load(tmp_path / "merged").model.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in lm.model.state_dict().items())
    assert not torch.equal(saved["layers.0.self_attn.q_proj.weight"],
                           load(bf16).model.state_dict()["layers.0.self_attn.q_proj.weight"])


DECODER_Q = "base_model.model.model.decoder.layers.0.self_attn.q_proj"
ENCODER_Q = "base_model.model.model.encoder.language_model.layers.0.self_attn.q_proj"


def edit_config(**changes):
    return lambda config, tensors: config.update(changes)


def drop_encoder(config, tensors):
    for key in [k for k in tensors if ".encoder." in k]:
        del tensors[key]


def untie(config, tensors):
    tensors[f"{ENCODER_Q}.lora_B.weight"] = tensors[f"{ENCODER_Q}.lora_B.weight"] + 1


def vision_target(config, tensors):
    tensors["base_model.model.model.encoder.vision_tower.encoder.layers.0.self_attn.q_proj.linear.lora_A.weight"] = \
        torch.zeros(4, 16)


def experts_target(config, tensors):  # peft's target_parameters on the routed experts' 3-D weights
    tensors["base_model.model.model.decoder.layers.0.experts.lora_A.weight"] = torch.zeros(4, 32)


def other_rank(config, tensors):
    tensors[f"{DECODER_Q}.lora_A.weight"] = torch.zeros(2, 32)
    tensors[f"{ENCODER_Q}.lora_A.weight"] = torch.zeros(2, 32)


@pytest.mark.parametrize("mutate, message", [
    (edit_config(r=8), r"layers\.0\.\S+\.lora_A\.weight: shape \[4, (\d+)\]; r=8 on this base needs \[8, \1\]"),
    (other_rank, r"q_proj\.lora_A\.weight: shape \[2, 32\]; r=4 on this base needs \[4, 32\]"),
    (drop_encoder, r"adapts 'model\.decoder\.layers\.\d+\..+' but not 'model\.encoder\.language_model\.layers.+: "
                   r"the reference's encoder and decoder share these weights and blockpress runs both on one module, "
                   r"so both must change alike"),
    (untie, r"'model\.encoder\.language_model\.layers\.0\.self_attn\.q_proj' is adapted unlike 'model\.decoder.+: "
            r"the reference's encoder and decoder share these weights and blockpress runs both on one module, so "
            r"both must change alike"),
    (vision_target, r"adapts 'model\.encoder\.vision_tower.+', which is not a linear layer of this base"),
    (experts_target, r"adapts the routed experts \('model\.decoder\.layers\.0\.experts': peft's target_parameters.*"
                     r"linear layers only, attention's and the dense MLP's \(q_proj, k_proj"),
    (edit_config(peft_type="IA3"), "peft_type 'IA3'; blockpress applies LoRA adapters only"),
    (edit_config(use_dora=True), "use_dora=True: blockpress applies plain LoRA only"),
])
def test_an_adapter_that_does_not_fit_is_refused_by_name(run, tmp_path, mutate, message):
    base, out = run
    bad = tmp_path / "adapter"
    shutil.copytree(out / "adapter", bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    tensors = load_file(bad / "adapter_model.safetensors")
    mutate(config, tensors)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(blockpress.CheckpointError, match=message) as info:
        load(base, adapter=bad)
    assert f"(it was trained on {base.resolve()})" in str(info.value)


def older_folder(out, tmp_path):
    """The run's adapter folder as blockpress wrote it before it recorded the base's shape and quantization (and as
    peft writes one): adapter_config.json and the weights alone."""
    old = tmp_path / "old_adapter"
    shutil.copytree(out / "adapter", old)
    (old / "blockpress_adapter.json").unlink()
    return old


def test_an_adapter_of_another_base_or_no_adapter_at_all_is_refused(run, tmp_path):
    base, out = run
    other = tmp_path / "other"  # blockpress's tiny config: 3 layers (the adapter's base has 4), another layout
    blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8)).save(other)
    # the shape the adapter recorded of its base, field by field
    with pytest.raises(blockpress.CheckpointError, match=r"trained on a base of another shape \(" + str(base.resolve())
                       + r"\): .*num_hidden_layers 4 \(this base: 3\)"):
        load(other, adapter=out / "adapter")
    # a folder without that record: its layers, one by one
    with pytest.raises(blockpress.CheckpointError, match=r"not a linear layer of this base \(DiffusionGemma: 3 layers"):
        load(other, adapter=older_folder(out, tmp_path))
    with pytest.raises(blockpress.CheckpointError, match="has no adapter_config.json or adapter_model.safetensors"):
        load(other, adapter=tmp_path)


def test_the_adapter_folder_loads_by_name_onto_its_recorded_base(run, tmp_path):
    """blockpress.load(OUT/adapter) is the base with the adapter merged, as the run's merged checkpoint; folders
    without blockpress's record (older ones, peft's) load by adapter_config.json's base_model_name_or_path."""
    base, out = run
    prompt, canvas = inputs()
    merged = load(out).logits(prompt, canvas)
    for folder in (out / "adapter", older_folder(out, tmp_path)):
        lm = load(folder)
        assert lm.path.resolve() == base.resolve() and lm.adapter == folder and lm.quantization is None
        assert torch.equal(lm.logits(prompt, canvas), merged)
    with pytest.raises(ValueError, match="adapter: the model .* is itself an adapter folder; give its base"):
        load(out / "adapter", adapter=out / "adapter")


def test_an_adapter_config_saved_with_a_byte_order_mark_loads_as_the_plain_one(run, tmp_path):
    """An adapter_config.json edited in Notepad ("UTF-8 with BOM", CRLF endings) was refused as 'not valid JSON
    (Unexpected UTF-8 BOM)'; it reads as the file it holds."""
    base, out = run
    edited = older_folder(out, tmp_path)  # (found by its config's base_model_name_or_path, which it must read)
    config = edited / "adapter_config.json"
    config.write_bytes(codecs.BOM_UTF8 + config.read_text(encoding="utf-8").replace("\n", "\r\n").encode())
    prompt, canvas = inputs()
    assert torch.equal(load(edited).logits(prompt, canvas), load(out).logits(prompt, canvas))
