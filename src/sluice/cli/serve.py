"""`sluice serve`: the OpenAI-compatible server (server/) on uvicorn.

The port is bound before the model loads, so /health answers 503 while it loads. SIGTERM or Ctrl-C
drains: /health and new requests get 503, requests in flight (streams included) finish within
--shutdown-timeout (then they are cut), and the process exits 0. A second Ctrl-C quits at once.

With --tp N under torchrun every rank loads its part of the model; rank 0 serves HTTP and drives the
others' engines in lockstep (server/batch_engine.py through parallel/lockstep.Leader); the others run
_follow() and leave shutdown to rank 0 (a SIGTERM or Ctrl-C that torchrun passes them is ignored:
rank 0 drains with their help, then tells them to stop).
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import sys
import threading
import time

from ..errors import ConfigError, SluiceError
from .common import engine_config, model_args, special_tokens_arg, speculative_args, tp_rank


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)",
                       description="Serve a model over OpenAI's API: /v1/chat/completions, /v1/completions, "
                                   "/v1/models, /health, /metrics (docs/server.md).",
                       epilog="exit status: 0 after a clean shutdown (SIGTERM or Ctrl-C drains), 2 bad input "
                              "or a model that failed to load")
    model_args(p)
    speculative_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine "
                                                        "only; 0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route (/health and /metrics stay open); "
                        "default: the SLUICE_API_KEY environment variable, which keeps the key out of `ps`")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: --model as given, or sluice-stdlib)")
    p.add_argument("--max-num-seqs", type=int, default=8, metavar="N",
                   help="sequences decoded together by the continuous-batching engine (a request with n "
                        "choices takes n; default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, metavar="N",
                   help="tokens one engine step may take: a long prompt is prefilled in chunks of this, "
                        "between decode steps of the others (default 256)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="engine steps between writes of a stream's tokens (each still its own SSE chunk); a "
                        "request's first token and its end go out at once. 2 or more saves the server work per "
                        "token with many streams, each token arriving up to N-1 steps later (default 1)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for the engine; past it, 429 with Retry-After (default 64)")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body accepted, else 413 (default 4 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds that requests in flight get to finish (default 30)")
    special_tokens_arg(p)
    g = p.add_argument_group("tensor parallelism (docs/server.md)")
    g.add_argument("--tp", type=int, default=None, metavar="N",
                   help="split the model over N processes, launched with `torchrun --nproc-per-node N -m sluice "
                        "serve --tp N ...`: rank 0 serves HTTP, the others follow its steps")
    g.add_argument("--tp-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a rank waits for the others in a collective (the load included) before it "
                        "gives up; a rank that exits is noticed at once, one that hangs after this (default 300)")
    p.set_defaults(func=cmd_serve)


def _check(args):
    """Refuse bad flags before the (slow) imports and load; the engine's, by building its EngineConfig."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    for flag, value in (("--max-queue", args.max_queue), ("--max-body-bytes", args.max_body_bytes),
                        ("--stream-interval", args.stream_interval)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    args.api_key = api_key(args.api_key)
    if not args.shutdown_timeout >= 0:  # also refuses nan
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    return engine_config(args)  # what --tp cannot run is refused there, by flag


def api_key(flag: str | None) -> str | None:
    """--api-key, else SLUICE_API_KEY, else None. An empty key would let a request with an empty bearer
    token in (or, set by a shell variable that expanded to nothing, leave the server open): refused."""
    key, where = (flag, "--api-key") if flag is not None else (os.environ.get("SLUICE_API_KEY"), "SLUICE_API_KEY")
    if key is not None and not key.strip():
        raise ConfigError(f"{where} is empty: give a key, or unset it to serve without one")
    return key


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use is an error message, not a uvicorn exit."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def _check_tp(args) -> None:
    if not args.tp_timeout > 0:  # also refuses nan
        raise ConfigError(f"--tp-timeout must be a positive number of seconds, got {args.tp_timeout}")


def _follow(args, config) -> int:
    """A rank other than 0: load this rank's part, then step whenever rank 0 says, until it says stop."""
    from ..llm import LLM
    from ..parallel import init, shutdown
    from ..parallel.lockstep import follow
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the group stops (see the docstring)
        signal.signal(sig, signal.SIG_IGN)
    try:
        init(timeout_s=args.tp_timeout, device=getattr(args, "device", None))
        follow(LLM(config=config), args.tp_timeout)
    finally:
        shutdown()
    return 0


def cmd_serve(args) -> int:
    rank = tp_rank(args, "serve")  # a rank other than 0 is silenced from here (rank 0 speaks)
    options = _check(args)
    tp = (args.tp or 1) > 1
    if tp:
        _check_tp(args)
        if rank:
            return _follow(args, options)
    try:
        import uvicorn

        from ..server import BatchServingEngine, create_app
        from ..server.app import DEFAULT_MAX_BODY_BYTES, UVICORN_OPTIONS
    except ImportError as e:
        raise SluiceError(f"sluice serve needs fastapi, uvicorn and pydantic ({e.name} is missing): "
                          "pip install fastapi uvicorn pydantic") from None
    from ..llm import LLM
    from ..model.loading import BUNDLED_MODEL
    from ..server.kernels import no_request_waits, wait_for_kernels

    wait_kernels = no_request_waits()  # from here no request waits for a kernel build; "wait": the load does
    sock = _bind(args.host, args.port)
    name = args.served_model_name or args.model or BUNDLED_MODEL
    server: list = []  # filled below; a failed load (on the worker thread) stops it
    engines: list = []  # the engine, for make_llm to see a SIGTERM (it starts running before the list is filled)

    def make_llm():
        t0 = time.perf_counter()
        if tp:
            from ..parallel import init
            # joins the others (part of the load: /health says 503 meanwhile)
            init(timeout_s=args.tp_timeout, device=getattr(args, "device", None))
        llm = LLM(config=options)
        llm.tokenizer.special_tokens_in_messages = args.special_tokens_in_messages
        if wait_kernels and not tp:
            why = wait_for_kernels(llm, lambda: bool(engines) and engines[0].draining)
            if why:
                print(f"sluice serve: not waiting for its native kernels any more ({why}); the torch path serves "
                      "until they land", file=sys.stderr)
        print(f"sluice serve: {name} loaded in {time.perf_counter() - t0:.1f} s; ready", file=sys.stderr)
        return llm

    def stop_server(_err):  # the load failed, or (--tp) the group broke: the engine serves no more
        if server:
            server[0].should_exit = True

    # Under --tp, rank 0 drives its LLM through a Leader that the followers' steps follow.
    from ..parallel.lockstep import Leader
    lockstep = (lambda llm: Leader(llm, args.tp_timeout)) if tp else None
    engine = BatchServingEngine(make_llm, name, max_queue=args.max_queue, on_fatal=stop_server, lockstep=lockstep,
                                stream_interval=args.stream_interval)
    engines.append(engine)
    app = create_app(engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    # uvicorn's own drain timeout is the backstop for a connection that will not close after ours
    config = uvicorn.Config(app, log_level="info", lifespan="off", timeout_graceful_shutdown=args.shutdown_timeout + 5,
                            log_config=_log_config(), **UVICORN_OPTIONS)
    server.append(_DrainingServer(config, engine, args.shutdown_timeout))
    if engine.load_error is not None or engine.fatal_error is not None:  # before the server existed to be told
        server[0].should_exit = True
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"sluice serve: {name} on http://{host}:{sock.getsockname()[1]}/v1 (loading; /health says when "
          "ready)", file=sys.stderr)
    try:
        server[0].run(sockets=[sock])
    finally:
        engine.close(timeout=10)  # under --tp its worker tells the other ranks to stop
        sock.close()
        if tp and engine.fatal_error is None:
            from ..parallel import shutdown
            shutdown()
    if engine.fatal_error is not None:
        from ..parallel import ParallelError
        raise ParallelError(str(engine.fatal_error))
    if engine.load_error is not None:
        err = engine.load_error
        raise err if isinstance(err, (SluiceError, OSError, MemoryError)) else SluiceError(
            f"the model failed to load: {type(err).__name__}: {err}")
    return 0


def _log_config() -> dict:
    """uvicorn's own logging, its access line ending in the request's x-request-id (server/guard.py)."""
    from uvicorn.config import LOGGING_CONFIG
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["access"]["fmt"] += " x-request-id=%(request_id)s"
    config["filters"] = {"request_id": {"()": "sluice.server.guard.RequestIdFilter"}}
    config["handlers"]["access"]["filters"] = ["request_id"]
    return config


def _draining_server_class():
    import uvicorn

    from ..server.engine import Draining

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, told that a signal means drain: the engine refuses new requests (503)
        while uvicorn lets the open ones finish. The signal is not re-raised after the drain (uvicorn
        would, and SIGTERM's default action would end the process with status -15 instead of 0)."""

        def __init__(self, config, engine, deadline: float):
            super().__init__(config)
            self.engine, self.deadline = engine, deadline

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                self.engine.begin_drain()
                # At the deadline the engine ends what is left, so each stream still gets its
                # finish_reason and [DONE] (uvicorn's own timeout, later, would cut them mid-chunk).
                timer = threading.Timer(self.deadline, self.engine.abort_all,
                                        (Draining("the server shut down before this request finished"),))
                timer.daemon = True
                timer.start()
            elif sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting
            self.should_exit = True

    return DrainingServer


def _DrainingServer(config, engine, deadline):  # noqa: N802 -- a class, built on first use: --help needs no uvicorn
    return _draining_server_class()(config, engine, deadline)

