"""`blockpress serve`: serve.py's OpenAI-compatible app under uvicorn, its socket bound and its flags checked
before the model loads."""

from __future__ import annotations

import argparse
import contextlib
import copy
import ipaddress
import logging
import math
import os
import re
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from blockpress.checks import utf8_problem
from blockpress.cli.common import load_announced
from blockpress.cli.output import print_warning, silence_output
from blockpress.stopping import fresh_line, stop_signals_interrupt, stop_status, stop_word


def served_name(model: str) -> str:
    """The model id clients send: a folder's own name; a shipped name or a cached repo id as given (a hub model
    keeps its "owner/name", as vLLM serves it); a LoRA run's adapter folder (OUT/adapter), its run's name."""
    from blockpress.train import ADAPTER_DIR, is_adapter_folder

    folder = Path(os.path.expanduser(model))  # (Path.expanduser raises with no home known)
    if not folder.is_dir():
        return model
    # its name as the absolute path spells it (".." taken out, links kept): "." and "./" have no name of their own,
    # so `serve --model .` from inside the folder would serve the id ''
    path = Path(os.path.abspath(folder))
    if path.name == ADAPTER_DIR and is_adapter_folder(path) and path.parent.name:
        # every run's adapter folder has that name: two runs served would both be 'adapter'
        return path.parent.name
    return path.name or model


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.prefix_cache_gb < math.inf:  # nan and inf too: int() of them would fail after the model loaded
        raise ValueError(f"--prefix-cache-gb: expected 0 (off) or more GiB, a finite number, got {args.prefix_cache_gb}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-context", args.max_context), ("--max-body-bytes", args.max_body_bytes),
                        ("--max-stops", args.max_stops)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: expected a positive integer, got {value}")
    if args.served_name is not None and not args.served_name.strip():  # ("" read as not given: the default served)
        raise ValueError(f"--served-name: expected the model id clients send, got {args.served_name!r}; leave the "
                         "flag out to serve the model's own name")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout: expected seconds >= 0, got {args.shutdown_timeout}")
    # uvicorn's root_path: a prefix the routes' URLs (/docs' openapi.json) are written with, never one they match
    # (a trailing slash would write //v1; a prefix without its / is not a path at all)
    if args.root_path and not re.fullmatch(r"(/[^/\s?#]+)+", args.root_path):
        raise ValueError(f"--root-path: expected the path prefix the proxy strips, such as /llm (starting with /, no "
                         f"trailing slash), got {args.root_path!r}")
    if args.root_path and not args.root_path.isascii():
        # uvicorn writes it into every request's scope as ASCII: each request, /health's too, was dropped
        raise ValueError(f"--root-path: {args.root_path!r} is not ASCII; give the prefix as the proxy sends it, "
                         "percent-encoded (/mod%C3%A8le for /modèle)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected 0-65535 (0: any free port), got {args.port}")
    import uvicorn

    from blockpress.serve import (
        check_api_key,
        check_hosts,
        check_origins,
        create_app,
        header_deadline_protocol,
        warm_up,
    )

    check_origins(args.allowed_origins or ())  # before the model loads, as the other flags
    name = args.served_name or served_name(args.model)
    problem = utf8_problem(name)
    if problem is not None:  # (a folder named in another encoding: its bytes read as lone surrogates)
        flag = "--served-name" if args.served_name else f"--model: the folder name {name!r}"
        raise ValueError(f"{flag}: not valid UTF-8 ({problem}), which clients cannot send as a model id; "
                         "give the id they send with --served-name")
    check_hosts(args.allowed_hosts or ())
    # the flag (or the file), else the variable (an empty one is unset, as vLLM reads VLLM_API_KEY); never printed. A
    # bad one is named as where it came from: the variable's trailing newline (a secret file's) is no --api-key's fault
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("--api-key-file: not together with --api-key; give the key one way (the file keeps it out of "
                         "the process list)")
    if args.api_key_file is not None:
        api_key = check_api_key(read_key_file(args.api_key_file), "--api-key-file")
    elif args.api_key is not None:
        api_key = check_api_key(args.api_key)
    else:
        api_key = check_api_key(os.environ.get("BLOCKPRESS_API_KEY") or None, "BLOCKPRESS_API_KEY")
    sock = bind_socket(args.host, args.port)  # first: a port in use fails before the model loads
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    # A big checkpoint loads for tens of seconds before the server answers: say what the wait is. Until uvicorn
    # takes the stop signals (run), a SIGTERM or SIGHUP stops it as a Ctrl-C does, said (run_command), not by the
    # signal's default action without a word; the warm-up below (minutes under --compile) likewise.
    with stop_signals_interrupt():
        lm = load_announced(args, keep=f"blockpress: loading {args.model} ... (http://{url_host}:{port}/v1 answers "
                                       "once it is loaded)")
    app = create_app(lm, name, max_queue=args.max_queue, max_batch=args.max_batch, max_context=args.max_context,
                     prefix_cache_bytes=int(args.prefix_cache_gb * 2**30), allowed_origins=args.allowed_origins or (),
                     allowed_hosts=args.allowed_hosts or (), api_key=api_key, max_body_bytes=args.max_body_bytes,
                     max_stops=args.max_stops,
                     chat_template_kwargs=args.chat_template_kwargs)
    if args.compile or args.cuda_graphs:
        # Here, before the engine thread that owns the model starts, so the first clients do not wait minutes for the
        # compile (vLLM captures its graphs at startup too). Connections made meanwhile wait in the socket's backlog.
        flag, doing = (("--compile", "compiling the model's steps (minutes on a CPU)") if args.compile else
                       ("--cuda-graphs", "capturing CUDA graphs"))
        print(f"blockpress: {flag}: {doing} with a few short generations before serving ...", file=sys.stderr,
              flush=True)
        started = time.perf_counter()
        with stop_signals_interrupt():
            warm_up(app)  # a compiler that cannot build stops the start here, in one line (run_command)
        print(f"blockpress: warmed up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    # that a key is required, never the key: the line lands in logs and terminals others read
    access = "; requests to /v1 need the API key" if api_key is not None else ""
    print(f"blockpress serving {name!r} on http://{url_host}:{port}/v1{access}", file=sys.stderr)
    if api_key is None and not ipaddress.ip_address(host).is_loopback:
        print_warning(f"no API key, so anyone who reaches {url_host}:{port} can use the model: set "
                      "BLOCKPRESS_API_KEY (or --api-key-file) to require one")
    # (its loggers set up as uvicorn's for the run, then as they were: log_config)
    with _own_loggers_restored():
        server = _server_class()(uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                                                log_config=log_config(args.log_level), root_path=args.root_path or "",
                                                http=header_deadline_protocol(),
                                                timeout_graceful_shutdown=args.shutdown_timeout))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt as exc:  # uvicorn raises the Ctrl-C again once shut down: the last line, said as the
            # stop's, on the line after "stopping" (run_command's would go off a "^C" long gone: a blank line between)
            say(f"blockpress serve: {stop_word(exc)}")
            _end_past_engine(app, stop_status(exc))
            return stop_status(exc)
        if server.first_signal is not None:
            # Stopped by a signal that uvicorn's raise once shut down did not end: a SIGTERM left at its default action
            # is ignored by a container's PID 1 (`docker stop` with no --init). Its status, as anywhere else.
            _end_past_engine(app, 128 + server.first_signal)
            return 128 + server.first_signal
        return 0


MAX_KEY_FILE = 4096  # bytes


def read_key_file(path: str) -> str:
    """--api-key-file's key: the file's text less one trailing newline (as `echo KEY > file` and a secret manager's
    mount write it), or an error naming the flag and the file. Read up to a bound: a key is short, and a path such
    as /dev/zero would never end."""
    if not path:
        raise ValueError("--api-key-file: expected the path of a file holding the key, got ''")
    try:
        with open(os.path.expanduser(path), "rb") as file:  # (Path.expanduser raises with no home known)
            data = file.read(MAX_KEY_FILE + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:  # a folder, a missing or unreadable file, bytes that are no text
        why = ("is a folder" if os.path.isdir(os.path.expanduser(path)) else
               exc.strerror or str(exc) if isinstance(exc, OSError) else "not UTF-8 text")
        raise ValueError(f"--api-key-file {path}: cannot read the key from it ({why})") from None
    if len(data) > MAX_KEY_FILE:
        raise ValueError(f"--api-key-file {path}: more than {MAX_KEY_FILE} bytes, not a key file")
    key = text.removesuffix("\n").removesuffix("\r")
    if not key:
        raise ValueError(f"--api-key-file {path}: the file is empty; expected the key, on a line of its own")
    return key


def log_config(level: str) -> dict:
    """uvicorn's logging setup with blockpress's own loggers (serve's "blockpress.serve": a failed batch, a reply the
    response template cannot read) on its handler, at `level` as uvicorn's are: left out, they went to logging's
    last resort, which shows WARNING and above whatever --log-level said."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    # propagated as well: a root handler an embedding process set up still sees them (the CLI sets none)
    config["loggers"]["blockpress"] = {"handlers": ["default"], "level": level.upper()}
    for handler in config["handlers"].values():
        handler["class"] = f"{__name__}.{DeadStreamHandler.__name__}"
    return config


class DeadStreamHandler(logging.StreamHandler):
    """A log handler that drops a line its stream can no longer take: the access log goes to stdout, and where
    nothing reads it any more (`blockpress serve | tee log` after tee is gone) every request printed logging's
    ~90-line 'Logging error' traceback to stderr, while the server answered on."""

    def handleError(self, record: logging.LogRecord) -> None:
        gone = isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError))
        if gone or getattr(self.stream, "closed", False):
            return
        super().handleError(record)


@contextlib.contextmanager
def _own_loggers_restored() -> Generator[None, None, None]:
    """Serve's logging setup of the "blockpress" loggers (log_config) undone once it ends: `main(["serve", ...])`
    run in a process that goes on (a test, a notebook) left them writing to a stream since closed, so its next
    warning printed 'I/O operation on closed file'."""
    logger = logging.getLogger("blockpress")
    saved = (logger.handlers[:], logger.level, logger.propagate, logger.disabled)
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate, logger.disabled = saved


def _end_past_engine(app: Any, status: int) -> None:
    """End the process at once, with `status`, if the engine thread is still inside torch past the shutdown's wait
    for it (Engine.close): a long prompt's encode, which a cut reaches only at its end. An interpreter that finalises
    around it aborts ("terminate called without an active exception", SIGABRT, 134, after atexit's wait too), as a
    SIGTERM's default action would have ended it once uvicorn raised it again."""
    if app.state.engine.thread.is_alive():
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os._exit(status)


def say(line: str) -> None:
    """A line on stderr about a stop, which a stderr that cannot take it must not fail: a pipe whose reader has gone
    (`blockpress serve 2>&1 | tee serve.log` after tee ended) raises BrokenPipeError, which, raised in a signal
    handler, lost the signal or ended the server at once. stderr then points at the null device, as after any
    broken pipe (output_failed): the interpreter's last flush would meet it again (exit status 120)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        silence_output()


def _server_class() -> type:
    import asyncio
    import contextlib
    import signal
    import threading

    import uvicorn

    from blockpress.stopping import on_signals

    class Server(uvicorn.Server):
        """uvicorn's server, saying what a stop signal does (uvicorn says it at INFO, which --log-level warning
        or error hides: a server finishing a long request would look hung)."""

        signals = 0  # stop signals received
        first_signal: int | None = None  # the first one's number: the exit status is 128 + it
        loop: asyncio.AbstractEventLoop | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Each signal is taken before its line is said: a line that cannot be written (stderr a pipe whose
            # reader has gone, a log shipper that crashed) raised its BrokenPipeError in this handler, so uvicorn
            # never took the signal (the server served on) or the error ended the server where it stood (141, the
            # requests in flight a bare 500).
            self.signals += 1
            if self.signals == 1:
                self.first_signal = sig
                super().handle_exit(sig, frame)
                grace = self.config.timeout_graceful_shutdown  # None (uvicorn's default): no limit
                say(f"{fresh_line(sig)}blockpress: stopping; requests in flight get "
                    + ("all the time they take" if grace is None else f"up to {grace:g} s")
                    + " to finish (signal again to stop now)")
            elif self.signals == 2 and self.loop is not None:
                # Stop now: end the grace period, as at its end (Server.shutdown), and cancel what is still running
                # a moment later, so the shutdown finishes within a step and the engine thread is joined. uvicorn's
                # own second signal forces the exit: only SIGINT's (a second SIGTERM waited out the grace period
                # for every request not in the engine: a body still arriving, a prompt being tokenized), and its
                # skipped shutdown would leave the requests a bare 500 and the engine thread inside torch (an
                # abort). Scheduled on the loop: this handler may interrupt the loop's thread while it holds the
                # engine's lock.
                self.loop.call_soon_threadsafe(self.stop_now)
                say(f"{fresh_line(sig)}blockpress: stopping now; requests in flight are cut")
            else:
                self.force_exit = True  # a third signal: uvicorn's forced exit, whatever is left

        def cut(self) -> None:
            """The grace period's end: the engine refuses new requests and ends its jobs, each a 503 (a stream: an
            error event), its thread within a step. A request not in the engine yet is cancelled by uvicorn a moment
            later, or by stop_now, and answered with the same 503 (serve.AnswerStopped)."""
            engine = self._engine()
            if engine is not None:
                engine.stop()

        def stop_now(self) -> None:
            """A second signal: the grace period ends now, and what is still running a moment later (a response
            of the cut still being written aside) is cancelled, as uvicorn cancels it at the grace period's end."""
            self.cut()
            assert self.loop is not None  # (set by serve, before any signal is taken)
            self.loop.call_later(0.1, lambda: [task.cancel() for task in list(self.server_state.tasks)])

        def _engine(self) -> Any:
            return getattr(getattr(self.config.app, "state", None), "engine", None)

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            """uvicorn's SIGINT and SIGTERM, and a SIGHUP (the terminal closed: an ssh session that dropped) taken
            as they are: left alone, a SIGHUP kills the server where it stands, each request in flight a dropped
            connection ("Server disconnected without sending a response") rather than finished in the grace period.
            uvicorn raises the signal again once shut down (after ours is put back), so the exit status is still
            SIGHUP's. A SIGINT or SIGTERM the process ignored on entry (a script's `blockpress serve &` starts with
            SIGINT ignored) stays ignored, as on_signals leaves nohup's SIGHUP and as generate and train leave it:
            uvicorn took it over, stopped on it, and its raise once shut down, under the SIG_IGN put back, did
            nothing, so the server exited 0 as after a clean end."""
            hangup = getattr(signal, "SIGHUP", None)
            main = threading.current_thread() is threading.main_thread()  # (elsewhere no handler can be set)
            ignored = [sig for sig in (signal.SIGINT, signal.SIGTERM)
                       if main and signal.getsignal(sig) == signal.SIG_IGN]
            with super().capture_signals(), on_signals(() if hangup is None else (hangup,), self.handle_exit):
                for sig in ignored:  # over uvicorn's handler; uvicorn puts the SIG_IGN it found back on the way out
                    signal.signal(sig, signal.SIG_IGN)
                yield

        async def shutdown(self, sockets: Any = None) -> None:
            # The grace period ends here, a moment before uvicorn cancels the requests still running: cut them
            # first, so they get a 503 (a stream: an error event) and the engine stops within a step (a cancel
            # alone answers a bare 500 and leaves the engine generating for nobody, and the exit aborts).
            grace = self.config.timeout_graceful_shutdown
            if grace is not None:  # None: uvicorn waits for them without a limit
                asyncio.get_running_loop().call_later(grace, self.cut)
            await super().shutdown(sockets)

    return Server


def bind_socket(host: str, port: int) -> Any:
    """A listening socket on host:port, or an error that names them."""
    import socket

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # As uvicorn does: IPv4 unless the host is an IPv6 address ("localhost" may list ::1 first, and clients
        # of http://127.0.0.1 would then be refused).
        info = next((a for a in found if a[0] == socket.AF_INET), found[0]) if ":" not in host else found[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        if os.name != "nt":  # a restart can rebind while old connections linger; on Windows the same option
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # binds a port in use (socket.create_server)
        sock.bind(info[4])
    except OSError as exc:
        raise OSError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
