"""LoRA adapters over a frozen quantized base (QLoRA): the forward is the quantized model's plus the adapters', the
gradient reaches the adapters alone through the dequantized base, the base stays quantized while training, and the
adapter folder loads onto the quantized and the unquantized base."""

import copy
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from fp8 import FP8, needs_fp8
from torch import nn

import blockpress
from blockpress.cli import main
from blockpress.data import Example, make_batch
from blockpress.model import ExpertRows, Experts
from blockpress.quantize import QuantizedExperts, QuantizedLinear, dequantize_weight
from blockpress.train import ExampleSource, Objective, TrainConfig, Trainer, add_lora, draw_noise, merge_lora

pytest.importorskip("peft")

EXAMPLES = [Example([2, 5], [10, 11, 12, 13, 20, 21]), Example([2, 6], [14, 15, 16, 17, 22, 23])]
SCHEMES = ["int8", FP8, "int4"]


def tiny_lm(seed=0, dtype="float32"):
    return blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), seed=seed, dtype=dtype)


def lora_layers(model):
    return [(name, module) for name, module in model.named_modules() if hasattr(module, "lora_A")]


def randomize_adapters(model, seed=1):
    """peft starts lora_B at zero (an adapter that changes nothing); random ones make the checks below bite."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for side in (layer.lora_A["default"], layer.lora_B["default"]):
                side.weight.copy_(0.1 * torch.randn(side.weight.shape, generator=g))


def objective_loss(model, seed=0):
    batch = make_batch(EXAMPLES, 8, 0, 1)
    cfg = TrainConfig(self_conditioning_prob=1.0)  # the self-conditioning MLP (quantized too) takes part
    noise = draw_noise(batch, 32, cfg, torch.Generator().manual_seed(seed))
    diffusion, ar = Objective(model, cfg)(batch, noise)
    return diffusion + ar


def stored_weight(module, name):
    """`module`'s weight `name` dequantized in float32 from the stored layout (its state dict's, whatever layout the
    module holds: int4 on a CPU keeps the CPU GEMM's)."""
    state = module.state_dict()
    return dequantize_weight(state[name], state[f"{name}_scale"], torch.float32)


def dequantized_twin(model):
    """A deep copy of the quantized `model` with every quantized projection replaced by its dequantized weights as
    a plain (frozen) float32 module: what the quantized base computes, in autograd's own arithmetic."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        parent_name, _, child = name.rpartition(".")
        parent = twin.get_submodule(parent_name) if parent_name else twin
        if isinstance(module, QuantizedLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight = nn.Parameter(stored_weight(module, "weight"), False)
            setattr(parent, child, linear)
        elif isinstance(module, QuantizedExperts):
            experts = Experts.__new__(Experts)  # the routing of Experts, plain frozen 3-D weights
            nn.Module.__init__(experts)
            experts.num_experts = module.num_experts
            experts.act = module.act
            for w in ("gate_up_proj", "down_proj"):
                weight = stored_weight(module, w)
                setattr(experts, w, nn.Parameter(weight, requires_grad=False))
            setattr(parent, child, experts)
    return twin


@pytest.mark.parametrize("scheme, dtype", [("int8", "float32"), ("int8", "bfloat16"), pytest.param("fp8", "float32", marks=needs_fp8),
                                           ("int4", "float32")])
def test_each_adapted_layer_is_the_quantized_layer_plus_the_adapters_delta(scheme, dtype):
    """Per layer, by hand: base(x) + alpha / r * x A^T B^T, the base the quantized layer as quantize() made it
    (bfloat16 int8 runs the packed kernel)."""
    lm = tiny_lm(dtype=dtype).quantize(scheme)
    quantized = copy.deepcopy(lm.model)
    model = add_lora(lm.model, rank=4, alpha=8)
    randomize_adapters(model)
    layers = lora_layers(model)
    assert {name.rsplit(".", 1)[1] for name, _ in layers} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"}
    g = torch.Generator().manual_seed(2)
    for name, layer in layers:
        base = quantized.get_submodule(name)
        assert isinstance(base, QuantizedLinear) and layer.get_base_layer().weight.dtype == base.weight.dtype
        x = torch.randn(3, 5, base.in_features, generator=g).to(base.weight_scale.device, getattr(torch, dtype))
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():  # both at inference (a float32 int4 base takes its rows in bf16 there, not in training)
            by_hand = base(x) + (2.0 * (x.float() @ a.T @ b.T)).to(x.dtype)  # alpha / r = 8 / 4
            got = layer(x)
        assert got.dtype == x.dtype
        assert torch.allclose(got.float(), by_hand.float(), atol=1e-2 if dtype == "bfloat16" else 1e-5), name


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_qlora_forward_and_gradients_are_those_of_lora_over_the_dequantized_base(scheme):
    """The whole model: the loss and every adapter's gradient equal LoRA over a float twin holding the dequantized
    weights (autograd's own backward, experts included); the gradient reaches the adapters and nothing else, and
    without adapters' updates (lora_B zero) the model is the quantized one exactly."""
    lm = tiny_lm().quantize(scheme)
    quantized = copy.deepcopy(lm)
    twin = dequantized_twin(lm.model)
    model = add_lora(lm.model, rank=4, alpha=8)
    prompt, canvas = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (2, 8))
    assert torch.equal(lm.logits(prompt, canvas), quantized.logits(prompt, canvas))
    twin = add_lora(twin, rank=4, alpha=8)
    randomize_adapters(model)
    randomize_adapters(twin)
    # In training mode, as train.py runs it: float32 rows stay float32 where torch's CPU kernels would take them in bf16
    # at inference (CPU_KERNEL_DTYPES), the objective's no_grad self-conditioning pass included
    model.train()
    twin.train()
    loss, twin_loss = objective_loss(model), objective_loss(twin)
    assert torch.allclose(loss, twin_loss, rtol=1e-5)
    loss.backward()
    twin_loss.backward()
    trained = {name: p for name, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in name for name in trained)
    assert {name for name, p in model.named_parameters() if p.requires_grad} == set(trained)
    twin_params = dict(twin.named_parameters())
    for name, p in trained.items():
        assert p.grad.abs().sum() > 0, name
        expected = twin_params[name].grad  # float32 rounding apart: the int8 GEMM scales after the product
        assert (p.grad - expected).abs().max() <= 1e-3 * expected.abs().max(), name


@needs_fp8
def test_fp8_base_passes_the_gradient_through():
    """fp8 quantizes activations too (no derivative): the gradient is the dequantized weights' (straight through)."""
    model = add_lora(tiny_lm().quantize("fp8").model, rank=4, alpha=8)
    randomize_adapters(model)
    objective_loss(model).backward()
    grads = [p.grad for name, p in model.named_parameters() if "lora_A" in name]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def quantized_bytes(model):
    return {name: (b.dtype, b.numel() * b.element_size()) for name, b in model.named_buffers()
            if name.endswith(("proj.weight", "gate_up_proj", "down_proj"))}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_base_stays_quantized_and_no_dequantized_weight_is_kept_for_the_backward(scheme):
    """What saves the memory: the projections stay quantized buffers, and what autograd keeps for the backward
    holds no full-precision copy of a projection (the weights are dequantized again in the backward)."""
    model = add_lora(tiny_lm().quantize(scheme).model, rank=4, alpha=8)
    codes = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}[scheme]
    stored = quantized_bytes(model)
    assert stored and all(dtype == codes for dtype, _ in stored.values())
    float_projections = [name for name, _ in model.named_parameters()
                         if "lora_" not in name and name.endswith(("_proj.weight", "_proj"))]
    assert not float_projections
    dequantized = []  # every full-precision copy of a projection the backward could have kept, transposes too
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            dequantized.append(stored_weight(module, "weight"))
        elif isinstance(module, QuantizedExperts):
            for w in ("gate_up_proj", "down_proj"):
                stacked = stored_weight(module, w)
                dequantized += [stacked, stacked.transpose(1, 2), *stacked]
    dequantized += [w.T for w in dequantized if w.dim() == 2]
    kept = []

    def pack(t):
        if t.dtype == torch.float32 and any(t.shape == w.shape and torch.equal(t, w) for w in dequantized):
            kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = objective_loss(model)
    loss.backward()
    assert not kept


def train(tmp_path, lm, steps, **cfg):
    """(the loss on fixed batches of the two examples before, the run's result, whether the base was still int8 at
    each step)."""
    tc = TrainConfig(steps=steps, batch_size=2, lr=0.1, warmup_steps=2, log_every=1, lora_rank=8, eval_batches=4,
                     **cfg)
    seen = []

    def check(step, loss):
        seen.append(all(dtype == torch.int8 for dtype, _ in quantized_bytes(lm.model).values()))

    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), tc, tmp_path / "out", heldout=ExampleSource(EXAMPLES, 0),
                      progress=False, on_step=check)
    return trainer.evaluate(), trainer.train(), seen


def test_qlora_memorises_two_examples_on_an_int8_base(tmp_path):
    lm = tiny_lm()
    full = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
    before, result, seen = train(tmp_path, lm, 40, quantize="int8")
    assert lm.quantization == "int8" and len(seen) == 40 and all(seen)  # quantized at every step
    (_, after), = result.eval_losses
    assert after < before - 0.25  # on the same fixed noise draws: 6.75 -> 6.33 when written
    # the projections take a quarter of their float32 bytes: adapters included, the model is smaller
    assert sum(t.numel() * t.element_size() for t in lm.model.state_dict().values()) < 0.6 * full
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "out" / "config.json").exists()  # no merged checkpoint of a quantized base


def test_full_fine_tuning_of_a_quantized_base_and_mismatched_schemes_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"quantize: 'int8' trains LoRA adapters .* needs lora_rank > 0"):
        TrainConfig(quantize="int8")
    with pytest.raises(ValueError, match=r"quantize: expected one of \['int8', 'fp8', 'int4'\], got 'int3'"):
        TrainConfig(quantize="int3", lora_rank=2)
    with pytest.raises(ValueError, match=r"train: the model is quantized \(int4\); .*quantize='int4'"):
        train(tmp_path, tiny_lm().quantize("int4"), 1, quantize="int8")
    model = add_lora(tiny_lm().quantize("int8").model, rank=2, alpha=4)
    with pytest.raises(ValueError, match=r"merge_lora: the adapters sit on a quantized base \(layers\.0\..*int8"):
        merge_lora(model)


def test_the_adapter_trained_on_an_int8_base_loads_onto_the_quantized_and_the_unquantized_base(tmp_path):
    base = tmp_path / "base"
    tiny_lm().save(base)
    lm = blockpress.load(base, quantize="int8")
    train(tmp_path, lm, 4, quantize="int8")
    adapter = tmp_path / "out" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    prompt, canvas = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (2, 8))
    trained = lm.logits(prompt, canvas)
    onto_quantized = blockpress.load(base, adapter=adapter, quantize="int8")
    assert onto_quantized.quantization == "int8" and lora_layers(onto_quantized.model)  # unmerged, as it trained
    assert torch.equal(onto_quantized.logits(prompt, canvas), trained)
    onto_float = blockpress.load(base, adapter=adapter)
    assert onto_float.quantization is None and not lora_layers(onto_float.model)  # merged
    plain, quantized_plain = blockpress.load(base).logits(prompt, canvas), blockpress.load(
        base, quantize="int8").logits(prompt, canvas)
    # the adapters change the unquantized base as they change the quantized one, up to quantization error
    change, quantized_change = (onto_float.logits(prompt, canvas) - plain).flatten(), (trained - quantized_plain).flatten()
    assert change.abs().max() > 0.1
    assert torch.nn.functional.cosine_similarity(change, quantized_change, dim=0) > 0.95


def qlora_run(tmp_path, scheme="int8", base_lm=None):
    """(base folder, the run's --out, the trained model) of a short QLoRA run on a saved tiny base."""
    base = tmp_path / "base"
    (base_lm or tiny_lm()).save(base)
    lm = blockpress.load(base, quantize=scheme)
    train(tmp_path, lm, 2, quantize=scheme)
    return base, tmp_path / "out", lm


def test_a_qlora_run_loads_by_its_adapter_folder_quantized_as_it_trained(tmp_path):
    base, out, trained = qlora_run(tmp_path)
    adapter = out / "adapter"
    prompt, canvas = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (2, 8))
    for spec in (adapter, str(adapter), out):  # the run's --out holds nothing else to load
        lm = blockpress.load(spec)
        assert lm.quantization == "int8" and lm.path.resolve() == base.resolve() and lm.adapter == adapter
        assert lora_layers(lm.model)  # unmerged over the quantized base, as it trained
        assert torch.equal(lm.logits(prompt, canvas), trained.logits(prompt, canvas))
    # told otherwise: quantized another way, or not at all (merged into the unquantized base)
    assert blockpress.load(adapter, quantize="int4").quantization == "int4"
    merged = blockpress.load(adapter, quantize="none")
    assert merged.quantization is None and not lora_layers(merged.model)
    assert torch.equal(merged.logits(prompt, canvas), blockpress.load(base, adapter=adapter).logits(prompt, canvas))


def test_qlora_adapters_load_over_their_base_saved_quantized_without_a_warning(tmp_path):
    """`blockpress quantize` of a QLoRA run's base with the run's scheme writes the codes the adapters trained over
    (what quantize's refusal of an adapter folder advises: --model THAT_FOLDER --adapter ...), but the adapters over
    it warned "applied to ..., another model; its update is added to weights it was not learned on". The folder now
    names the checkpoint it was quantized from, kept when it is saved again; another scheme, or a folder quantized
    from elsewhere, still warns."""
    base, out, trained = qlora_run(tmp_path)
    adapter = out / "adapter"
    blockpress.load(base, quantize="int8").save(tmp_path / "q8")
    blockpress.load(tmp_path / "q8").save(tmp_path / "copy")  # saved again as stored: the record stays
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["quantization_config"]["quantized_from"] == \
        str(base.resolve())
    prompt, canvas = torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for folder in ("q8", "copy"):
            lm = blockpress.load(tmp_path / folder, adapter=adapter)
            assert torch.equal(lm.logits(prompt, canvas), trained.logits(prompt, canvas))
    blockpress.load(base, quantize="int4").save(tmp_path / "q4")
    with pytest.warns(UserWarning, match=rf"trained over '{base}' \(quantized int8\), and applied to .*q4' \(saved int4 "
                                         r"from .*\), another quantization; its update is added to weights it was not"):
        blockpress.load(tmp_path / "q4", adapter=adapter)
    tiny_lm().quantize("int8").save(tmp_path / "unnamed")  # random weights: no checkpoint to name
    with pytest.warns(UserWarning, match="another model; its update is added to weights it was not learned on"):
        blockpress.load(tmp_path / "unnamed", adapter=adapter)


def test_a_quantized_save_after_a_chdir_names_the_folder_it_was_loaded_from(tmp_path, monkeypatch):
    """A model loaded by a relative path kept it relative: saved after a chdir, its quantized_from named the
    folder of that name under the new working directory (another model, or nothing there)."""
    for where in ("one", "two"):
        (tmp_path / where).mkdir()
        tiny_lm(seed=len(where)).save(tmp_path / where / "base")
    monkeypatch.chdir(tmp_path / "one")
    lm = blockpress.load("base", quantize="int8")
    monkeypatch.chdir(tmp_path / "two")
    lm.save(tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quantized_from"] == \
        str((tmp_path / "one" / "base").resolve())
    assert lm.path == tmp_path / "one" / "base"


def test_a_quantize_of_weights_rounded_below_the_checkpoints_names_no_origin(tmp_path):
    """A float32 folder loaded in bf16, then lm.quantize: the codes are the bf16 rounding's, not those
    load(..., quantize=) makes from the stored float32 weights, yet the save named the folder as quantized_from, so a
    QLoRA adapter trained over it loaded over the folder quantized in the load without a warning (logits 0.25 off)."""
    tiny_lm().save(tmp_path / "base")  # float32
    def origin(lm, name):
        lm.save(tmp_path / name)
        return json.loads((tmp_path / name / "config.json").read_text())["quantization_config"].get("quantized_from")

    assert origin(blockpress.load(tmp_path / "base", dtype="bfloat16").quantize("int4"), "rounded") is None
    assert origin(blockpress.load(tmp_path / "base").to(dtype="bfloat16").quantize("int8"), "cast") is None
    round_trip = blockpress.load(tmp_path / "base").to(dtype="bfloat16").to(dtype="float32")  # rounded all the same
    assert origin(round_trip.quantize("int8"), "round trip") is None
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)  # the stored tensors' dtype tells it then
    shutil.copytree(tmp_path / "base", tmp_path / "undeclared")
    (tmp_path / "undeclared" / "config.json").write_text(json.dumps(config))
    assert origin(blockpress.load(tmp_path / "undeclared", dtype="bfloat16").quantize("int4"), "undeclared") is None
    # a bf16 folder widened to float32 and cast back holds its own values: its origin is recorded
    tiny_lm().to(dtype="bfloat16").save(tmp_path / "base16")
    widened = blockpress.load(tmp_path / "base16", dtype="float32").to(dtype="bfloat16").quantize("int8")
    assert origin(widened, "widened") == str((tmp_path / "base16").resolve())
    exact = str((tmp_path / "base").resolve())
    assert origin(blockpress.load(tmp_path / "base").quantize("int4"), "own") == exact
    assert origin(blockpress.load(tmp_path / "base", dtype="bfloat16", quantize="int4"), "in the load") == exact


def test_qlora_adapters_trained_over_a_folder_saved_quantized_load_over_its_checkpoint_quantized_alike(tmp_path):
    """The other way round: adapters trained over a folder saved quantized (train --lora-rank --model Q) loaded over
    the checkpoint Q was quantized from with Q's scheme (generate --model PLAIN --adapter A --quantize int8) run over
    the same codes, yet warned "another model". They now load without a word, as trained; quantized otherwise, or not
    at all, the warning names both schemes and the flag that loads it as trained."""
    base = tmp_path / "base"
    tiny_lm().save(base)
    blockpress.load(base, quantize="int8").save(tmp_path / "q8")
    lm = blockpress.load(tmp_path / "q8")
    train(tmp_path, lm, 2, quantize="int8")
    adapter = tmp_path / "out" / "adapter"
    prompt, canvas = torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        over_plain = blockpress.load(base, adapter=adapter, quantize="int8")
        assert main(["info", "--model", str(base), "--adapter", str(adapter), "--quantize", "int8"]) == 0
    assert torch.equal(over_plain.logits(prompt, canvas), lm.logits(prompt, canvas))
    for quantize, named in (("int4", "quantized int4"), (None, "unquantized")):
        with pytest.warns(UserWarning) as caught:
            blockpress.load(base, adapter=adapter, quantize=quantize)
        said = [str(w.message) for w in caught if str(w.message).startswith("adapter")]
        assert said == [f"adapter {str(adapter)!r}: trained over {str((tmp_path / 'q8').resolve())!r} (saved int8 from "
                        f"{str(base.resolve())!r}), and applied to {str(base)!r} ({named}), another quantization; its "
                        f"update is added to weights it was not learned on (load it with quantize='int8' (--quantize "
                        f"int8), or give the adapter folder alone, --model {adapter}, to load it over its own base as it "
                        "trained)"]


@pytest.mark.parametrize("name", ["my runs", "it's"])
def test_an_adapters_warning_quotes_its_paths_and_its_advice_reads_as_a_command(tmp_path, name, capsys):
    """The warnings of an adapter over another base named its folders bare, where its errors quote them: with a
    space in a folder's name ("my runs") neither where a path ended nor the --model it advised could be read off
    the line. Each path is now quoted, and the advised flag's value is quoted as a shell takes it."""
    import shlex

    base, out, _ = qlora_run(tmp_path / name)
    adapter = out / "adapter"
    other = tmp_path / name / "other base"
    tiny_lm(seed=3).save(other)
    capsys.readouterr()
    assert main(["info", "--model", str(other), "--adapter", str(adapter)]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: adapter")]
    assert len(said) == 1, said
    assert said[0].startswith(f"warning: adapter {str(adapter)!r}: trained on {str(base)!r}, and applied to "
                              f"{str(other)!r}, another model")
    advice = re.search(r"\(give the adapter folder alone, (--model .*), to load it over its own base\)$", said[0])
    assert advice and shlex.split(advice[1]) == ["--model", str(adapter)]



def test_an_adapter_folder_whose_base_is_gone_or_another_is_refused_by_name(tmp_path):
    base, out, _ = qlora_run(tmp_path)
    adapter = out / "adapter"
    shutil.rmtree(base)
    with pytest.raises(FileNotFoundError, match=rf"adapter folder trained on '{base.resolve()}', which is not here.*"
                                                r"give the base as the model and this folder as the adapter"):
        blockpress.load(adapter)
    # another model where the base was: refused before the adapters touch it, naming what differs
    blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8, hidden_size=64)).save(base)
    for load in (lambda: blockpress.load(adapter), lambda: blockpress.load(base, adapter=adapter, quantize="int8")):
        with pytest.raises(blockpress.CheckpointError, match=r"trained on a base of another shape .*: hidden_size 32 "
                                                             r"\(this base: 64\)"):
            load()


def test_a_model_holding_unmerged_adapters_is_not_trained_again(tmp_path):
    """Over a quantized base the loaded adapters stay LoRA layers: new ones would wrap them (peft) and both train;
    merged into an unquantized base they are plain weights, which a new run records no base for (the folder's
    weights alone are not the model)."""
    from blockpress.train import base_name

    _, out, _ = qlora_run(tmp_path)
    with pytest.raises(ValueError, match=r"train: the model holds LoRA adapters, unmerged over its quantized base"):
        Trainer(blockpress.load(out), ExampleSource(EXAMPLES, 0), TrainConfig(lora_rank=2, quantize="int8"),
                tmp_path / "again", progress=False)
    merged = blockpress.load(out, quantize="none")
    assert base_name(merged) is None
    with pytest.raises(ValueError, match=r"lora_rank: the model is the LoRA adapters in .* merged into their base; "
                                         r"new adapters over it would name no base"):  # (they were written base null)
        Trainer(merged, ExampleSource(EXAMPLES, 0), TrainConfig(lora_rank=2), tmp_path / "again", progress=False)
    Trainer(merged, ExampleSource(EXAMPLES, 0), TrainConfig(), tmp_path / "again", progress=False)  # all weights: fine


def test_train_cli_quantize_trains_lora_over_the_quantized_base(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_lm().save(base)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": e.prompt, "response_ids": e.response}) + "\n" for e in EXAMPLES))
    def args(out, *more):
        return ["train", "--model", str(base), "--data", str(data), "--out", str(tmp_path / out), "--steps", "2",
                "--batch-size", "2", "--heldout", "0", "--quiet", "--warmup-steps", "1", *more]

    assert main(args("out", "--lora-rank", "2", "--quantize", "int4")) == 0
    err = capsys.readouterr().err
    # the way to run what it made, from the command line: the adapter folder as --model, which loads as it trained
    command = re.search(r"--quantize int4: .*`blockpress generate --model (\S+) PROMPT`", err)
    assert command and Path(command.group(1)) == tmp_path / "out" / "adapter"
    assert main(["info", "--model", command.group(1), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == "int4"
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["quantize"] == "int4"
    assert blockpress.load(base, adapter=tmp_path / "out" / "adapter", quantize="int4").quantization == "int4"
    assert main(args("full", "--quantize", "int4")) == 2
    assert "quantize: 'int4' trains LoRA adapters" in capsys.readouterr().err


def test_a_quantized_model_holding_unmerged_adapters_is_not_saved(tmp_path):
    """A quantized model saves quantized, but peft's layers over it would be written under names no load reads."""
    lm = tiny_lm().quantize("int4")
    add_lora(lm.model, rank=2, alpha=4)
    with pytest.raises(ValueError, match=r"^save: the model holds LoRA adapters, unmerged over its quantized base "
                                         r"\(int4, layer 'layers\.0\.[^']+'\); save the adapters apart"):
        lm.save(tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_train_cli_over_a_folder_saved_quantized(tmp_path, capsys):
    """QLoRA over a folder saved quantized (lm.save of a quantized model) trains with --quantize of its scheme, or
    with --lora-rank alone, which takes the stored scheme (it was refused, asking for --quantize), and its adapter
    folder loads back over it; a full fine-tune is refused naming the scheme (it met the load's generic refusal of
    quantize 'none'), and another scheme naming both."""
    base = tmp_path / "base"
    quantized = tiny_lm().quantize("int8")
    quantized.save(base)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": e.prompt, "response_ids": e.response}) + "\n" for e in EXAMPLES))

    def args(out, *more):
        return ["train", "--model", str(base), "--data", str(data), "--out", str(tmp_path / out), "--steps", "2",
                "--batch-size", "2", "--heldout", "0", "--quiet", "--warmup-steps", "1", *more]

    assert main(args("full")) == 2
    assert re.search(r"--model \S+: stored quantized \(int8\); a full fine-tune needs the unquantized weights; train "
                     r"LoRA adapters over it instead \(--lora-rank R: QLoRA\)", capsys.readouterr().err)
    assert main(args("other", "--lora-rank", "2", "--quantize", "int4")) == 2
    assert "--quantize: 'int4' asked for, but" in capsys.readouterr().err
    assert not any((tmp_path / out).exists() for out in ("full", "other"))
    assert main(args("qlora", "--lora-rank", "2", "--quantize", "int8")) == 0
    lm = blockpress.load(tmp_path / "qlora" / "adapter")
    assert lm.quantization == "int8" and lm.path == base and lora_layers(lm.model)
    # --lora-rank alone: QLoRA over its stored scheme, said on stderr, the same adapters as --quantize int8 trains
    run = args("inferred", "--lora-rank", "2")
    run.remove("--quiet")
    assert main(run) == 0
    said = capsys.readouterr().err
    assert "stored quantized (int8); its LoRA adapters train over it as QLoRA (--quantize int8)" in said
    # the closing advice: the base is the quantized checkpoint, with nothing unquantized to merge into (it said
    # "no checkpoint of the quantized base" and offered --quantize none, which the load then refused)
    assert f"holds the adapters, unmerged (over {base}, saved int8); run them as trained" in said
    assert "--quantize none" not in said and "no checkpoint of the quantized base" not in said
    inferred = blockpress.load(tmp_path / "inferred" / "adapter")
    assert inferred.quantization == "int8" and inferred.path == base
    assert torch.equal(inferred.logits(*(ids := (torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (1, 8))))),
                       lm.logits(*ids))
    prompt, canvas = torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (1, 8))
    assert not torch.equal(lm.logits(prompt, canvas), quantized.logits(prompt, canvas))  # the adapters act


def test_resuming_a_finished_qlora_run_says_so_before_loading_its_base(tmp_path, capsys, monkeypatch):
    """--resume on a finished QLoRA run said "give it again with --model"; given it, the base was loaded and quantized
    (a minute for blockpress-code) before the run was found finished. With a save mid-run its lora_base.json stayed,
    and the base was loaded at once. Now a finished LoRA run is refused before any base is looked for."""
    base = tmp_path / "base"
    tiny_lm().save(base)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": e.prompt, "response_ids": e.response}) + "\n" for e in EXAMPLES))
    common = ["--data", str(data), "--steps", "2", "--batch-size", "2", "--heldout", "0", "--quiet",
              "--warmup-steps", "1"]
    for out, more in (("done", []), ("saved", ["--save-every", "1"])):  # "saved" keeps its lora_base.json
        assert main(["train", "--model", str(base), "--out", str(tmp_path / out), *common, "--lora-rank", "2",
                     "--quantize", "int4", *more]) == 0
    assert (tmp_path / "saved" / "lora_base.json").is_file()
    capsys.readouterr()

    def no_load(*args, **kwargs):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr("blockpress.cli.train.load_model", no_load)
    for out, more in (("done", []), ("done", ["--model", str(base)]), ("saved", [])):
        assert main(["train", "--out", str(tmp_path / out), "--resume", *common[:2], "--steps", "4", *more]) == 2
        err = capsys.readouterr().err
        assert f"--resume: the LoRA run in {tmp_path / out} finished; its adapters are in " \
               f"{tmp_path / out / 'adapter'}" in err, err


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_compiled_experts_op_has_the_eager_loops_gradient(scheme):
    """Under torch.compile the experts run as one custom op: its backward is the per-expert loop's."""
    from blockpress.quantize import _quantized_experts, quantize_weight

    q, scale = quantize_weight(torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(0)), scheme)
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)  # the middle expert has no rows
    x = torch.randn(5, 32, requires_grad=True)
    grad = torch.randn(5, 16)
    eager = torch.autograd.grad(_quantized_experts(x, q, scale, ExpertRows(offsets), scheme), x, grad)[0]
    op = torch.autograd.grad(torch.ops.blockpress.quantized_experts(x, q, scale, offsets, scheme, True), x, grad)[0]
    assert torch.equal(op, eager)
    by_hand = torch.cat([grad[:2] @ dequantize_weight(q[0], scale[0], torch.float32),
                         grad[2:] @ dequantize_weight(q[2], scale[2], torch.float32)])
    assert torch.allclose(op, by_hand)


LOADING_COMMANDS = [["generate", "hi"], ["infill", "a <|hole|> b"], ["chat"], ["serve", "--port", "0"],
                    ["sudoku", "0" * 81], ["info"]]


@pytest.mark.parametrize("command", LOADING_COMMANDS, ids=[c[0] for c in LOADING_COMMANDS])
def test_every_command_that_loads_a_model_takes_an_adapter(command, tmp_path, capsys):
    """--adapter reaches the load: an adapter of another base is refused by its shape, naming it."""
    base, out, _ = qlora_run(tmp_path)
    other = tmp_path / "other"
    blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8, hidden_size=64)).save(other)
    assert main([*command, "--model", str(other), "--adapter", str(out / "adapter")]) == 2
    err = capsys.readouterr().err
    assert f"error: --adapter {out / 'adapter'}: trained on a base of another shape" in err  # the flag, as others are


def test_generate_runs_an_adapter_by_its_folder_or_over_its_base(tmp_path, capsys):
    from blockpress.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([""], vocab_size=300)
    config = blockpress.ModelConfig.tiny(vocab_size=tokenizer.vocab_size, canvas_length=8)
    base, out, _ = qlora_run(tmp_path, base_lm=blockpress.random_model(config, tokenizer=tokenizer))
    adapter = out / "adapter"
    flags = ["--json", "--max-new-tokens", "8", "--seed", "3", "--no-token-healing", "--no-live"]

    def generate(*model):
        assert main(["generate", "hi", *model, *flags]) == 0
        return json.loads(capsys.readouterr().out)["text"]

    expected = blockpress.load(adapter).generate("hi", max_new_tokens=8, seed=3, token_healing=False).texts[0]
    assert generate("--model", str(adapter)) == expected
    assert generate("--model", str(base), "--adapter", str(adapter), "--quantize", "int8") == expected
    merged = blockpress.load(base, adapter=adapter).generate("hi", max_new_tokens=8, seed=3, token_healing=False)
    assert generate("--model", str(adapter), "--quantize", "none") == merged.texts[0]
    shutil.rmtree(base)
    assert main(["generate", "hi", "--model", str(adapter), *flags]) == 2
    assert "which is not here" in capsys.readouterr().err


def test_info_reports_the_adapter_and_what_its_load_takes(tmp_path, capsys):
    base, out, _ = qlora_run(tmp_path)
    adapter = out / "adapter"

    def info(*flags):
        assert main(["info", *flags, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    for flags, quantization in ((["--model", str(adapter)], "int8"), (["--model", str(out), "--quantize", "int4"], "int4"),
                                (["--model", str(base), "--adapter", str(adapter)], None)):
        shown = info(*flags)
        lm = blockpress.load(flags[1], adapter=flags[3] if "--adapter" in flags else None,
                             quantize=flags[3] if "--quantize" in flags else None)
        assert shown["quantization"] == lm.quantization == quantization
        assert shown["path"] == str(base.resolve()) and shown["weights_bytes"] == lm.weights_bytes()
        held = blockpress.load(base, adapter=adapter, quantize="int8").model  # unmerged: its adapters to count
        layers = lora_layers(held)
        assert shown["adapter"]["rank"] == 8 and shown["adapter"]["trained_quantization"] == "int8"
        assert shown["adapter"]["targets"] == sorted({name.split(".", 2)[2] for name, _ in layers})
        assert shown["adapter"]["parameters"] == sum(p.numel() for name, p in held.named_parameters() if "lora_" in name)
    assert info("--model", str(base))["adapter"] is None


def test_a_base_from_the_hugging_face_cache_is_recorded_by_its_repo_id(tmp_path, monkeypatch):
    """A LoRA run over `acme/tiny` recorded the cache's snapshot folder (…/models--acme--tiny/snapshots/<hash>), a
    path no other machine has and a stale one once main moves; it records the name blockpress.load finds it by."""
    from blockpress.train import base_name

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--tiny"
    for commit in ("c0ffee", "beef01"):
        blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8)).save(
            repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("beef01")
    assert base_name(blockpress.load("acme/tiny")) == "acme/tiny"
    old = blockpress.load("acme/tiny@c0ffee")
    assert base_name(old) == "acme/tiny@c0ffee"
    assert blockpress.load(base_name(old)).path == old.path  # the name loads that snapshot back
    elsewhere = tmp_path / "models--acme--tiny" / "snapshots" / "c0ffee"  # the layout outside the cache: a folder
    old.save(elsewhere)
    assert base_name(blockpress.load(elsewhere)) == str(elsewhere.resolve())
    # A LoRA run over the older snapshot writes peft's fields (repo id + revision) and loads back onto that snapshot.
    Trainer(old, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=2, lora_rank=2), tmp_path / "run",
            progress=False).train()
    written = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert (written["base_model_name_or_path"], written["revision"]) == ("acme/tiny", "c0ffee")
    assert blockpress.load(tmp_path / "run" / "adapter").path == old.path
