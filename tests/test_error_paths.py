"""Error paths reached from the public API, by raise site: each refusal names its argument or field and what was
expected (the sites no other test reached, found by a hunt over every raise), and the defects that hunt found."""
import pytest
import torch

import blockpress


@pytest.fixture(scope="module")
def lm():
    return blockpress.load("blockpress-code")


def test_logits_batch_mismatch_names_both(lm):  # lm.py: canvas_ids batch vs prompt_ids batch
    with pytest.raises(ValueError, match=r"canvas_ids: batch 2 does not match prompt_ids batch 3"):
        lm.logits([[1, 2], [1, 3], [4, 5]], [[3] * 8, [3] * 8])


def test_generate_list_of_2d_tensors_refused(lm):  # generate.py _id_row: each row 1-D
    with pytest.raises(ValueError, match=r"prompt: expected each row of a list to be 1-D token ids, got shape \[1, 2\]"):
        lm.generate([torch.tensor([[1, 2]]), torch.tensor([[3, 4]])], 2, max_denoising_steps=1)


def test_zero_length_hole_refused(lm):  # generate.py parse_template: <|hole:0|>
    with pytest.raises(ValueError, match=r"template: <\|hole:0\|> holds no token"):
        lm.generate("x", template="a <|hole:0|> b", max_denoising_steps=1)


@pytest.mark.parametrize("ids", [[], "hi"])
def test_chat_ids_refuses_non_id_lists(lm, ids):  # lm.py _chat_start
    with pytest.raises(ValueError, match=r"^ids: expected chat_prompt's token ids"):
        lm.chat_ids(ids, max_new_tokens=2)


def test_generate_without_prompt(lm):  # lm.py: "prompt: generate needs a prompt"
    with pytest.raises(ValueError, match=r"^prompt: generate needs a prompt"):
        lm.generate(max_new_tokens=2)


def test_attention_mask_unreadable_with_copies(lm):  # lm.py _repeat_rows: num_return_sequences repeats the mask
    with pytest.raises(ValueError, match=r"^attention_mask: expected a text, a list of them, or ids, got object"):
        lm.generate([[1, 2]], 2, num_return_sequences=2, attention_mask=object(), max_denoising_steps=1)


def test_cache_truncate_to_another_caches_mark(lm):  # cache.py truncate
    a, b = lm.new_cache(1, 16), lm.new_cache(1, 16)
    with pytest.raises(ValueError, match=r"KVCache.truncate: this mark was made on another cache"):
        b.truncate(a.mark())


def test_cache_keep_more_than_held(lm):  # cache.py keep
    with pytest.raises(ValueError, match=r"KVCache.keep: expected one count per row, each at most what the row holds"):
        lm.new_cache(1, 16).keep([5])


def test_load_adapter_wrong_type():  # lm.py: adapter must be a folder
    with pytest.raises(ValueError, match=r"^adapter: expected a PEFT LoRA folder, got 3"):
        blockpress.load("blockpress-code", adapter=3)


def test_load_close_name_suggests_shipped():  # lm.py: did you mean
    with pytest.raises(FileNotFoundError, match=r"did you mean 'blockpress-code'\?"):
        blockpress.load("blockpress-cod")


def test_config_without_text_config():  # config.py from_dict
    from blockpress.config import ConfigError
    with pytest.raises(ConfigError, match=r"^text_config: missing"):
        blockpress.ModelConfig.from_dict({})


@pytest.mark.parametrize("messages, match", [
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role: expected a str"),
    ([{"content": "x"}], r"messages\[0\]\.role: expected a str .*got nothing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
     r"messages\[0\]\.content: only text parts .* is 'image_url'"),
])
def test_chat_message_fields_named(lm, messages, match):  # tokenizer.py chat_message
    from blockpress.tokenizer import MessageError
    with pytest.raises(MessageError, match=match):
        lm.chat_prompt(messages)


@pytest.mark.parametrize("messages, match", [
    ("hi", r"messages must be a list of dicts, got str"),
    ([1], r"Message 0 must be a dict, got int"),
    ([{"content": "x"}], r"Message 0 has no 'role' field"),
    ([{"role": 1, "content": "x"}], r"Message 0 field 'role' must be a str, got int"),
])
def test_tokenizer_apply_chat_template_validates(lm, messages, match):  # tokenizer.py _validate_messages
    with pytest.raises(ValueError, match=match):
        lm.tokenizer.apply_chat_template(messages)
@pytest.mark.parametrize("raw, match", [
    ({"time_schedule": True}, r"^time_schedule: needs max_minutes > 0"),
    ({"diffusion_weight": 0, "aux_ar_weight": 0}, r"^diffusion_weight/aux_ar_weight: must be >= 0 and not both 0"),
    ({"min_lr_ratio": 2.0}, r"^min_lr_ratio: expected in \[0, 1\], got 2.0"),
    ({"beta1": 1.0}, r"^beta1: expected in \[0, 1\), got 1.0"),
    ({"beta2": -0.1}, r"^beta2: expected in \[0, 1\)"),
    ({"t_eps": 0.6}, r"^t_eps: expected in \(0, 0.5\), got 0.6"),
    ({"prompt_min": 5, "prompt_max": 2}, r"^prompt_min/prompt_max: need 0 < prompt_min <= prompt_max, got 5/2"),
    ({"bogus": 1}, r"^train config: unknown field\(s\) \['bogus'\]"),
])
def test_train_config_refusals_name_the_field(raw, match):
    from blockpress.train_config import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict(raw)


@pytest.mark.parametrize("entry", ["chat", "chat_ids", "chat_stream"])
@pytest.mark.parametrize("cache", [{}, "cache.pt", object()])
def test_a_chat_turn_names_a_cache_that_is_no_kvcache(lm, entry, cache):
    """The cache's claim was asked for before its type was checked: AttributeError "'dict' object has no attribute
    'in_use'" where generate says what it expected."""
    msgs = [{"role": "user", "content": "hi"}]
    call = {"chat": lambda: lm.chat(msgs, max_new_tokens=2, cache=cache),
            "chat_ids": lambda: lm.chat_ids(lm.chat_prompt(msgs), max_new_tokens=2, cache=cache),
            "chat_stream": lambda: list(lm.chat_stream(lm.chat_prompt(msgs), max_new_tokens=2, cache=cache))}[entry]
    with pytest.raises(ValueError, match=rf"^cache: expected the KVCache of an earlier call \(return_cache=True\), "
                                         rf"got {type(cache).__name__}$"):
        call()


@pytest.mark.parametrize("keyword", ["continue_final_message", "add_generation_prompt", "tools", "chat_template"])
def test_chat_points_a_template_option_to_template_options(lm, keyword):
    """lm.chat(messages, continue_final_message=True) was passed on to generate: "generate takes no such keyword;
    it takes prompt, ...", naming neither chat nor template_options, the way that works."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def"}]
    with pytest.raises(ValueError, match=rf"^{keyword}: chat takes the chat template's options in template_options: "
                                         rf"pass template_options={{'{keyword}': \.\.\.}}"):
        lm.chat(msgs, max_new_tokens=2, **{keyword: True})


@pytest.mark.parametrize("value", ["no", torch.tensor([True, False])])
def test_chat_checks_token_healing_before_reading_it(lm, value):
    """Its truth was read first: "no" got the long refusal about chat prompts, a two-element tensor torch's
    "Boolean value of Tensor with more than one value is ambiguous"."""
    with pytest.raises(ValueError, match=r"^token_healing: expected True, False or None"):
        lm.chat([{"role": "user", "content": "hi"}], max_new_tokens=2, token_healing=value)


@pytest.mark.parametrize("item", [None, 3, b"x"])
def test_a_batch_of_texts_names_the_row_that_is_no_text(lm, item):
    """One row that was not a str sent the whole batch to the token-id reader, which blamed the first, valid row:
    "prompt: expected integer token ids, got 'def f(x):'"."""
    with pytest.raises(ValueError, match=rf"^prompt\[1\]: a batch of texts holds {type(item).__name__} "):
        lm.generate(["def f(x):", item], 2, max_denoising_steps=1)


@pytest.mark.parametrize("max_length", ["x", 1.5, -1, float("nan")])
def test_max_length_is_checked_when_max_new_tokens_wins(lm, max_length):
    """max_new_tokens takes precedence (as in transformers), and max_length was then dropped unchecked: "x" ran
    with only the precedence warning, where alone it is refused."""
    with pytest.raises(ValueError, match=r"^max_length: expected a positive integer"):
        lm.generate("ab", 3, max_length=max_length, max_denoising_steps=1)


@pytest.mark.parametrize("rows, cache_rows, name", [(1, 2, "encode"), (2, 1, "encode"), (2, 1, "denoise")])
def test_a_pass_of_your_own_names_a_cache_of_other_rows(lm, rows, cache_rows, name):  # model.py _check_ids
    cache = lm.new_cache(cache_rows, 64)
    ids = torch.ones(rows, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"(input|canvas)_ids: {rows} rows, but the cache holds {cache_rows}"):
        getattr(lm.model, name)(ids, cache)


@pytest.mark.parametrize("ids", [torch.ones(4, dtype=torch.long), torch.ones(1, 4)])
def test_a_pass_of_your_own_wants_2d_integer_ids(lm, ids):  # model.py _check_ids
    with pytest.raises(ValueError, match=r"input_ids: expected token ids as a 2-D int64 tensor"):
        lm.model.encode(ids, lm.new_cache(1, 64))


@pytest.mark.parametrize("name", ["encode", "denoise"])
def test_a_pass_of_your_own_of_no_tokens_is_refused_by_name(lm, name):  # model.py _check_ids
    with pytest.raises(ValueError, match=r"_ids: no tokens \(shape \[1, 0\]\); a pass needs at least one"):
        getattr(lm.model, name)(torch.ones(1, 0, dtype=torch.long), lm.new_cache(1, 64))


@pytest.mark.parametrize("mask", [torch.ones(1, 3), torch.ones(4), [[1, 1, 1, 1]]])
def test_an_encode_of_your_own_names_a_mask_not_shaped_like_its_ids(lm, mask):
    cache = lm.new_cache(1, 64)
    with pytest.raises(ValueError, match=r"^attention_mask: expected a tensor shaped like input_ids \[1, 4\]"):
        lm.model.encode(torch.ones(1, 4, dtype=torch.long), cache, attention_mask=mask)
    assert cache.length == 0
    lm.model.encode(torch.ones(1, 4, dtype=torch.long), cache, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    assert cache.length == 4 and cache.next_pos.tolist() == [3]


def test_a_model_built_directly_starts_from_finite_weights():  # model.py Experts: not torch.empty's memory
    torch.manual_seed(0)
    model = blockpress.DiffusionGemma(blockpress.ModelConfig.tiny())
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert p.abs().max() < 10, name  # (empty memory can hold finite garbage such as 1e37 too)
        assert p.dim() == 1 or p.std() > 0, name  # (or zeros: fresh pages)
    out = blockpress.LM(model).logits(torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]]))
    assert torch.isfinite(out).all()
