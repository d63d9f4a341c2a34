"""`blockpress bench`: bench.py's speed harness, its --out and --plot written after each row."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from blockpress.cli.common import RANDOM_PREFIX, check_file_path
from blockpress.cli.output import OutputError
from blockpress.stopping import fresh_line, stop_status, stop_word


def cmd_bench(args: argparse.Namespace) -> int:
    from blockpress.bench import PLOT_FORMATS, BenchSettings, plot, run_bench
    from blockpress.files import new_tag, release_tag, remove_killed_writes, same_place

    if args.model is not None:
        preset = args.model[len(RANDOM_PREFIX):] if args.model.startswith(RANDOM_PREFIX) else None
        raise ValueError("--model: bench times random weights of a preset's shape, never a checkpoint; "
                         + (f"use --preset {preset}" if preset else
                            "use --preset tiny, small, medium or 26b-a4b (a checkpoint's speed: the stats line of "
                            "`blockpress generate --model M`)"))
    s = BenchSettings(preset=args.preset, batch_sizes=args.batch_sizes, new_tokens=args.new_tokens, steps=args.steps,
                      prompt_length=args.prompt_length, repeats=args.repeats, reference=not args.no_reference,
                      ar=not args.no_ar, dtype=args.dtype, device=args.device, compile=args.compile,
                      cuda_graphs=args.cuda_graphs, canvas_lengths=args.canvas_lengths, quantize=args.quantize,
                      layers=args.layers)
    # Found now, not after minutes of benchmarking.
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag}: no folder {str(Path(path).parent)!r} to write {path!r} into")
        if path and Path(path).is_dir():
            raise ValueError(f"{flag}: {path!r} is a folder; give a file name")
        if path and Path(path).exists() and not Path(path).is_file():  # each write replaces the file: as root, a
            # device (--out /dev/null) became a regular file holding the JSON, for every later writer to append to
            raise ValueError(f"{flag}: {path!r} is not a regular file (a device, a pipe or a socket), which each "
                             "write would replace; give a file name")
        if path:
            check_file_path(flag, path)
        if path and not os.access(Path(path).resolve().parent, os.W_OK):  # a read-only disk, another user's folder:
            # else the first write, after the first row (minutes at a large preset), is the first to find it
            raise ValueError(f"{flag}: cannot write into the folder {str(Path(path).parent)!r} (read-only, or not "
                             "yours)")
    if args.out and args.plot and same_place(args.out, args.plot):  # the plot, written after
        # the JSON each row, replaced it: the run ended 0 with its --out an image
        raise ValueError(f"--out: {args.out!r} is the --plot file too; give the JSON and the plot a file each")
    if args.plot and Path(args.plot).suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise ValueError(f"--plot: expected a file ending in one of {', '.join('.' + f for f in PLOT_FORMATS)}, "
                         f"got {args.plot!r}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # run_command names the extra that has it
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    out_rows = 0  # the rows the --out file holds: the last row's too, unless its write failed (a full disk)

    def write(result: dict[str, Any], done: bool) -> None:
        """--out and --plot as the run stands: after each row too, so a sweep cut short (a timeout, a failure at a
        larger batch) keeps the rows it measured, its JSON marked "partial"."""
        nonlocal out_rows
        if args.out:  # written beside it, then moved into place: a kill while it writes leaves the last one whole
            out = Path(args.out)
            # under a name of this write's own: two runs with one --out took each other's file from under them
            tag = new_tag()
            written = out.with_name(f".{out.name}.{tag}.partial")
            try:
                remove_killed_writes(out.parent, out.name, ".partial")
                written.write_text(json.dumps(result if done else {**result, "partial": True}, indent=2) + "\n")
                os.replace(written, out)
                out_rows = len(result.get("rows", []))
            except OSError as exc:  # a full disk: the half-written file must not lie beside it, and the
                # error ("[Errno 28] No space left on device") names no file
                try:
                    written.unlink(missing_ok=True)
                except OSError:
                    pass
                raise OSError(f"--out {args.out}: cannot write it ({exc.strerror or exc})") from None
            finally:
                release_tag(tag)
        if args.plot:  # (matplotlib is there: checked above)
            plot(result, args.plot)

    measured: dict[str, Any] = {}  # the result as of the last row measured

    def on_row(so_far: dict[str, Any]) -> None:
        if args.plot:  # (named in each row's JSON: an interrupted run's on stdout is the --out file's)
            so_far["plot"] = str(args.plot)
        measured.update(so_far)
        write(so_far, done=False)

    try:
        result = run_bench(s, on_row=on_row)
    except Exception:  # an error that ends the run: --out could not be written (a full disk), a later batch ran out
        # of memory (the pre-check is only a floor), a variant failed at a larger batch. The rows measured before it
        # are still measurements: they go to stdout, as on a Ctrl-C (without --out they were lost), and the error is
        # raised on, to be said (run_command) or shown as the traceback of a bug, with the run's non-zero status.
        rows = len(measured.get("rows", []))
        if rows:
            try:  # (stdout gone or full: the run's own error is still the one said)
                print(json.dumps({**measured, "partial": True}, indent=2))
                print(f"bench: stopped by an error after {rows} row{'s' if rows != 1 else ''} (their JSON on stdout"
                      f"{' and in ' + str(args.out) if args.out and out_rows == rows else ''}, marked \"partial\")",
                      file=sys.stderr)
            except (BrokenPipeError, OutputError, OSError):
                pass
        raise
    except KeyboardInterrupt as exc:
        # The rows measured are the run's result, as a cut-short generate --json's text is: on stdout too, not in --out
        # alone (and without it lost).
        rows = len(measured.get("rows", []))
        print(fresh_line(exc), end="", file=sys.stderr, flush=True)  # off the terminal's "^C"
        if rows:
            print(json.dumps({**measured, "interrupted": True, "partial": True}, indent=2))
            if args.out:  # else it holds the last row's "partial" alone, as if the run had failed, not been stopped
                try:
                    write({**measured, "interrupted": True}, done=False)
                except OSError:  # (a full disk) the rows are on stdout, and the stop is what is said
                    pass
        print(f"bench: {stop_word(exc)} after {rows} row{'s' if rows != 1 else ''}"
              + (f" (their JSON on stdout{' and in ' + str(args.out) if args.out else ''}, marked \"partial\")"
                 if rows else ""), file=sys.stderr)
        return stop_status(exc)
    if args.plot:
        result["plot"] = str(args.plot)
    try:
        print(json.dumps(result, indent=2))  # first: whatever fails after this, the figures are on screen
    finally:  # and --out gets the whole run when stdout's reader has gone (`| true`), not the last row's "partial"
        write(result, done=True)
    return 0
