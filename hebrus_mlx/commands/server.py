"""`hebrus-mlx server` (like mlx_lm.server): the verb's command line over the serve package
(hebrus_mlx/serve/: the routes, the worker that owns the model, sampling, output parsing).

Under `mlx.launch` (pipeline parallel, see hebrus_mlx/pipeline) rank 0 serves HTTP and drives the
pipeline; the other ranks run their layer ranges. Prefix snapshots are kept by every rank for its
own layers (`--prompt-cache-bytes` bounds rank 0's share). A rank that dies fails the request with
a 503 and every later one (the pipeline is down); a stalled rank gets the request a 503 within the
pipeline timeout, then the server exits (MLX cannot interrupt a collective).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import socket
import sys

from .. import flags
from ..errors import UsageError
from ..pipeline import launched as pipeline_launched
from ..serve.app import DEFAULT_MAX_BODY_BYTES, App
from ..serve.worker import ServerDefaults, Worker
from .cli_args import MLX_LM_SERVER_REFUSED, ArgumentParser, add_refused_arguments, prefetch_from_args
from .verb_flags import (
    add_prompt_cache_arguments,
    check_args,
    check_shared_flags,
    load_from_args,
    share_generate_flags,
)

log = logging.getLogger("hebrus_mlx.server")

DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
DEFAULT_SHUTDOWN_TIMEOUT = 5.0
DEFAULT_PREP_PROCESS_BYTES = 64 << 10  # bodies this large are rendered/tokenized in the prep process
API_KEY_ENV = "HEBRUS_MLX_API_KEY"  # the key without a command line that `ps` shows
SWITCH_INTERVAL_S = 0.001  # the GIL hand-off interval while serving (CPython's default: 0.005)


_NOT_SHARED = {"help", "prompt", "system_prompt", "ignore_chat_template", "verbose", "prompt_cache_file"}


def _origins(value: str) -> list[str]:
    origins = [o.strip() for o in value.split(",") if o.strip()]
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s,]+", o):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin (scheme://host[:port]) or '*'")
    if not origins:
        raise argparse.ArgumentTypeError("no origin given")
    return origins


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="hebrus-mlx server",
        description="OpenAI-compatible HTTP server (like mlx_lm.server).",
        conflict_handler="resolve",
    )
    p.shared = share_generate_flags(p, _NOT_SHARED)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=flags.integer(0, 65535), default=8080, help="0 picks a free port (printed on start)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (visible in ps: prefer --api-key-file or ${API_KEY_ENV})",
    )
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from PATH (one line)")
    p.add_argument(
        "--shutdown-timeout",
        type=flags.seconds(),
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGTERM/SIGINT: seconds to let cancelled requests finish before exiting "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    p.add_argument(
        "--decode-concurrency",
        type=flags.integer(1),
        default=1,
        help="requests that share each decode step (continuous batching; default 1: one at a time)",
    )
    p.add_argument(
        "--prompt-concurrency",
        type=flags.integer(1),
        default=1,
        help="requests prefilling at once under --decode-concurrency > 1, a chunk per decode step",
    )
    add_prompt_cache_arguments(p, DEFAULT_PROMPT_CACHE_BYTES, "no prefix reuse")
    p.add_argument(
        "--max-body-bytes",
        type=flags.integer(1),
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are a 413, refused from the declared length (default %(default)s)",
    )
    p.add_argument(
        "--prep-process-bytes",
        type=flags.integer(0, flags.INT64_MAX),
        default=DEFAULT_PREP_PROCESS_BYTES,
        help="request bodies of at least this many bytes are rendered and tokenized in a separate "
        "process, so the event loop never waits on them (default %(default)s; 0: all on threads)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        metavar="ORIGINS",
        help="comma-separated origins browsers may call from (CORS), '*' for any "
        "(default: none; mlx-lm's default is '*')",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="server log level (default INFO)",
    )
    add_refused_arguments(p, MLX_LM_SERVER_REFUSED)
    p.set_defaults(max_tokens=None)  # not given: DEFAULT_MAX_TOKENS, or the context left (/v1/responses)
    return p


def api_key_from(args, environ=None) -> str | None:
    """The key from exactly one of --api-key, --api-key-file or $HEBRUS_MLX_API_KEY (None: no key)."""
    environ = os.environ if environ is None else environ
    given = [
        (f, v)
        for f, v in (
            ("--api-key", args.api_key),
            ("--api-key-file", args.api_key_file),
            (API_KEY_ENV, environ.get(API_KEY_ENV)),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise UsageError(given[1][0], f"the API key is also given by {given[0][0]}; give it once")
    if not given:
        return None
    field, value = given[0]
    if field == "--api-key-file":
        from ..artifact import untrusted

        path = os.path.abspath(os.path.expanduser(value))
        try:
            data = untrusted.read_path(
                untrusted.resolve(os.path.dirname(path), os.path.basename(path), field, links=True), "api_key", field
            )
        except OSError as e:
            raise UsageError(field, f"{value}: {e.strerror or e}") from None
        except untrusted.UntrustedFileError as e:
            raise UsageError(field, e.message) from None
        try:
            value = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise UsageError(field, f"{value}: not UTF-8") from None
    if not value or any(c.isspace() or not c.isprintable() for c in value):
        raise UsageError(field, "the API key must be one non-empty word of printable characters")
    if not value.isascii():  # an HTTP header cannot carry it as sent: no client could ever match it
        raise UsageError(field, "the API key must be ASCII (it travels in the Authorization header)")
    return value


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket (before the "listening on" line: a client may connect once it reads it);
    a taken port or an address this machine lacks is a UsageError naming the flag."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(
                "--port", f"port {port} on {host} is in use; give another --port (0 picks a free one)"
            ) from None
        raise UsageError("--host", f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


class _Server:
    """uvicorn's server, stopped our way: the first SIGTERM/SIGINT/SIGHUP cancels every in-flight
    generation (App.begin_shutdown) and uvicorn stops accepting and waits at most
    --shutdown-timeout for the responses; main() then exits 0 (uvicorn's re-raise of the
    signal after its shutdown is absorbed)."""

    @staticmethod
    def run(app: App, config, sock, announce=lambda: None):
        """`announce()` (the "listening on" line) runs once a stop signal can no longer kill the
        process: one that arrives before uvicorn installs its handlers is held and replayed."""
        import contextlib
        import signal

        import uvicorn

        pending = []

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                first = not self.should_exit
                super().handle_exit(sig, frame)
                if first:
                    log.warning("signal %d: stopping (cancelling %d request(s))", sig, len(app.live))
                    app.begin_shutdown()

            @contextlib.contextmanager
            def capture_signals(self):
                # uvicorn handles SIGINT/SIGTERM only; SIGHUP (the terminal closed) would kill the
                # process with requests in flight: it takes the same graceful path.
                with super().capture_signals():
                    hup = signal.signal(signal.SIGHUP, self.handle_exit)
                    for sig in pending:  # arrived between the announcement and these handlers
                        self.handle_exit(sig, None)
                    try:
                        yield
                    finally:
                        signal.signal(signal.SIGHUP, hup)

        # uvicorn restores these and raises the caught signal again once it has shut down: make
        # that a no-op so the worker is stopped and the process exits normally.
        previous = {
            s: signal.signal(s, lambda sig, _frame: pending.append(sig))
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        try:
            announce()
            Server(config).run(sockets=[sock])
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def main(argv=None) -> int:
    """`hebrus-mlx server`; typed errors propagate to `cli.run` (one line, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args)
    api_key = api_key_from(args)
    check_shared_flags(args, parser, "server")
    if not 0 <= args.port <= 65535:
        raise UsageError("--port", f"must be in [0, 65535], got {args.port}")
    if args.max_body_bytes < 1:
        raise UsageError("--max-body-bytes", f"must be >= 1, got {args.max_body_bytes}")
    if args.pipeline_split is not None and not pipeline_launched():
        raise UsageError("--pipeline-split", "needs a distributed launch (mlx.launch)")
    if args.decode_concurrency > 1 and args.draft_model is not None:
        raise UsageError(
            "--decode-concurrency",
            "speculative drafting (--draft-model) runs one request at a time; "
            "give --decode-concurrency 1 or drop --draft-model",
        )
    if args.decode_concurrency > 1 and pipeline_launched():
        raise UsageError("--decode-concurrency", "a pipeline (mlx.launch) serves one request at a time")
    if args.prompt_concurrency > args.decode_concurrency:
        raise UsageError(
            "--prompt-concurrency",
            f"must be <= --decode-concurrency ({args.decode_concurrency}), got {args.prompt_concurrency}",
        )
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prefetch_from_args(args)  # checked before the model loads
    pipe = None
    if pipeline_launched():
        import mlx.core as mx

        from ..loading.hub import resolve_model
        from .verb_flags import load_or_serve

        if mx.distributed.init().rank() != 0:
            load_or_serve(resolve_model(args.model), args)  # serves until rank 0 stops
            return 0
    import uvicorn

    defaults = ServerDefaults.from_args(args)

    def load():
        if args.seed is not None:  # on the worker thread, which samples
            import mlx.core as mx

            mx.random.seed(args.seed)
        if pipeline_launched():
            nonlocal pipe
            pipe, model, tokenizer = load_or_serve(resolve_model(args.model), args)
            return model, tokenizer
        return load_from_args(args)

    sock = _listen(args.host, args.port)  # before the model loads: a taken port is the user's one line
    worker = Worker(load, args.prompt_cache_bytes, defaults)
    if pipe is not None:
        from ..pipeline.ranks import finish

        worker.close = lambda: finish(pipe.model)  # stops the serving ranks, prints one line per rank
    app = App(worker, args.model, api_key, args.max_body_bytes, args.allowed_origins, args.prep_process_bytes)
    # Rendering and tokenizing a big request on a prep thread is Python-heavy: every time the
    # event loop gives up the GIL for I/O it waits for the prep thread's next switch (5 ms by
    # default, several times per /health). 1 ms keeps that wait small (benchmarks/bench_server_stall.py).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app.app,
        log_level=args.log_level.lower(),
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    try:
        _Server.run(
            app, config, sock, lambda: print(f"hebrus-mlx server: listening on http://{host}:{port}", flush=True)
        )
    finally:
        worker.stop()
        # The worker drains its cancelled step (its expert reads already failed); a pipeline also
        # stops its ranks. A worker still busy past the grace period is left to the process exit.
        worker.join(60 if pipe is not None else app.grace_left(args.shutdown_timeout))
        disk = worker.prompt_cache.disk
        if disk is not None and not disk.flush(timeout=max(1.0, app.grace_left(args.shutdown_timeout))):
            log.warning("prompt cache: snapshots still being written at exit are lost")
        if app.prep_process is not None:
            app.prep_process.stop()  # no orphan, whatever way uvicorn ended
            if not app.prep_process.join(5.0):
                log.warning("the request preparation process did not exit")
    if worker.alive or app.prep.alive:
        log.warning("exiting with work still running (past --shutdown-timeout)")
    else:
        log.info("stopped")
    # Leave without interpreter finalization: the worker thread's MLX thread-locals (its compile
    # cache holds Python objects) are destroyed when the OS thread exits, which can be after
    # join() returns; overlapping finalization, CPython aborts the process (SIGABRT in about 1 of
    # 6 shutdowns with streamed experts, seen under gdb). Everything is stopped by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("server", main))
