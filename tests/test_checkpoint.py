"""Checkpoints: save -> reference from_pretrained, sharding, dtype, and clear errors for bad folders."""

import functools
import json
import math
import mmap
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import hypothesis
import pytest
import torch
from fp8 import FP8
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import blockpress
from blockpress.checkpoint import hf_hub_cache, local_to_hf, plan_model
from blockpress.config import ConfigError, ModelConfig
from blockpress.sampling import SamplerConfig


def load_quiet(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return blockpress.load(path, **kw)


@pytest.fixture(scope="module")
def lm(ref_checkpoint):
    return load_quiet(ref_checkpoint[0])


def test_save_roundtrip_through_reference(lm, ref_checkpoint, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    lm.save(tmp_path / "out")
    ref2 = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "out").eval()
    g = torch.Generator().manual_seed(0)
    prompt, canvas = torch.randint(0, 96, (2, 13), generator=g), torch.randint(0, 96, (2, 8), generator=g)
    with torch.no_grad():
        expected = ref2(input_ids=prompt, decoder_input_ids=canvas).logits
        original = ref_checkpoint[1](input_ids=prompt, decoder_input_ids=canvas).logits
    diff = (lm.logits(prompt, canvas) - expected).abs().max().item()
    print(f"save -> reference from_pretrained max|diff| = {diff:.2e}")
    assert diff <= 1e-4
    assert (expected - original).abs().max().item() <= 1e-6  # nothing lost on the way
    # vision tensors were carried through unchanged
    src = load_file(ref_checkpoint[0] / "model.safetensors")
    out = load_file(tmp_path / "out" / "model.safetensors")
    vision = [k for k in src if "vision" in k]
    assert vision and all(torch.equal(src[k], out[k]) for k in vision)


def test_sharded_checkpoint_loads_the_same(lm, tmp_path):
    from blockpress.checkpoint import save_model

    save_model(lm.model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    lm2 = load_quiet(tmp_path / "sharded")
    for (n1, p1), (n2, p2) in zip(lm.model.state_dict().items(), lm2.model.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_a_save_in_the_other_layout_removes_the_old_weights_files_and_no_file_of_the_users(lm, tmp_path):
    """A save removed every model*.safetensors* it did not write: a user's model.safetensors.bak or
    model.fp16.safetensors beside the checkpoint went too. Only the other layout's files go."""
    from blockpress.checkpoint import save_model

    folder = tmp_path / "ckpt"
    save_model(lm.model, folder, max_shard_bytes=20_000)
    shards = sorted(p.name for p in folder.glob("model*"))
    assert len(shards) > 2 and "model.safetensors.index.json" in shards
    mine = ["model.safetensors.bak", "model_backup.safetensors", "model.fp16.safetensors", "model-1-of-2.safetensors",
            "model_notes.safetensors.txt"]
    for name in mine:
        (folder / name).write_bytes(b"the user's")
    save_model(lm.model, folder)  # one file now
    assert sorted(p.name for p in folder.glob("model*")) == sorted([*mine, "model.safetensors"])
    assert all((folder / name).read_bytes() == b"the user's" for name in mine)
    save_model(lm.model, folder, max_shard_bytes=20_000)  # and back
    assert sorted(p.name for p in folder.glob("model*")) == sorted([*mine, *shards])
    # shards named otherwise (a hub repo's 'model-00001-of-000163.safetensors'): the index names them, so they go too
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    renamed = {old: old.replace("-of-0", "-of-00") for old in set(index["weight_map"].values())}
    for old, new in renamed.items():
        (folder / old).rename(folder / new)
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_quiet(folder).model is not None  # (a folder that loads)
    save_model(lm.model, folder)
    assert sorted(p.name for p in folder.glob("model*")) == sorted([*mine, "model.safetensors"])


def test_shards_of_two_saves_are_refused_by_name(lm, tmp_path, monkeypatch):
    """A sharded save stopped while it moved its shards into place left some new shards beside old ones, and the
    folder loaded without a word: 23 tensors of the new model, 108 of the old. A stop the process lives through is
    undone now (the old save, whole); one it does not (a SIGKILL between two moves, stood for here by a shard of
    another save copied in) is refused by name at load."""
    import shutil

    import blockpress.files
    from blockpress.checkpoint import CheckpointError, save_model

    folder = tmp_path / "sharded"
    save_model(lm.model, folder, max_shard_bytes=20_000)
    other = blockpress.random_model(lm.config, seed=9)
    real, moved = os.replace, []

    def stopped_after_one_shard(src, dst):
        real(src, dst)
        moved.append(Path(dst).name)
        if Path(dst).name.startswith("model-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(blockpress.files.os, "replace", stopped_after_one_shard)
    with pytest.raises(KeyboardInterrupt):
        save_model(other.model, folder, max_shard_bytes=20_000)
    monkeypatch.setattr(blockpress.files.os, "replace", real)
    first = next(name for name in moved if name.startswith("model-"))
    kept = load_quiet(folder).model.state_dict()  # undone: the first save, whole
    assert all(torch.equal(kept[name], t) for name, t in lm.model.state_dict().items())
    save_model(other.model, tmp_path / "other", max_shard_bytes=20_000)
    shutil.copyfile(tmp_path / "other" / first, folder / first)  # as a kill after its move would leave it
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder))}: .*{first}.* are shards of two different "
                                              r"saves: a save was stopped while it moved its shards into place"):
        blockpress.load(folder)
    save_model(other.model, folder, max_shard_bytes=20_000)  # saved again, whole: it loads
    again = load_quiet(folder).model.state_dict()
    assert all(torch.equal(again[name], t) for name, t in other.model.state_dict().items())
    # an unmarked shard (of a save from before marks, or another tool's) beside marked ones is another save too;
    # shards none of which holds a mark load
    from safetensors.torch import load_file, save_file

    shards = sorted(folder.glob("model-*.safetensors"))
    save_file(load_file(shards[0]), shards[0], metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="are shards of two different saves"):
        blockpress.load(folder)
    for shard in shards[1:]:
        save_file(load_file(shard), shard, metadata={"format": "pt"})
    again = load_quiet(folder).model.state_dict()
    assert all(torch.equal(again[name], t) for name, t in other.model.state_dict().items())


def test_an_index_whose_shards_are_not_fetched_is_a_folder_without_weights(lm, tmp_path):
    """A download of a repo's JSON files (config.json, the shards' index, the tokenizer's) is what one fetches to look
    at a model first. `info` described config.json alone but refused it with the index beside it ("lists shard(s)
    that are not in the folder: [10 names]"): now both are a folder without weights, counted from config.json. A
    load still needs the weights, and a folder with some of the shards is refused naming the missing ones."""
    from blockpress.checkpoint import NoWeights, plan_model, save_model

    full = tmp_path / "full"
    save_model(lm.model, full, max_shard_bytes=20_000)
    shards = sorted(full.glob("model-*.safetensors"))
    fetched = tmp_path / "json"
    fetched.mkdir()
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(full / name, fetched / name)
    plan = plan_model(fetched, weights=False)
    assert plan.files == [] and plan.stored is None
    assert sum(t.numel() for t in plan.meta_model().parameters()) == lm.num_parameters(active=False)
    with pytest.raises(NoWeights, match=rf"none of the {len(shards)} shard\(s\) it lists are in the folder"):
        blockpress.load(fetched)
    shutil.copy(shards[0], fetched / shards[0].name)  # some fetched: a broken download, refused by name
    with pytest.raises(blockpress.checkpoint.CheckpointError, match=re.escape(shards[1].name)):
        plan_model(fetched, weights=False)


def test_a_git_lfs_pointer_is_named_as_one(ref_checkpoint, tmp_path):
    """A hub repository cloned without git-lfs holds, for each large file, a pointer of a few lines of text. Read as
    safetensors its first bytes made a header length ("its header claims 2336927755350992246 bytes but the file has
    131"), and as tokenizer.json "expected value at line 1 column 1": neither said the weights were never fetched."""
    from blockpress.tokenizer import Tokenizer

    folder = tmp_path / "clone"
    shutil.copytree(ref_checkpoint[0], folder)
    pointer = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 1640960\n")
    (folder / "model.safetensors").write_text(pointer)
    (folder / "tokenizer.json").write_text(pointer)
    with pytest.raises(blockpress.checkpoint.CheckpointError,
                       match=r"model\.safetensors: a Git LFS pointer, not the file itself .*git lfs pull"):
        blockpress.load(folder)
    with pytest.raises(ValueError, match=r"tokenizer\.json: a Git LFS pointer, not the file itself .*git lfs pull"):
        Tokenizer.from_dir(folder)


def test_a_config_json_refusal_names_the_file(ref_checkpoint, tmp_path):
    """config.json's refusals named the field alone ("model_type: expected 'diffusion_gemma', got 'gemma4'" for a
    Gemma 4 folder given by mistake), where every other file's errors name the file."""
    folder = tmp_path / "gemma4"
    folder.mkdir()
    raw = json.loads((ref_checkpoint[0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(raw, model_type="gemma4")))
    with pytest.raises(ConfigError, match=re.escape(f"{folder / 'config.json'}: model_type: expected 'diffusion_gemma'")):
        blockpress.load(folder)
    raw["text_config"]["sliding_window"] = 0
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=re.escape(f"{folder / 'config.json'}: text_config.sliding_window")):
        blockpress.load(folder)


def test_load_reports_the_bytes_it_reads(lm, tmp_path, capsys):
    """A 26B's 50 GB load (minutes from a network disk) said nothing while it read. progress(done, total) counts
    the stored bytes of every weight, sharded or not, vision tensors and tied copies aside; True shows a bar."""
    from blockpress.checkpoint import MappedSafetensors, save_model, tensor_kind

    save_model(lm.model, tmp_path / "sharded", max_shard_bytes=20_000)
    files = [MappedSafetensors(f) for f in sorted((tmp_path / "sharded").glob("*.safetensors"))]
    stored = sum(f.nbytes(n) for f in files for n in f.keys() if tensor_kind(n)[0] == "weight")
    calls = []
    load_quiet(tmp_path / "sharded", dtype=torch.bfloat16, progress=lambda done, total: calls.append((done, total)))
    assert len(calls) == len(lm.model.state_dict()) - sum(1 for n in lm.model.state_dict() if "rotary" in n)
    assert {total for _, total in calls} == {stored}
    dones = [done for done, _ in calls]
    assert dones == sorted(dones) and dones[0] > 0 and dones[-1] == stored
    capsys.readouterr()
    load_quiet(tmp_path / "sharded", progress=True)
    assert "loading sharded" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"progress: expected True, False or a callable progress\(done, total\), got 'yes'"):
        load_quiet(tmp_path / "sharded", progress="yes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "float32"])
def test_dtypes(ref_checkpoint, dtype):
    lm = load_quiet(ref_checkpoint[0], dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else torch.float32
    assert all(p.dtype == want for p in lm.model.parameters())
    out = lm.logits([1, 2, 3], [[4, 5, 6, 7, 8, 9, 10, 11]])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


CASTS = {
    "lm.to": lambda lm, dtype: lm.to(dtype=str(dtype).removeprefix("torch.")),
    "model.to": lambda lm, dtype: lm.model.to(dtype),
    "model.half / .bfloat16": lambda lm, dtype: lm.model.half() if dtype == torch.float16 else lm.model.bfloat16(),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casting_a_loaded_model_is_loading_it_in_that_dtype(ref_checkpoint, dtype):
    """nn.Module casts round every floating buffer: in bf16 the rotary frequencies put a 4000-token prompt's logits
    5x further from float32 than a bf16 load. However it is cast, the tables stay float32, as a load keeps them,
    and the logits are the load's exactly (the angles' error grows with the position: a long-ish prompt)."""
    path = ref_checkpoint[0]
    loaded = load_quiet(path, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    v, c = loaded.config.text.vocab_size, loaded.config.canvas_length
    prompt, canvas = torch.randint(0, v, (1, 200), generator=g), torch.randint(0, v, (2, c), generator=g)
    want = loaded.logits(prompt, canvas)
    for name, cast in CASTS.items():
        lm = load_quiet(path)
        cast(lm, dtype)
        assert lm.dtype == dtype, name
        assert {b.dtype for n, b in lm.model.named_buffers() if "inv_freq" in n} == {torch.float32}, name
        assert torch.equal(lm.logits(prompt, canvas), want), name


def test_to_moves_and_remakes_compiled_steps(ref_checkpoint, monkeypatch):
    """`lm.to` returns the LM, and steps made for the old tensors (compile) are made anew for the new ones."""
    moved = load_quiet(ref_checkpoint[0])
    cache = moved.new_cache(1, 32)
    made = []
    monkeypatch.setattr(blockpress.lm.StepFunctions, "compiled", classmethod(
        lambda cls, model, **options: made.append(options) or cls.eager(model)))
    moved.compile(mode="default")
    assert moved.to() is moved and moved.to(device="cpu", dtype="float32") is moved and len(made) == 1  # no change
    assert moved.to(dtype=torch.bfloat16) is moved and moved.dtype == torch.bfloat16
    assert made == [{"mode": "default"}] * 2
    with pytest.raises(ValueError, match="cache: built by another model"):  # made for the float32 weights
        moved.generate([[3, 4]], max_new_tokens=8, cache=cache)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, r"dtype: expected one of .*got 'int8'"),
    ({"dtype": torch.float64}, r"dtype: expected one of \['bfloat16', 'float16', 'float32'\]"),
    ({"device": "cuda:99"}, r"device: 'cuda:99' asked for"),
    ({"device": "gpu"}, r"device: 'gpu' is not a torch device"),
    ({"device": 2**63}, rf"device: {2**63} is not a torch device"),  # torch: 'Overflow when unpacking long long'
    ({"device": "meta"}, r"device: 'meta' holds no weights"),
    ({"device": torch.bfloat16}, r"device: torch.bfloat16 is a dtype; pass it as lm.to\(dtype=torch.bfloat16\)"),
    ({"device": "bf16"}, r"device: 'bf16' is a dtype; pass it as lm.to\(dtype='bf16'\)"),
])
def test_to_names_a_bad_argument(lm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        lm.to(**kwargs)
    assert lm.dtype == torch.float32 and lm.device.type == "cpu"


def test_device_none_is_the_default_device(ref_checkpoint):
    """lm.to(device=None) keeps the device, while load(device=None) was refused ("None is not a torch device"):
    None is the default, the CPU, for load and random_model too."""
    assert load_quiet(ref_checkpoint[0], device=None).device.type == "cpu"
    assert blockpress.random_model(blockpress.ModelConfig.tiny(), device=None).device.type == "cpu"


def test_a_ctrl_c_during_a_cast_waits_for_the_cast_to_end(monkeypatch):
    """A Ctrl-C that landed inside lm.to(dtype=...) (or lm.model.bfloat16()) left the model half cast: some weights
    bfloat16 and some float32, or the rotary tables not made anew, so every later pass failed in torch or differed
    unsaid, and a second lm.to to the dtype the model claimed did nothing. The interrupt now comes as the cast ends,
    and the model is what a clean cast gives."""
    import asyncio
    import signal
    import threading

    from blockpress.model import DiffusionGemma

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("signals reach the main thread's Python handler alone")
    ids = torch.tensor([[2, 5, 7, 9]])
    want = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0).to(dtype="bfloat16")
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    reset = DiffusionGemma.reset_buffers

    def interrupted(model):  # a real SIGINT, part-way through the cast (the weights cast, the tables not yet)
        signal.raise_signal(signal.SIGINT)
        reset(model)

    monkeypatch.setattr(DiffusionGemma, "reset_buffers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lm.to(dtype="bfloat16")
    monkeypatch.setattr(DiffusionGemma, "reset_buffers", reset)
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    for (name, a), b in zip(lm.model.named_buffers(), want.model.buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    kw = dict(max_new_tokens=16, seed=1, max_denoising_steps=4)
    assert torch.equal(lm.generate(ids, **kw).new_tokens, want.generate(ids, **kw).new_tokens)
    with pytest.raises(KeyboardInterrupt):  # the model's own casts alike
        monkeypatch.setattr(DiffusionGemma, "reset_buffers", interrupted)
        lm.model.float()
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}

    async def app():  # an asyncio app's handler (a wakeup fd) runs once for one Ctrl-C, not again as the cast ends
        loop, hits = asyncio.get_running_loop(), []
        loop.add_signal_handler(signal.SIGINT, lambda: hits.append(1))
        try:
            lm.model.bfloat16()
            for _ in range(5):
                await asyncio.sleep(0.02)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        return hits

    assert asyncio.run(app()) == [1] and {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}


def test_to_keeps_a_quantized_model_in_its_dtype(ref_checkpoint):
    """Casting would round the scales the quantization chose for this dtype: refused, naming the way that works."""
    lm = load_quiet(ref_checkpoint[0], quantize="int8")
    scales = {n: b.dtype for n, b in lm.model.named_buffers() if n.endswith("_scale")}
    with pytest.raises(ValueError, match=r"dtype: the model is quantized \(int8\) in float32.*quantize='int8'"):
        lm.to(dtype="bfloat16")
    assert lm.to(device="cpu", dtype="float32") is lm
    assert {n: b.dtype for n, b in lm.model.named_buffers() if n.endswith("_scale")} == scales


def test_saved_config_names_the_dtype_saved(ref_checkpoint, tmp_path):
    """A float32 checkpoint read as bf16 and saved says bfloat16, so transformers loads it at that precision
    (before: the old "float32", twice the memory)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    load_quiet(ref_checkpoint[0], dtype="bfloat16").save(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "bf16")
    assert ref.model.decoder.embed_tokens.weight.dtype == torch.bfloat16


def test_dtype_names_people_type():
    from blockpress.checkpoint import resolve_dtype

    for name, want in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("half", torch.float16),
                       ("torch.float32", torch.float32), ("BFloat16", torch.bfloat16), (torch.float16, torch.float16)):
        assert resolve_dtype(name) == want
    with pytest.raises(ValueError, match=r"dtype: expected one of .* got torch.float64$"):
        resolve_dtype(torch.float64)  # no 8-bit hint for a wider dtype
    with pytest.raises(ValueError, match="quantize='fp8'"):
        resolve_dtype(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="got 'float128'"):
        resolve_dtype("float128")


@pytest.mark.parametrize("stray", [torch.float32, torch.float64])
def test_dtype_none_is_the_dtype_of_most_weights(ref_checkpoint, tmp_path, stray):
    """A bf16 checkpoint with its scalars in another dtype loads as bf16 (where this CPU computes it natively):
    safetensors lists the widest dtype first, and the first tensor decided (float32 at twice the memory, or
    float64)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from blockpress.checkpoint import native_dtype

    src = ref_checkpoint[0]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = {k: v.to(stray if k.endswith("layer_scalar") else torch.bfloat16)
               for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, tmp_path / "model.safetensors")
    lm = load_quiet(tmp_path)
    assert lm.dtype == native_dtype(torch.bfloat16, torch.device("cpu"))
    assert all(p.dtype == lm.dtype for p in lm.model.parameters())


def test_vision_tensors_warn_once(ref_checkpoint):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blockpress.load(ref_checkpoint[0])
    vision = [w for w in caught if "vision" in str(w.message)]
    assert len(vision) == 1


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_named(ref_checkpoint, tmp_path):
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.decoder.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(blockpress.CheckpointError, match=r"layers\.1\.self_attn\.q_proj\.weight"):
        load_quiet(path)
    with pytest.raises(blockpress.CheckpointError, match=r"layers\.1\.self_attn\.q_proj\.weight\b(?!_scale)"):
        load_quiet(path, quantize="int8")  # the scale is missing too, but the weight is what the file lacks


@pytest.mark.parametrize("scheme", ["int8", FP8, "int4"])
def test_quantizing_while_loading_is_quantizing_after(ref_checkpoint, scheme):
    """load(quantize=) quantizes each tensor as it is read (the full-precision model never exists at once) and
    gives exactly the model that quantizing after a plain load gives."""
    during = load_quiet(ref_checkpoint[0], quantize=scheme)
    after = load_quiet(ref_checkpoint[0]).quantize(scheme)
    assert during.quantization == after.quantization == scheme
    state_during, state_after = during.model.state_dict(), after.model.state_dict()
    assert state_during.keys() == state_after.keys()
    for name, tensor in state_during.items():
        assert tensor.dtype == state_after[name].dtype, name
        assert torch.equal(tensor.float(), state_after[name].float()), name
    prompt, canvas = torch.randint(3, 64, (1, 5)), torch.randint(3, 64, (1, 8))
    assert torch.equal(during.logits(prompt, canvas), after.logits(prompt, canvas))


def _resident_bytes_of_mappings(file):
    """Bytes of `file` that this process's mappings of it hold resident (Linux's /proc/self/smaps)."""
    total, mapped = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            mapped = fields[5] if len(fields) > 5 else None
        elif fields[0] == "Rss:" and mapped == str(file):
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_load_keeps_no_page_of_the_weights_it_quantized(scheme, tmp_path):
    """The file stays mapped (the embedding and norms are views of it), so the pages a quantized projection was read
    from stayed resident beside its codes: a medium model's int8 load grew by 230 MB for 66 MB of codes. Only the
    pages of the tensors still viewed may stay (each with the pages it shares with its neighbours)."""
    config = ModelConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
    blockpress.random_model(config, dtype=torch.bfloat16).save(tmp_path)
    quantized = {local_to_hf(local) for local in plan_model(tmp_path, quantize=scheme).quantized}
    lm = load_quiet(tmp_path, quantize=scheme)
    file = tmp_path / "model.safetensors"
    with open(file, "rb") as opened:
        header = json.loads(opened.read(int.from_bytes(opened.read(8), "little")))
    viewed = [end - begin for name, info in header.items() if name != "__metadata__" and name not in quantized
              for begin, end in [info["data_offsets"]]]
    allowed = sum(viewed) + 2 * mmap.PAGESIZE * len(viewed)
    assert file.stat().st_size > 2 * allowed  # the test's premise: the quantized weights are most of the file
    assert _resident_bytes_of_mappings(file.resolve()) <= allowed
    assert lm.quantization == scheme


def test_a_page_release_the_system_refuses_leaves_the_load_going(tmp_path):
    """madvise fails on locked pages (a server that called mlockall): the release, an optimisation, failed the whole
    quantized (or widened) load with a bare "OSError: [Errno 22] Invalid argument"."""
    from blockpress.checkpoint import MappedSafetensors

    blockpress.random_model(ModelConfig.tiny(vocab_size=64), dtype=torch.bfloat16).save(tmp_path)
    opened = MappedSafetensors(tmp_path / "model.safetensors")
    name = next(n for n in opened.keys() if opened.nbytes(n))

    class Locked:
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    real, opened.map = opened.map, Locked()
    opened.release(name)  # kept resident, no error
    opened.map = real
    assert torch.equal(opened.tensor(name), opened.tensor(name))


def test_quantizing_hands_the_heaps_freed_temporaries_back_to_the_system(ref_checkpoint, monkeypatch):
    """glibc keeps what the float32 temporaries of quantizing held (a medium model's int8 load: 67 MB above its codes
    until malloc_trim). A quantized load and lm.quantize trim the C heap once, on a CPU; a plain load has no
    temporaries to give back and does not."""
    import blockpress.checkpoint as checkpoint
    import blockpress.lm as lm_module

    trims = []
    monkeypatch.setattr(checkpoint, "return_freed_heap", trims.append)
    monkeypatch.setattr(lm_module, "return_freed_heap", trims.append)
    lm = load_quiet(ref_checkpoint[0])
    assert trims == []
    load_quiet(ref_checkpoint[0], quantize="int8")
    assert trims == [torch.device("cpu")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (int4's groups below 32 in a tiny model)
        lm.quantize("int4")
    assert trims == [torch.device("cpu")] * 2


def test_the_heap_trim_calls_glibc_on_a_cpu_and_nothing_elsewhere(monkeypatch):
    import ctypes

    from blockpress.checkpoint import return_freed_heap

    calls = []

    class Libc:
        def malloc_trim(self, pad):
            calls.append(pad)

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc() if name == "libc.so.6" else None)
    return_freed_heap(torch.device("meta"))
    assert calls == []
    return_freed_heap(torch.device("cpu"))
    assert calls == [0]

    def no_glibc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_glibc)
    return_freed_heap(torch.device("cpu"))  # macOS, Windows, musl: nothing to do, no error
    assert calls == [0]


def test_a_quantized_save_writes_what_a_plain_save_writes_beside_its_codes(lm, tmp_path):
    """The same save (save_model and LM.save's staging): the vision tensors kept from the loaded checkpoint, the
    generation config, blockpress's own generation file, and a config.json that differs from the plain one by its
    quantization_config alone; the plain save writes none."""
    lm.generation_config["entropy_bound"] = 0.25  # reference's sampler_config, and blockpress's own file
    lm.generation_config["noise_token_id"] = 7
    lm.save(tmp_path / "plain")
    quantized = load_quiet(lm.path, quantize="int4")
    quantized.generation_config.update(lm.generation_config)
    quantized.save(tmp_path / "int4")
    plain_config, config = (json.loads((tmp_path / f / "config.json").read_text()) for f in ("plain", "int4"))
    assert "quantization_config" not in plain_config
    assert config.pop("quantization_config")["scheme"] == "int4" and config == plain_config
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "int4").iterdir())
    for name in names:
        if name.endswith(".json") and name != "config.json":
            assert (tmp_path / "plain" / name).read_text() == (tmp_path / "int4" / name).read_text(), name
    plain, saved = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "int4" / "model.safetensors")
    vision = [k for k in plain if k.startswith("model.encoder.vision_tower.")]
    assert vision and all(torch.equal(plain[k], saved[k]) for k in vision)
    scales = {k for k in saved if k.endswith("_scale") and k.removesuffix("_scale") in saved}  # (not per_expert_scale)
    assert scales and set(saved) - scales == set(plain)
    load_quiet(tmp_path / "int4").save(tmp_path / "again")  # loaded as stored, saved as held: the same files
    for name in names:
        assert (tmp_path / "int4" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_a_prequantized_checkpoint_is_named_as_such(ref_checkpoint, tmp_path):
    """Its scales are tensors blockpress does not read: the error says what the checkpoint is (before: "unexpected
    tensor ...weight_scale")."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fbgemm_fp8"}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(blockpress.CheckpointError, match=r"pre-quantized checkpoint \(quantization_config: fbgemm_fp8\)"):
        load_quiet(path)


def test_an_mlx_quantized_checkpoint_is_named_as_such(ref_checkpoint, tmp_path):
    """mlx-lm writes its scheme under config.json's `quantization` and packs codes in U32 tensors: refused as the
    pre-quantized checkpoint it is (before: "unsupported safetensors dtype 'U32'; the file is damaged")."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization"] = {"group_size": 64, "bits": 4}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(blockpress.CheckpointError, match=r"pre-quantized checkpoint \(quantization: 4-bit, as mlx-lm"):
        load_quiet(path)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch 2.7 on has float8_e8m0fnu")
def test_unsigned_and_e8m0_tensors_pass_through(ref_checkpoint, tmp_path):
    """U16/U32/U64 and F8_E8M0 are safetensors dtypes transformers reads: a vision-tower buffer in one was refused as
    "damaged or truncated"; it loads, and lm.save writes it back as it was."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    extra = {f"model.encoder.vision_tower.extra_{i}": torch.arange(6).to(dtype).reshape(2, 3)
             for i, dtype in enumerate((torch.uint16, torch.uint32, torch.uint64))}
    extra["model.encoder.vision_tower.extra_e8m0"] = torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e8m0fnu)
    save_file({**tensors, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    load_quiet(path).save(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    for name, tensor in extra.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name].view(torch.uint8), tensor.view(torch.uint8))


def test_wrong_shape_named(ref_checkpoint, tmp_path):
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    tensors["model.decoder.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(blockpress.CheckpointError, match=r"mlp\.up_proj\.weight.*\[3, 3\].*\[40, 32\]"):
        load_quiet(path)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_config_that_disagrees_with_the_shards_names_the_shard(lm, tmp_path, quantize):
    """The shape error names the file as its neighbours do (it named the tensor alone), and it comes before
    quantizing: int4's refusal of the config's odd intermediate size read as if the stored weights had it."""
    from blockpress.checkpoint import save_model

    save_model(lm.model, tmp_path / "c", max_shard_bytes=20_000)
    raw = json.loads((tmp_path / "c" / "config.json").read_text())
    raw["text_config"]["intermediate_size"] = 41  # the shards hold 40
    (tmp_path / "c" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(blockpress.CheckpointError, match=r"^model-\d{5}-of-\d{5}\.safetensors: tensor '[^']+': shape "
                                                         r"\[(40, 32|32, 40)\] in the checkpoint, config needs "
                                                         r"\[(41, 32|32, 41)\]$"):
        load_quiet(tmp_path / "c", quantize=quantize)


@pytest.mark.parametrize("quantize", [None, "int8", "fp8", "int4"])
@pytest.mark.parametrize("name", ["model.decoder.layers.0.mystery.weight",
                                  "model.decoder.layers.0.mlp.gate_proj.weight_scale",
                                  # an encoder name counted as a tied copy, of a decoder weight there is none of:
                                  # loaded without a word, where the decoder's own typo was refused
                                  "model.encoder.language_model.layers.0.mystery.weight"])
def test_unexpected_tensor_named(ref_checkpoint, tmp_path, name, quantize):
    """A `*.weight_scale` (an fp8 export without its quantization_config) is unexpected too when loading quantized,
    though the quantized model holds such a buffer (it was a bare KeyError)."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    tensors[name] = torch.ones(40)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(blockpress.CheckpointError, match=rf"^model\.safetensors: unexpected tensor '{name}'"):
        load_quiet(path, quantize=quantize)


@pytest.mark.parametrize("content, message", [
    ([1], "expected a JSON object, got list"),
    ({"entropy_bound": "0.1"}, "entropy_bound: expected a finite number"),
    ({"t_min": "0.4"}, "t_min: expected a finite number"),
    ({"sampler_config": {"entropy_bound": "abc"}}, "entropy_bound: expected a finite number"),
    ({"max_new_tokens": "abc"}, "max_new_tokens: expected a positive integer"),
    ({"max_length": 0}, "max_length: expected a positive integer"),
    ({"max_length": "64"}, "max_length: expected a positive integer"),
    ({"max_denoising_steps": 2**40}, "max_denoising_steps: expected an integer in"),  # loaded, then failed in torch
    ({"eos_token_id": "abc"}, "eos_token_id: expected a token id"),
    ({"eos_token_id": [1, "a"]}, "eos_token_id: expected a token id"),
])
def test_bad_generation_config_is_named_on_load(ref_checkpoint, tmp_path, content, message):
    """A wrong type in generation_config.json failed at the first generate, or in `info`, with a bare TypeError."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    (path / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=f"generation_config.json: {message}"):
        load_quiet(path)


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not valid JSON"),
    # not UTF-8: a bare UnicodeDecodeError that named no file (read in the locale's encoding, at that)
    (b"\xff{}", r"not valid JSON \(not UTF-8: byte 0xff at byte 1\)"),
    (b"[1, 2]", "expected a JSON object, got list"),  # said 'config: ...', with no path
    # a bare RecursionError out of json.loads, a traceback naming no file
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"not valid JSON \(nested deeper than Python's JSON parser"),
])
def test_garbage_config(ref_checkpoint, tmp_path, content, message):
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    (path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path / 'config.json'))}: {message}"):
        load_quiet(path)


def test_a_config_deeper_than_blockpress_builds_is_refused_before_building(ref_checkpoint, tmp_path, monkeypatch):
    """An untrusted config.json's num_hidden_layers is checked before the layer pattern is drawn from it or a model
    built with it: 10**6 layers held a load for hours on the meta device alone, and 10**12 drew a list of that many."""
    from blockpress import config as config_module

    raw = json.loads((ref_checkpoint[0] / "config.json").read_text())
    deep = json.loads(json.dumps(raw))
    deep["text_config"].update(layer_types=None, num_hidden_layers=10**12)
    monkeypatch.setattr(config_module, "_default_layer_types", lambda n: pytest.fail(f"drew a pattern of {n} layers"))
    with pytest.raises(ConfigError, match=r"^text_config\.num_hidden_layers: 1000000000000 layers is more than the "
                                          r"1024 blockpress builds"):
        ModelConfig.from_dict(deep)
    monkeypatch.undo()
    # a layer_types list as long (its JSON is what bounds it): refused by the count, before the model is built
    n = 1024 + 1  # config.MAX_LAYERS, and one more
    listed = json.loads(json.dumps(raw))
    _hand_written(listed, layer_types=["sliding_attention", "full_attention"] * (n // 2) + ["full_attention"],
                  num_hidden_layers=n)
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    (path / "config.json").write_text(json.dumps(listed))
    with pytest.raises(ConfigError, match=f"config.json: text_config.num_hidden_layers: {n} layers is more than"):
        load_quiet(path)
    listed["text_config"].update(layer_types=listed["text_config"]["layer_types"][1:], num_hidden_layers=n - 1)
    assert ModelConfig.from_dict(listed).text.num_hidden_layers == 1024  # the limit itself is taken


def _hand_written(raw, **fields):
    """`raw`'s text config as written by hand: the full layers' shape from global_head_dim and
    num_global_key_value_heads (which the reference reads, then pops) rather than a saved per_layer_config."""
    raw["text_config"].pop("per_layer_config")
    raw["text_config"].update(global_head_dim=16, num_global_key_value_heads=1)
    raw["text_config"].update(fields)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c["text_config"].update(hidden_size=-4), "hidden_size"),
        (lambda c: c["text_config"].update(num_experts=None), "num_experts"),
        (lambda c: c["text_config"].update(layer_types=["sliding_attention"]), "layer_types"),
        (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(rope_type="ntk"),
         "rope_parameters.full_attention.rope_type: 'ntk' is not supported"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(
            rope_type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=8),
         "the reference cannot build longrope"),
        # each rope type's own fields, by name
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(rope_type="yarn", factor=4.0),
         "sliding_attention.original_max_position_embeddings: rope_type 'yarn' needs"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=8, attention_factor="x"),
         "sliding_attention.attention_factor: expected a positive number or null"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=-8),
         "original_max_position_embeddings: expected a positive number"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(
            rope_type="yarn", factor="4", original_max_position_embeddings=8),
         r"sliding_attention.factor: expected a positive number or null \(max_position_embeddings"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(
            rope_type="llama3", factor=4.0, high_freq_factor=4.0, original_max_position_embeddings=8),
         "sliding_attention.low_freq_factor: rope_type 'llama3' needs"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(
            rope_type="llama3", factor=4.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_position_embeddings=8),
         "high_freq_factor: expected at least low_freq_factor"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(rope_type="dynamic"),
         "sliding_attention.factor: rope_type 'dynamic' needs"),
        (lambda c: c["text_config"].update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c.update(canvas_length=0), "canvas_length"),
        (lambda c: c.update(model_type="llama"), "model_type"),
        (lambda c: c.pop("text_config"), "text_config"),
        # Each of these failed later with a bare AttributeError, TypeError or a torch error.
        (lambda c: c["text_config"].update(per_layer_config=[1]), "per_layer_config: expected an object"),
        (lambda c: c["text_config"].update(per_layer_config={"0": {"head_dim": "x"}}), "per_layer_config"),
        # a digit to str.isdigit, not to int(): "invalid literal for int() with base 10: '²'", naming no file or field
        (lambda c: c["text_config"].update(per_layer_config={"²": {"head_dim": 16}}),
         r"per_layer_config\['²'\]: expected a layer index below"),
        (lambda c: c["text_config"].update(rope_parameters=5), "rope_parameters: expected an object"),
        (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(partial_rotary_factor=2.0),
         "partial_rotary_factor: expected a fraction"),
        (lambda c: c["text_config"].update(max_position_embeddings="big"), "max_position_embeddings"),
        (lambda c: c["text_config"].update(max_position_embeddings=-5), "max_position_embeddings"),
        (lambda c: c["text_config"].update(final_logit_softcapping="30"), "final_logit_softcapping"),
        # the reference divides by it, and knows no activation of this name: both loaded here, failed there
        (lambda c: c["text_config"].update(final_logit_softcapping=None), "final_logit_softcapping: expected a positive"),
        (lambda c: c["text_config"].update(hidden_activation="gelu_tanh"), "hidden_activation"),
        # the reference's forward fails on it (is_causal passed twice): refused, saying so
        (lambda c: c["text_config"].update(use_bidirectional_attention="all"),
         "use_bidirectional_attention: 'all' is not supported.*fails in the reference's own forward"),
        # transformers' PReLU learns a weight that no DiffusionGemma checkpoint holds
        (lambda c: c["text_config"].update(hidden_activation="prelu"), "hidden_activation: 'prelu' is not supported"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=0),
         "factor: expected a positive number"),
        (lambda c: c["text_config"].update(eos_token_id="x"), "eos_token_id"),
        (lambda c: c["text_config"].update(pad_token_id=10**6), r"pad_token_id: expected a token id in \[0, vocab_size"),
        (lambda c: c["text_config"].update(bos_token_id=999), "bos_token_id"),
        (lambda c: c["text_config"].update(initializer_range=-1), "initializer_range"),
        # a string is truthy: "false" tied the weights and was saved back for transformers to read as true too
        (lambda c: c["text_config"].update(tie_word_embeddings="false"),
         "text_config.tie_word_embeddings: expected true or false, got 'false'"),
        (lambda c: c.update(tie_word_embeddings="false"), "^tie_word_embeddings: expected true or false, got 'false'"),
        # the reference keeps every key for a one-token window (its slice [-0:]): refused rather than differ
        (lambda c: c["text_config"].update(sliding_window=1), "sliding_window: expected at least 2"),
        # JSON true was read as 1 for these
        (lambda c: c["text_config"].update(num_experts=True), "num_experts: expected a positive integer"),
        (lambda c: c["text_config"].update(max_position_embeddings=True), "max_position_embeddings"),
        (lambda c: c["text_config"].update(rms_norm_eps=True), "rms_norm_eps"),
        (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(rope_theta=True), "rope_theta"),
        # one rotary table per kind of layer: a mixed size was a torch shape error at the first forward
        (lambda c: c["text_config"].update(per_layer_config={"1": {"head_dim": 16}, "3": {"head_dim": 20}}),
         r"the full_attention layers have head_dim \[16, 20\]"),
        # the reference refuses to build layers of one kind whose entries differ: blockpress ran them, and saved a
        # checkpoint that transformers could not load
        (lambda c: c["text_config"].update(per_layer_config={"1": {"head_dim": 16, "num_key_value_heads": 1},
                                                             "3": {"head_dim": 16, "num_key_value_heads": 2}}),
         r"per_layer_config: the full_attention layers' entries differ \(layer 1: .*, layer 3: .*num_key_value_heads"),
        (lambda c: c["text_config"].update(per_layer_config={"0": {"num_key_value_heads": 1}, "1": {"head_dim": 16},
                                                             "3": {"head_dim": 16}}),
         r"the sliding_attention layers' entries differ \(layer 0: \{'num_key_value_heads': 1\}, layer 2: \{\}\)"),
        # a hand-written config's full-layer shape (the reference refuses each): int() read 1.5, "1" and true as 1,
        # and the others failed naming no field ("text_config: int() argument must be ...", a bare ValueError)
        (lambda c: _hand_written(c, num_global_key_value_heads=1.5),
         r"^text_config\.num_global_key_value_heads: expected a positive integer or null, got 1\.5"),
        (lambda c: _hand_written(c, num_global_key_value_heads="1"), "num_global_key_value_heads: expected a positive"),
        (lambda c: _hand_written(c, num_global_key_value_heads=True), "num_global_key_value_heads: expected a positive"),
        (lambda c: _hand_written(c, num_global_key_value_heads=[1]), "num_global_key_value_heads: expected a positive"),
        (lambda c: _hand_written(c, global_head_dim=None), r"^text_config\.global_head_dim: expected a positive integer"),
        (lambda c: _hand_written(c, global_head_dim="x"), "global_head_dim: expected a positive integer, got 'x'"),
        (lambda c: _hand_written(c, global_head_dim=15.5), "global_head_dim: expected a positive integer, got 15.5"),
        (lambda c: _hand_written(c, global_head_dim=0), "global_head_dim: expected a positive integer, got 0"),
        # "text_config: 'int' object is not iterable"; a string was split into one layer type per letter
        (lambda c: c["text_config"].update(layer_types=3), "layer_types: expected a list of layer types, got 3"),
        (lambda c: c["text_config"].update(layer_types="full_attention"), "layer_types: expected a list"),
        (lambda c: c["text_config"].update(layer_types=None, num_hidden_layers="4"),
         "num_hidden_layers: expected a positive integer, got '4'"),
        # JSON true was read as token 1 (false as 0), where the reference refuses a bool
        (lambda c: c["text_config"].update(pad_token_id=True), "pad_token_id: expected a token id"),
        (lambda c: c["text_config"].update(bos_token_id=False), "bos_token_id: expected a token id"),
        (lambda c: c["text_config"].update(eos_token_id=[1, True]), "eos_token_id: expected a token id"),
        (lambda c: c.update(canvas_length=True), "canvas_length: expected a positive integer"),
        # JSON's Infinity (Python's json reads and writes it): an infinite softcapping made every logit NaN, which
        # generation blamed on "activations overflowed float32"; an infinite eps zeroed every norm's output
        (lambda c: c["text_config"].update(final_logit_softcapping=math.inf),
         "final_logit_softcapping: expected a positive finite number, got inf"),
        (lambda c: c["text_config"].update(rms_norm_eps=math.inf), "rms_norm_eps: expected a positive finite number"),
        (lambda c: c["text_config"].update(initializer_range=math.inf), "initializer_range: expected a finite number"),
        (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(rope_theta=math.inf),
         "full_attention.rope_theta: expected a positive number, got inf"),
        (lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=math.inf),
         "sliding_attention.factor: expected a positive number, got inf"),
        # past torch's 64-bit sizes: these loaded, then failed in torch ("Overflow when unpacking long long")
        (lambda c: c["text_config"].update(vocab_size=2**63), r"vocab_size: expected a positive integer of at most "
                                                               r"9223372036854775807 \(torch's sizes are 64-bit\)"),
        (lambda c: c["text_config"].update(max_position_embeddings=10**400), "max_position_embeddings: .*64-bit"),
        # a float field given an integer past a float's range: a bare OverflowError from math.isfinite, naming nothing
        (lambda c: c["text_config"].update(rms_norm_eps=10**400), "rms_norm_eps: expected a positive finite number"),
        (lambda c: c["text_config"].update(initializer_range=10**400), "initializer_range: expected a finite number"),
        (lambda c: c["text_config"].update(num_experts=2**64), "num_experts: .*64-bit"),
        (lambda c: c.update(canvas_length=2**70), "^canvas_length: .*64-bit"),
        # a key past int()'s 4,300 digits: a bare "Exceeds the limit" ValueError
        (lambda c: c["text_config"].update(per_layer_config={"1" * 5000: {"head_dim": 8}}),
         r"per_layer_config\['1+'\]: expected a layer index below"),
        (lambda c: c["text_config"].update(per_layer_config={"1": {"head_dim": 2**64}, "3": {"head_dim": 2**64}}),
         r"per_layer_config\[1\].head_dim: expected a positive even integer"),
    ],
)
def test_bad_config_fields_named(ref_checkpoint, edit, field):
    raw = json.loads((ref_checkpoint[0] / "config.json").read_text())
    edit(raw)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("over, field", [
    (dict(head_dim=7), "head_dim: expected a positive even integer, got 7"),
    (dict(num_key_value_heads=3), "num_key_value_heads: 3 does not divide"),
    (dict(global_head_dim=15), "global_head_dim: expected a positive even integer, got 15"),
    (dict(num_global_key_value_heads=3), "num_global_key_value_heads: 3 does not divide"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), r"rope_parameters\.rope_theta: expected a "),
    (dict(per_layer_config={"1": {"head_dim": 15}}), r"per_layer_config\[1\]\.head_dim: expected a positive even"),
])
def test_a_config_without_per_layer_config_names_the_keys_it_holds(over, field):
    """A config.json with no per_layer_config (the published checkpoint's layout) or a flat rope_parameters: the
    errors named per_layer_config[0].head_dim and rope_parameters.full_attention.rope_theta, keys it does not have."""
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=6,
                num_experts=4, top_k_experts=2, moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ConfigError, match=rf"^text_config\.{field}"):
        ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": {**text, **over}})


def test_a_shape_set_after_construction_is_named_as_set():
    """The names of the file's flat forms hold while the values are the ones drawn from them: a per_layer_config or a
    rope entry set after construction was named global_head_dim (16 all along) or rope_parameters without its kind."""
    config = ModelConfig.tiny(num_hidden_layers=3)
    config.text.per_layer_config = {"2": {"head_dim": 15}}
    with pytest.raises(ConfigError, match=r"^text_config\.per_layer_config\[2\]\.head_dim: expected a positive even"):
        config.text.validate()
    config = ModelConfig.tiny(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.text.rope_parameters = {**config.text.rope_parameters,
                                   "full_attention": {"rope_type": "default", "rope_theta": -1.0}}
    with pytest.raises(ConfigError, match=r"^text_config\.rope_parameters\.full_attention\.rope_theta: expected"):
        config.text.validate()


def test_too_many_open_files_says_what_to_do(monkeypatch, tmp_path):
    """A model of many shards past `ulimit -n` (each mapped file held a descriptor) failed with a bare EMFILE."""
    import errno

    import blockpress.checkpoint as checkpoint

    blockpress.random_model(blockpress.ModelConfig.tiny()).save(tmp_path)

    def exhausted(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(checkpoint.mmap, "mmap", exhausted)
    with pytest.raises(OSError, match=r"model.safetensors: cannot open it: too many open files.*ulimit -n"):
        blockpress.load(tmp_path)


def test_not_a_folder_or_name():
    with pytest.raises(FileNotFoundError, match="never downloads"):
        blockpress.load("no-such-model-anywhere")


def test_a_hub_name_with_no_home_known_gets_the_usual_error(monkeypatch, tmp_path):
    """HOME unset and a user id with no passwd entry (docker --user 1234, runAsUser): Path.home() raised a bare
    'Could not determine home directory.' for any owner/name, where huggingface_hub's rule (expanduser) keeps "~"."""
    import pwd

    for name in ("HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        blockpress.load("acme/no-such-model")


def fake_hub_cache(root, checkpoint, repo_id="acme/tiny-dg", commits=("a1b2c3d4e5",), refs=None):
    """Lay a checkpoint out as huggingface_hub's cache does: blobs, snapshots/<commit>/ of symlinks, refs/."""
    owner, name = repo_id.split("/")
    repo = root / f"models--{owner}--{name}"
    (repo / "blobs").mkdir(parents=True)
    for commit in commits:
        (repo / "snapshots" / commit).mkdir(parents=True)
        for f in checkpoint.iterdir():
            blob = repo / "blobs" / f"{commit}-{f.name}"
            shutil.copy(f, blob)
            (repo / "snapshots" / commit / f.name).symlink_to(blob)
    for ref, commit in (refs or {"main": commits[-1]}).items():
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


def test_a_repo_id_loads_from_the_hugging_face_cache(lm, ref_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, ref_checkpoint[0], commits=("0123abcd", "4567ef01"), refs={"main": "4567ef01", "v1": "0123abcd"})
    prompt, canvas = torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7, 8, 9]])
    want = lm.logits(prompt, canvas)
    for name, commit in [("acme/tiny-dg", "4567ef01"), ("acme/tiny-dg@v1", "0123abcd"), ("acme/tiny-dg@0123", "0123abcd")]:
        cached = load_quiet(name)
        assert cached.path == tmp_path / "models--acme--tiny-dg" / "snapshots" / commit
        torch.testing.assert_close(cached.logits(prompt, canvas), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["acme/tiny-dg@v9", "acme/other"])
def test_a_repo_id_not_in_the_cache_says_where_it_looked(ref_checkpoint, tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, ref_checkpoint[0])
    with pytest.raises(FileNotFoundError) as err:
        blockpress.load(name)
    assert str(tmp_path) in str(err.value) and "hf download" in str(err.value)


@pytest.mark.parametrize("name", ["/no/such/folder", "./ckpt", "../tiny-dg", "~/no-such-ckpt", "runs/x/final",
                                  "acme/tiny-dg/extra", "ckpt/", ".ckpt", "runs\\x", "models\\my-run"])
def test_a_missing_path_is_said_to_be_no_folder(ref_checkpoint, tmp_path, monkeypatch, name):
    """A name only a folder can have got the hub's advice ("... nor a model in the Hugging Face cache; fetch it
    first, e.g. `hf download google/...`"), as if a typo in a path were a model to download. A backslash (Windows'
    separator: runs\\x) is in no repo id."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, ref_checkpoint[0])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        blockpress.load(name)
    where = Path(name).expanduser().absolute()
    assert str(err.value) == f"model {name!r}: no such folder ({where})"
    assert not where.exists()


def test_a_shipped_name_is_the_shipped_model_even_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    """A folder named like a shipped model in the current folder (a run's --out, a copy) was loaded in its place,
    silently, for the name and for the CLI's default --model alike. The name is the shipped model, with a warning;
    ./name is the folder."""
    blockpress.random_model(ModelConfig.tiny()).save(tmp_path / "blockpress-code")
    monkeypatch.chdir(tmp_path)
    for given in ("blockpress-code", Path("blockpress-code")):
        with pytest.warns(UserWarning, match=r"loading the shipped model; the folder .*blockpress-code of the same "
                                             r"name is not read \(give ./blockpress-code to load it\)"):
            path = blockpress.lm.resolve_path(given)
        assert path == blockpress.lm.MODELS_DIR / "blockpress-code"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blockpress.lm.resolve_path("./blockpress-code") == Path("blockpress-code")
        assert blockpress.lm.resolve_path("blockpress-sudoku") == blockpress.lm.MODELS_DIR / "blockpress-sudoku"


def test_a_home_path_is_expanded_where_a_model_is_written_and_an_adapter_read(tmp_path, monkeypatch):
    """load("~/x") read the home folder's x, while lm.save("~/x") made a folder named ~ in the current one and
    adapter="~/a" was no folder."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    lm = blockpress.random_model(ModelConfig.tiny())
    lm.save("~/saved")
    assert (home / "saved" / "model.safetensors").is_file() and not (work / "~").exists()
    assert blockpress.load("~/saved").path == home / "saved"
    (home / "ad").mkdir()
    assert blockpress.lm.resolve_model("~/saved", adapter="~/ad")[1] == home / "ad"
    # a ~user that names no user is refused by the argument, where pathlib's bare RuntimeError ('Could not
    # determine home directory.') named neither it nor the path; nothing is written
    user = "~no-such-user-blockpress"
    for call, name in ((lambda: lm.save(f"{user}/out"), "save"), (lambda: blockpress.load(f"{user}/m"), "model"),
                       (lambda: blockpress.lm.resolve_model("~/saved", adapter=f"{user}/a"), "adapter")):
        with pytest.raises(ValueError, match=rf"^{name}: '{user}/\w+' starts with {user}, and no home folder is known "
                                             "for a user 'no-such-user-blockpress'"):
            call()
    assert sorted(p.name for p in work.iterdir()) == []


def test_a_path_with_a_nul_byte_is_refused_by_the_argument(tmp_path, monkeypatch):
    """Python's bare ValueError 'embedded null byte' named neither the argument nor the path (save), and load
    looked for it as a shipped name and in the Hugging Face cache first."""
    monkeypatch.chdir(tmp_path)
    lm = blockpress.random_model(ModelConfig.tiny())
    for call, name, path in ((lambda p: lm.save(p), "save", "out/a\x00b"), (blockpress.load, "model", "\x00"),
                             (lambda p: blockpress.lm.resolve_model("blockpress-code", adapter=p), "adapter", "ad\x00"),
                             (lambda p: blockpress.load(Path(p)), "model", "m\x00/x")):
        with pytest.raises(ValueError, match=rf"^{name}: {re.escape(repr(path))} holds a NUL byte \(\\x00\), which no "
                                             "file name may"):
            call(path)
    assert not any(tmp_path.iterdir())


def test_saving_onto_a_dangling_link_names_the_link_and_its_target(tmp_path):
    """lm.save onto a symlink whose target is missing failed with a bare `FileExistsError: File exists`."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    lm = blockpress.random_model(ModelConfig.tiny())
    with pytest.raises(ValueError, match=r"save: '.*out' is a link to '.*gone', which does not exist"):
        lm.save(link)
    (tmp_path / "gone").mkdir()  # once its target exists, the link is a folder like any other
    lm.save(link)
    assert (tmp_path / "gone" / "model.safetensors").is_file()


@pytest.mark.parametrize("typo, meant", [("blockpress-cod", "blockpress-code"), ("blockpres-sudoku", "blockpress-sudoku"),
                                         ("Blockpress-Code", "blockpress-code")])
def test_a_typo_of_a_shipped_name_suggests_it(tmp_path, monkeypatch, typo, meant):
    """It was told to fetch google/diffusiongemma-26B-A4B-it from the hub, with no word of the name it was close to."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        blockpress.load(typo)
    assert str(err.value).endswith(f"did you mean {meant!r}?") and "hf download" not in str(err.value)


def test_a_repo_id_not_in_the_cache_names_itself_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    for name, fetch in [("acme/other", "`hf download acme/other`"),
                        ("acme/other@v2", "`hf download acme/other --revision v2`")]:
        with pytest.raises(FileNotFoundError, match="never downloads") as err:
            blockpress.load(name)
        assert str(err.value).endswith(f"fetch it first, {fetch}")


def test_a_folder_without_config_json_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json; is this a Hugging Face checkpoint folder"):
        blockpress.load(tmp_path)


def test_a_cache_without_refs_takes_the_newest_snapshot(ref_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = fake_hub_cache(tmp_path, ref_checkpoint[0], commits=("old", "new"), refs={})
    os.utime(repo / "snapshots" / "old", (1, 1))
    assert load_quiet("acme/tiny-dg").path == repo / "snapshots" / "new"


@pytest.mark.parametrize(
    "name, message",
    [
        ("acme/tiny-dg@v9", "names no ref or snapshot"),
        ("acme/tiny-dg@0", "matches 2 snapshots"),  # an ambiguous commit prefix
        ("acme/tiny-dg@gone", "names snapshot 'ffff0000', which"),  # an interrupted download
    ],
)
def test_a_revision_the_cache_cannot_give_says_why(ref_checkpoint, tmp_path, monkeypatch, name, message):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, ref_checkpoint[0], commits=("0123abcd", "0456ef01"),
                   refs={"main": "0456ef01", "gone": "ffff0000"})
    with pytest.raises(FileNotFoundError, match=message):
        blockpress.load(name)


@pytest.mark.parametrize("broken", ["generation_config.json", "tokenizer.json", "model.safetensors"])
def test_a_snapshot_with_a_dangling_link_is_refused_not_half_loaded(ref_checkpoint, tmp_path, monkeypatch, broken):
    """A missing generation_config.json or tokenizer.json is optional, so a link to a lost blob used to load a
    model with other decoding defaults or no tokenizer, silently."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(ref_checkpoint[0], checkpoint)
    (checkpoint / "tokenizer.json").write_text("{}")  # the tiny reference has none: any file will do as a blob
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = fake_hub_cache(tmp_path / "hub", checkpoint)
    blob = (repo / "snapshots" / "a1b2c3d4e5" / broken).resolve()
    blob.unlink()
    with pytest.raises(FileNotFoundError, match=rf"\['{broken}'\] link to files that are not there"):
        blockpress.load("acme/tiny-dg")


def test_saving_into_a_cache_snapshot_is_refused_and_saved_files_are_readable(lm, ref_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = fake_hub_cache(tmp_path / "hub", ref_checkpoint[0])
    cached = load_quiet("acme/tiny-dg")
    blobs = {f: f.read_bytes() for f in (repo / "blobs").iterdir()}
    with pytest.raises(ValueError, match="holds links .* as a Hugging Face cache snapshot does"):
        cached.save(cached.path)
    assert {f: f.read_bytes() for f in (repo / "blobs").iterdir()} == blobs  # no blob was written through
    cached.save(tmp_path / "mine")
    config_mode = (tmp_path / "mine" / "config.json").stat().st_mode & 0o777
    assert (tmp_path / "mine" / "model.safetensors").stat().st_mode & 0o777 == config_mode


@pytest.mark.parametrize(
    "env, want",
    [
        ({"HF_HUB_CACHE": "/a/hub", "HF_HOME": "/b"}, "/a/hub"),
        ({"HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}, "/b/hub"),
        ({"XDG_CACHE_HOME": "/c"}, "/c/huggingface/hub"),
        ({}, "~/.cache/huggingface/hub"),
    ],
)
def test_the_hub_cache_follows_huggingface_hubs_variables(monkeypatch, env, want):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert hf_hub_cache() == Path(want).expanduser()


def test_config_roundtrip(ref_checkpoint):
    raw = json.loads((ref_checkpoint[0] / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert [s.head_dim for s in cfg.text.layers] == [8, 16, 8, 16]
    assert [s.num_kv_heads for s in cfg.text.layers] == [2, 1, 2, 1]


def test_text_config_fields_blockpress_does_not_model_survive_a_save(ref_checkpoint, tmp_path):
    """text_config keys that are no blockpress field (the reference's attention_dropout and use_cache, an author's
    own) are written back as read, as top-level ones are: the reference reads the same values after a save (before:
    dropped, and transformers read attention_dropout 0.0)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    path = copy_ckpt(ref_checkpoint[0], tmp_path / "src")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(attention_dropout=0.1, use_cache=False, my_text_field={"a": [1, 2]})
    raw["my_top_field"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    load_quiet(path).save(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("attention_dropout", "use_cache", "my_text_field"):
        assert saved["text_config"][key] == raw["text_config"][key]
    assert saved["my_top_field"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "out").config.text_config
    assert (text.attention_dropout, text.my_text_field) == (0.1, {"a": [1, 2]})
    # a dtype the writer put in text_config too is the one saved, as the top level's is
    raw["text_config"]["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(raw))
    load_quiet(path, dtype="bfloat16").save(tmp_path / "bf16")
    saved = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert saved["dtype"] == saved["text_config"]["dtype"] == "bfloat16" and "torch_dtype" not in saved["text_config"]


def test_generic_transformers_config_keys_load_without_a_warning(ref_checkpoint):
    """Every key transformers' PretrainedConfig writes is one blockpress knows (a field) or knows to ignore, so none
    warns "unknown field" (before: _name_or_path, output_attentions and transformers 4's tie_encoder_decoder did)."""
    from transformers import PretrainedConfig

    generic = PretrainedConfig().to_dict()
    generic.update(_name_or_path="", output_attentions=False, tie_encoder_decoder=False)  # in released configs
    raw = json.loads((ref_checkpoint[0] / "config.json").read_text())
    raw["text_config"] = {**generic, **raw["text_config"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelConfig.from_dict(raw)
    raw["text_config"]["temperature"] = 0.7  # a setting blockpress does not read still says so
    with pytest.warns(UserWarning, match="text_config.temperature: unknown field, ignored"):
        ModelConfig.from_dict(raw)


def test_parameter_count_matches_model(lm):
    n = sum(p.numel() for p in lm.model.parameters())
    assert lm.num_parameters(active=False) == n
    assert lm.num_parameters(active=True) < n


def test_random_model_meta_init_any_size():
    lm = blockpress.random_model(ModelConfig.tiny(), seed=3)
    lm2 = blockpress.random_model(ModelConfig.tiny(), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(lm.model.parameters(), lm2.model.parameters(), strict=True))
    big = ModelConfig.gemma_26b_a4b()
    # the released shape: ~25B total, ~3.8B active (we only count, never allocate, here)
    assert 24e9 < big.num_parameters() < 27e9
    assert 3.5e9 < big.num_parameters(active=True) < 4.2e9


@pytest.mark.parametrize("field, value, message", [
    ("final_logit_softcapping", 0.0, "final_logit_softcapping: expected a positive finite number"),  # logits all 0
    ("num_attention_heads", 0, "num_attention_heads: expected a positive integer"),  # ran with no attention
    ("rms_norm_eps", -1.0, "rms_norm_eps: expected a positive finite number"),  # NaN logits
    ("num_key_value_heads", 3, "num_key_value_heads: 3 does not divide num_attention_heads"),  # SDPA's RuntimeError
    ("top_k_experts", 9, "top_k_experts: 9 is more than num_experts"),  # "selected index k out of range"
    ("hidden_activation", "bogus", "hidden_activation: 'bogus' is not supported"),  # KeyError: 'bogus'
])
def test_a_config_changed_after_it_was_built_is_checked_again_when_a_model_is_built(field, value, message):
    """A config is checked when it is built; one changed after (`cfg.text.x = v`) built a model that gave all-zero or
    NaN logits, or failed deep inside torch at the first pass. The model's construction checks it again."""
    config = ModelConfig.tiny()
    setattr(config.text, field, value)
    with pytest.raises(ConfigError, match=rf"^text_config\.{message}"):
        blockpress.random_model(config)
    config = ModelConfig.tiny()
    config.canvas_length = 0
    with pytest.raises(ConfigError, match="^canvas_length: expected a positive integer"):
        blockpress.random_model(config, device="meta")


@pytest.mark.parametrize("kind", [1, ["sliding_attention"], None])
def test_a_layer_type_that_is_no_string_is_named(kind):
    """layer_types [1, ...] failed as "text_config: '<' not supported between instances of 'int' and 'str'", and a
    list in it as a bare TypeError (unhashable type)."""
    with pytest.raises(ConfigError, match=rf"^text_config\.layer_types: unknown layer type {re.escape(repr(kind))}; "):
        ModelConfig.tiny(num_hidden_layers=2, layer_types=[kind, "full_attention"])


def test_loaded_weights_are_file_backed_and_writable(ref_checkpoint, tmp_path):
    """CPU loads map the file copy-on-write: no copy at load, and training can still write the weights."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    lm = load_quiet(path)
    w = lm.model.layers[0].mlp.up_proj.weight
    before = load_file(path / "model.safetensors")["model.decoder.layers.0.mlp.up_proj.weight"]
    assert torch.equal(w, before)
    with torch.no_grad():
        w.add_(1.0)
    after = load_file(path / "model.safetensors")["model.decoder.layers.0.mlp.up_proj.weight"]
    assert torch.equal(after, before)  # the file on disk is untouched


def test_truncated_safetensors_is_a_clear_error(ref_checkpoint, tmp_path):
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    (path / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(blockpress.CheckpointError, match="not a safetensors file"):
        load_quiet(path)


def _rewrite_header(path, edit):
    """Rewrite a safetensors file's JSON header through `edit(header)`, keeping its data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    pairs = header.pop("__pairs__", None)  # an edit's own list of entries, repeated keys and all
    text = (json.dumps(header) if pairs is None else
            "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs) + "}").encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def _first_tensor(header):
    return header[next(k for k in header if k != "__metadata__" and "up_proj" in k)]


def _empty_entry(header, shape):
    """An entry of no bytes, after the last tensor's, for a vision-tower tensor of `shape` (holding a 0)."""
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["model.encoder.vision_tower.extra"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end]}


_NORM, _LAYER_NORM = "model.decoder.norm.weight", "model.decoder.layers.0.input_layernorm.weight"  # same size


def _entry_twice(header):
    """`_rewrite_header`'s edit that gives the final norm's entry twice, first with the layer norm's bytes."""
    entries = list(header.items())
    header.clear()
    header["__pairs__"] = [(_NORM, {**dict(entries)[_NORM], "data_offsets": dict(entries)[_LAYER_NORM]["data_offsets"]}),
                           *entries]


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "holds .* bytes of data"),
    (lambda p: p.write_bytes((2**62).to_bytes(8, "little") + p.read_bytes()[8:]), "its header claims"),
    (lambda p: p.write_bytes(bytes(range(256)) * 20), "not a safetensors file"),
    (lambda p: _rewrite_header(p, lambda h: _first_tensor(h).update(data_offsets=[0, 4])), "needs"),
    (lambda p: _rewrite_header(p, lambda h: _first_tensor(h).pop("data_offsets")), "expected dtype, shape and data_offsets"),
    (lambda p: _rewrite_header(p, lambda h: _first_tensor(h).update(dtype="I64")), "needs|expected a floating-point"),
    (lambda p: _rewrite_header(p, lambda h: _first_tensor(h).update(dtype="Q3")),
     "safetensors dtype 'Q3', which blockpress does not read"),
    # a size that is a bool, past int64, or sizes whose product is: each failed inside torch (TypeError, "Storage size
    # calculation overflowed") for an entry blockpress passes through as stored (the vision tower's)
    (lambda p: _rewrite_header(p, lambda h: _empty_entry(h, [0, 2**70])), r"shape \[0, 1180591620717411303424\] is not"),
    (lambda p: _rewrite_header(p, lambda h: _empty_entry(h, [True, 0])), r"shape \[True, 0\] is not a list of sizes"),
    (lambda p: _rewrite_header(p, lambda h: _empty_entry(h, [2**40, 2**40, 0])), r"shape \[1099511627776, .* is not"),
    (lambda p: _rewrite_header(p, lambda h: h.clear() or h.update(x=[1])), "expected dtype, shape"),
    # two tensors' bytes overlapping (the final norm given a layer norm's), bytes past the last tensor, an entry given
    # twice (json.loads kept the last): each loaded, the first with logits 5 off, where transformers refuses the file
    (lambda p: _rewrite_header(p, lambda h: h[_NORM].update(data_offsets=h[_LAYER_NORM]["data_offsets"])),
     r"its data starts at byte \d+, (inside the tensor before it|leaving bytes)"),
    (lambda p: p.write_bytes(p.read_bytes() + bytes(8)), "or holds bytes past its tensors"),
    (lambda p: _rewrite_header(p, _entry_twice), f"its header gives '{_NORM}' twice"),
    # JSON nested past Python's parser: a RecursionError, no CheckpointError, named no file
    (lambda p: p.write_bytes(len(deep := b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}").to_bytes(8, "little") + deep),
     "not a safetensors file .*nested deeper than Python's JSON parser reads"),
])
def test_damaged_safetensors_are_clear_errors(ref_checkpoint, tmp_path, damage, message):
    """Truncated files, a header length of 2**62, random bytes, wrong offsets, dtypes or entries: each one is a
    CheckpointError naming the file (and the tensor), before torch touches the data."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    damage(path / "model.safetensors")
    with pytest.raises(blockpress.CheckpointError, match=message) as caught:
        load_quiet(path)
    assert "model.safetensors" in str(caught.value)


def _raw_safetensors(path, header, data):
    import struct

    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("offsets", [[0, 8], [4, 12]])
def test_a_tensor_starting_inside_the_one_before_is_refused_as_an_overlap(tmp_path, offsets):
    """Two tensors sharing bytes, every byte owned: only the overlap check sees it (the damaged-file case above
    also leaves a gap, which a second check refuses)."""
    from blockpress.checkpoint import MappedSafetensors

    path = tmp_path / "model.safetensors"
    _raw_safetensors(path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "b": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}, bytes(offsets[1]))
    with pytest.raises(blockpress.CheckpointError, match=rf"'b': its data starts at byte {offsets[0]}, inside the "
                                                         "tensor before it"):
        MappedSafetensors(path)


def test_a_tensor_of_no_elements_reads_as_its_shape_and_dtype(tmp_path):
    """torch.frombuffer refuses a count of 0: an empty tensor is made, not read."""
    from blockpress.checkpoint import MappedSafetensors

    path = tmp_path / "model.safetensors"
    save_file({"empty": torch.empty(0, 3, dtype=torch.bfloat16), "last": torch.arange(4, dtype=torch.float32)},
              str(path))
    f = MappedSafetensors(path)
    empty = f.tensor("empty")
    assert empty.shape == (0, 3) and empty.dtype == torch.bfloat16
    assert torch.equal(f.tensor("last"), torch.arange(4, dtype=torch.float32))


@pytest.mark.parametrize("index", ['{"weight_map": ["a"]}', "[]", "{}", '{"weight_map": {"x": 3}}', "{nope",
                                   "[" * 100_000 + "]" * 100_000,
                                   '{"weight_map": {}}'])  # (no shard read: it failed inside torch, all missing)
def test_a_bad_shard_index_is_a_clear_error(ref_checkpoint, tmp_path, index):
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")  # else the index is not read
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(blockpress.CheckpointError, match="model.safetensors.index.json: not a valid safetensors index"):
        load_quiet(path)


def test_a_folder_with_both_layouts_reads_the_file_transformers_reads(ref_checkpoint, tmp_path):
    """model.safetensors beside a sharded index (a stale leftover of one layout): transformers reads
    model.safetensors, and blockpress read the index, so the same folder gave other logits, without a word."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from blockpress.checkpoint import save_model

    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")  # model.safetensors: the reference's weights
    other = load_quiet(ref_checkpoint[0])
    with torch.no_grad():
        for p in other.model.parameters():
            p.mul_(-1.5)
    save_model(other.model, tmp_path / "other", max_shard_bytes=20_000)
    shards = [f for f in (tmp_path / "other").iterdir() if f.name.startswith("model")]
    assert len(shards) > 2  # an index and its shards, other weights
    for f in shards:
        shutil.copy(f, path / f.name)
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = blockpress.load(path)
    prompt, canvas = torch.randint(3, 64, (1, 7)), torch.randint(3, 64, (1, 8))
    with torch.no_grad():
        expected = reference(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (loaded.logits(prompt, canvas) - expected).abs().max().item() <= 1e-4
    assert (other.logits(prompt, canvas) - expected).abs().max().item() > 1e-1  # the index's weights differ
    assert any("both model.safetensors and model.safetensors.index.json; reading model.safetensors, as "
               "transformers does" in str(w.message) for w in caught)


def test_an_integer_tensor_where_weights_are_floats_is_a_clear_error(ref_checkpoint, tmp_path):
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    file = path / "model.safetensors"
    state = load_file(file)
    name = next(k for k in state if "up_proj" in k)
    state[name] = state[name].to(torch.int32) if state[name].element_size() == 4 else state[name].to(torch.int16)
    save_file(state, file)
    with pytest.raises(blockpress.CheckpointError, match=f"tensor '{name}': dtype torch.int.* expected a floating-point"):
        load_quiet(path)


@pytest.mark.parametrize("native", [True, False])
def test_half_precision_loads_as_float32_where_the_cpu_only_emulates_it(ref_checkpoint, tmp_path, monkeypatch, native):
    from blockpress import checkpoint

    lm16 = load_quiet(ref_checkpoint[0], dtype="bfloat16")
    lm16.save(tmp_path / "m")
    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: native)
    lm = load_quiet(tmp_path / "m")
    assert lm.dtype == (torch.bfloat16 if native else torch.float32)
    # The same values either way: only the arithmetic's precision changes.
    assert all(torch.equal(p.float(), q.float()) for p, q in zip(lm.model.parameters(), lm16.model.parameters()))
    assert load_quiet(tmp_path / "m", dtype="bfloat16").dtype == torch.bfloat16  # an explicit dtype wins


class _NoOneDNNOps:
    """torch.ops.mkldnn in a torch built without oneDNN: its ops are not registered, and asking for one raises the
    AttributeError torch._ops._OpNamespace raises for an unknown op."""

    def __getattr__(self, name):
        raise AttributeError(f"'_OpNamespace' 'mkldnn' object has no attribute '{name}'")


def test_a_torch_without_onednn_loads_half_precision_as_float32(ref_checkpoint, tmp_path, monkeypatch):
    """PyTorch's macOS arm64 wheels are built without oneDNN (USE_MKLDNN=OFF), which registers
    mkldnn::_is_mkldnn_bf16_supported: the check raised AttributeError, so every CPU load of a bf16 checkpoint with
    no dtype (the shipped models, the README's first command), `bench` and the --dtype note ended in a traceback.
    Without the check the CPU counts as emulating half precision: float32, the same values."""
    from blockpress import bench, checkpoint
    from blockpress.cli.common import emulated_dtype_note

    load_quiet(ref_checkpoint[0], dtype="bfloat16").save(tmp_path / "m")
    monkeypatch.setattr(torch.ops, "mkldnn", _NoOneDNNOps())
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not checkpoint.cpu_computes_natively(torch.bfloat16)
    assert not checkpoint.cpu_computes_natively(torch.float16)
    assert checkpoint.cpu_computes_natively(torch.float32)
    lm = load_quiet(tmp_path / "m")
    assert lm.dtype == torch.float32 and lm.widened_from == torch.bfloat16
    assert load_quiet(tmp_path / "m", dtype="bfloat16").dtype == torch.bfloat16  # an explicit dtype still wins
    assert bench.machine("cpu")["native_bf16"] is False
    assert "no native bf16 matmuls" in emulated_dtype_note("bfloat16", "cpu")


@pytest.mark.parametrize("native", [True, False])
def test_save_writes_the_dtype_a_load_widened_from(ref_checkpoint, tmp_path, monkeypatch, native):
    """A bf16 checkpoint loaded with no dtype on a CPU without native bf16 computes in float32, and lm.save wrote
    float32: twice the size, and a folder that depended on the CPU that saved it. It writes the stored bf16 now,
    the same tensors on any CPU; save(dtype=) casts what is written, never the live model."""
    from saved import saved_dtype

    from blockpress import checkpoint

    load_quiet(ref_checkpoint[0], dtype="bfloat16").save(tmp_path / "m")
    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: native)
    lm = load_quiet(tmp_path / "m")
    assert lm.dtype == (torch.bfloat16 if native else torch.float32)
    assert lm.widened_from == (None if native else torch.bfloat16)
    lm.save(tmp_path / "again")
    assert saved_dtype(tmp_path / "again") == torch.bfloat16
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"
    original, again = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    for dtype in ("float16", torch.float32):  # asked for: the files only
        lm.save(tmp_path / str(dtype), dtype=dtype)
        assert saved_dtype(tmp_path / str(dtype)) == blockpress.checkpoint.resolve_dtype(dtype)
        assert all(torch.equal(before[k], v) and before[k].dtype == v.dtype for k, v in lm.model.state_dict().items())
    assert load_file(tmp_path / "float16" / "model.safetensors")["model.decoder.norm.weight"].dtype == torch.float16
    lm.to(dtype=lm.dtype)  # a dtype named, even the one computed in already, is what a save writes from then on
    assert lm.widened_from is None
    lm.save(tmp_path / "named")
    assert saved_dtype(tmp_path / "named") == lm.dtype


def test_what_a_load_said_of_the_weights_ends_when_they_change_around_the_lm(ref_checkpoint, tmp_path, monkeypatch):
    """widened_from and stored_values were ended by lm.to alone: a widened bf16 folder cast with lm.model.half()
    still saved bfloat16 (the values rounded through float16, config.json saying bfloat16), and codes quantized
    from weights edited in place (weights_changed(), as the docs ask) or cast with lm.model.half().float() were
    recorded as made from the checkpoint (quantized_from), so its QLoRA adapters loaded over them unwarned.
    What keeps the values keeps both: lm.to, moves, lm.quantize (or one undone part-way), a copy of the LM."""
    from copy import deepcopy

    from saved import saved_dtype

    from blockpress import checkpoint
    from blockpress.quantize import fit_cpu_kernels

    load_quiet(ref_checkpoint[0], dtype="bfloat16").save(tmp_path / "m")
    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: False)
    lm = load_quiet(tmp_path / "m")
    assert lm.widened_from == lm.stored_values == torch.bfloat16 and lm.dtype == torch.float32
    lm.to("cpu")  # moved, or cast to the dtype they are in, or copied: the values are the same
    lm.model.to("cpu").float()
    assert lm.widened_from == lm.stored_values == torch.bfloat16
    copied = deepcopy(lm)
    assert copied.widened_from == copied.stored_values == torch.bfloat16
    failed = deepcopy(lm)
    monkeypatch.setattr(sys.modules["blockpress.quantize"], "fit_cpu_kernels", lambda model: 1 / 0)  # undone part-way
    with pytest.raises(ZeroDivisionError):
        failed.quantize("int8")
    assert failed.quantization is None and failed.widened_from == failed.stored_values == torch.bfloat16
    monkeypatch.setattr(sys.modules["blockpress.quantize"], "fit_cpu_kernels", fit_cpu_kernels)
    lm.model.half()
    assert lm.widened_from is None and lm.stored_values is None
    lm.save(tmp_path / "half")
    assert saved_dtype(tmp_path / "half") == torch.float16

    def quantized_from(change):
        lm = load_quiet(tmp_path / "m", dtype="float32")
        change(lm)
        lm.quantize("int8").save(tmp_path / "q")
        return json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"].get("quantized_from")

    def edited(lm):
        with torch.no_grad():
            lm.model.embed_tokens.weight[3, 0] += 1
        lm.model.weights_changed()

    def merged(lm):  # adapters folded in by hand (what lm.save's refusal of unmerged ones asks for)
        from blockpress.train import add_lora, merge_lora

        add_lora(lm.model, 2, 4.0)
        with torch.no_grad():
            for name, p in lm.model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.01)
        merge_lora(lm.model)

    assert quantized_from(lambda lm: None) is not None  # codes made from the stored values
    assert quantized_from(edited) is None
    assert quantized_from(merged) is None  # (merge_lora changed the values unsaid: the unmerged folder was named)
    assert quantized_from(lambda lm: lm.model.half().float()) is None
    emptied = load_quiet(tmp_path / "m", dtype="float32")
    emptied.model.to_empty(device="cpu")  # (uninitialised memory, of the same dtype and device: not a move)
    assert emptied.stored_values is None


def test_a_sharded_save_in_another_dtype_counts_the_bytes_written(lm, tmp_path):
    from blockpress.checkpoint import save_model

    save_model(lm.model, tmp_path / "s", max_shard_bytes=20_000, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    shards = [load_file(tmp_path / "s" / name) for name in sorted(set(index["weight_map"].values()))]
    assert len(shards) > 1 and {t.dtype for shard in shards for t in shard.values()} == {torch.bfloat16}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for shard in shards for t in shard.values())
    assert all(sum(t.numel() * 2 for t in shard.values()) <= 20_000 for shard in shards if len(shard) > 1)
    assert lm.dtype == torch.float32


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_save_copies_to_the_host_one_shard_at_a_time(lm, tmp_path, monkeypatch, dtype):
    """A GPU model's save moved the whole state dict to the host before writing its first shard: 50 GB of host
    memory for the 26B, where the docstring promises a shard's bytes. Simulated: Tensor.cpu copies (as from a
    GPU), and each shard written may follow only its own tensors' copies."""
    import blockpress.checkpoint as checkpoint

    copied, shards = [0], []
    real_cpu, real_to = torch.Tensor.cpu, torch.Tensor.to

    def cpu(t, *a, **k):
        copied[0] += 1
        return real_cpu(t, *a, **k).clone()

    def to(t, *a, **k):
        copied[0] += "cpu" in a or k.get("device") == "cpu"
        return real_to(t, *a, **k)

    def save_file(tensors, filename, metadata=None):
        shards.append((copied[0], len(tensors)))
        copied[0] = 0

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(checkpoint, "save_file", save_file)
    checkpoint.save_model(lm.model, tmp_path / "s", max_shard_bytes=20_000, dtype=dtype)
    assert len(shards) > 1 and all(copies == count for copies, count in shards)


def _untied_reference(path, same_weights: bool):
    """A reference checkpoint saved with tie_word_embeddings=false: its encoder and LM head are stored apart."""
    from reference import TINY_TEXT, TINY_VISION
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    cfg = DiffusionGemmaConfig(text_config=dict(TINY_TEXT), vision_config=dict(TINY_VISION), canvas_length=8,
                               tie_word_embeddings=False)
    ref = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
        if same_weights:  # the copies hold the decoder's values
            decoder = dict(ref.model.decoder.named_parameters())
            for name, p in ref.model.encoder.language_model.named_parameters():
                p.copy_(decoder[name])
            ref.lm_head.weight.copy_(ref.model.decoder.embed_tokens.weight)
    ref.save_pretrained(path)
    names = load_file(path / "model.safetensors").keys()
    assert "lm_head.weight" in names and any(n.startswith("model.encoder.language_model.layers") for n in names)
    return ref


def test_an_untied_config_over_a_checkpoint_that_stores_no_copies_is_refused(ref_checkpoint, tmp_path):
    """A tied checkpoint (no encoder or LM head tensors stored) whose config.json says tie_word_embeddings false loaded
    running the decoder's weights, where transformers starts the encoder and LM head from random weights (logits 10
    off): nothing was compared, the copies being absent. Refused now, naming what is missing."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    raw = json.loads((path / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(blockpress.CheckpointError, match=r"^tie_word_embeddings is false, but the checkpoint stores no "
                                                         r"'lm_head.weight', 'model.encoder.language_model.[^']+', '[^']+'"
                                                         r" and \d+ more: transformers would start them from random"):
        load_quiet(path)


def test_a_text_config_untied_under_a_tied_top_level_loads_tied_as_in_transformers(ref_checkpoint, tmp_path):
    """transformers ties by the top-level flag alone: text_config's tie_word_embeddings false under a top-level true
    loads tied there. blockpress refused it (for copies the checkpoint need not store), its own save of such a folder
    included."""
    from transformers import DiffusionGemmaForBlockDiffusion

    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(raw))
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    assert ref.lm_head.weight.data_ptr() == ref.model.decoder.embed_tokens.weight.data_ptr()  # tied there
    g = torch.Generator().manual_seed(0)
    prompt, canvas = torch.randint(0, 96, (2, 13), generator=g), torch.randint(0, 96, (2, 8), generator=g)
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    lm = load_quiet(path)
    assert (lm.logits(prompt, canvas) - expected).abs().max().item() <= 1e-4
    lm.save(tmp_path / "saved")
    assert (load_quiet(tmp_path / "saved").logits(prompt, canvas) - expected).abs().max().item() <= 1e-4


def test_untied_checkpoint_with_weights_of_its_own_is_refused(tmp_path):
    _untied_reference(tmp_path, same_weights=False)
    with pytest.raises(Exception, match="tie_word_embeddings is false and .* differs from"):
        load_quiet(tmp_path)


def test_untied_checkpoint_whose_copies_equal_the_decoder_loads_exactly(tmp_path):
    ref = _untied_reference(tmp_path, same_weights=True)
    g = torch.Generator().manual_seed(1)
    prompt, canvas = torch.randint(0, 96, (2, 9), generator=g), torch.randint(0, 96, (2, 8), generator=g)
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (load_quiet(tmp_path).logits(prompt, canvas) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("listed, want", [([7, 3], [7, 3]), (None, [1])])
def test_eos_ids_are_generation_configs_when_it_names_them(tmp_path, listed, want):
    """As in the reference, generation_config.json's eos_token_id is the whole set; without one, the model's."""
    lm = blockpress.random_model(ModelConfig.preset("tiny"), seed=0)
    lm.save(tmp_path)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.pop("eos_token_id", None)
    if listed is not None:
        gen["eos_token_id"] = listed
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert load_quiet(tmp_path)._eos_ids() == want


@pytest.mark.parametrize("name", blockpress.shipped_models())
def test_shipped_generation_configs_load_in_the_reference(name):
    """The reference's generation config refuses keys it does not know; blockpress's own live beside it."""
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    lm = load_quiet(name)
    ref = gen.DiffusionGemmaGenerationConfig.from_pretrained(lm.path)
    defaults = lm.sampler_defaults
    assert ref.max_denoising_steps == defaults.max_denoising_steps
    written = json.loads((lm.path / "generation_config.json").read_text())
    for key in ("t_min", "t_max"):  # the reference reads what the file says; where it says nothing, both default
        assert getattr(ref, key) == written.get(key) and getattr(defaults, key) == written.get(key, getattr(SamplerConfig(), key))
    assert ref.sampler_config is None or ref.sampler_config.entropy_bound == defaults.entropy_bound


def test_saved_sampler_settings_split_between_the_two_files(tmp_path):
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    lm = blockpress.random_model(ModelConfig.preset("tiny"), seed=0)
    settings = dict(sampler="greedy", entropy_bound=0.03, keep_accepted=True, frequency_penalty=0.5,
                    noise_token_id=5, t_min=0.2, t_max=0.6, max_denoising_steps=12)
    lm.generation_config.update(settings)
    lm.save(tmp_path / "a")
    ref = gen.DiffusionGemmaGenerationConfig.from_pretrained(tmp_path / "a")  # raised "Unexpected kwargs" before
    assert (ref.sampler_config.entropy_bound, ref.t_min, ref.t_max, ref.max_denoising_steps) == (0.03, 0.2, 0.6, 12)
    own = json.loads((tmp_path / "a" / "blockpress_generation_config.json").read_text())
    assert own == {k: settings[k] for k in ("sampler", "keep_accepted", "frequency_penalty", "noise_token_id")}
    again = load_quiet(tmp_path / "a")
    assert again.sampler_defaults == lm.sampler_defaults
    # Saving settings the reference knows alone leaves no stale file of blockpress's own behind.
    again.generation_config = {k: v for k, v in again.generation_config.items() if k not in own}
    again.save(tmp_path / "a")
    assert not (tmp_path / "a" / "blockpress_generation_config.json").exists()
    assert load_quiet(tmp_path / "a").sampler_defaults.sampler == "entropy_bound"


def test_generation_config_written_before_the_split_reads_the_same(tmp_path):
    lm = blockpress.random_model(ModelConfig.preset("tiny"), seed=0)
    lm.save(tmp_path)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.update(sampler="topk", rank_by="margin", entropy_bound=0.07)  # blockpress's keys, one file, as saved before
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    defaults = load_quiet(tmp_path).sampler_defaults
    assert (defaults.sampler, defaults.rank_by, defaults.entropy_bound) == ("topk", "margin", 0.07)


def test_a_forced_full_last_layer_takes_the_full_layers_shape():
    """All-sliding layer_types: the reference forces the last layer to full before deriving per-layer shapes."""
    with pytest.warns(UserWarning, match="last layer must be full"):
        cfg = ModelConfig.tiny(num_hidden_layers=2, layer_types=["sliding_attention"] * 2)
    last = cfg.text.layers[-1]
    assert (last.kind, last.head_dim, last.num_kv_heads) == ("full_attention", cfg.text.global_head_dim,
                                                             cfg.text.num_global_key_value_heads)


def test_saving_keeps_the_eos_set_a_model_stops_on(tmp_path):
    """Only the model's id was written when generation_config named none (a reload lost the tokenizer's EOS),
    and the tokenizer's union overwrote a set that generation_config did name (a reload gained ids)."""
    from blockpress.tokenizer import Tokenizer

    code = blockpress.lm.MODELS_DIR / "blockpress-code"
    lm = blockpress.random_model(ModelConfig.tiny(vocab_size=8192), seed=0, tokenizer=Tokenizer.from_dir(code))
    lm.generation_config.pop("eos_token_id", None)
    in_memory = lm._eos_ids()
    assert len(in_memory) > 1  # the model's EOS and the tokenizer's end-of-turn
    lm.save(tmp_path / "a")
    assert load_quiet(tmp_path / "a")._eos_ids() == in_memory
    shipped = load_quiet("blockpress-code")
    shipped.generation_config["eos_token_id"] = 1  # only <eos> ends a row now
    shipped.save(tmp_path / "b")
    assert load_quiet(tmp_path / "b")._eos_ids() == [1]


def test_sampler_settings_the_reference_would_refuse_stay_in_blockpress_file(tmp_path):
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    lm = load_quiet("blockpress-code")
    lm.generation_config.update(entropy_bound=1, t_min=0.5, t_max=0.5, confidence_threshold=1)
    assert lm.sampler_defaults.entropy_bound == 1  # blockpress's key wins over the shipped sampler_config
    lm.save(tmp_path)
    ref = gen.DiffusionGemmaGenerationConfig.from_pretrained(tmp_path)  # refused t_max == t_min and int numbers
    assert ref.sampler_config.entropy_bound == 1.0 and ref.t_min is None and ref.confidence_threshold == 1.0
    again = load_quiet(tmp_path).sampler_defaults
    assert (again.entropy_bound, again.t_min, again.t_max, again.confidence_threshold) == (1, 0.5, 0.5, 1)


@pytest.mark.parametrize("sampler_config", [{"entropy_bound": 0.25}, {"entropy_bound": 1}, {}])
@pytest.mark.parametrize("where", ["python", "file"])
def test_a_sampler_config_without_a_class_name_is_saved_as_the_reference_reads_it(ref_checkpoint, tmp_path,
                                                                                  sampler_config, where):
    """blockpress reads a sampler_config without "_cls_name" (set in lm.generation_config, or a hand-written
    generation_config.json) as the one sampler there is; saved as it was, transformers' from_pretrained failed on it
    (TypeError). It is written with the class name now, and one that sets no bound is left out (the defaults agree)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    path = copy_ckpt(ref_checkpoint[0], tmp_path / "src")
    if where == "file":
        gen = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps(dict(gen, sampler_config=sampler_config)))
    lm = load_quiet(path)
    if where == "python":
        lm.generation_config["sampler_config"] = dict(sampler_config)
    lm.save(tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "out").generation_config
    want = lm.sampler_defaults.entropy_bound
    assert want == sampler_config.get("entropy_bound", SamplerConfig().entropy_bound)
    if sampler_config:
        assert ref.sampler_config.entropy_bound == want
    else:  # left out, so the reference runs its default bound, which is blockpress's
        assert "sampler_config" not in json.loads((tmp_path / "out" / "generation_config.json").read_text())
        assert type(ref)._get_default_generation_params()["sampler_config"].entropy_bound == want
    assert load_quiet(tmp_path / "out").sampler_defaults == lm.sampler_defaults


def _with_tied_copies(ref_checkpoint, path, copies):
    """The tiny (tied) reference checkpoint with `copies` (copy name -> decoder tensor name, offset) stored too."""
    path = copy_ckpt(ref_checkpoint[0], path)
    tensors = load_file(path / "model.safetensors")
    for copy, (source, offset) in copies.items():
        tensors[copy] = tensors[source] + offset
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path



@pytest.mark.parametrize("copy, source", [
    ("lm_head.weight", "model.decoder.embed_tokens.weight"),
    ("model.encoder.language_model.layers.0.mlp.up_proj.weight", "model.decoder.layers.0.mlp.up_proj.weight"),
])
def test_a_tied_checkpoint_storing_a_copy_is_checked_against_the_reference(ref_checkpoint, tmp_path, copy, source):
    """With tie_word_embeddings=true transformers unties a stored copy that differs and runs it (logits 20.9
    apart from blockpress's), and blockpress dropped the copy without a word. A copy equal to its decoder tensor
    still loads as the reference; one that differs is refused by name."""
    from transformers import DiffusionGemmaForBlockDiffusion

    same = _with_tied_copies(ref_checkpoint, tmp_path / "same", {copy: (source, 0.0)})
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(same).eval()
    prompt, canvas = torch.randint(0, 96, (2, 9)), torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (load_quiet(same).logits(prompt, canvas) - expected).abs().max().item() <= 1e-4
    differs = _with_tied_copies(ref_checkpoint, tmp_path / "differs", {copy: (source, 0.5)})
    with pytest.raises(blockpress.CheckpointError, match=rf"tie_word_embeddings is true .* {copy!r}.* differs from {source!r}"):
        load_quiet(differs)


def test_the_vision_tensors_saved_are_the_ones_loaded_whatever_became_of_their_files(ref_checkpoint, tmp_path,
                                                                                    monkeypatch):
    """The vision tensors kept for saving were read again by path at save time: after a chdir a relative path named
    another checkpoint (its vision weights were saved, unsaid), a save of another model over the source handed over
    that model's, and after a save over a sharded source had removed its shards every later save failed. The loaded
    tensors are held now; a source deleted since loading changes nothing either."""
    vision = {k: v for k, v in load_file(ref_checkpoint[0] / "model.safetensors").items() if "vision" in k}
    other = tmp_path / "b" / "ck"
    make_reference_at = __import__("reference").make_reference
    make_reference_at(other, seed=7)
    assert not all(torch.equal(load_file(other / "model.safetensors")[k], v) for k, v in vision.items())
    copy_ckpt(ref_checkpoint[0], tmp_path / "a" / "ck")
    monkeypatch.chdir(tmp_path / "a")
    lm = load_quiet("ck")
    monkeypatch.chdir(tmp_path / "b")  # "ck" is now the other checkpoint
    lm.save(tmp_path / "after_chdir")
    lm_b = load_quiet(other)
    lm_b.save(tmp_path / "a" / "ck")  # another model saved over lm's source
    lm.save(tmp_path / "after_replaced")
    shutil.rmtree(tmp_path / "a")
    lm.save(tmp_path / "after_deleted")
    sharded = tmp_path / "sharded"
    __import__("transformers").DiffusionGemmaForBlockDiffusion.from_pretrained(ref_checkpoint[0]).save_pretrained(
        sharded, max_shard_size="20KB")
    lm = load_quiet(sharded)
    lm.save(sharded)  # removes the shards it was loaded from
    lm.save(sharded)
    lm.save(tmp_path / "after_own_shards")
    for name in ("after_chdir", "after_replaced", "after_deleted", "after_own_shards", "sharded"):
        saved = load_file(tmp_path / name / "model.safetensors")
        assert all(torch.equal(saved[k], v) for k, v in vision.items()), name
    lm.passthrough.tensors.clear()  # the text model alone
    lm.save(tmp_path / "text_only")
    assert not any("vision" in k for k in load_file(tmp_path / "text_only" / "model.safetensors"))


def _load_recording(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = blockpress.load(path)
    return lm, [str(w.message) for w in caught if "vision" not in str(w.message)]


def test_derived_rotary_buffers_are_skipped_with_one_warning(lm, ref_checkpoint, tmp_path):
    """Older transformers saved the rotary tables as tensors; transformers loads such a folder, blockpress
    refused it ("unexpected tensor ...rotary_emb.inv_freq")."""
    path = copy_ckpt(ref_checkpoint[0], tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    for name in ("model.decoder.layers.0.self_attn.rotary_emb.inv_freq", "model.decoder.rotary_emb.inv_freq",
                 "model.encoder.language_model.rotary_emb.sliding_attention_inv_freq"):
        tensors[name] = torch.ones(4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    loaded, caught = _load_recording(path)
    assert len(caught) == 1 and "3 derived rotary buffer(s) skipped" in caught[0], caught
    prompt, canvas = torch.randint(0, 96, (1, 7)), torch.randint(0, 96, (1, 8))
    assert torch.equal(loaded.logits(prompt, canvas), lm.logits(prompt, canvas))


def test_missing_layer_scalars_warn_and_load_as_the_reference(ref_checkpoint, tmp_path):
    """They were set to 1 without a word; transformers reports them missing. (It sets a missing decoder scalar to 1
    too; a missing encoder one it leaves uninitialised, so the logits are compared with decoder scalars missing.)"""
    from transformers import DiffusionGemmaForBlockDiffusion

    def without(name, *dropped):
        path = copy_ckpt(ref_checkpoint[0], tmp_path / name)
        tensors = load_file(path / "model.safetensors")
        for key in dropped:
            del tensors[key]
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path

    path = without("decoder", "model.decoder.layers.1.layer_scalar", "model.decoder.layers.3.layer_scalar")
    loaded, caught = _load_recording(path)
    assert len(caught) == 1 and "2 layer_scalar tensor(s) missing (e.g. 'model.decoder.layers.1.layer_scalar')" in caught[0]
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    prompt, canvas = torch.randint(0, 96, (2, 9)), torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (loaded.logits(prompt, canvas) - expected).abs().max().item() <= 1e-4
    encoder = "model.encoder.language_model.layers.2.layer_scalar"
    _, caught = _load_recording(without("encoder", encoder))
    assert len(caught) == 1 and f"1 layer_scalar tensor(s) missing (e.g. {encoder!r})" in caught[0]


@pytest.mark.parametrize("names", [["pytorch_model.bin"], ["pytorch_model-00001-of-00002.bin",
                                   "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"], ["model.pt"]])
def test_a_pickle_checkpoint_is_named_with_how_to_convert_it(ref_checkpoint, tmp_path, names):
    """It read "no model.safetensors or model.safetensors.index.json", as if the folder were the wrong one."""
    path = tmp_path / "c"
    path.mkdir()
    shutil.copy(ref_checkpoint[0] / "config.json", path / "config.json")
    for name in names:
        (path / name).write_bytes(b"not read")  # never unpickled: its name is all that is looked at
    with pytest.raises(FileNotFoundError, match=rf"pickle checkpoint \({names[0]}.*does not load pickles .*"
                                                r"from_pretrained\(folder\)\.save_pretrained\(new_folder\)"):
        blockpress.load(path)


def test_a_trainers_own_pickle_is_not_taken_for_the_checkpoint(ref_checkpoint, tmp_path):
    """training_args.bin beside missing weights is the trainer's, not a checkpoint: the plain message stays."""
    path = tmp_path / "c"
    path.mkdir()
    shutil.copy(ref_checkpoint[0] / "config.json", path / "config.json")
    (path / "training_args.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError) as caught:
        blockpress.load(path)
    message = str(caught.value).replace(str(path), "PATH")  # the test's own folder name holds "pickle"
    assert "no model.safetensors" in message and "pickle" not in message


def test_shard_names_that_leave_the_folder_are_refused(lm, ref_checkpoint, tmp_path):
    """A weight_map entry "../other/model.safetensors" (or an absolute path) read a file outside the checkpoint.
    The name is checked, not where links lead, so folders and shards that are links keep loading."""
    from blockpress.checkpoint import save_model

    other = copy_ckpt(ref_checkpoint[0], tmp_path / "other")
    # (a drive is absolute on Windows: "C:/x" there, and drive-relative "C:x", read from anywhere on that drive)
    for shard in ("../other/model.safetensors", str(other / "model.safetensors"), "sub/../../other/model.safetensors",
                  "C:/Users/someone/model.safetensors", "C:model.safetensors"):
        path = tmp_path / "c"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        shutil.copy(other / "config.json", path / "config.json")
        names = load_file(other / "model.safetensors").keys()
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))
        with pytest.raises(blockpress.CheckpointError, match=rf"mapped to shard '{shard}', which is not a file name inside"):
            load_quiet(path)
    sharded = tmp_path / "sharded"
    save_model(lm.model, sharded, max_shard_bytes=20_000)
    (tmp_path / "linked").symlink_to(sharded)  # a folder that is a link
    linked_files = tmp_path / "linked_files"
    linked_files.mkdir()
    for f in sharded.iterdir():  # shards that are links to files elsewhere
        (linked_files / f.name).symlink_to(f)
    for path in (tmp_path / "linked", linked_files):
        again = load_quiet(path)
        assert all(torch.equal(a, b) for a, b in zip(again.model.parameters(), lm.model.parameters(), strict=True))


@pytest.mark.parametrize("quantize", [None, "int8", "int4", FP8])
@pytest.mark.parametrize("stored, dtype", [("bfloat16", None), ("float32", "bfloat16"), ("float16", "float32")])
def test_a_plans_meta_model_is_the_loaded_model_on_meta(tmp_path, stored, dtype, quantize):
    """plan_model is what both a load and `blockpress info` start from: its meta model must hold, tensor for
    tensor, the names, shapes and dtypes the load leaves (info counts bytes from it)."""
    from blockpress.checkpoint import load_model, plan_model

    blockpress.random_model(ModelConfig.tiny(), dtype=stored).save(tmp_path)
    meta = plan_model(tmp_path, dtype, "cpu", quantize).meta_model()
    loaded, _ = load_model(tmp_path, dtype, "cpu", quantize)
    described = {n: (t.shape, t.dtype) for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
    assert described == {n: (t.shape, t.dtype) for n, t in [*loaded.named_parameters(), *loaded.named_buffers()]}
    assert all(t.device.type == "meta" for t in meta.state_dict().values())


@pytest.mark.parametrize("shard_bytes", [4 << 30, 20_000])  # one file, and shards
def test_a_save_that_fails_part_way_leaves_the_folder_as_it_was(lm, tmp_path, monkeypatch, shard_bytes):
    """Files were written in place: a save killed mid-write left a truncated model.safetensors, and no checkpoint."""
    import blockpress.checkpoint as checkpoint

    checkpoint.save_model(lm.model, tmp_path / "c", max_shard_bytes=shard_bytes)
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    written = []

    def dies_after_part_of_it(tensors, filename, metadata=None):  # half a file, then the process "dies"
        written.append(filename)
        if len(written) == 2 or shard_bytes > 20_000:
            Path(filename).write_bytes(b"\0" * 100)
            raise OSError("No space left on device")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", dies_after_part_of_it)
    with torch.no_grad():
        lm.model.embed_tokens.weight.add_(1.0)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_model(lm.model, tmp_path / "c", max_shard_bytes=shard_bytes)
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == before  # no temporary left either
    assert all(Path(f).parent == tmp_path / "c" and Path(f).name.startswith(".") for f in written)


def test_a_save_into_a_new_folder_that_fails_leaves_no_folder_and_names_the_file(tmp_path, monkeypatch):
    """A disk that fills at any file of lm.save (weights, configs, tokenizer) left the new folder behind, empty
    (and its missing parents), and the error said "[Errno 28] No space left on device" naming no file. Now the folders
    the save made are gone, the error names the file, and a folder there before is left as it was."""
    import errno

    from blockpress.files import StagedFiles
    from blockpress.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([""], vocab_size=300)
    lm = blockpress.random_model(ModelConfig.tiny(vocab_size=tokenizer.vocab_size), tokenizer=tokenizer)
    lm.save(tmp_path / "whole")
    real, staged = StagedFiles.write, []

    def fills_at(index):
        def write(self, path, writer):
            staged.append(Path(path))
            if len(staged) - 1 != index:
                return real(self, path, writer)

            def part_then_full(file):
                Path(file).write_bytes(b"\0" * 64)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, path, part_then_full)
        return write

    (tmp_path / "there").mkdir()
    for index in range(len(list((tmp_path / "whole").iterdir()))):  # each file the save writes, in turn
        staged.clear()
        monkeypatch.setattr(StagedFiles, "write", fills_at(index))
        for folder in (tmp_path / "new" / "a" / "b", tmp_path / "there"):
            with pytest.raises(OSError) as caught:
                lm.save(folder)
            assert str(caught.value) == f"{staged[index]}: No space left on device" and staged[index].parent == folder
            assert caught.value.errno == errno.ENOSPC
            staged.clear()
        assert not (tmp_path / "new").exists() and list((tmp_path / "there").iterdir()) == []
    monkeypatch.undo()
    lm.save(tmp_path / "new" / "a" / "b")  # and a save that completes keeps the folders it made
    assert sorted(p.name for p in (tmp_path / "new" / "a" / "b").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir())


def _saved_and_another(tmp_path):
    """A model with a tokenizer saved in tmp_path/c, and another (other weights and settings) to save over it."""
    from blockpress.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["abc def"], vocab_size=300)
    old = blockpress.random_model(ModelConfig.tiny(vocab_size=tokenizer.vocab_size), seed=0, tokenizer=tokenizer)
    old.generation_config = {"max_new_tokens": 7}
    new = blockpress.random_model(ModelConfig.tiny(vocab_size=tokenizer.vocab_size), seed=1, tokenizer=tokenizer)
    new.generation_config = {"max_new_tokens": 9}
    folder = tmp_path / "c"
    old.save(folder)
    return old, new, folder


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "OSError", "OSError later"])
def test_a_save_stopped_while_its_files_move_into_place_is_whole_or_leaves_no_temporary(tmp_path, monkeypatch, stop):
    """A Ctrl-C (or SIGTERM) between two of the commit's renames left the new weights beside the old
    generation_config and tokenizer, loading as one checkpoint, and the staged files not yet moved (a hidden copy
    of the weights among them) stayed. A stop signal now waits for the renames, then stops the save's caller; a
    rename that fails leaves no staged file behind."""
    import signal

    import blockpress.files as files
    from blockpress.stopping import Stopped, stop_signals_interrupt

    old, new, folder = _saved_and_another(tmp_path)
    moves, real = [], os.replace

    def stopped_at_the_second(source, destination):
        moves.append(Path(destination).name)
        if stop.startswith("OSError") and len(moves) == (1 if stop == "OSError" else 2):  # before or after a move
            raise OSError(5, "Input/output error")
        if len(moves) == 2 and not stop.startswith("OSError"):
            signal.raise_signal(getattr(signal, stop))  # delivered here, at once, had nothing deferred it
        return real(source, destination)

    monkeypatch.setattr(files.os, "replace", stopped_at_the_second)
    with stop_signals_interrupt(), pytest.raises(OSError if "OSError" in stop else KeyboardInterrupt) as caught:
        new.save(folder)
    monkeypatch.undo()
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    if stop == "OSError":  # before any move: the old save stands whole
        assert blockpress.load(folder).generation_config["max_new_tokens"] == 7
    if "OSError" in stop:  # (after a move, what was not moved is gone too: only a training save's record finishes it)
        return
    assert isinstance(caught.value, Stopped) == (stop == "SIGTERM") and len(moves) > 3  # after every rename
    back = blockpress.load(folder)
    assert back.generation_config["max_new_tokens"] == 9
    assert torch.equal(back.model.embed_tokens.weight, new.model.embed_tokens.weight)


def test_a_save_whose_commit_fails_part_way_is_undone(tmp_path, monkeypatch):
    """A rename that failed part-way through a save's commit (EIO on its 3rd file) left the new config and weights
    beside the old generation config and tokenizer, which loaded as one checkpoint without a word, and the error
    named no file. The commit is undone now, whichever rename fails: the folder holds the old save's files, byte for
    byte, with no backup or staged file left, and the error names the file; into a new folder, none is left."""
    import errno

    import blockpress.files as files

    old, new, folder = _saved_and_another(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real = os.replace

    def save_failing_at(k, into):
        """new.save(into) with its k-th os.replace failing; the error, or None where it made fewer."""
        calls = []

        def replace(source, destination):
            calls.append(destination)
            if len(calls) == k:
                raise OSError(errno.EIO, "Input/output error")
            return real(source, destination)

        monkeypatch.setattr(files.os, "replace", replace)
        try:
            new.save(into)
        except OSError as exc:
            return exc
        finally:
            monkeypatch.setattr(files.os, "replace", real)
        return None

    for k in range(1, 100):
        if (exc := save_failing_at(k, folder)) is None:
            break
        assert re.match(rf"^{re.escape(str(folder))}/[a-z_]+\.[a-z]+: could not be moved into place \(Input/output "
                        rf"error\); the save was undone: {re.escape(str(folder))} was left as it was$", str(exc)), exc
        assert exc.errno == errno.EIO
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before, k  # the old save, whole, and nothing else
    assert k > 4  # each of its renames failed once, then it saved
    assert blockpress.load(folder).generation_config["max_new_tokens"] == 9
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert "was left as it was" in str(save_failing_at(3, tmp_path / "new" / "c"))
    assert not (tmp_path / "new").exists()  # (a partial new folder was left)


def test_a_commit_that_removes_nested_folders_leaves_no_backup(tmp_path):
    """A folder removed with a folder inside it that the same commit removes: the inner one's backup went aside with
    the outer one, and dropping the backups after the commit raised FileNotFoundError, leaving the outer backup."""
    from blockpress.files import StagedFiles

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f.txt").write_text("x")
    (tmp_path / "a" / "g.txt").write_text("y")
    staged = StagedFiles()
    for path in ("a/b/f.txt", "a/b", "a/g.txt", "a"):
        staged.remove(tmp_path / path)
    with staged:
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_commit_that_cannot_be_undone_says_the_folder_is_incomplete_and_keeps_the_old_file(tmp_path, monkeypatch):
    """When the move that failed is followed by a failure to put a replaced file back, the error says the folder is
    incomplete, names the new file and the backup of the old one, and the backup is kept (the old bytes are there)."""
    import errno

    import blockpress.files as files

    old, new, folder = _saved_and_another(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real = os.replace
    calls = []

    def replace(source, destination):  # the third move into place fails, and so does the undo's first restore
        calls.append(destination)
        if len(calls) in (3, 4):
            raise OSError(errno.EIO, "Input/output error")
        return real(source, destination)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(OSError, match=r"could not be moved into place \(Input/output error\), and the save could "
                                      r"not be undone: .* is incomplete, holding this save's new ") as caught:
        new.save(folder)
    monkeypatch.setattr(files.os, "replace", real)
    assert caught.value.errno == errno.EIO
    kept = re.search(r"\(the one before it kept as (\S+)\)", str(caught.value))
    assert kept is not None, caught.value
    name = kept.group(1)[1:].rsplit(".", 2)[0]  # (".NAME.TAG.bak")
    assert (folder / kept.group(1)).read_bytes() == before[name]


def test_a_commit_stopped_without_waiting_or_without_hard_links_never_mixes_or_loses_files(tmp_path, monkeypatch):
    """Review of the undo: a stop that did not wait for the commit (sys.exit in an app's SIGUSR1 handler, as SLURM
    pre-emption installs) dropped the backups and left the mixed folder; where the file system has no hard links the
    old file was moved aside before the new one came in (a kill between the two: no weights file at all); and a
    sharded save's backups, kept by a commit killed after its moves, stayed for good beside a single-file save."""
    import errno

    import blockpress.files as files

    old, new, folder = _saved_and_another(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real_replace, real_link = os.replace, os.link
    calls = []

    def stopped_at_the_third(source, destination):
        calls.append(destination)
        if len(calls) == 3:
            raise SystemExit("pre-empted")
        return real_replace(source, destination)

    monkeypatch.setattr(files.os, "replace", stopped_at_the_third)
    with pytest.raises(SystemExit):
        new.save(folder)
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # undone: the old save, whole

    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    moved = []

    def watched(source, destination):  # every destination is there, old or new, at every rename
        moved.append(destination)
        assert (folder / "config.json").exists() and (folder / "model.safetensors").exists(), destination
        return real_replace(source, destination)

    monkeypatch.setattr(files.os, "link", no_links)
    monkeypatch.setattr(files.os, "replace", watched)
    new.save(folder)
    assert not any(".bak" in str(p) for p in moved)  # replaced in one rename each, no file moved aside first
    saved = {p.name: p.read_bytes() for p in folder.iterdir()}

    def failing_at_the_third(source, destination):  # and still undone there (the backups are copies)
        moved.append(destination)
        if len(moved) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(source, destination)

    moved.clear()
    monkeypatch.setattr(files.os, "replace", failing_at_the_third)
    with pytest.raises(OSError, match="the save was undone"):
        old.save(folder)
    monkeypatch.setattr(files.os, "replace", watched)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == saved
    monkeypatch.setattr(files.os, "link", real_link)
    monkeypatch.setattr(files.os, "replace", real_replace)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    (folder / f".model-00001-of-00002.safetensors.{gone}-0123abcd.bak").write_bytes(b"old weights")  # a killed commit's
    new.save(folder)
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".bak")]


def test_every_stop_signal_held_back_is_delivered_once_a_ctrl_c_last():
    """Only the first signal a save held back was delivered: a SIGTERM after a Ctrl-C was lost, where the Ctrl-C's
    KeyboardInterrupt was caught (a REPL goes on) and the process then ignored what its scheduler asked."""
    import signal

    from blockpress.stopping import STOP_SIGNALS, interrupts_deferred

    got = []
    previous = {sig: signal.signal(sig, lambda signum, _: got.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with interrupts_deferred(STOP_SIGNALS):
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
                signal.raise_signal(sig)
            assert got == []  # (held back while inside)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert got == [signal.SIGTERM, signal.SIGINT]


def test_a_save_removes_the_temporaries_a_killed_save_of_another_layout_left(lm, tmp_path, monkeypatch):
    """Only the temporary of a name written again was removed: a sharded save killed part-way left its shards'
    beside every later single-file save (gigabytes for a real model)."""
    import blockpress.checkpoint as checkpoint

    def killed_at_the_second_shard(tensors, filename, metadata=None):
        if "00002" in Path(filename).name:
            raise KeyboardInterrupt  # the process stops: no discarding
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", killed_at_the_second_shard)
    killed = checkpoint.StagedFiles()
    with pytest.raises(KeyboardInterrupt):  # (staged into files of the test's: nothing discards them)
        checkpoint.save_model(lm.model, tmp_path / "c", max_shard_bytes=20_000, files=killed)
    monkeypatch.undo()
    blockpress.files.release_tag(killed.tag)  # its save is over, as a killed process's is
    left = {p.name for p in (tmp_path / "c").iterdir()}
    assert f".config.json.{killed.tag}.tmp" in left and any(n.startswith(".model-00002-of-") for n in left)
    for name in (".notes.tmp", ".model-notes.txt"):  # hidden files of the user's own: kept
        (tmp_path / "c" / name).write_text("mine")
    checkpoint.save_model(lm.model, tmp_path / "c")  # one file
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        ".model-notes.txt", ".notes.tmp", "config.json", "model.safetensors"]


def _save_often(job):
    """`lm.save(folder)` `times` times, for a model of `seed`; the errors raised."""
    seed, folder, times = job
    lm = blockpress.random_model(ModelConfig.tiny(), seed=seed)
    errors = []
    for _ in range(times):
        try:
            lm.save(folder)
        except Exception as exc:  # noqa: BLE001 - each is what the test finds
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


@pytest.mark.parametrize("side_by_side", ["threads", "processes"])
def test_saves_into_one_folder_at_once_leave_each_other_alone(tmp_path, side_by_side):
    """Every save staged its files under fixed names (.config.json.tmp), and first deleted one found there as a
    killed save's: two saves into one folder at once (fork Pool workers, two runs on one --out) deleted and moved
    each other's, and most raised FileNotFoundError. Each save names its files by a tag of its own now: none fails,
    none leaves a file behind, and the folder loads as one save's weights, whole."""
    import concurrent.futures
    import multiprocessing

    if side_by_side == "processes" and not hasattr(os, "fork"):
        pytest.skip("fork")
    folder = tmp_path / "shared"
    jobs = [(1, folder, 8), (2, folder, 8)]
    if side_by_side == "threads":
        with concurrent.futures.ThreadPoolExecutor(2) as threads:
            done = list(threads.map(_save_often, jobs, timeout=60))
    else:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            done = pool.map_async(_save_often, jobs, chunksize=1).get(timeout=60)
    assert [error for errors in done for error in errors] == []
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    saved = blockpress.load(folder).model.state_dict()
    assert any(all(torch.equal(saved[name], weight) for name, weight in
                   blockpress.random_model(ModelConfig.tiny(), seed=seed).model.state_dict().items())
               for seed in (1, 2))


def test_a_save_removes_the_temporaries_of_saves_whose_process_is_gone(tmp_path):
    """A killed save's temporaries are removed by the next save of their names, those of a save still running
    (another process's) kept: of a gone process, and of versions before tags (one fixed name), removed."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=30)
    folder = tmp_path / "c"
    folder.mkdir()
    running, killed = f".config.json.{os.getppid()}-0123abcd.tmp", f".config.json.{gone.stdout.strip()}-0123abcd.tmp"
    backup = f".model.safetensors.{gone.stdout.strip()}-0123abcd.bak"  # kept by a save killed in its commit
    for name in (running, killed, backup, ".config.json.tmp", ".model.safetensors.tmp"):
        (folder / name).write_text("half a save")
    blockpress.random_model(ModelConfig.tiny(), seed=0).save(folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        running, "config.json", "generation_config.json", "model.safetensors"]


def test_save_metadata_is_read_back_and_checked(lm, tmp_path):
    from blockpress.checkpoint import MappedSafetensors, checkpoint_files, save_model

    save_model(lm.model, tmp_path / "c", max_shard_bytes=20_000, metadata={"blockpress_train_step": "7"})
    files = checkpoint_files(tmp_path / "c")
    assert len(files) > 1 and all(MappedSafetensors(f).metadata["blockpress_train_step"] == "7" for f in files)
    with pytest.raises(ValueError, match="metadata: expected a dict of str -> str"):
        save_model(lm.model, tmp_path / "d", metadata={"step": 7})


def test_attention_biases_save_into_the_reference(tmp_path):
    """attention_bias: true: both sides' biases (the reference does not tie the encoder's to the decoder's) go out
    under the reference's names, and it loads them with nothing missing or left over."""
    from reference import make_reference
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = make_reference(tmp_path / "ref", seed=5, attention_bias=True)
    lm = load_quiet(tmp_path / "ref")
    assert lm.num_parameters(active=False) == sum(p.numel() for p in lm.model.parameters())
    lm.save(tmp_path / "out")
    ref2, info = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    saved, original = ref2.state_dict(), ref.state_dict()
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
    g = torch.Generator().manual_seed(0)
    prompt, canvas = torch.randint(0, 96, (2, 13), generator=g), torch.randint(0, 96, (2, 8), generator=g)
    with torch.no_grad():
        expected = ref2.eval()(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (lm.logits(prompt, canvas) - expected).abs().max().item() <= 1e-4


def test_attention_biases_start_at_zero_and_survive_quantizing():
    """A fresh biased model starts with zero biases (as the reference's init), and quantizing keeps them exact."""
    lm = blockpress.random_model(ModelConfig.tiny(attention_bias=True), seed=1)
    biases = {k: v.clone() for k, v in lm.model.state_dict().items() if "bias." in k}
    assert biases and all(torch.equal(v, torch.zeros_like(v)) for v in biases.values())
    with torch.no_grad():
        for k in biases:
            lm.model.get_parameter(k).normal_()
    biases = {k: v.clone() for k, v in lm.model.state_dict().items() if "bias." in k}
    lm.quantize("int8")
    assert all(torch.equal(lm.model.state_dict()[k], v) for k, v in biases.items())


def test_yarn_truncate_false_is_said_to_be_ignored():
    """The reference ignores `truncate` for DiffusionGemma, and so does blockpress (tests/test_parity.py runs one):
    a config asking for it is told so rather than silently given the rounded ramp."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                               "original_max_position_embeddings": 16, "truncate": False}}
    with pytest.warns(UserWarning, match="full_attention.truncate: false is ignored, as the reference ignores it"):
        ModelConfig.tiny(rope_parameters=rope)


def test_a_load_or_a_profile_does_not_import_torchs_compiler():
    """Building the model on the meta device ran nn.Embedding's normal_ init and the rotary frequencies' arithmetic
    through torch's Python reference ops, whose first call imports torch._dynamo: each process's first load (every
    CLI run's) took 1.5-3.5 s longer on a 2-core CPU, for values the load replaces. A fresh process loads, builds a
    random model and decodes without it (a compile still imports it, when asked for).
    torch.profiler.profile's start imported torch._inductor and torch._dynamo too (`hasattr(torch, "_inductor")`):
    each process's first profile (`bench`'s matmul floor, gpu_bench, profile_train_step) took 3.7 s longer on a
    loaded 2-core CPU. The same process then profiles a decoding, which still counts its ops, without it."""
    import subprocess
    import sys

    code = ("import sys, torch, blockpress\n"
            "from blockpress.bench import _gemm_ms_per_step, profile_ops\n"
            "tiny = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)\n"
            "lm = blockpress.load(sys.argv[1]) if sys.argv[1] else tiny\n"
            "lm.generate('x', max_new_tokens=4, max_denoising_steps=2, seed=0)\n"
            "print('torch._dynamo' in sys.modules)\n"
            "ops = profile_ops(lambda: tiny.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4,\n"
            "                                        max_denoising_steps=2, seed=0), torch.device('cpu'))\n"
            "gemm = _gemm_ms_per_step(tiny, torch.tensor([[5, 6, 7]]), passes=1)\n"
            "print(ops['aten_ops'], gemm > 0, 'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules)\n")
    shipped = blockpress.shipped_models()
    model = shipped[0] if shipped else ""  # random weights alone where the package ships no model
    r = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    loaded, profiled = r.stdout.splitlines()
    assert loaded == "False"
    aten_ops, gemm_timed, dynamo, inductor = profiled.split()
    assert int(aten_ops) > 50 and gemm_timed == "True"
    assert (dynamo, inductor) == ("False", "False")


def _past_float16(dtype=torch.float32, value=1e5, tokenizer=None):
    """A tiny model whose one weight is `value` (1e5: past float16's 65,504)."""
    lm = blockpress.random_model(ModelConfig.preset("tiny"), seed=0, dtype=dtype, tokenizer=tokenizer)
    with torch.no_grad():
        lm.model.layers[1].mlp.down_proj.weight[2, 3] = value
    return lm


FLOAT16_REFUSAL = (r"dtype: {name} holds a value of magnitude {magnitude}, past float16's range \(65,504 at most\), where "
                   r"the cast to float16 makes it inf; {outcome}\. Use bfloat16 .* or float32$")


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_weights_past_float16_are_refused_by_load_to_and_save(tmp_path, stored):
    """Loading into float16, lm.to(float16) and saving as float16 wrote a weight of 1e5 as inf, without a word (then
    NaN logits, or a checkpoint of infs); each now refuses, naming the tensor and its magnitude, and leaves the
    model and the destination as they were."""
    lm = _past_float16(stored)
    lm.save(tmp_path / "m")
    held = lm.model.layers[1].mlp.down_proj.weight[2, 3].detach()  # 1e5 as `stored` holds it (bf16: 99,840)
    refusal = functools.partial(FLOAT16_REFUSAL.format, magnitude=f"{float(held):,.6g}")
    hf_name = re.escape("model.decoder.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=refusal(
            name=hf_name, outcome=f"nothing was loaded from {re.escape(str(tmp_path / 'm'))}")):
        load_quiet(tmp_path / "m", dtype="float16")
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    for cast in (lambda: lm.to(dtype=torch.float16), lambda: lm.model.half()):
        with pytest.raises(ValueError, match=refusal(
                name=re.escape("layers.1.mlp.down_proj.weight"), outcome="nothing was cast")):
            cast()
    after = lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    with pytest.raises(ValueError, match=refusal(
            name=hf_name, outcome=f"nothing was written to {re.escape(str(tmp_path / 'half'))}")):
        lm.save(tmp_path / "half", dtype="float16")
    assert not (tmp_path / "half").exists()
    for dtype in (torch.bfloat16, torch.float32):  # the ways out it names: both load the value
        assert load_quiet(tmp_path / "m", dtype=dtype).model.layers[1].mlp.down_proj.weight[2, 3] == held.to(dtype)


def test_a_float16_load_quantized_refuses_a_weight_its_matmuls_would_rebuild_as_inf(tmp_path):
    """int8 and int4 weights are rebuilt from codes and scales in the model's dtype: in float16 a weight of 1e5 was
    inf on every call (NaN logits, blamed on the activations), quantized on load or stored quantized, while the plain
    float16 load refuses it by name. Refused alike; one in range loads."""
    lm = _past_float16(torch.float32)
    lm.save(tmp_path / "m")
    name = re.escape("model.decoder.layers.1.mlp.down_proj.weight")
    for scheme in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"^dtype: {name} holds a value of magnitude 100,000"):
            load_quiet(tmp_path / "m", dtype="float16", quantize=scheme)
        lm.quantized_copy(scheme).save(tmp_path / scheme)
        with pytest.raises(ValueError, match=f"^dtype: {name} holds a value of magnitude "):
            load_quiet(tmp_path / scheme, dtype="float16")
    with torch.no_grad():
        lm.model.layers[1].mlp.down_proj.weight[2, 3] = 6e4  # (int4's codes run -7..7: 8 x its scale would not fit)
    lm.model.weights_changed()
    for scheme in ("int8", "int4"):
        lm.quantized_copy(scheme).save(tmp_path / f"fits-{scheme}")
        fits = load_quiet(tmp_path / f"fits-{scheme}", dtype="float16")
        canvas = torch.full((1, fits.config.canvas_length), 3)
        assert torch.isfinite(fits.logits(torch.tensor([[2, 5, 7]]), canvas)).all()


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(st.floats(min_value=6e4, max_value=7e4) | st.sampled_from([65504.0, 65519.99, 65520.0, 1e38]), st.booleans())
def test_a_cast_is_refused_exactly_where_float16_would_hold_inf(value, negative):
    """The line is where the cast itself makes inf (65,520 and up round to it; 65,504 < x < 65,520 round down to
    65,504), as torch's own cast says, whatever the sign; a weight that holds inf already is not the cast's doing."""
    value = -value if negative else value
    lm = _past_float16(value=value)
    held = lm.model.layers[1].mlp.down_proj.weight[2, 3].detach()
    overflows = bool(torch.isinf(held.half()))
    try:
        lm.to(dtype=torch.float16)
    except ValueError as exc:
        assert overflows and f"magnitude {abs(float(held)):,.6g}," in str(exc)
    else:
        assert not overflows and lm.dtype == torch.float16
        assert torch.isfinite(lm.model.layers[1].mlp.down_proj.weight).all()


def test_a_weight_that_holds_inf_already_is_judged_by_its_finite_values():
    """inf stored (a damaged checkpoint: model_logits_fault names it when it decodes) is no overflow of the cast, but
    a finite value past float16's range beside it still is."""
    lm = _past_float16(value=float("inf"))
    lm.to(dtype=torch.float16)
    assert torch.isinf(lm.model.layers[1].mlp.down_proj.weight[2, 3])
    lm = _past_float16(value=float("nan"))
    with torch.no_grad():
        lm.model.layers[1].mlp.down_proj.weight[0, 0] = -1e5
    with pytest.raises(ValueError, match="down_proj.weight holds a value of magnitude 100,000,"):
        lm.to(dtype=torch.float16)


def test_the_cli_refuses_a_float16_load_past_its_range_in_one_line(tmp_path, capsys):
    from blockpress.cli import main
    from blockpress.tokenizer import train_bpe_tokenizer

    _past_float16(tokenizer=train_bpe_tokenizer([""], 300)).save(tmp_path)
    assert main(["generate", "hello", "--model", str(tmp_path), "--dtype", "float16", "--no-live",
                 "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err  # (a note may come first: this CPU emulates float16)
    assert err.splitlines()[-1].startswith("blockpress generate: error: --dtype: model.decoder.layers.1.mlp.down_proj"
                                           ".weight holds a value of magnitude 100,000, past float16's range")
    assert "Traceback" not in err and err.count("error") == 1
@pytest.mark.parametrize("name", ["num_experts", "top_k_experts", "moe_intermediate_size"])
def test_the_expert_sizes_are_hinted_as_the_integers_they_must_be(name):
    """TextConfig hinted the experts' sizes `int | None`, so a type checker took num_experts=None, which the config
    refuses (every DiffusionGemma layer has experts), and read cfg.text.num_experts as maybe None (mypy: 'Unsupported
    operand types for * ("int" and "None")' at each use): the hint is int, and None is refused by name."""
    import typing

    from blockpress.config import TextConfig

    assert typing.get_type_hints(TextConfig)[name] is int
    with pytest.raises(ConfigError, match=f"text_config.{name}: expected a positive integer"):
        ModelConfig.tiny(**{name: None})


def test_text_config_resolved_fields_and_kinds():
    """The fields __post_init__ draws read back drawn (kinds once each, in layer order), and one set back to None
    afterwards is refused by name rather than read as a missing list."""
    from blockpress.config import FULL, SLIDING, TextConfig

    text = TextConfig(num_hidden_layers=7, layer_types=None)  # the default pattern: full every sixth, and last
    assert text.resolved_layer_types == [SLIDING] * 5 + [FULL, FULL]
    assert text.kinds == [SLIDING, FULL]
    assert set(text.resolved_per_layer_config) == {"5", "6"}
    assert set(text.resolved_rope_parameters) == {SLIDING, FULL}
    assert ModelConfig.tiny(layer_types=[FULL, SLIDING, FULL]).text.kinds == [FULL, SLIDING]
    for name in ("layer_types", "per_layer_config", "rope_parameters"):
        broken = TextConfig(num_hidden_layers=7)
        setattr(broken, name, None)
        with pytest.raises(ConfigError, match=f"text_config.{name}: None after construction"):
            broken.validate()


# google/diffusiongemma-26B-A4B-it's config.json with every key it has, as transformers 5.8 wrote it (the full layers'
# shape as global_head_dim / num_global_key_value_heads, no per_layer_config; a complete vision_config), shrunk;
# its generation_config.json as published. Its shard index names every decoder tensor, the encoder's layer_scalars
# alone (the rest is tied to the decoder), the vision tower (std_bias / std_scale too), no lm_head, in bf16.
PUBLISHED_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "dtype": "bfloat16", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "global_head_dim": 16, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 40,
    "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
    "max_position_embeddings": 262144, "model_type": "diffusion_gemma_text", "moe_intermediate_size": 16,
    "num_attention_heads": 4, "num_experts": 4, "num_global_key_value_heads": 1, "num_hidden_layers": 6,
    "num_key_value_heads": 2, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    "sliding_window": 6, "tie_word_embeddings": True, "top_k_experts": 2, "use_bidirectional_attention": "vision",
    "vocab_size": 128,
}
PUBLISHED_VISION = {
    "_name_or_path": "", "architectures": None, "attention_bias": False, "attention_dropout": 0.0,
    "chunk_size_feed_forward": 0, "default_output_length": 280, "dtype": "bfloat16", "global_head_dim": 8,
    "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 16, "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "initializer_range": 0.02, "intermediate_size": 32, "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "max_position_embeddings": 131072, "model_type": "gemma4_vision",
    "num_attention_heads": 2, "num_hidden_layers": 1, "num_key_value_heads": 2, "output_attentions": False,
    "output_hidden_states": False, "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 64,
    "problem_type": None, "return_dict": True, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}, "standardize": True, "use_clipped_linears": False,
}
PUBLISHED_CONFIG = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "boi_token_id": 120, "canvas_length": 8, "dtype": "bfloat16",
    "eoi_token_id": 121, "eos_token_id": [1, 106 % 128], "image_token_id": 122, "initializer_range": 0.02,
    "model_type": "diffusion_gemma", "text_config": PUBLISHED_TEXT, "tie_word_embeddings": True,
    "transformers_version": "5.8.0.dev0", "vision_config": PUBLISHED_VISION, "vision_soft_tokens_per_image": 280,
}
PUBLISHED_GENERATION = {
    "confidence_threshold": 0.005, "eos_token_id": [1, 106, 50], "max_denoising_steps": 48, "max_new_tokens": 256,
    "pad_token_id": 0, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "stability_threshold": 1, "t_max": 0.8, "t_min": 0.4, "transformers_version": "5.8.0.dev0",
}
_PUBLISHED_STORED = re.compile(r"model\.decoder\.|model\.encoder\.(vision_tower|embed_vision)\.|"
                               r"model\.encoder\.language_model\.layers\.\d+\.layer_scalar$")


def _published_layout(folder):
    """A tiny checkpoint laid out as the published one; returns the reference's from_pretrained of it, in float32."""
    from reference import perturbed
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PUBLISHED_CONFIG))
    (folder / "generation_config.json").write_text(json.dumps(PUBLISHED_GENERATION))
    torch.manual_seed(3)
    ref = perturbed(DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig.from_pretrained(folder)).eval(), 3)
    stored = {k: v.to(torch.bfloat16).contiguous() for k, v in ref.state_dict().items() if _PUBLISHED_STORED.match(k)}
    names = sorted(stored)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: stored[k] for k in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.nbytes for t in stored.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiffusionGemmaForBlockDiffusion.from_pretrained(folder, dtype=torch.float32).eval()


def test_a_checkpoint_laid_out_as_the_published_one_loads_as_the_reference_reads_it(tmp_path):
    """Every key of the published config.json is read or knowingly kept, every tensor name of its index maps, and
    its generation_config.json's settings are the ones the reference reads (checked against the real files' copies
    in public repositories, by hand; their keys, names and values are reproduced here, shrunk)."""
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    ref = _published_layout(tmp_path / "published")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = blockpress.load(tmp_path / "published", dtype="float32")
    assert [str(w.message) for w in caught if "vision tensors" not in str(w.message)] == []
    # (named_parameters lists each tied tensor once)
    assert lm.config.num_parameters() == sum(p.numel() for n, p in ref.named_parameters() if "vision" not in n)
    g = torch.Generator().manual_seed(0)
    prompt, canvas = torch.randint(0, 128, (2, 11), generator=g), torch.randint(0, 128, (2, 8), generator=g)
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (lm.logits(prompt, canvas) - expected).abs().max().item() <= 1e-4
    theirs = gen.DiffusionGemmaGenerationConfig.from_pretrained(tmp_path / "published")
    ours = lm.sampler_defaults
    assert (ours.max_denoising_steps, ours.t_max, ours.t_min, ours.stability_threshold, ours.confidence_threshold,
            ours.entropy_bound) == (theirs.max_denoising_steps, theirs.t_max, theirs.t_min, theirs.stability_threshold,
                                    theirs.confidence_threshold, theirs.sampler_config.entropy_bound)
    assert (lm.default_max_new_tokens, lm._eos_ids()) == (theirs.max_new_tokens, theirs.eos_token_id) == (256, [1, 106, 50])


@pytest.mark.parametrize("text, written", [
    ({}, (16, 1)),  # the published config's own two keys
    ({"num_global_key_value_heads": None}, (16, None)),  # full layers with the sliding ones' kv heads
    ({"per_layer_config": {"2": {"head_dim": 16}, "5": {"head_dim": 16}}}, (16, None)),  # as transformers 5.15+ saves
    ({"per_layer_config": {"2": {"head_dim": 16, "num_key_value_heads": 1}, "05": {"head_dim": 16,
                                                                                 "num_key_value_heads": 1}}}, (16, 1)),
    # sliding layers with a shape of their own: the two keys cannot say it, so only per_layer_config is written
    ({"per_layer_config": {str(i): {"num_key_value_heads": 1} for i in (0, 1, 3, 4)}}, None),
])
def test_a_saved_config_gives_the_full_layers_shape_as_the_published_one_does(text, written):
    """blockpress wrote per_layer_config alone, as transformers >= 5.15 saves; the published config.json says the full
    layers' shape with global_head_dim / num_global_key_value_heads, which readers written for it (transformers 5.8,
    converters) look for: without them the reference reads its defaults (512-wide heads). Both are written now, and
    the two alone build the same model in the reference."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    raw = json.loads(json.dumps(PUBLISHED_CONFIG))
    raw["text_config"].update(text)
    cfg = ModelConfig.from_dict(raw)
    saved = cfg.to_dict()["text_config"]
    if written is None:
        assert "global_head_dim" not in saved and "num_global_key_value_heads" not in saved
        return
    assert (saved["global_head_dim"], saved["num_global_key_value_heads"]) == written
    del saved["per_layer_config"]  # read as the published file is: by the two keys alone
    with torch.device("meta"):
        ref = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(**{**raw, "text_config": saved}))
    shapes = []
    for layer in ref.model.decoder.layers:
        head_dim = layer.self_attn.q_proj.weight.shape[0] // saved["num_attention_heads"]
        shapes.append((head_dim, layer.self_attn.k_proj.weight.shape[0] // head_dim))
    assert shapes == [(s.head_dim, s.num_kv_heads) for s in cfg.text.layers]


def test_a_config_whose_per_layer_config_was_set_back_to_none_writes_the_keys_to_draw_it_from():
    """A config edited after construction (layers changed, per_layer_config set back to None so that a new one draws
    it, as tests/test_sudoku_model.py builds its tiny model) failed in to_dict, which read the full layers' shape off
    per_layer_config to write global_head_dim beside it: the two keys it was drawn from are written as they are."""
    cfg = blockpress.ModelConfig.tiny()
    cfg.text.global_head_dim, cfg.text.num_global_key_value_heads = 24, 1
    cfg.text.num_hidden_layers, cfg.text.layer_types = 2, ["sliding_attention", "full_attention"]
    cfg.text.per_layer_config = None
    again = blockpress.ModelConfig.from_dict(cfg.to_dict())
    full = again.text.per_layer_config["1"]
    assert full["head_dim"] == 24 and full.get("num_key_value_heads") == 1
    assert again.text.resolved_layer_types == ["sliding_attention", "full_attention"]


def test_cuda_memory_available_counts_what_torchs_allocator_holds_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    """After earlier work torch keeps freed blocks reserved, outside the driver's free figure; a new cache reuses
    them, so counting the driver's figure alone refused caches (and num_return_sequences batches) that fit."""
    from blockpress.checkpoint import available_bytes

    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gb, 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * gb)
    assert available_bytes(torch.device("cuda", 0)) == 32 * gb
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 50 * gb)  # nothing held unused
    assert available_bytes(torch.device("cuda", 0)) == 2 * gb


def test_a_folder_whose_json_files_were_saved_on_windows_loads_as_the_plain_one(tmp_path):
    """config.json, generation_config.json, tokenizer_config.json and the shards' index saved with a UTF-8 byte-order
    mark (Notepad's "UTF-8 with BOM") and CRLF line endings: json refused each as 'Unexpected UTF-8 BOM', and the
    index was read in the locale's encoding (cp1252 on Windows). Each now loads as the plain file does."""
    from blockpress.checkpoint import save_model

    plain = tmp_path / "plain"
    shutil.copytree(blockpress.lm.MODELS_DIR / "blockpress-code", plain)
    (plain / "model.safetensors").unlink()
    shipped = load_quiet("blockpress-code")
    save_model(shipped.model, plain, max_shard_bytes=8_000_000)
    edited = tmp_path / "edited"
    shutil.copytree(plain, edited)
    names = ("config.json", "generation_config.json", "tokenizer_config.json", "model.safetensors.index.json")
    for name in names:
        (edited / name).write_bytes(b"\xef\xbb\xbf" + (plain / name).read_bytes().replace(b"\n", b"\r\n"))
    a, b = load_quiet(plain), load_quiet(edited)
    assert a.model.config == b.model.config and a.generation_config == b.generation_config
    assert a.tokenizer.chat_template == b.tokenizer.chat_template and a.tokenizer.eos_ids == b.tokenizer.eos_ids
    assert a.tokenizer.bos_id == b.tokenizer.bos_id is not None
    for (n1, p1), (n2, p2) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    # a Latin-1 byte in one is named at its offset in the file, the mark's 3 bytes counted (utf-8-sig's left them out)
    data = (edited / "config.json").read_bytes()
    at = data.index(b'"model_type"') + 1
    (edited / "config.json").write_bytes(data[:at] + "é".encode("latin-1") + data[at:])
    with pytest.raises(ConfigError, match=re.escape(f"{edited / 'config.json'}: not valid JSON (not UTF-8: byte "
                                                    f"0xe9 at byte {at + 1})")):
        load_quiet(edited)


def test_rope_entries_by_layer_type_rule_over_flat_keys_beside_them():
    """transformers 5.15 saves a config whose layer_types hold one kind only with `rope_type: default, rope_theta:
    null` beside the entries by layer type, which its rotary embedding reads alone: blockpress refused such a
    config.json ('full_attention.rope_theta: expected a positive number, got None'); it now reads those entries."""
    by_kind = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    mixed = ModelConfig.tiny(layer_types=["full_attention"] * 3,
                             rope_parameters={**by_kind, "rope_type": "default", "rope_theta": None})
    assert mixed.text.rope_parameters == by_kind
    # a flat dict alone still applies to every layer type
    flat = ModelConfig.tiny(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert flat.text.rope_parameters == {k: {"rope_type": "default", "rope_theta": 500.0} for k in by_kind}


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE")
def test_a_full_disk_in_torch_save_or_safetensors_is_an_oserror_naming_the_file(tmp_path):
    """torch.save and safetensors raise a full disk in their own words, neither an OSError: a training run's save
    ended in torch's "[enforce fail at inline_container.cc] unexpected pos" (20 lines of traceback), a LoRA run's in
    a SafetensorError, and neither said what --out keeps. A file-size limit stands in for the full disk."""
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from safetensors.torch import save_file
        from blockpress.files import StagedFiles
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        big = torch.zeros(1 << 20)  # 4 MB
        for name, writer in (("state.pt", lambda f: torch.save({{"w": big}}, f)),
                             ("a.safetensors", lambda f: save_file({{"w": big}}, str(f)))):
            try:
                with StagedFiles() as files:
                    files.write({str(tmp_path)!r} + "/" + name, writer)
            except OSError as exc:
                print(type(exc).__name__, exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stderr[-2000:]
    assert lines[0].startswith(f"OSError {tmp_path / 'state.pt'}: torch.save could not write it, as when the disk is full")
    assert lines[1].startswith(f"OSError {tmp_path / 'a.safetensors'}: ") and "File too large" in lines[1]
    assert not list(tmp_path.iterdir())  # nothing half-written is left


def test_reference_names_ties_a_layers_weights_but_not_its_biases_or_scalars():
    """The reference's encoder runs the decoder's layer weights (an adapter is written for both names), but each side
    has attention biases and layer scalars of its own: naming the encoder's bias as the decoder's twin would write
    one side's adapter over the other's tensor."""
    from blockpress.checkpoint import reference_names

    assert reference_names("layers.0.self_attn.q_proj.weight") == [
        "model.decoder.layers.0.self_attn.q_proj.weight", "model.encoder.language_model.layers.0.self_attn.q_proj.weight"]
    assert reference_names("layers.0.self_attn.bias.q_proj") == ["model.decoder.layers.0.self_attn.q_proj.bias"]
    assert reference_names("layers.0.self_attn.encoder_bias.q_proj") == [
        "model.encoder.language_model.layers.0.self_attn.q_proj.bias"]
    assert reference_names("layers.1.layer_scalar") == ["model.decoder.layers.1.layer_scalar"]


def test_an_empty_tensor_is_no_float16_overflow():
    """A tensor of no elements has no largest value (torch.aminmax refuses it): it is skipped, and a tensor past
    float16's range beside it is still the one named."""
    from blockpress.checkpoint import check_float16_range

    check_float16_range([("empty", torch.empty(0, 4))], "nothing was cast")
    with pytest.raises(ValueError, match="dtype: big holds a value of magnitude 70,000,"):
        check_float16_range([("empty", torch.empty(0, 4)), ("big", torch.full((2,), 7e4))], "nothing was cast")


def test_stored_dtype_leaves_out_codes_and_reads_other_dtypes_as_float32(tmp_path):
    """A quantized folder's fp8 codes hold most of its bytes, yet its weights are stored in the dtype of the rest
    (its embedding, norms): the codes are left out, or an fp8 folder saved in bf16 reads as float32. A dtype the
    model does not compute in (float64, fp8 without scales) reads as float32. Vision tensors (kept in their own
    dtype, float32 in released checkpoints) are not text weights and do not count."""
    from blockpress.checkpoint import MappedSafetensors, stored_dtype

    def stored(tensors, coded=()):
        path = tmp_path / "model.safetensors"
        save_file(tensors, str(path))
        return stored_dtype([MappedSafetensors(path)], coded)

    codes = "model.decoder.layers.0.mlp.down_proj.weight"
    tensors = {"model.decoder.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
               codes: torch.zeros(16, 16).to(torch.float8_e4m3fn)}
    assert stored(tensors, [codes]) == torch.bfloat16
    assert stored(tensors) == torch.float32  # fp8 with no scales: not a dtype to compute in
    assert stored({"model.decoder.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.float64)}) == torch.float32
    vision = {"model.encoder.vision_tower.patch.weight": torch.zeros(16, 16)}  # kept as stored, not a text weight
    assert stored({**vision, "model.decoder.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}) == torch.bfloat16


def test_an_index_total_size_of_zero_is_a_size(tmp_path):
    """index_total_size reads the index's metadata.total_size as stated, 0 included (shards of empty tensors); only
    what is no byte count (a negative number, a bool, a string) reads as None."""
    from blockpress.checkpoint import index_total_size

    index = tmp_path / "model.safetensors.index.json"
    for total, want in ((0, 0), (12, 12), (-1, None), (True, None), ("12", None)):
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": {}}))
        assert index_total_size(tmp_path) == want


def _cgroup_files(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_the_memory_check_sees_a_containers_cgroup_limit(tmp_path):
    """MemAvailable is the whole host's: in a container (docker --memory, a Kubernetes limit) a model past the
    limit passed the check and the OOM killer ended the process without a word. The tightest limit of the group and
    its parents counts, less what the group uses besides page cache; v2 and v1 layouts."""
    from blockpress.checkpoint import _cgroup_room

    proc = tmp_path / "cgroup"
    proc.write_text("0::/pods/me\n")
    v2 = tmp_path / "v2"
    _cgroup_files(v2 / "pods" / "me", memory_max="max", memory_current="900", memory_stat="anon 700\nfile 200\n")
    _cgroup_files(v2 / "pods", memory_max="1000", memory_current="950", memory_stat="anon 720\nfile 230\n")
    assert _cgroup_room(proc, v2) == 1000 - 950 + 230
    _cgroup_files(v2 / "pods" / "me", memory_max="800")  # the group's own, tighter
    assert _cgroup_room(proc, v2) == 800 - 900 + 200
    _cgroup_files(v2 / "pods" / "me", memory_max="100")  # over its limit already: no room, not a negative one
    assert _cgroup_room(proc, v2) == 0
    proc.write_text("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n")
    v1 = tmp_path / "v1"
    _cgroup_files(v1 / "memory" / "docker" / "abc", memory_limit_in_bytes="2000", memory_usage_in_bytes="1500",
                  memory_stat="cache 10\ntotal_cache 300\n")
    _cgroup_files(v1 / "memory", memory_limit_in_bytes=str(9223372036854771712), memory_usage_in_bytes="9",
                  memory_stat="total_cache 0\n")
    assert _cgroup_room(proc, v1) == 2000 - 1500 + 300
    _cgroup_files(v1 / "memory" / "docker", memory_limit_in_bytes="1000", memory_usage_in_bytes="900",
                  memory_stat="total_cache 0\n", memory_use_hierarchy="1")
    assert _cgroup_room(proc, v1) == 1000 - 900  # a parent's limit bounds its children...
    _cgroup_files(v1 / "memory" / "docker", memory_use_hierarchy="0")
    assert _cgroup_room(proc, v1) == 2000 - 1500 + 300  # ...unless it counts its own tasks alone (v1)
    _cgroup_files(v1 / "memory" / "docker" / "abc", memory_limit_in_bytes=str(9223372036854771712))
    assert _cgroup_room(proc, v1) is None  # no limit that bounds the group
    assert _cgroup_room(tmp_path / "absent", v1) is None


def test_the_memory_check_sees_an_address_space_limit(monkeypatch):
    """Under `ulimit -v` a model past the limit passed the check and torch's allocator failed with its own error
    ("DefaultCPUAllocator: can't allocate memory"); it is refused with the figures first."""
    import resource

    import blockpress

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    limit = status("VmSize") + (64 << 20)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, resource.RLIM_INFINITY)
                        if which == resource.RLIMIT_AS else (resource.RLIM_INFINITY,) * 2)
    cfg = blockpress.ModelConfig.tiny(vocab_size=32768, hidden_size=1024)  # ~150 MB in float32
    with pytest.raises(ValueError, match=r"^random_model: .* needs 0\.1 GB on cpu but 0\.\d GB are available"):
        blockpress.random_model(cfg)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads which files the process maps")
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_save_over_the_folder_loaded_from_where_mapped_files_are_locked(tmp_path, monkeypatch, quantize):
    """Windows refuses to replace a file a process maps, and a CPU load keeps the weights as views of the mapped
    model.safetensors: lm.save into the folder it was loaded from failed as it moved its files into place
    (PermissionError, WinError 1224). Simulated: os.replace refuses a mapped destination, as Windows does."""
    import blockpress
    import blockpress.lm

    def mapped_files():  # (device major, minor, inode) of each mapped file
        with open("/proc/self/maps") as f:
            return {(*(int(n, 16) for n in parts[3].split(":")), int(parts[4]))
                    for parts in map(str.split, f) if len(parts) >= 6 and parts[4] != "0"}

    real_replace = os.replace

    def replace(src, dst, **kw):
        st = os.stat(dst) if os.path.exists(dst) else None
        if st is not None and (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in mapped_files():
            raise PermissionError(13, "[WinError 1224] a user-mapped section is open (simulated)", str(dst))
        return real_replace(src, dst, **kw)

    blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0).save(tmp_path)
    lm = blockpress.load(tmp_path, quantize=quantize)
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    monkeypatch.setattr(blockpress.lm, "MAPPED_FILES_LOCKED", True)
    monkeypatch.setattr(os, "replace", replace)
    lm.save(tmp_path)
    monkeypatch.undo()
    assert all(torch.equal(v, before[k]) for k, v in lm.model.state_dict().items())  # the model kept its values
    again = blockpress.load(tmp_path)
    assert again.quantization == quantize
    assert all(torch.equal(v, before[k]) for k, v in again.model.state_dict().items())


def test_copying_the_mapped_weights_before_a_save_is_refused_where_it_cannot_fit(tmp_path, monkeypatch):
    """The copy that frees the loaded files (Windows) takes the model's bytes: refused with the figures, before a
    byte is copied or written, where they are not free (else torch's allocator failed part-way)."""
    import blockpress
    import blockpress.checkpoint
    import blockpress.lm

    blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0).save(tmp_path)
    lm = blockpress.load(tmp_path)
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    monkeypatch.setattr(blockpress.lm, "MAPPED_FILES_LOCKED", True)
    monkeypatch.setattr(blockpress.checkpoint, "available_bytes", lambda device: 1000)
    with pytest.raises(ValueError, match=r"^save: over the folder the model was loaded from, on Windows, .* needs "):
        lm.save(tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == written
    assert all(not t.untyped_storage().resizable() for t in lm.model.state_dict().values())  # nothing copied


def test_a_config_that_leaves_out_tie_word_embeddings_loads_tied(tmp_path):
    """transformers' default is tied (the LM head is the embedding, as DiffusionGemma is released): a config.json
    that leaves the key out, at the top and in text_config, loads as tied (a default of False would refuse it, the
    checkpoint storing no lm_head.weight). From a mutation hunt (C35)."""
    import blockpress

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    lm.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("tie_word_embeddings", None)
    cfg["text_config"].pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    again = blockpress.load(tmp_path)
    ids = torch.tensor([[2, 5, 6]])
    canvas = torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14]])
    assert torch.equal(again.logits(ids, canvas), lm.logits(ids, canvas))


def test_shards_fill_up_to_their_limit_and_a_large_tensor_stands_alone(lm, tmp_path):
    """A shard takes tensors (in name order) while they fit max_shard_bytes, the limit itself included, and a tensor
    past the limit gets a shard of its own, with no empty shard before it. From a mutation hunt (C37, C38)."""
    from blockpress.checkpoint import local_to_hf, save_model

    names = sorted(local_to_hf(k) for k in lm.model.state_dict())
    sizes = {local_to_hf(k): v.numel() * v.element_size() for k, v in lm.model.state_dict().items()}
    limit = sizes[names[0]] + sizes[names[1]]  # exactly the first two
    save_model(lm.model, tmp_path / "exact", max_shard_bytes=limit)
    index = json.loads((tmp_path / "exact" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[names[0]] == index[names[1]] != index[names[2]]
    save_model(lm.model, tmp_path / "one", max_shard_bytes=1)
    folder = tmp_path / "one"
    shards = [load_file(p) for p in sorted(folder.glob("model-*.safetensors"))]
    assert [len(s) for s in shards] == [1] * len(names)


@pytest.mark.parametrize("source", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_keeps_values_says_whether_a_cast_keeps_every_value(source, target):
    """lm.stored_values (the folder's exact dtype, which quantizing from it names) survives a cast only where the
    cast loses nothing: float64 to float32 rounds, so it must not count as keeping values."""
    from blockpress.lm import keeps_values

    info = torch.finfo(source)
    values = torch.tensor([info.max, info.tiny, info.eps, 1 / 3, -7.123456789], dtype=torch.float64).to(source)
    exact = torch.equal(values.to(target).to(source), values)
    assert keeps_values(source, target) is exact
