"""A model whose own logits are NaN or infinite (NaN weights, or activations past its dtype's range) is refused
with the cause, where decoding them wrote token 0 at every position and said nothing."""

import pytest
import torch

import blockpress
from blockpress.generate import model_logits_fault


def tiny(dtype=None):
    return blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0, dtype=dtype)


def poison(lm, value):
    with torch.no_grad():
        lm.model.layers[0].self_attn.q_proj.weight[0, 0] = value
    return lm


@pytest.fixture(scope="module")
def nan_lm():
    return poison(tiny(), float("nan"))


@pytest.mark.parametrize("how", ["generate", "generate_ar", "stream"])
def test_nan_weights_are_named_instead_of_decoding_zeros(nan_lm, how):
    run = {
        "generate": lambda: nan_lm.generate([5, 6, 7], max_new_tokens=8, max_denoising_steps=4, seed=1),
        "generate_ar": lambda: nan_lm.generate_ar([5, 6, 7], max_new_tokens=8),
        "stream": lambda: list(nan_lm.stream([5, 6, 7], max_new_tokens=8, max_denoising_steps=4, seed=1)),
    }[how]
    with pytest.raises(blockpress.NonFiniteLogits, match=r"NaN or infinite .* 1 of its \d+ weight tensors hold NaN "
                                                        r"or inf \(layers\.0\.self_attn\.q_proj\.weight\)"):
        run()


@pytest.mark.parametrize("where", ["embedding", "fp8 codes"])
def test_an_fp8_model_with_nan_weights_is_named(where):
    """The cause was looked for with torch.isfinite over every float tensor, FP8 codes too, which torch has no
    isfinite for: NotImplementedError ("not implemented for 'Float8_e4m3fn'") in place of NonFiniteLogits."""
    lm = tiny().quantize("fp8")
    codes = [(name, t) for name, t in lm.model.named_buffers() if t.dtype == torch.float8_e4m3fn]
    assert codes
    with torch.no_grad():
        if where == "embedding":
            name, tensor = "embed_tokens.weight", lm.model.embed_tokens.weight
        else:
            name, tensor = codes[0]
        tensor.view(-1)[0] = float("nan")
    lm.model.weights_changed()
    with pytest.raises(blockpress.NonFiniteLogits, match=rf"1 of its \d+ weight tensors hold NaN or inf \({name}\)"):
        lm.generate([5, 6, 7], max_new_tokens=8, max_denoising_steps=2, seed=1)


def test_a_nan_model_is_blamed_before_a_logits_processor():
    """The hooks' own check (a processor that leaves no token) read the model's NaN as the processor's fault."""
    lm = poison(tiny(), float("nan"))
    with pytest.raises(blockpress.NonFiniteLogits, match="canvas 0's first denoising step"):
        lm.generate([5, 6, 7], max_new_tokens=8, max_denoising_steps=2, seed=1, logits_processor=lambda x, rows: x)


def test_finite_weights_that_overflow_say_the_dtype():
    lm = poison(tiny(), 3e38)  # finite, but q @ k overflows float32
    with pytest.raises(blockpress.NonFiniteLogits, match="its weights are finite, so its activations overflowed "
                                                        "float32$"):
        lm.generate([5, 6, 7], max_new_tokens=4, max_denoising_steps=2, seed=1)
    half = tiny(torch.float16)
    assert "load it in bfloat16 or float32" in str(model_logits_fault(half.model, "x"))


def test_a_healthy_model_is_not_refused():
    lm = tiny()
    for out in (lm.generate([5, 6, 7], max_new_tokens=8, max_denoising_steps=4, seed=1),
                lm.generate_ar([5, 6, 7], max_new_tokens=8)):
        assert out.sequences.shape == (1, 3 + 8) and out.sequences[0, :3].tolist() == [5, 6, 7]


def test_the_cli_prints_the_cause_and_exits_2(tmp_path, capsys):
    from blockpress.cli import main
    from blockpress.tokenizer import train_bpe_tokenizer

    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), tokenizer=train_bpe_tokenizer([""], 300))
    poison(lm, float("inf")).save(tmp_path)
    assert main(["generate", "hello", "--model", str(tmp_path), "--no-live", "--max-new-tokens", "4",
                 "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "blockpress generate: error: the model's logits are NaN or infinite" in err
    assert "layers.0.self_attn.q_proj.weight" in err


def overflow_on_call(module, call):
    """Make `module`'s `call`-th output (1-based) overflow float16 (x 1e5), as activations that grow past its 65,504
    at a later pass would: the passes before and after are the model's own."""
    calls = []

    def hook(_module, _inputs, output):
        calls.append(None)
        return output * 1e5 if len(calls) == call else output

    return module.register_forward_hook(hook)


@pytest.fixture(scope="module")
def half_lm():
    return tiny(torch.float16)


@pytest.mark.parametrize("call, where", [(1, "canvas 0's first denoising step"), (3, "canvas 0's denoising step 3"),
                                         (6, "canvas 1's denoising step 2")])
def test_a_float16_overflow_at_a_later_step_is_named(half_lm, call, where):
    """Only a canvas's first step was checked, so a float16 overflow at a later step (its activations growing as the
    canvas settles) decoded NaN logits as token 0, unsaid; a float16 model's every step is checked now, on the
    device, and read at the canvas's end. Denoising runs only in the decoder's self-conditioning input: one call a
    step, 4 steps a canvas."""
    handle = overflow_on_call(half_lm.model.self_conditioning, call)
    try:
        with pytest.raises(blockpress.NonFiniteLogits, match=f"at {where}, so there is nothing to decode: its weights "
                                                              "are finite, so its activations overflowed float16"):
            half_lm.generate([5, 6, 7], max_new_tokens=32, max_denoising_steps=4, seed=1, adaptive_stopping=False)
    finally:
        handle.remove()


def test_a_float16_overflow_at_a_later_ar_token_is_named(half_lm):
    """generate_ar read the first token's logits alone; a float16 model's are read for every token, once at the end.
    The 1st pass after the prompt's is the one that gives the 2nd new token's logits."""
    handle = overflow_on_call(half_lm.model.norm, 4)  # the prompt's pass, then 3 one-token passes: the 4th new token
    try:
        with pytest.raises(blockpress.NonFiniteLogits, match="at new token 4, so there is nothing to decode"):
            half_lm.generate_ar([5, 6, 7], max_new_tokens=6)
    finally:
        handle.remove()


def test_a_healthy_float16_model_is_not_refused(half_lm):
    """Every step checked finds nothing in a float16 model that does not overflow: canvases that stop early
    (adaptive stopping), rows that end before others, and AR rows that ended decoding pads."""
    for out in (half_lm.generate([[5, 6, 7], [8, 9, 10]], max_new_tokens=[8, 20], max_denoising_steps=3, seed=1),
                half_lm.generate_ar([[5, 6, 7], [8, 9, 10]], max_new_tokens=[2, 6])):
        assert out.sequences.shape[0] == 2 and out.sequences[:, :3].tolist() == [[5, 6, 7], [8, 9, 10]]


@pytest.mark.parametrize("step", [1, 3])
def test_a_stream_stops_at_the_step_that_overflowed_not_after_showing_it(half_lm, step):
    """A stream's drafts were shown for the steps after an overflow (NaN logits decode as token 0 everywhere, a canvas
    of pads on a live view), and the error came at the canvas's end. A draft reads the device anyway, so the step
    that overflowed is refused before its draft."""
    from blockpress.generate import Draft

    handle = overflow_on_call(half_lm.model.self_conditioning, step)
    seen = []
    try:
        with pytest.raises(blockpress.NonFiniteLogits, match="at canvas 0's " + ("first denoising step" if step == 1
                                                                               else f"denoising step {step}")):
            for event in half_lm.stream([5, 6, 7], max_new_tokens=16, max_denoising_steps=4, seed=1,
                                        adaptive_stopping=False):
                seen.append(event)
    finally:
        handle.remove()
    assert [e.step for e in seen if isinstance(e, Draft)] == list(range(1, step))


@pytest.mark.parametrize(("sampler", "ar"), [
    (dict(), dict()),
    (dict(t_max=0.5, t_min=0.1), dict(temperature=0.5)),  # the schedule's temperature, and AR's
    (dict(draw_temperature=0.25, top_k=5), dict(temperature=0.25, top_k=5)),
    (dict(draw_temperature=0.5, top_p=0.9), dict(temperature=0.5, top_p=0.9)),
])
def test_a_processor_that_favours_a_token_with_the_largest_finite_logit_gets_it(sampler, ar):
    """What the processors' error advises ("favour one with a large finite value"): divided by a temperature below 1,
    float32's largest value overflowed to +inf and its softmax to NaN, so AR wrote the vocabulary's last token and
    diffusion blamed the processor for NaN it never returned."""
    lm = tiny()

    def favour3(logits, rows):
        logits[..., 3] = torch.finfo(logits.dtype).max
        return logits

    out = lm.generate_ar([[5, 6, 7]], max_new_tokens=6, seed=1, logits_processor=favour3, **ar)
    assert out.new_tokens.tolist() == [[3] * 6]
    out = lm.generate([[5, 6, 7]], max_new_tokens=8, max_denoising_steps=4, seed=1, logits_processor=favour3,
                      **sampler)
    assert out.new_tokens.tolist() == [[3] * 8]
