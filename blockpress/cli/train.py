"""`blockpress train`: its flags over --train-config and a resumed run's settings, the data read and summed up,
the Trainer run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blockpress.cli.common import RANDOM_PREFIX, emulated_dtype_note, load_model, preset_config
from blockpress.cli.output import print_warning

if TYPE_CHECKING:
    import torch

    from blockpress.config import ModelConfig
    from blockpress.lm import LM
    from blockpress.tokenizer import Tokenizer
    from blockpress.train import ExampleSource, ShardSource, TrainConfig, Trainer, TrainResult

DEFAULT_HELDOUT = 0.02  # train: the fraction of JSONL examples held out when --heldout is not given


@dataclasses.dataclass
class Settings:
    """A run's settings: `cfg`, and what it was made from: `raw`, the settings given (a resumed run's own, then
    --train-config's, then the flags'), and `saved`, a resumed run's own ({} for a new run)."""

    cfg: TrainConfig
    raw: dict[str, Any]
    saved: dict[str, Any]


@dataclasses.dataclass
class Sources:
    """What a run trains and evaluates on, and its settings (with the --heldout fraction it took, where none was
    given)."""

    source: ExampleSource | ShardSource
    heldout: ExampleSource | ShardSource | None
    cfg: TrainConfig


@dataclasses.dataclass
class Run:
    """A Trainer ready to run, and what its report needs: the settings it runs (--heldout-data recorded whole), and
    the base's dtype and that of the checkpoint a LoRA run merges into."""

    lm: LM
    trainer: Trainer
    cfg: TrainConfig
    base_dtype: torch.dtype
    merged_dtype: torch.dtype


def cmd_train(args: argparse.Namespace) -> int:
    from blockpress.files import lock_folder
    from blockpress.train import _world, init_distributed

    args.device = init_distributed(args.device)  # under torchrun on CUDA: this process's GPU, cuda:LOCAL_RANK
    args.out = os.path.expanduser(args.out)  # --out=~/x reaches us unexpanded (bash expands ~ only at a word's start)
    out = Path(args.out)
    # Every check of the flags comes before the model loads (a checkpoint's load takes minutes), in this order.
    _check_out(args, out)
    # The folder is this run's until it ends (rank 0's: torchrun's other ranks share it): a second run on it (a job
    # resubmitted while the first runs) is refused before it reads or writes anything there; two at once deleted
    # each other's staged files, and both appended to one metrics.jsonl
    # (the process group's rank, not $RANK: one left set in a shell would skip the lock)
    release = lock_folder(out, f"--out {args.out}") if _world()[0] == 0 else lambda: None
    try:
        return _run(args, out)
    finally:
        release()


def _run(args: argparse.Namespace, out: Path) -> int:
    """cmd_train from --resume's check on, with --out held."""
    if args.resume:
        from blockpress.train import check_resumable

        check_resumable(args.out)  # (finishes a save killed while its files moved: in the folder held)
    args.data = _run_data(args, out)
    stale_metrics = _check_new_run(args, out)
    settings = _train_settings(args, out)
    lora_shape = _check_lora_resume(args, settings)
    args.model = _model_to_train(args, out)
    _check_model_flags(args, settings)
    from blockpress.train import check_data_workers

    check_data_workers(settings.cfg.data_workers, "--data-workers")  # before the load, not at the first step
    if (slow := emulated_dtype_note(settings.cfg.dtype, args.device)) is not None:  # (as generate's load says it)
        print(slow, file=sys.stderr, flush=True)
    if args.model:
        lm, cfg = _load_checkpoint(args, settings, lora_shape)
    else:
        lm, cfg = _fresh_model(args, settings.cfg), settings.cfg
    from blockpress.data import folders_listed_once

    with folders_listed_once():  # a folder's checks and reading walk it once, not once each (9 times)
        _check_data_files(args.data, cfg.heldout_data, out)
        # a run saved before --chat-turns existed (0c217e2) trained on each chat's last assistant turn
        old_reading = bool(args.resume and settings.saved) and "chat_turns" not in settings.saved
        sources = _sources(args, lm, cfg, old_reading=old_reading, kept="chat_turns" not in settings.raw)
    run = _start_run(args, lm, sources, stale_metrics)
    _say_what_runs(args, run, sources)
    try:
        result = run.trainer.train()
    except KeyboardInterrupt:  # a second stop signal: at once, this step unsaved; the command's handler says so too
        if run.trainer.rank == 0:  # what the folder holds, which would otherwise go unsaid
            from blockpress.train import TRAINER_STATE_FILE

            saved = (Path(args.out) / TRAINER_STATE_FILE).is_file()
            print(f"\nstopped at once: {args.out} holds the run's last save (continue it with --resume)" if saved
                  else f"\nstopped at once: {args.out} holds no save of this run", file=sys.stderr)
        raise
    if run.trainer.rank == 0:
        _plot_training(Path(args.out), quiet=args.quiet)
    _report(args, run, result)
    return _exit_status(args, run, result)


def _check_out(args: argparse.Namespace, out: Path) -> None:
    """--out can hold the run: a folder, or one that can be made (with --resume, _run checks it holds a run)."""
    if not args.out.strip():  # Path("") is the current folder: the run's files would be written among the user's own
        raise ValueError(f"--out: expected the folder to write the run to, got {args.out!r}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: a file, not a folder")
    # before the model loads: the folder is made only at the first save, minutes later
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {args.out}: cannot be created ({existing} is "
                         f"{'not a folder' if not existing.is_dir() else 'not writable'})")


def _run_data(args: argparse.Namespace, out: Path) -> str:
    """--data, or where it is left out of a resumed run, the data the run in `out` records."""
    if args.data is not None:
        return args.data
    if not args.resume:
        raise ValueError("--data: required (the training data; with --resume, the run's own is read from --out)")
    from blockpress.train import recorded_data

    data = recorded_data(out)
    if data is None:
        raise ValueError(f"--resume: the run in {args.out} does not record its data (a run saved before it was, "
                         "or one a Trainer ran without it); give it again with --data")
    print(f"--resume: training on the run's own data, {data}", file=sys.stderr)
    return data


def _check_new_run(args: argparse.Namespace, out: Path) -> bool:
    """A new run's --out holds no run or checkpoint it would overwrite. Returns whether it holds the metrics.jsonl
    alone of a run that stopped before its first save (nothing to resume; this run starts it over)."""
    if not args.resume and (out / "trainer_state.pt").exists():
        raise ValueError(f"--out {args.out}: already holds a training run (trainer_state.pt); continue it with "
                         "--resume, or give another folder")
    stale_metrics = not args.resume and (out / "metrics.jsonl").is_file()
    if not args.resume and (out / "config.json").exists():  # e.g. --model X --out X: the run would overwrite it
        raise ValueError(f"--out {args.out}: already holds a checkpoint (config.json); give another folder")
    return stale_metrics


def _train_settings(args: argparse.Namespace, out: Path) -> Settings:
    """The run's settings: a resumed run keeps its own, and --train-config and flags given now override them."""
    from blockpress.train import TrainConfig

    raw: dict[str, Any] = resumed_train_config(out) if args.resume else {}
    saved = dict(raw)
    if args.train_config:
        from blockpress.files import read_json_object

        try:
            given = read_json_object(args.train_config, where="--train-config ")
        except OSError as exc:  # Python's own text repeated the path: "[Errno 2] No such file or directory: 'x'"
            why = "is a folder" if Path(args.train_config).is_dir() else exc.strerror or str(exc)
            raise ValueError(f"--train-config {args.train_config}: {why} (expected a JSON object of training "
                             "settings)") from None
        # each value its field's type, before the model loads: the file is named, where from_dict below cannot
        TrainConfig.check_fields(given, where=f"--train-config {args.train_config}: ")
        raw.update(given)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f.name)
        if value is not None:
            raw[f.name] = value
    return Settings(cfg=TrainConfig.from_dict(raw), raw=raw, saved=saved)


def _check_lora_resume(args: argparse.Namespace, settings: Settings) -> Any:
    """A resumed LoRA run can go on (it has not finished, --model is a base it can take), said before the base is
    looked for and loaded (a minute for a quantized one): else a finished LoRA run would say "give --model", then, with
    it, that it has finished. Returns the shape of the base its adapters trained over, checked against the model as soon
    as it loads (None: no such run, or none recorded)."""
    if not (args.resume and settings.saved.get("lora_rank")):
        return None
    from blockpress.train import (
        TRAINER_STATE_FILE,
        check_continues,
        check_lora_resume_model,
        read_trainer_state,
    )

    state = read_trainer_state(Path(args.out) / TRAINER_STATE_FILE, map_location="cpu")
    check_continues(args.out, state, settings.cfg)
    if args.model is not None:
        check_lora_resume_model(args.out, args.model)  # before it loads, and before the data is read with it
    return state.get("base_shape")


def _model_to_train(args: argparse.Namespace, out: Path) -> str | None:
    """--model, or where a resumed run is given neither --model nor --config, the model it goes on from."""
    if not (args.resume and args.model is None and args.config is None):
        return args.model
    from blockpress.train import LORA_BASE_FILE, lora_base

    # A LoRA run to be resumed keeps its adapters apart from the base they adapt, recorded beside them (a run its
    # clock stopped also holds its merged checkpoint, which is not that base).
    if (out / LORA_BASE_FILE).is_file() or not (out / "config.json").is_file():
        if not (out / LORA_BASE_FILE).is_file() and not resumed_train_config(out).get("lora_rank"):
            # a full fine-tune's checkpoint is its config.json and weights (not a LoRA run's adapters)
            raise ValueError(f"--resume: {args.out} holds no config.json, which a full fine-tune saves with its "
                             "weights at every save, so its checkpoint is incomplete; give the model to go on from "
                             "with --model, or start the run again")
        model = lora_base(out)
        if model is None:
            raise ValueError(f"--resume: {args.out} holds a LoRA run's adapters, and not the base model they "
                             "adapt; give it again with --model (or --config)")
        if Path(model).is_absolute() and not Path(model).exists():  # (a folder; shipped names and repo ids are not)
            raise ValueError(f"--resume: the base model this LoRA run adapts, {model} (recorded in "
                             f"{out / LORA_BASE_FILE}), is gone; give it where it is now with --model")
        return model
    # the run's own last checkpoint; Trainer.resume restores the rest. As a path: a folder named as a shipped model
    # ("--out blockpress-code") would be that model, not this folder
    return str(Path(args.out).absolute())


def _check_model_flags(args: argparse.Namespace, settings: Settings) -> None:
    """One model to train, flags that apply to it, and a resumed run's held-out split kept; then the warning that
    names the settings a resumed run changes (after the checks: an error there comes alone)."""
    if (args.model is None) == (args.config is None):
        raise ValueError("give exactly one of --model (fine-tune a checkpoint) or --config (a fresh model)")
    if args.model and args.tokenizer:
        raise ValueError("--tokenizer: only for a fresh model (--config); a checkpoint given by --model brings its own")
    raw, saved = settings.raw, settings.saved
    if args.resume and saved.get("heldout") is not None and raw.get("heldout") != saved["heldout"]:
        # another split would score examples the run already trained on as held out (or train on held-out ones)
        raise ValueError(f"--heldout: the run in {args.out} holds out {saved['heldout']} of its examples; a resumed "
                         "run keeps its split (leave --heldout out, or start a new run)")
    if (args.resume and bool(saved.get("heldout_data")) != bool(raw.get("heldout_data")) and "heldout_data" in raw
            and saved.get("heldout") != 0):
        # a held-out file added to (or dropped from) a run that split --data its own way: another split too, which
        # was refused as "--heldout/--heldout-data: give one of them" with one given (a run that held out none of
        # --data keeps training on all of it: a file to evaluate on changes no split)
        kept = (f"holds out {saved['heldout_data']}" if saved.get("heldout_data") else
                f"holds out {saved.get('heldout', 0)} of --data's examples")
        raise ValueError(f"--heldout-data: the run in {args.out} {kept}; a resumed run keeps its split (leave "
                         "--heldout-data out, or start a new run)")
    if args.resume and saved.get("heldout_data") and raw.get("heldout") not in (None, 0):
        # the mirror: a fraction of --data held out of a run that holds out a file
        raise ValueError(f"--heldout: the run in {args.out} holds out {saved['heldout_data']}; a resumed run keeps "
                         "its split (leave --heldout out, or start a new run)")
    # (--heldout-data is recorded whole, below: the same file typed relative again is no change)
    changed = {k: (saved[k], v) for k, v in raw.items() if k in saved and saved[k] != v
               and not (k == "heldout_data" and v and saved[k] and Path(v).resolve() == Path(saved[k]).resolve())}
    if changed:
        print_warning("--resume: the run's saved settings, except " +
                      ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))


def _load_checkpoint(args: argparse.Namespace, settings: Settings, lora_shape: Any) -> tuple[LM, TrainConfig]:
    """--model loaded to be trained, and the settings it trains with: QLoRA over a base stored quantized, and the
    model's own noise unless the settings name one."""
    # float32 weights unless asked: AdamW steps on bf16 weights round small updates away (a bf16 fine-tune
    # changes about half as many weights as a float32 one). LoRA trains float32
    # adapters, so its frozen base may stay in its own dtype.
    # --quantize: each projection quantized as it is read (QLoRA: the full-precision base never exists at once)
    # (an adapter folder as --model: merged into its base, unquantized unless --quantize says otherwise)
    from blockpress.checkpoint import folder_quantization
    from blockpress.lm import resolve_path
    from blockpress.train import TrainConfig

    cfg, raw = settings.cfg, settings.raw
    stored = (None if cfg.quantize or args.model.startswith(RANDOM_PREFIX)  # (random weights: no folder)
              else folder_quantization(resolve_path(args.model)))
    if stored is not None and cfg.lora_rank:  # QLoRA over it, as --quantize of its scheme would say (recorded
        # with the run and its adapters, so that a resume and a load of them take the same base)
        raw = {**raw, "quantize": stored}
        cfg = dataclasses.replace(cfg, quantize=stored)
        if not args.quiet:
            print(f"--model {args.model}: stored quantized ({stored}); its LoRA adapters train over it as QLoRA "
                  f"(--quantize {stored})", file=sys.stderr)
    elif stored is not None:  # (with --quantize, the load refuses another scheme than the stored one)
        raise ValueError(f"--model {args.model}: stored quantized ({stored}); a full fine-tune needs the "
                         f"unquantized weights; train LoRA adapters over it instead (--lora-rank R: QLoRA), or "
                         "fine-tune the unquantized checkpoint")
    lm = load_model(args.model, cfg.dtype or (None if cfg.lora_rank else "float32"), args.device,
                    cfg.quantize or "none")
    if lora_shape:
        from blockpress.train import shape_differences

        # another base (its recorded one gone) of another shape: said before the data is read with it
        differ = shape_differences(lora_shape, lm.model, "this model")
        if differ:
            raise ValueError(f"--model {args.model}: not of the shape of the base the LoRA run in {args.out} "
                             f"trained its adapters over: {', '.join(differ)}")
    if "noise_token_id" not in raw and "noise_token_id" in lm.generation_config:
        # continue the model's own recipe: an absorbing-noise model fine-tuned with uniform noise forgets it
        cfg = TrainConfig.from_dict({**raw, "noise_token_id": lm.generation_config["noise_token_id"]})
    return lm, cfg


def _fresh_model(args: argparse.Namespace, cfg: TrainConfig) -> LM:
    """A model of random weights of --config's shape, with --tokenizer's vocabulary and special ids where given."""
    import blockpress

    if not args.config.endswith(".json"):
        mcfg = preset_config(args.config, f"--config {args.config}")
    else:
        try:
            mcfg = blockpress.ModelConfig.from_file(args.config)
        except (ValueError, OSError) as exc:  # their messages start with the path, or name a field
            message = str(exc)
            raise ValueError(f"--config {message}" if message.startswith(str(Path(args.config)))
                             else f"--config {args.config}: {message}") from None
    tokenizer = None
    if args.tokenizer:
        tokenizer = _fresh_tokenizer(args)
        mcfg = _with_tokenizer(args, mcfg, tokenizer)
    return blockpress.random_model(mcfg, seed=cfg.seed, dtype=cfg.dtype or "float32", device=args.device,
                                   tokenizer=tokenizer)


def _fresh_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """--tokenizer read: its tokenizer.json, its folder, or a shipped model's name."""
    from blockpress.lm import resolve_path
    from blockpress.tokenizer import Tokenizer

    tokenizer_path = Path(args.tokenizer)
    if tokenizer_path.is_file() and tokenizer_path.name != "tokenizer.json":  # its folder's own would be read
        raise ValueError(f"--tokenizer {args.tokenizer}: expected a tokenizer.json, the folder that holds "
                         "one, or a shipped model's name")
    try:
        return Tokenizer.from_dir(tokenizer_path.parent if tokenizer_path.is_file() else resolve_path(args.tokenizer))
    except (ValueError, OSError) as exc:
        raise ValueError(f"--tokenizer {args.tokenizer}: {exc}") from None


def _with_tokenizer(args: argparse.Namespace, mcfg: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """--config's model config fitted to `tokenizer`: a preset takes its vocabulary, and every config its special
    ids; a tokenizer that does not fit, or names no EOS, is refused."""
    from blockpress.lm import check_tokenizer

    if not args.config.endswith(".json"):  # a preset is a shape; its vocabulary is the tokenizer's
        mcfg = dataclasses.replace(mcfg, text=dataclasses.replace(mcfg.text, vocab_size=tokenizer.vocab_size))
    check_tokenizer(tokenizer, mcfg.text.vocab_size, f"--tokenizer {args.tokenizer}")  # (random_model's check)
    if tokenizer.eos_id is None:  # an example's end is learned as this token: without one, answers never end
        raise ValueError(f"--tokenizer {args.tokenizer}: names no EOS token (eos_token in "
                         "tokenizer_config.json); the model learns to end its answers with it")
    # The saved model's specials must be the tokenizer's: the preset's Gemma ids (pad 0, eos 1, bos 2) would
    # fill the canvases after an answer with whatever token the tokenizer put there.
    eos = tokenizer.eos_ids if len(tokenizer.eos_ids) > 1 else tokenizer.eos_id
    # (an id the tokenizer does not name keeps the config's)
    text = mcfg.text
    return dataclasses.replace(mcfg, text=dataclasses.replace(
        text, eos_token_id=eos,
        bos_token_id=text.bos_token_id if tokenizer.bos_id is None else tokenizer.bos_id,
        pad_token_id=text.pad_token_id if tokenizer.pad_id is None else tokenizer.pad_id))


def _check_data_files(data: str, heldout_data: str | None, out: Path) -> None:
    """--data and --heldout-data can be read as what their first line says they are; files of a folder or glob that
    are not trained on (a README.md beside JSONL files) are said to be left out (but this run's own `out` folder,
    which a run inside its data leaves there: said at every resume, it would tell the user nothing)."""
    from blockpress.data import is_examples, left_out, named_files

    if heldout_data and (both := sorted(named_files(data) & named_files(heldout_data))):
        # its examples would be trained on and then scored as held out, without a word (the same file for both is a
        # way to watch a run fit its data: said, not refused)
        shown = ", ".join(map(str, both[:3])) + (f" and {len(both) - 3} more" if len(both) > 3 else "")
        print_warning(f"--heldout-data {heldout_data}: {shown} {'is' if len(both) == 1 else 'are'} also read by "
                      f"--data {data}, so the held-out data is trained on, and its loss says how well the run fits "
                      "it, not how it does on data it has not seen; give --data the training files alone (a file, "
                      "or a glob that leaves the held-out ones out)")
    for flag, path in (("--data", data), ("--heldout-data", heldout_data)):
        try:
            note = left_out(path, out) if path else None
            # what the data is, read from its first line: an error there (not JSON, not UTF-8) names the flag as one
            # on a later line does (not the file alone, whichever of --data and --heldout-data it was)
            is_examples(path) if path else None
        except ValueError as exc:  # a folder or glob of JSONL and other files; the message starts with the path
            raise ValueError(f"{flag} {exc}") from None
        if note:
            print_warning(f"{flag} {path}: {note}")


def _sources(args: argparse.Namespace, lm: LM, cfg: TrainConfig, old_reading: bool = False,
             kept: bool = True) -> Sources:
    """--data (and --heldout-data) read: JSONL examples, or running text and token shards. `old_reading`: a resumed
    run that predates chat_turns, whose chat records trained on their last assistant turn alone; `kept`: no
    --chat-turns (nor --train-config's) says otherwise now, so the rest of the run reads them so too."""
    from blockpress.data import is_examples

    if is_examples(args.data):
        return _example_sources(args, lm, cfg, old_reading, kept)
    return _shard_sources(args, lm, cfg)


def _examples(path: str, flag: str, lm: LM, cfg: TrainConfig, quiet: bool = False) -> list[Any]:
    """The JSONL examples at `path`, tokenized and checked against the model's context, with a bar of the bytes read
    on a terminal's stderr unless `quiet` (as train_corpus's: 800k records took minutes without a sign); errors name
    `flag`."""
    from blockpress.cli.output import progress_bar
    from blockpress.data import load_jsonl

    bar = progress_bar(desc=f"{flag} reading", unit="B", unit_scale=True, hidden=quiet)

    def advance(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        return load_jsonl(path, lm.tokenizer, lm.config.text.vocab_size, context=(lm.config.canvas_length,
                          lm.config.text.max_position_embeddings, cfg.max_canvases or None),
                          chat_turns=cfg.chat_turns, progress=advance)
    except (ValueError, OSError) as exc:  # missing, unreadable, empty, a bad line: the flag's path (as text's)
        raise type(exc)(f"{flag} {exc}") from None
    finally:
        bar.close()


def _example_sources(args: argparse.Namespace, lm: LM, cfg: TrainConfig, old_reading: bool = False,
                     kept: bool = True) -> Sources:
    """JSONL examples to train on, and those held out: --heldout-data's, or the --heldout fraction of --data.
    `old_reading`, `kept`: see _sources."""
    from blockpress.data import is_examples, split_heldout
    from blockpress.train import ExampleSource

    cfg.check_examples()  # before the examples are read (the Trainer checks again)
    last_turns = old_reading and kept
    if last_turns:  # (prompt/response and ids records read the same either way)
        cfg = dataclasses.replace(cfg, chat_turns="last")
    if cfg.heldout_data:  # the held-out examples are a file of their own
        if not is_examples(cfg.heldout_data):
            raise ValueError(f"--heldout-data {cfg.heldout_data}: not JSONL examples; with JSONL examples as --data, "
                             "held-out examples are a JSONL file of them (or the --heldout fraction of --data)")
        if cfg.heldout:
            raise ValueError("--heldout/--heldout-data: the held-out examples are a fraction of --data or the "
                             "examples of --heldout-data; give one of them")
        train = _examples(args.data, "--data", lm, cfg, args.quiet)
        held = _examples(cfg.heldout_data, "--heldout-data", lm, cfg, args.quiet)
    else:
        fraction = cfg.heldout
        if fraction is None:
            if args.resume:  # a run saved before train_config.json kept it: the split may differ from the run's
                print_warning(f"--resume: the run in {args.out} did not record its --heldout; holding out "
                              f"{DEFAULT_HELDOUT} (give the value it was started with, if another)")
            fraction = DEFAULT_HELDOUT
            cfg = dataclasses.replace(cfg, heldout=fraction)  # saved with the run: --resume keeps the split
        examples = _examples(args.data, "--data", lm, cfg, args.quiet)
        train, held = split_heldout(examples, fraction)  # (none held out: the Trainer says so, once a run)
    chats = any(e.templated for e in (*train, *held))
    if last_turns and chats:  # the rest of the run trains on what its start did, and its saved settings say so
        print_warning(f"--resume: the run in {args.out} began before --chat-turns, on each chat's last assistant "
                      "turn, and goes on so (--chat-turns all trains on every turn)")
    elif last_turns:  # no chats: the reading asked for, which was the default (`kept`)
        cfg = dataclasses.replace(cfg, chat_turns=cfg.default("chat_turns"))
    elif old_reading and chats and cfg.chat_turns != "last":  # asked for now: said, as a changed setting is
        print_warning(f"--resume: the run in {args.out} began before --chat-turns, on each chat's last assistant "
                      f"turn; chat_turns {cfg.chat_turns!r} changes what the rest of it trains on")
    if cfg.chat_turns != cfg.default("chat_turns") and not chats:
        # it would be ignored: prompt/response and ids records are one example each, with no turns to choose
        raise ValueError(f"--chat-turns {cfg.chat_turns}: for JSONL examples of chat `messages`; the examples "
                         "given are prompt/response (or ids) records, one example each, with no turns")
    return Sources(source=ExampleSource(train, cfg.seed), heldout=ExampleSource(held, cfg.seed) if held else None,
                   cfg=cfg)


def _shard_sources(args: argparse.Namespace, lm: LM, cfg: TrainConfig) -> Sources:
    """Running text or token shards to train on, and --heldout-data's to evaluate on."""
    from blockpress.train import ShardSource

    if cfg.heldout:  # it would be ignored: running text has no examples to split
        raise ValueError("--heldout: for JSONL examples (a fraction of them); with raw text or token shards "
                         "give the held-out text or shards with --heldout-data")
    if cfg.chat_turns != cfg.default("chat_turns"):  # it would be ignored: running text has no chats
        raise ValueError(f"--chat-turns {cfg.chat_turns}: for JSONL examples of chat `messages`; running text "
                         "has no turns")
    # each window after the BOS that generate puts before a text prompt (ShardSource)
    bos = lm.tokenizer.bos_id if lm.tokenizer is not None else None
    vocab = lm.config.text.vocab_size
    source = ShardSource(train_corpus(args.data, "--data", lm.tokenizer, vocab, quiet=args.quiet), cfg,
                         lm.config.canvas_length, bos)
    heldout = ShardSource(train_corpus(cfg.heldout_data, "--heldout-data", lm.tokenizer, vocab, quiet=args.quiet),
                          cfg, lm.config.canvas_length, bos) if cfg.heldout_data else None
    return Sources(source=source, heldout=heldout, cfg=cfg)


def _start_run(args: argparse.Namespace, lm: LM, sources: Sources, stale_metrics: bool) -> Run:
    """The Trainer built (its checks are the last a run is refused by), the stale metrics of a run that never saved
    replaced, and a resumed run's state restored."""
    from blockpress.train import ExampleSource, Trainer

    cfg, source = sources.cfg, sources.source
    base_dtype = lm.widened_from or lm.dtype  # the checkpoint's (a bf16 base widened for this CPU is a bf16 base)
    # (LoRA: the adapters are merged in float32 at the end; the checkpoint stays float32 unless --dtype asks to round,
    # trainer.merged_dtype. --heldout-data is recorded whole, trainer.cfg's)
    trainer = Trainer(lm, source, cfg, args.out, heldout=sources.heldout, progress=not args.quiet,
                      data=str(Path(args.data).resolve()),  # one spelling of a file: --resume compares them
                      heldout_name="--heldout")
    cfg = trainer.cfg
    if trainer.prompts_healed and trainer.rank == 0 and isinstance(source, ExampleSource):  # (only examples heal)
        print(f"--data: {trainer.prompts_healed} of {len(source.examples)} training prompts end in whitespace that "
              "token healing would re-choose, and the model learns to answer after it as it is: its generation "
              "settings say token_healing false, so `blockpress generate` keeps a prompt's end as typed "
              "(--token-healing heals it)", file=sys.stderr)
    if stale_metrics and trainer.rank == 0:  # after every check: a refused run leaves the folder as it was
        print(f"--out {args.out}: replacing the metrics.jsonl of a run that stopped before its first save (no "
              "trainer_state.pt to resume from)", file=sys.stderr)
        (Path(args.out) / "metrics.jsonl").unlink()
    if args.resume:
        trainer.resume()
    return Run(lm=lm, trainer=trainer, cfg=cfg, base_dtype=base_dtype, merged_dtype=trainer.merged_dtype)


def _trainable(trainer: Trainer) -> dict[str, Any]:
    """How many parameters train, and their share of the model's (peft's print_trainable_parameters)."""
    return {"trainable_parameters": trainer.trainable_parameters,
            "trainable_fraction": round(trainer.trainable_parameters / max(trainer.total_parameters, 1), 6)}


def _say_what_runs(args: argparse.Namespace, run: Run, sources: Sources) -> None:
    """What the run trains on, and how much of the model, which would otherwise go unseen (a folder's stray files, a
    chat's turns, a --heldout split, how many passes --steps makes); after --resume, which says where the run's data
    stands. Then a warmup the run never ends."""
    cfg, trainer = run.cfg, run.trainer
    if not args.quiet and trainer.rank == 0:
        print(data_summary(args.data, sources.source, sources.heldout, cfg, run.lm.config.canvas_length,
                           trainer.data_start), file=sys.stderr)
    if cfg.lora_rank and not args.quiet and trainer.rank == 0:
        fraction = _trainable(trainer)["trainable_fraction"]
        print(f"--lora-rank {cfg.lora_rank}: training {trainer.trainable_parameters:,} of "
              f"{trainer.total_parameters:,} parameters ({100 * fraction:.3g}%) on {cfg.lora_targets}",
              file=sys.stderr)
    # no step after the warmup's end decays (step warmup_steps is the peak); no warmup, no word (--steps 1 smoke runs)
    if cfg.warmup_steps and cfg.warmup_steps >= cfg.steps - 1:
        from blockpress.train import lr_at

        last = lr_at(cfg, cfg.steps - 1)
        print_warning(f"--warmup-steps {cfg.warmup_steps} leaves --steps {cfg.steps} no step to decay in: the "
                      f"learning rate ends at {last:.3g} ({last / cfg.lr:.2g}x --lr), not at --lr x --min-lr-ratio "
                      f"({cfg.lr * cfg.min_lr_ratio:.3g}) as the cosine schedule does; give fewer warmup steps "
                      "(the decay takes the steps after them)")


def _report(args: argparse.Namespace, run: Run, result: TrainResult) -> None:
    """The run's summary (a JSON line on stdout), and where a run that was not interrupted left what it trained: a
    QLoRA run's unmerged adapters, a LoRA run's checkpoint of another dtype than its base."""
    cfg, trainer = run.cfg, run.trainer
    if not args.quiet and trainer.rank == 0:  # under torchrun, one summary, not one a process
        losses = result.losses
        # This invocation's losses: after --resume, first_step says which step of the run the first one is
        first_step = trainer.data_start[0] + 1 if losses else None
        print(json.dumps({"out": args.out, "steps": result.steps, "stopped": result.stopped, "first_step": first_step,
                          "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
                          "eval_losses": result.eval_losses,
                          "tokens_per_second": round(result.tokens_per_second, 1), **_trainable(trainer)}))
    if cfg.quantize and result.stopped != "interrupted" and trainer.rank == 0:
        _say_quantized_adapters(args, run.lm, cfg.quantize)
    elif (cfg.lora_rank and result.stopped != "interrupted" and run.base_dtype != run.merged_dtype
          and trainer.rank == 0):
        base = str(run.base_dtype)[6:]
        # (--dtype takes float32 and bfloat16: a float16 base, trained with loss scaling, is cast by save's dtype)
        how = (f"--dtype {base} saves that" if base != "float16" else
               f"blockpress.load({str(args.out)!r}).save(FOLDER, dtype='float16') writes that")
        print(f"--lora-rank: the adapters were merged in float32 and {args.out} holds a "
              f"{str(run.merged_dtype)[6:]} checkpoint (the base was {base}; {how}, rounding part of the adapters' "
              "update away)", file=sys.stderr)


def _say_quantized_adapters(args: argparse.Namespace, lm: LM, quantize: str) -> None:
    """Where a QLoRA run's adapters are, unmerged, and how to run them over their quantized base."""
    from blockpress.checkpoint import folder_quantization
    from blockpress.train import ADAPTER_DIR, base_name

    adapter = Path(args.out) / ADAPTER_DIR
    named = base_name(lm) is not None  # the folder names its base (one loaded from a folder): it loads alone
    flags = f"--model {adapter}" if named else f"--model BASE --adapter {adapter} --quantize {quantize}"
    python = repr(str(adapter)) if named else f"BASE, adapter={str(adapter)!r}, quantize={quantize!r}"
    # a base saved quantized is itself the quantized checkpoint, and has no unquantized weights to merge into
    saved_quantized = lm.path is not None and folder_quantization(lm.path) is not None
    base = (f"(over {lm.path}, saved {quantize})" if saved_quantized
            else "(no checkpoint of the quantized base)")
    merge = "" if saved_quantized else "; --quantize none merges them into the unquantized base instead"
    print(f"--quantize {quantize}: {adapter} holds the adapters, unmerged {base}; run them as trained, over "
          f"the {quantize} base: `blockpress generate {flags} PROMPT` (chat, serve and info alike{merge}), or "
          f"in Python blockpress.load({python})", file=sys.stderr)


def _exit_status(args: argparse.Namespace, run: Run, result: TrainResult) -> int:
    """0, or for a run a signal stopped, 128 + the signal, once it is said where the run was saved; under torchrun
    only after every process is done."""
    if result.stopped == "interrupted":
        import signal

        adapters = f" (its adapters so far load as --model {Path(args.out) / 'adapter'})" if run.cfg.lora_rank else ""
        # 128 + the signal, as a shell reports a process it ended: a scheduler's SIGTERM (timeout, Slurm, docker stop)
        # exited 130, Ctrl-C's status, and a job script could not tell the two apart
        signum = result.stop_signal or signal.SIGINT
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        if run.trainer.rank == 0:  # the process that saves (under torchrun each would say "saved")
            print(f"{what} at step {result.steps}: saved in {args.out}{adapters}; continue with --resume",
                  file=sys.stderr)
        _leave_peers()  # rank 0 has saved and said so: only now may a process exit non-zero
        return 128 + signum
    _leave_peers()
    return 0


def _leave_peers() -> None:
    """Under torchrun: wait for every process, then leave the process group. torchrun stops the other processes as
    soon as one exits non-zero (a stop's 130 or 143), so a process that left at once would cut rank 0 short after its
    save, before it says where the run was saved, or during it; and a group never left can abort at exit ("terminate
    called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def data_summary(data: str, source: Any, heldout: Any, cfg: Any, canvas_length: int,
                 start: tuple[int, int] = (0, 0)) -> str:
    """The line `train` starts with: how much data --data gave, how much of it is held out, and how many passes over
    it --steps x --batch-size make. `start`: (step, examples consumed) where a resumed run goes on (Trainer's
    data_start); a run resumed at another batch size consumed its first steps at the old one."""
    from blockpress.train import ExampleSource

    step, seen = start
    drawn = seen + (cfg.steps - step) * cfg.batch_size

    def span(first: int, last: int) -> str:
        return f"step {last}" if first == last else f"steps {first}-{last}"

    if seen == step * cfg.batch_size:  # one batch size all along
        steps, draw = f"--steps {cfg.steps} x --batch-size {cfg.batch_size}", "draws"
    else:
        steps = f"the {seen:,} of {span(1, step)} and {span(step + 1, cfg.steps)} x --batch-size {cfg.batch_size}"
        draw = "draw"
    upto = "up to " if cfg.max_minutes else ""  # the clock may end the run first
    if isinstance(source, ExampleSource):
        n = len(source.examples)
        held = len(heldout.examples) if isinstance(heldout, ExampleSource) else None
        of = (f"{n:,} examples (--heldout-data: {held:,})" if cfg.heldout_data and held is not None else
              f"{n + held:,} examples, {held:,} held out, {n:,} trained on" if held is not None else f"{n:,} examples")
        from blockpress.data import canvas_count

        cut = sum(canvas_count(e, canvas_length) > cfg.max_canvases for e in source.examples) if cfg.max_canvases else 0
        cuts = (f"; --max-canvases {cfg.max_canvases} cuts {cut:,} of their responses short (their end, EOS, is not "
                "trained)") if cut else ""
        return f"--data {data}: {of}; {steps} {draw} {upto}{drawn:,}: {drawn / n:.3g} epochs{cuts}"
    shards = source.shards
    count, kind = (shards.documents, "document") if shards.documents else (len(shards.arrays), "shard file")
    where = f" in {count:,} {kind}{'s' if count != 1 else ''}"
    response = source.canvases * canvas_length
    return (f"--data {data}: {shards.tokens:,} tokens{where}; {steps} windows of {response} response tokens cover "
            f"{upto}{_times(drawn * response / shards.tokens)} of them")


def _times(ratio: float) -> str:
    """A share of the data as a reader takes it in: "2.5x", or "0.56%" for a small one (not "0.0056x")."""
    return f"{ratio:.3g}x" if ratio >= 0.1 else f"{100 * ratio:.2g}%"


def train_corpus(path: str, flag: str, tokenizer: Any, vocab_size: int, quiet: bool = False) -> Any:
    """Running text for `train` as TokenShards (data.load_corpus), with a bar of the characters tokenised on a
    terminal's stderr unless `quiet` (a large corpus takes minutes without a sign); errors name `flag`."""
    from blockpress.cli.output import progress_bar
    from blockpress.data import is_raw_text, load_corpus

    if not is_raw_text(path):  # token shards (or examples, which it refuses): nothing to tokenise, no bar
        return load_corpus(path, flag, tokenizer, vocab_size)
    bar = progress_bar(desc=f"{flag} tokenizing", unit="char", unit_scale=True, hidden=quiet)

    def advance(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
            bar.refresh()  # (the total at once, before the first piece is done)
        bar.update(done - bar.n)

    try:
        return load_corpus(path, flag, tokenizer, vocab_size, progress=advance)
    finally:
        bar.close()


def resumed_train_config(out: Path) -> dict[str, Any]:
    """The settings the run in `out` was started with (train_config.json; older runs: trainer_state.pt)."""
    from dataclasses import fields

    from blockpress.files import read_json_object
    from blockpress.train import TRAIN_CONFIG_FILE, TRAINER_STATE_FILE, TrainConfig, read_trainer_state

    file = out / TRAIN_CONFIG_FILE
    if file.is_file():
        saved = read_json_object(file, where="--resume: ")
    else:
        saved = read_trainer_state(out / TRAINER_STATE_FILE, map_location="cpu").get("config", {})
    known = {f.name for f in fields(TrainConfig)}
    return {k: v for k, v in saved.items() if k in known}


def _plot_training(out: Path, quiet: bool) -> None:
    """loss.png beside metrics.jsonl: the curves of the whole run, resumed parts included."""
    from blockpress.train import plot_metrics

    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return
    try:
        plot_metrics(metrics, out / "loss.png")
    except ImportError:
        if not quiet:
            print_warning("no loss.png: matplotlib is not installed (pip install 'blockpress[train]')")
        return
    if not quiet:
        print(f"loss curves: {out / 'loss.png'}", file=sys.stderr)
