"""int4 on a CPU: the experts dequantized only where they have rows, and, in bfloat16 or float32, the codes held in the
layout of torch's CPU int4 GEMM (quantize.to_cpu_int4) while state dicts, saves and loads keep the stored layout."""

import copy
import tempfile
import warnings

import pytest
import torch
from experts import noisy_experts
from hypothesis import given, settings
from hypothesis import strategies as st

import blockpress
import blockpress.quantize as quantize_module
from blockpress.model import ExpertRows
from blockpress.quantize import (
    INT4_CPU_MAX_ROWS,
    QuantizedExperts,
    QuantizedLinear,
    _codes_by_input,
    _pack_rows,
    cpu_int4_layout,
    dequantize_weight,
    from_cpu_int4,
    int4_cpu_fits,
    quantize_weight,
    quantized_matmul,
    to_cpu_int4,
)

needs_layout = pytest.mark.skipif(cpu_int4_layout() is None, reason="this torch has no CPU int4 GEMM of a known layout")


def quiet(call, *args, **kwargs):
    """call(*args, **kwargs) without its warnings (int4's groups below 32 in the tiny shapes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


def int4_lm(dtype="bfloat16", seed=3):
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=64, canvas_length=8), seed=seed, dtype=dtype)
    return quiet(lm.quantize, "int4")


def coded_modules(lm):
    return [m for m in lm.model.modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))]


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from([(64, True), (32, True), (32, False), (64, False)]), blocks=st.integers(0, 3),
       tail=st.sampled_from([0, 16, 32, 48]), half=st.integers(1, 6), seed=st.integers(0, 99))
def test_the_cpu_layout_is_a_permutation_of_the_codes_undone_exactly(layout, blocks, tail, half, seed):
    """_pack_rows then _codes_by_input gives the codes back (transposed) for every layout torch's packer is known to
    use, with full blocks and a shorter last one."""
    rows = blocks * layout[0] + tail
    if rows == 0:
        rows = 16
    codes = torch.randint(0, 16, (rows, 2 * half), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = _pack_rows(codes, layout)
    assert packed.shape == (rows, half) and packed.dtype == torch.uint8
    assert torch.equal(_codes_by_input(packed, layout), codes.t())


@needs_layout
@settings(max_examples=20, deadline=None)
@given(rows=st.sampled_from([16, 48, 64, 80, 128, 208]), groups=st.integers(1, 3), seed=st.integers(0, 99))
def test_to_cpu_int4_packs_as_torch_does_and_from_cpu_int4_gives_the_stored_codes_back(rows, groups, seed):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight(torch.randn(rows, 32 * groups, generator=g), "int4")
    packed, scale_zeros = to_cpu_int4(q, scale)
    codes = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2).to(torch.int32)  # the stored code + 8, as torch reads
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
    assert scale_zeros.shape == (groups, rows, 2) and torch.equal(scale_zeros[..., 1], torch.zeros(groups, rows,
                                                                                                  dtype=scale.dtype))
    back_q, back_scale = from_cpu_int4(packed, scale_zeros)
    assert torch.equal(back_q, q) and torch.equal(back_scale, scale)


@needs_layout
@settings(max_examples=20, deadline=None)
@given(rows=st.sampled_from([16, 48, 64, 80, 128, 208]), groups=st.integers(1, 3), seed=st.integers(0, 99),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]))
def test_dequantizing_where_the_cpu_layout_lies_gives_dequantize_weights_bits(rows, groups, seed, dtype):
    """Past INT4_CPU_MAX_ROWS rows (and in QLoRA's backward) the weight is dequantized from the CPU layout directly,
    transposed: the same bits as the stored layout's dequantize_weight, whatever the dtype."""
    from blockpress.quantize import _dequantize_cpu_int4

    q, scale = quantize_weight(torch.randn(rows, 32 * groups, generator=torch.Generator().manual_seed(seed)), "int4")
    got = _dequantize_cpu_int4(*to_cpu_int4(q, scale), dtype)
    assert got.shape == (32 * groups, rows) and torch.equal(got, dequantize_weight(q, scale, dtype).t())


@needs_layout
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, INT4_CPU_MAX_ROWS, INT4_CPU_MAX_ROWS + 1, 300])
def test_the_cpu_int4_matmul_is_the_dequantized_matmul(rows, dtype):
    """Up to INT4_CPU_MAX_ROWS rows torch's int4 GEMM, past it the weight dequantized from the CPU layout: both are x
    times the dequantized weight, up to bf16's rounding of the output (and of the kernel's sums). float32 rows go
    through the GEMM in bf16 and come back in float32; past it, float32 throughout, the stored layout's result."""
    g = torch.Generator().manual_seed(rows)
    q, scale = quantize_weight(torch.randn(80, 96, generator=g), "int4")
    x = torch.randn(rows, 96, generator=g).to(dtype)
    exact = x.float() @ dequantize_weight(q, scale, torch.float32).T
    with torch.no_grad():  # inference: float32 rows take the bf16 GEMM only there
        got = quantized_matmul(x, *to_cpu_int4(q, scale), "int4-cpu")
        stored = quantized_matmul(x, q, scale, "int4")  # the stored layout's path: the same product
    assert got.dtype == dtype and got.shape == (rows, 80)
    assert (got.float() - exact).abs().max() <= 2 * 2**-8 * exact.abs().max()
    assert (got.float() - stored.float()).abs().max() <= 2 * 2**-8 * exact.abs().max()
    if dtype == torch.float32:  # rounded through the GEMM up to its rows, float32 throughout past them
        assert torch.allclose(got, stored, rtol=1e-5, atol=1e-5) == (rows > INT4_CPU_MAX_ROWS)


def test_an_int4_model_on_a_cpu_holds_the_cpu_layout_where_it_fits_and_computes_as_stored():
    lm = int4_lm()
    modules = coded_modules(lm)
    fits = [m for m in modules if all(quantize_module.int4_cpu_fits((*getattr(m, n).shape[:-1], 2 * getattr(m, n).shape[-1]))
                                      for n in m.coded_names)]
    expected = cpu_int4_layout() is not None
    assert fits and all(m.cpu_int4 == expected for m in fits)
    assert not any(m.cpu_int4 for m in modules if m not in fits)  # e.g. a 48-input projection: groups of 16
    stored = copy.deepcopy(lm)
    for m in coded_modules(stored):
        m.set_cpu_int4(False)
    sd, stored_sd = lm.model.state_dict(), stored.model.state_dict()
    assert sd.keys() == stored_sd.keys() and all(torch.equal(sd[k], stored_sd[k]) for k in sd)  # layout-free
    # A float32 model holds the CPU layout too (its rows go through the GEMM in bf16: CPU_KERNEL_DTYPES)
    float32 = int4_lm(dtype="float32")
    assert [m.cpu_int4 for m in coded_modules(float32)] == [m.cpu_int4 for m in modules]
    float32.model.load_state_dict({k: v.float() if v.is_floating_point() and not k.endswith("_scale") else v
                                   for k, v in stored_sd.items()})
    exact = copy.deepcopy(float32)
    for m in coded_modules(exact):
        m.set_cpu_int4(False)
    # The same codes computed in float32 in the stored layout are the reference: both bf16 layouts are off it by bf16's
    # rounding (a random 3-layer model's logits by up to a quarter of their largest), the CPU GEMM no more than the
    # stored layout's; float32 through the GEMM, whose activations alone are rounded to bf16, by less than either
    g = torch.Generator().manual_seed(0)
    errors = {"cpu": 0.0, "stored": 0.0, "float32 cpu": 0.0}
    for _ in range(8):
        prompt, canvas = torch.randint(3, 60, (2, 5), generator=g), torch.randint(3, 60, (2, 8), generator=g)
        want = exact.logits(prompt, canvas)
        errors["cpu"] += (lm.logits(prompt, canvas) - want).abs().mean().item()
        errors["stored"] += (stored.logits(prompt, canvas) - want).abs().mean().item()
        errors["float32 cpu"] += (float32.logits(prompt, canvas) - want).abs().mean().item()
    assert 0 < errors["cpu"] <= 1.25 * errors["stored"], errors
    assert 0 < errors["float32 cpu"] <= 0.75 * min(errors["cpu"], errors["stored"]), errors


@needs_layout
def test_a_cpu_layout_model_saves_the_stored_layout_and_loads_back_into_the_cpu_layout():
    lm = int4_lm()
    prompt, canvas = torch.randint(3, 60, (2, 5)), torch.randint(3, 60, (2, 8))
    with tempfile.TemporaryDirectory() as folder:
        lm.save(folder)
        from safetensors.torch import load_file

        files = load_file(f"{folder}/model.safetensors")
        module = lm.model.layers[0].self_attn.q_proj
        assert module.cpu_int4
        q, scale = from_cpu_int4(module.weight, module.weight_scale)
        assert torch.equal(files["model.decoder.layers.0.self_attn.q_proj.weight"], q)
        assert torch.equal(files["model.decoder.layers.0.self_attn.q_proj.weight_scale"], scale)
        back = quiet(blockpress.load, folder)
    assert [m.cpu_int4 for m in coded_modules(back)] == [m.cpu_int4 for m in coded_modules(lm)]
    assert torch.equal(back.model.layers[0].self_attn.q_proj.weight, module.weight)
    assert torch.equal(back.logits(prompt, canvas), lm.logits(prompt, canvas))
    # load_state_dict into a model holding the CPU layout: the stored layout in, the CPU's kept
    other = int4_lm(seed=9)
    other.model.load_state_dict(back.model.state_dict())
    assert [m.cpu_int4 for m in coded_modules(other)] == [m.cpu_int4 for m in coded_modules(lm)]
    assert torch.equal(other.logits(prompt, canvas), lm.logits(prompt, canvas))


@needs_layout
def test_generation_in_the_cpu_layout_matches_the_stored_layout():
    """The kernel's sums round otherwise than a bf16 GEMM's, so tokens may differ in a random model; greedy AR on the
    same weights agrees on most tokens, and both engines run."""
    lm = int4_lm()
    stored = copy.deepcopy(lm)
    for m in coded_modules(stored):
        m.set_cpu_int4(False)
    prompt = torch.tensor([[3, 4, 5, 6]])
    out = lm.generate(prompt, max_new_tokens=8, max_denoising_steps=3, seed=0)
    assert out.sequences.shape == (1, 12)
    ar, ar_stored = lm.generate_ar(prompt, max_new_tokens=8), stored.generate_ar(prompt, max_new_tokens=8)
    assert (ar.sequences == ar_stored.sequences).float().mean() >= 0.75


@needs_layout
def test_the_input_gradient_through_the_cpu_layout_is_the_stored_layouts():
    """QLoRA over a bf16 int4 base on a CPU: the backward dequantizes from the CPU layout, the same weight exactly."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 80, bias=False).to(torch.bfloat16)
    stored = QuantizedLinear(linear, "int4")
    held = copy.deepcopy(stored)
    held.set_cpu_int4(True)
    x = torch.randn(3, 96, generator=g).to(torch.bfloat16).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    upstream = torch.randn(3, 80, generator=g).to(torch.bfloat16)
    held(x).backward(upstream)
    stored(x2).backward(upstream)
    assert torch.equal(x.grad, x2.grad)


def plain_experts(dtype):
    torch.manual_seed(0)
    # inputs of 32 (hidden) and 32 (the experts' width): groups of 32 both ways, as the CPU layout needs
    return noisy_experts(4, dtype, width=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_experts_on_a_cpu_dequantize_only_the_experts_with_rows(dtype, monkeypatch):
    """Before, every expert's weight was dequantized on each call: an AR token of the 26B-A4B (8 of 128 experts)
    dequantized 16x the weights it used. The output is each expert's rows through its own dequantized weight."""
    experts = quiet(QuantizedExperts, plain_experts(dtype), "int4")
    x = torch.randn(6, experts.gate_up_proj.shape[-1] * 2, dtype=dtype)
    offsets = torch.tensor([2, 2, 2, 6], dtype=torch.int32)  # experts 1 and 2 have no rows
    seen = []
    real = quantize_module.dequantize_weight
    monkeypatch.setattr(quantize_module, "dequantize_weight", lambda q, s, d: seen.append(tuple(q.shape)) or real(q, s, d))
    got = experts.project(x, "gate_up_proj", ExpertRows(offsets))
    assert seen == [tuple(experts.gate_up_proj.shape[1:])] * 2  # experts 0 and 3, one matrix each
    q, scale = experts.gate_up_proj, experts.gate_up_proj_scale
    want = torch.cat([x[:2] @ real(q[0], scale[0], dtype).T, x[2:] @ real(q[3], scale[3], dtype).T])
    assert torch.equal(got, want)


@needs_layout
def test_int4_experts_in_the_cpu_layout_trace_as_one_graph_and_match_the_stored_layout():
    experts = quiet(QuantizedExperts, plain_experts(torch.bfloat16), "int4")
    held = copy.deepcopy(experts)
    held.set_cpu_int4(True)
    assert held.kernel == "int4-cpu" and experts.kernel == "int4"
    x = torch.randn(12, experts.gate_up_proj.shape[-1] * 2, dtype=torch.bfloat16)
    offsets = torch.tensor([3, 3, 9, 12], dtype=torch.int32)

    def project(x, offsets):
        return held.project(x, "gate_up_proj", ExpertRows(offsets))

    got = project(x, offsets)
    assert torch.equal(torch.compile(project, fullgraph=True, backend="eager")(x, offsets), got)
    want = experts.project(x, "gate_up_proj", ExpertRows(offsets))
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()


@needs_layout
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-op"])
def test_float32_rows_take_the_int4_gemm_in_bf16_at_inference_and_stay_float32_in_grad_mode(compiled):
    """A float32 model's int4 weights in the CPU layout: at inference (no_grad) their rows go through the int4 GEMM in
    bf16, its vectorized kernel (float32 rows ran 27x slower than dequantizing); with grad enabled, training's
    arithmetic stays float32 (a LoRA's gradient depends on the base's outputs), the stored layout's result."""
    torch.manual_seed(0)
    experts = quiet(QuantizedExperts, plain_experts(torch.float32), "int4")
    held = copy.deepcopy(experts).eval()  # (a module starts in training mode, which keeps float32 rows float32)
    held.set_cpu_int4(True)
    x = torch.randn(12, experts.gate_up_proj.shape[-1] * 2)
    offsets = torch.tensor([3, 3, 9, 12], dtype=torch.int32)

    def project(module, x):
        return module.project(x, "gate_up_proj", ExpertRows(offsets))

    # (aot_eager: AOTAutograd runs the op with grad mode off, so the flag the op is handed is what keeps it float32)
    run = torch.compile(project, fullgraph=True, backend="aot_eager") if compiled else project
    exact = project(experts, x)  # the stored layout: dequantized, float32 throughout
    q, scale = held.gate_up_proj, held.gate_up_proj_scale
    in_bf16 = torch.cat([quantized_matmul(x[a:b].bfloat16(), q[e], scale[e], "int4-cpu").float()
                         for e, a, b in ((0, 0, 3), (2, 3, 9), (3, 9, 12))])
    with torch.no_grad():
        inference = run(held, x)
    assert inference.dtype == torch.float32 and torch.equal(inference, in_bf16)
    assert not torch.allclose(inference, exact, rtol=1e-5, atol=1e-5)  # rounded: the bf16 kernel did run
    assert (inference - exact).abs().max() <= 2 * 2**-8 * exact.abs().max()
    torch.testing.assert_close(run(held, x), exact, rtol=1e-5, atol=1e-5)  # grad mode: float32
    layer = quiet(QuantizedLinear, torch.nn.Linear(96, 80, bias=False), "int4").eval()
    stored = layer(x[:, :1].expand(-1, 96).contiguous())
    layer.set_cpu_int4(True)
    torch.testing.assert_close(layer(x[:, :1].expand(-1, 96).contiguous()), stored, rtol=1e-5, atol=1e-5)


@needs_layout
def test_eager_calls_the_cpu_kernels_themselves_and_compiled_code_their_opaque_ops(monkeypatch):
    """A custom op's dispatch cost about 15 us a call in eager (one thread), more than a small projection's kernel:
    blockpress-code's AR ran 13-25% faster calling the kernels directly. Under torch.compile they stay opaque ops."""
    linear = quiet(QuantizedLinear, torch.nn.Linear(64, 48, bias=False), "int4").eval()
    linear.set_cpu_int4(True)
    packed = quiet(QuantizedLinear, torch.nn.Linear(64, 48, bias=False), "int8").eval()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    calls = []
    for name in ("_int4_cpu_mm_op", "_int8pack_mm_op"):
        real = getattr(quantize_module, name)
        monkeypatch.setattr(quantize_module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    with torch.no_grad():
        eager = (linear(x), packed(x))
        assert calls == []
        compiled = [torch.compile(m, fullgraph=True, backend="eager")(x) for m in (linear, packed)]
    assert calls == ["_int4_cpu_mm_op", "_int8pack_mm_op"]
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@needs_layout
def test_a_weight_the_cpu_int4_gemm_does_not_take_is_refused_by_name():
    layer = QuantizedLinear(torch.nn.Linear(48, 32, bias=False), "int4")  # 48 inputs: groups of 16
    with pytest.raises(ValueError, match=r"set_cpu_int4: .* int4 weight weight \(codes \[32, 24\]\)"):
        layer.set_cpu_int4(True)
    assert not layer.cpu_int4
    with pytest.raises(ValueError, match=r"set_cpu_int4: .* int8 weight"):
        QuantizedLinear(torch.nn.Linear(64, 32, bias=False), "int8").set_cpu_int4(True)


@needs_layout
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_int4_projection_in_the_cpu_layout_compiles_with_inductor(dtype):
    layer = QuantizedLinear(torch.nn.Linear(64, 48, bias=False), "int4").eval()
    layer.set_cpu_int4(True)
    x = torch.randn(16, 64, dtype=dtype)

    def step(x):
        return layer(torch.nn.functional.gelu(x) * 2)

    with torch.no_grad():  # (float32 rows take the int4 GEMM at inference alone: eval mode, no_grad)
        assert torch.equal(torch.compile(step)(x), step(x))


@needs_layout
def test_a_move_off_the_cpu_holds_the_stored_layout_again():
    """The CPU layout is the CPU GEMM's alone: a model moved elsewhere (a GPU dequantizes from the stored layout) is
    laid out as stored on arrival, by DiffusionGemma._apply. Moved to the meta device here, which no GPU is needed for:
    the shapes are the stored ones."""
    lm = int4_lm()
    module = lm.model.layers[0].self_attn.q_proj
    assert module.cpu_int4 and module.weight_scale.dim() == 3  # [groups, out, 2]
    stored_shapes = {k: tuple(v.shape) for k, v in lm.model.state_dict().items()}
    lm.model.to("meta")
    assert not any(m.cpu_int4 for m in coded_modules(lm))
    assert {k: tuple(v.shape) for k, v in lm.model.state_dict().items()} == stored_shapes
    assert module.weight_scale.shape == (module.out_features, module.in_features // 32)


@needs_layout
def test_info_counts_int4_as_a_cpu_in_bf16_holds_it(capsys):
    """`info --device cpu` counts what a load there would hold: the CPU layout's scales carry a zero each; on the meta
    device (the stored layout) they do not."""
    import json

    from blockpress.cli import main

    held = quiet(blockpress.random_model(blockpress.ModelConfig.preset("tiny"), dtype="bfloat16").quantize, "int4")
    assert any(m.cpu_int4 for m in coded_modules(held))
    counted = {}
    for device in ("cpu", "meta"):
        assert quiet(main, ["info", "--model", "random-tiny", "--device", device, "--dtype", "bfloat16", "--quantize",
                            "int4", "--json"]) == 0
        counted[device] = json.loads(capsys.readouterr().out)["weights_bytes"]
    assert counted["cpu"] == held.weights_bytes() > counted["meta"]


@pytest.mark.parametrize("scheme, dtype", [("int4", "bfloat16"), ("int4", "float32"), ("int8", "bfloat16")])
def test_a_quantized_copy_is_quantize_of_a_copy_bit_for_bit_and_shares_the_rest(scheme, dtype):
    """quantize.quantized_copy (bench's quantized engine): what copy-then-quantize gives, built from the model's own
    weights one matrix at a time, the unquantized tensors shared, the model left as it was."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from blockpress.quantize import quantized_copy

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=64, canvas_length=8), seed=4, dtype=dtype)
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    expected = quiet(copy.deepcopy(lm).quantize, scheme)

    class Allocations(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor) and a.device.type == "cpu"}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu"
                        and t.untyped_storage().data_ptr() not in inputs):  # new memory, not a view of an input
                    self.largest = max(self.largest, t.numel())
            return out

    with Allocations() as seen:
        twin = quiet(quantized_copy, lm.model, scheme)
    matrices = [w[0] if w.dim() == 3 else w for name, w in lm.model.named_parameters()
                if w.dim() >= 2 and name != "embed_tokens.weight"]  # the embedding is shared, never copied
    assert seen.largest <= max(w.numel() for w in matrices)  # float temporaries of one matrix at a time
    got, want = twin.state_dict(), expected.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert twin.embed_tokens.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    assert lm.quantization is None and all(torch.equal(v, before[k]) for k, v in lm.model.state_dict().items())
    prompt, canvas = torch.randint(3, 60, (2, 5)), torch.randint(3, 60, (2, 8))
    assert torch.equal(blockpress.LM(twin).logits(prompt, canvas), expected.logits(prompt, canvas))
    with pytest.raises(ValueError, match=r"quantize: the model is already quantized \(" + scheme):
        quantized_copy(expected.model, scheme)


@needs_layout
def test_a_load_counts_the_copies_of_the_cpu_layout_before_reading(tmp_path, monkeypatch):
    """A folder saved int4 and loaded in bf16 on a CPU was not counted at all (its codes stay views of the file), yet the
    CPU layout copies every fitting int4 weight, scales doubled: the 26B-A4B's 16.8 GB. Too little memory for them is
    now refused by name before anything is read, as for any other load."""
    import blockpress.checkpoint as checkpoint
    from blockpress.quantize import cpu_layout_bytes

    quiet(int4_lm().save, tmp_path)
    plan = checkpoint.plan_model(tmp_path, None, "cpu", None)
    copied, added = cpu_layout_bytes(plan.model, plan.device, plan.dtype)
    # the same counted from the plan's meta model laid out as the load will hold it (what info describes)
    assert cpu_layout_bytes(plan.meta_model(), plan.device, plan.dtype) == (copied, added) and copied > 0
    monkeypatch.setattr(checkpoint, "available_bytes", lambda device: copied - 1)
    with pytest.raises(ValueError, match=r"load: .* in bfloat16, int4: needs 0\.0 GB on cpu but 0\.0 GB are available"):
        quiet(blockpress.load, tmp_path)
    monkeypatch.setattr(checkpoint, "available_bytes", lambda device: copied)
    back = quiet(blockpress.load, tmp_path)
    held = [(getattr(m, n), getattr(m, n + "_scale")) for m in coded_modules(back) if m.cpu_int4 for n in m.coded_names]
    assert copied == sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s in held)
    assert added * 2 == sum(s.numel() * s.element_size() for _, s in held)  # a zero beside each scale


@needs_layout
def test_out_sizes_of_8_not_16_stay_in_the_stored_layout():
    """torch's CPU int4 GEMM takes rows in 16s: a weight of 24 rows is refused that layout by name and computes as
    stored."""
    assert not int4_cpu_fits((24, 64)) and int4_cpu_fits((32, 64))
    torch.manual_seed(0)
    layer = QuantizedLinear(torch.nn.Linear(64, 24, bias=False), "int4").eval()
    with pytest.raises(ValueError, match=r"set_cpu_int4: .* int4 weight weight \(codes \[24, 32\]\)"):
        layer.set_cpu_int4(True)
    assert not layer.cpu_int4
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), x @ dequantize_weight(layer.weight, layer.weight_scale, torch.bfloat16).t())


@needs_layout
def test_a_state_dict_loaded_off_the_cpu_into_the_cpu_layout_stays_in_the_stored_layout():
    """A layer holding the CPU layout takes a state dict of codes on another device (assign=True: they are kept as
    given) in the stored layout, and keeps that layout: the CPU GEMM's is for codes on a CPU alone (a GPU dequantizes
    from the stored layout). The meta device stands in for a GPU here; the shapes are the stored ones."""
    torch.manual_seed(0)
    layer = QuantizedLinear(torch.nn.Linear(64, 32, bias=False), "int4").eval()
    layer.set_cpu_int4(True)
    assert layer.cpu_int4 and layer.weight_scale.dim() == 3  # [groups, out, 2]
    stored = {k: v.to("meta") for k, v in QuantizedLinear(torch.nn.Linear(64, 32, bias=False), "int4").state_dict().items()}
    layer.load_state_dict(stored, assign=True)
    assert not layer.cpu_int4 and layer.weight.device.type == "meta"
    assert (tuple(layer.weight.shape), tuple(layer.weight_scale.shape)) == ((32, 32), (32, 2))
    # on a CPU the layout is put back, as before the load
    layer.load_state_dict({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in stored.items()}, assign=True)
    assert layer.cpu_int4 is False  # (it was not held when this load began)
    layer.set_cpu_int4(True)
    layer.load_state_dict({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in stored.items()})
    assert layer.cpu_int4 and layer.weight_scale.dim() == 3


@needs_layout
def test_an_int4_model_in_float16_on_a_cpu_stays_in_the_stored_layout():
    """The CPU layout is for bfloat16 and float32 (CPU_KERNEL_DTYPES): a float16 int4 model on a CPU holds its codes
    as stored, weights that fit torch's CPU int4 GEMM too, and counts the stored bytes."""
    half = int4_lm(dtype="float16")
    modules = coded_modules(half)
    fits = [m for m in modules if all(int4_cpu_fits((*getattr(m, n).shape[:-1], 2 * getattr(m, n).shape[-1]))
                                      for n in m.coded_names)]
    assert fits and not any(m.cpu_int4 for m in modules)  # (in bfloat16 the fitting ones hold it)
    assert all(m.weight_scale.dim() == 2 for m in modules if isinstance(m, QuantizedLinear))
