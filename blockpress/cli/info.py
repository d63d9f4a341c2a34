"""`blockpress info` (a model counted on the meta device, nothing loaded) and `blockpress quantize` (a quantized
copy written)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from blockpress.cli.common import RANDOM_PREFIX, load_announced, load_model, preset_config
from blockpress.cli.generate import model_heals


def meta_model(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The model `args` names, built on the meta device (shapes, dtypes, no memory) by the plan `blockpress.load`
    carries out on --device (checkpoint.plan_model), and what its folder stores: the safetensors headers only,
    never a tensor's data. (Loading to count would convert a bf16 checkpoint to float32 on a CPU without native bf16:
    four bytes a parameter.)"""
    from blockpress.checkpoint import index_total_size, plan_model, resolve_device, tensor_kind
    from blockpress.lm import LM, read_generation_config, resolve_model, unread_generation_keys

    if args.model.startswith(RANDOM_PREFIX):  # random weights: float32 unless --dtype, as `random_model` makes them
        from blockpress.quantize import fit_cpu_kernels

        device = resolve_device(args.device)  # checked as a load would: the figures are for this device
        lm = load_model(args.model, args.dtype, "meta", args.quantize, args.adapter)
        fit_cpu_kernels(lm.model, device, lm.dtype)  # laid out as on --device (int4's CPU layout holds more scales)
        return lm, dict(checkpoint_dtype=None, dtype_note=None, checkpoint_bytes=None, tied_copies=None)
    path, adapter, quantize = resolve_model(args.model, args.quantize, args.adapter)  # the base, as a load takes it
    if args.adapter is not None and adapter is not None:  # its own run's merged checkpoint refused, another base
        from blockpress.train import check_adapter_pairing  # warned about, as a load

        check_adapter_pairing(adapter, path, quantize)
    plan = plan_model(path, args.dtype, args.device, quantize, weights=False)  # config.json alone works too
    tokenizer = None
    if (path / "tokenizer.json").exists():  # as blockpress.load reads it
        from blockpress.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
    generation = read_generation_config(path, plan.config.text.vocab_size)
    if adapter is not None:
        from blockpress.train import adapter_generation

        generation.update(adapter_generation(adapter))  # as blockpress.load puts them over the base's
    lm = LM(plan.meta_model(), tokenizer, generation, path=path, adapter=adapter,
            unread_said=unread_generation_keys(generation))  # (said by read_generation_config, as in a load)
    if adapter is not None:
        from blockpress.train import check_adapter_base

        check_adapter_base(adapter, lm.model)  # a base of another shape: refused as a load refuses it
    # stored copies of tied weights (untied checkpoints hold them): a load compares their values with the decoder's
    # tensors and refuses one that differs; info reads no data, so it can only count them
    copies = sum(tensor_kind(n)[0] == "copy" for f in plan.files for n in f.keys())
    return lm, dict(checkpoint_dtype=str(plan.stored).removeprefix("torch.") if plan.stored else None,
                    dtype_note=widened_note(plan.widened_from, plan.dtype, bool(plan.files)),
                    # the shards' headers; before they are fetched, what their index says they hold
                    checkpoint_bytes=(sum(f.nbytes(n) for f in plan.files for n in f.keys()) if plan.files
                                      else index_total_size(path)),
                    tied_copies=copies or None)


def widened_note(own: Any, dtype: Any, stored: bool) -> str | None:
    """Why a load computes in `dtype` rather than the checkpoint's `own` (checkpoint.native_dtype), or None when it
    does not: said by `info` alone, not by every command that loads."""
    if own is None:
        return None
    name, wide = str(own).removeprefix("torch."), str(dtype).removeprefix("torch.")
    short = {"bfloat16": "bf16", "float16": "fp16"}.get(name, name)
    isa = "AVX512-FP16 / AMX" if name == "float16" else "AVX512-BF16 / AMX"
    return (f"{'stored' if stored else 'declared'} {name}, computed in {wide}: this CPU has no native {short} "
            f"matmuls ({isa}); --dtype {name} forces it, slower here (lm.save writes {name} back)")


def cmd_info(args: argparse.Namespace) -> int:
    from blockpress.cache import KVCache

    lm, stored = meta_model(args)
    cfg = lm.config
    adapter = None
    if lm.adapter is not None:
        from blockpress.train import describe_adapter

        adapter = describe_adapter(lm.adapter)
    # a LoRA adapter over a quantized base stays unmerged, in float32 (over a float one it is merged: no bytes more)
    adapter_bytes = 4 * adapter["parameters"] if adapter and lm.quantization else 0
    info = dict(
        model=args.model, path=str(lm.path) if lm.path else None, summary=cfg.describe(),
        parameters_total=lm.num_parameters(active=False), parameters_active=lm.num_parameters(active=True),
        # the dtype and bytes the weights would take loaded on --device (with --dtype / --quantize)
        dtype=str(lm.dtype).replace("torch.", ""), quantization=lm.quantization, device=args.device,
        weights_bytes=lm.weights_bytes() + adapter_bytes, adapter=adapter,
        # a sequence's keys and values per token, in the model's dtype: every layer keeps every token (sliding ones
        # too), so a request of N tokens (prompt, answer and a canvas of scratch) takes N times this, per row
        kv_cache_bytes_per_token=KVCache.bytes_per_token(cfg.text, lm.dtype),
        **stored,  # what the folder's safetensors hold (None: no weights in it)
        # the context every "exceed the model's context" error counts against: prompt, cache and canvases
        canvas_length=cfg.canvas_length, max_position_embeddings=cfg.text.max_position_embeddings,
        vocab_size=cfg.text.vocab_size, layers=cfg.text.num_hidden_layers,
        sliding_window=cfg.text.sliding_window, experts=cfg.text.num_experts, top_k=cfg.text.top_k_experts,
        # what a checkpoint may set otherwise than DiffusionGemma's own (each runs as in the reference)
        hidden_activation=cfg.text.hidden_activation, attention_bias=cfg.text.attention_bias,
        rope={kind.removesuffix("_attention"): cfg.text.resolved_rope_parameters[kind].get("rope_type", "default")
              for kind in cfg.text.kinds},
        tokenizer=lm.tokenizer is not None,
        # token_healing: `blockpress generate`'s default (a run fine-tuned on prompts ending in whitespace writes
        # false); eos_token_id: the ids that end a row
        generation_defaults={"max_new_tokens": lm.default_max_new_tokens, **asdict(lm.sampler_defaults),
                             "token_healing": model_heals(lm),
                             "eos_token_id": lm.eos_ids},
    )
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))  # a fixed width would put longer names' colons out of line
        for k, v in info.items():
            print(f"{k:>{width}}: {v}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Load --model quantized with --quantize (each projection as it is read: the full-precision weights are never
    all in memory) and save it to OUT as lm.save writes a quantized model, which every command's --model then loads
    as stored. Everything that can be refused is refused before the load: a 26B takes minutes to read."""
    from blockpress.checkpoint import checkpoint_files, folder_quantization
    from blockpress.files import same_place
    from blockpress.lm import resolve_path
    from blockpress.train import ADAPTER_DIR, is_adapter_folder

    if args.quantize is None:
        raise ValueError("--quantize: required: the scheme to write, int8, fp8 or int4 (`blockpress quantize --help` says what each keeps)")
    source = None  # the folder the weights are read from (random-<preset>: none)
    if args.model.startswith(RANDOM_PREFIX):
        preset_config(args.model[len(RANDOM_PREFIX):], f"--model {args.model}")
    else:
        source = resolve_path(args.model)
        if is_adapter_folder(source) or (not (source / "config.json").is_file()
                                         and is_adapter_folder(source / ADAPTER_DIR)):
            # Merged into the codes, an adapter's update would be rounded to their step, and a QLoRA adapter
            # learned its update over the quantized base, not the full one: either way not the model it was.
            raise ValueError(f"--model {args.model}: a LoRA adapter folder; quantize the model it adapts instead: a "
                             "plain LoRA run's --out holds the merged checkpoint (give that folder), and adapters "
                             "trained over a quantized base (QLoRA) stay apart, loaded over the folder this writes "
                             "(--model THAT_FOLDER --adapter ADAPTER_FOLDER)")
        stored = folder_quantization(source)
        if stored is not None and stored != args.quantize:
            raise ValueError(f"--model {args.model}: stored quantized with {stored} (its codes, not the unquantized "
                             f"weights), so --quantize {args.quantize} cannot be made from it; give the unquantized "
                             f"checkpoint as --model (or --quantize {stored} to copy it as it is)")
    if not args.out.strip():  # Path("") is the current folder: written over with --overwrite
        raise ValueError(f"OUT: expected the folder to write the quantized checkpoint to, got {args.out!r}")
    out = Path(os.path.expanduser(args.out))
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {args.out}: a file, not a folder")
    if source is not None and out.is_dir() and same_place(out, source):  # (runs/base on macOS is runs/Base)
        raise ValueError(f"OUT {args.out}: is the folder --model {args.model} is read from; give another folder "
                         "(the unquantized checkpoint is what a quantization is made from)")
    # a killed save's temporaries alone (StagedFiles') leave a folder as good as empty: the next save replaces them
    held = sorted(p.name for p in out.iterdir() if not (p.name.startswith(".") and p.name.endswith(".tmp"))
                  ) if out.is_dir() else []
    if held and not args.overwrite:
        raise ValueError(f"OUT {args.out}: not empty (holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''});"
                         " give a new or empty folder, or --overwrite to write over the checkpoint it holds")
    if held and not (out / "config.json").is_file():  # --overwrite replaces a checkpoint, not a folder of other files
        raise ValueError(f"OUT {args.out}: --overwrite: holds no checkpoint to write over (no config.json, but "
                         f"{', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); give a new or empty folder")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):  # found now, not after the load
        raise ValueError(f"OUT {args.out}: cannot be written ({existing} is "
                         f"{'not a folder' if not existing.is_dir() else 'not writable'})")

    started = time.perf_counter()
    lm = load_announced(args)
    terminal = sys.stderr is not None and sys.stderr.isatty()
    line = f"writing {args.out} ..."
    if terminal:  # a 15 GB write takes a while too; erased once written, as the loading line is
        print(line, end="", file=sys.stderr, flush=True)
    try:
        lm.save(out)
    except OSError as exc:  # a full disk: the save leaves OUT as it was (StagedFiles), and the error names no path
        raise OSError(f"OUT {args.out}: cannot write it ({exc.strerror or exc})") from None
    finally:
        if terminal:
            print("\r" + " " * len(line) + "\r", end="", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started

    def on_disk(folder: Path) -> int:
        return sum(f.stat().st_size for f in checkpoint_files(folder))

    written, read = on_disk(out), None if source is None else on_disk(source)
    result = dict(out=str(out), model=args.model, source=str(source) if source else None,
                  quantization=lm.quantization,
                  # the one written (a bf16 checkpoint widened to float32 for this CPU saves bf16: LM.widened_from)
                  dtype=str(lm.widened_from or lm.dtype).removeprefix("torch."),
                  bytes=written, source_bytes=read, seconds=round(seconds, 3))
    if args.json:
        print(json.dumps(result))
    else:
        against = f" against {read / 1e6:.1f} MB for {args.model}" if read else ""
        print(f"wrote {out}: {lm.quantization}, {written / 1e6:.1f} MB{against}, in {seconds:.1f} s")
    return 0
