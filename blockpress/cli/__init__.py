"""The `blockpress` command line: `main` parses the arguments (parser.py) and runs the command (run_command), one
module a command or family (generate.py, infill.py, chat.py, train.py, serve.py, sudoku.py, bench.py, info.py for
info and quantize) over what they share (common.py, output.py), ending with the exit status and message the README
lists.

Torch and the modules that import it are imported once a command runs (run_command), not here: importing torch takes
seconds, and building the parser (--help, a mistyped flag) needs none of it. The names the help shows come from
torch-free modules (config, train_config)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from blockpress.checks import allocation_failed, compile_failure
from blockpress.cli.common import as_flags, command_flags, expand_path_flags, train_flag_of, utf8_arguments
from blockpress.cli.output import (
    OutputError,
    compile_failed,
    guard_stdout,
    out_of_memory_message,
    output_failed,
    show_warning,
    utf8_stdio,
)
from blockpress.cli.parser import build_parser
from blockpress.stopping import (
    STOP_SIGNALS,
    fresh_line,
    interrupts_deferred,
    stop_signals_interrupt,
    stop_status,
    stop_word,
)

OPENMP_SPINS = 10_000  # GOMP_SPINCOUNT for every command's torch (see run_command)


# Optional packages: the extra of pyproject.toml that installs each, and what needs it, by command ("*": any other).
# peft is needed by train's --lora-rank and by every command that loads a LoRA adapter: a message naming
# --lora-rank to `generate --model OUT/adapter` named a flag generate does not have.
EXTRA_OF = {"fastapi": ("serve", {"*": "blockpress serve"}), "uvicorn": ("serve", {"*": "blockpress serve"}),
            "peft": ("train", {"train": "--lora-rank", "*": "a LoRA adapter: --adapter, or an adapter folder as --model"}),
            "matplotlib": ("train", {"bench": "--plot", "*": "loss.png"})}


def main(argv: list[str] | None = None) -> int:
    restore_stdio = utf8_stdio()
    replaced = guard_stdout()
    # A descriptor the shell closed (`<&-`, `2>&-`) is None to Python: a closed stdin would fail as AttributeError
    # tracebacks ('NoneType' object has no attribute 'read'), and print(file=None) writes to stdout, so a closed
    # stderr's messages would go into the output (a JSON-lines file would get a stats line) or end chat and train
    # silently. Each reads as /dev/null instead: stdin empty, stderr's messages dropped (the exit status still tells).
    closed = {name: open(os.devnull, "w" if name == "stderr" else "r", encoding="utf-8")
              for name in ("stdin", "stderr") if getattr(sys, name) is None}
    for name, stream in closed.items():
        setattr(sys, name, stream)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help, --version: their text is out once flushed, and that can fail too
            if exc.code in (0, None) and sys.stdout is not None:
                sys.stdout.flush()
            raise
        # Set for the command's run alone, not on import: the library's users keep Python's warnings.
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            # Each run says each of its warnings once: a new filter also clears the record of warnings an earlier
            # main() in this process already showed (a test, a notebook), which would silence them here. Appended:
            # the user's own filters (-W ignore, -W error, PYTHONWARNINGS) come first and still decide.
            warnings.filterwarnings("default", category=UserWarning, append=True)
            return run_command(args)
    except (BrokenPipeError, OutputError) as exc:  # the parser's (a command's own are run_command's)
        return output_failed(exc, "blockpress")
    finally:
        if replaced is not False:  # the caller's stream back, ours flushed (a failure in it was said, or is moot)
            try:
                sys.stdout.flush()
            except (OutputError, OSError, ValueError):
                pass
            sys.stdout = replaced
        for name, stream in closed.items():
            setattr(sys, name, None)
            stream.close()
        restore_stdio()


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; a bad argument, a missing optional package or a broken pipe ends it with the exit
    status the README lists, and a message under the command's name."""
    # libgomp (torch's OpenMP on Linux) has each idle thread spin 300,000 times before it sleeps. Beside other work
    # those spins take the cores the other threads wait for (blockpress-code writes less than half its tokens a
    # second on 2 busy cores); 10,000 spins keep its speed alone and win most of that back. Set before the command
    # imports torch (the parser imports none), and only where the user set no value of their own.
    # It is taken back once the command ends, as is --threads' count: main() called in a program's own process (a
    # notebook, a tool) leaves that program, and the processes it starts, as they were.
    spins_ours = "GOMP_SPINCOUNT" not in os.environ
    os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPINS))
    threads_before = None
    try:
        expand_path_flags(args)
        utf8_arguments(args)
        if getattr(args, "threads", 0):  # (checked before torch's import: a mistyped count is said at once)
            if args.threads < 0:
                raise ValueError(f"--threads: expected 0 (torch's default) or more, got {args.threads}")
            cpus = os.cpu_count()
            if cpus is not None and args.threads > cpus:  # 100000: a segmentation fault in torch's thread pool
                raise ValueError(f"--threads: expected 0 (torch's default) to {cpus}, the CPUs of this machine "
                                 f"(more threads only wait for one), got {args.threads}")
        # Every command runs torch: imported here, before the command's own handling, with the stop signals held
        # until it is in. A Ctrl-C's KeyboardInterrupt raised while torch's C start-up imports numpy is cleared there:
        # the command ran to the end and exited 0. Held, it is raised as the import ends, into the handling below
        # (130, said); a SIGTERM or SIGHUP, into stop_signals_interrupt's (not the silent death of the default action).
        with stop_signals_interrupt(), interrupts_deferred(STOP_SIGNALS):
            import torch
        if getattr(args, "threads", 0):
            threads_before = torch.get_num_threads()
            torch.set_num_threads(args.threads)
        if getattr(args, "device", None) == "auto":  # (the default) named before the command reads it: its notes,
            # torchrun's GPU per process and its --json say the device the run is on
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.command == "serve":  # it takes its stop signals itself (uvicorn's shutdown)
            code = args.func(args)
        else:  # (train's loop takes them itself, to save; before it, as it reads its data and loads, they stop it)
            with stop_signals_interrupt():
                code = args.func(args)
        if sys.stdout is not None:  # a reader gone away (`| head`) is met here, not in the interpreter's last flush
            sys.stdout.flush()
        return code
    except ImportError as exc:
        package = (exc.name or "").partition(".")[0]
        # only a package that is missing: one installed but too old fails with its own message
        if package not in EXTRA_OF or not isinstance(exc, ModuleNotFoundError) or exc.name != package:
            raise
        extra, uses = EXTRA_OF[package]
        print(f"blockpress {args.command}: error: {package} is not installed (needed for "
              f"{uses.get(args.command, uses['*'])}); pip install 'blockpress[{extra}]'", file=sys.stderr)
        return 2
    except (BrokenPipeError, OutputError) as exc:  # before OSError's: not the arguments' fault
        return output_failed(exc, f"blockpress {args.command}")
    except (ValueError, OSError) as exc:  # OSError: a missing, unreadable or existing path
        flagged = ("generate", "infill", "chat", "bench", "sudoku", "info", "serve", "quantize")
        message = as_flags(str(exc), command_flags(args)) if args.command in flagged else str(exc)
        if args.command == "train":  # (--resume's model is the run's own, or its base, which no --model named)
            message = as_flags(message, {**train_flag_of(), **({} if args.resume else {"model": "--model"})})
        print(f"blockpress {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a command without its own handling, or before it (while loading)
        # said, as the commands' own handlers say it: a Ctrl-C while the model loads must not exit 130 without a word
        print(f"{fresh_line(exc)}blockpress {args.command}: {stop_word(exc)}", file=sys.stderr)  # off the "^C"
        return stop_status(exc)
    except (RuntimeError, MemoryError) as exc:  # (the CPU allocator's error is a RuntimeError, as a GPU's is)
        if getattr(args, "compile", False) and compile_failed(exc):
            print(f"blockpress {args.command}: error: {compile_failure(exc)}", file=sys.stderr)
            return 2
        if not allocation_failed(exc):
            raise
        print(f"blockpress {args.command}: error: {out_of_memory_message(exc, args.command)}", file=sys.stderr)
        return 1
    finally:
        if threads_before is not None:  # (torch imported: the count was read from it)
            torch.set_num_threads(threads_before)
        if spins_ours:
            os.environ.pop("GOMP_SPINCOUNT", None)
