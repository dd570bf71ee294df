"""`tangram serve`: one orchestrator serving many client processes over TCP.

    tangram serve [--config FILE] [--host 127.0.0.1] [--port 7450] [--token T]
                  [--policy P] [--max-frame BYTES] [--grace SECONDS] [--manager KIND=NAME]
                  [--sandbox-fusion-port PORT] [--sandbox-fusion-fresh] [--sandbox-fusion-cpu CORES]
                  [--sandbox-fusion-max-sessions N] [--sandbox-fusion-max-connections N]
                  [--sandbox-fusion-client-timeout SECONDS]

The command parses its arguments and configuration, makes the Server (tangram.server.server)
and runs it until SIGTERM or SIGINT; --log-actions appends every finished action's record
to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import signal
import socket
import sys
from typing import Any, Callable

from .._errors import TangramError, ValidationError
from ..runtime.config import RuntimeConfig
from ..runtime.managers.base import ResourceManager, manager_class
from ..runtime.orchestrator import Orchestrator
from ..runtime.records import ActionRecord
from ..scheduler import OBJECTIVES
from . import protocol as P
from .protocol import is_loopback
from .server import Server


def _parser() -> argparse.ArgumentParser:
    from .._arguments import ArgumentParser, non_negative_seconds, positive_int, positive_number

    def port(text: str) -> int:
        if not text.isdigit() or int(text) > 65535:
            raise argparse.ArgumentTypeError(f"expected a TCP port, 0 to 65535, got {text!r}")
        return int(text)

    parser = ArgumentParser(
        prog="tangram serve", description="Serve one orchestrator to many client processes (tangram.Client).",
        epilog="Prints 'tangram serve: listening on HOST:PORT ...' once ready. SIGTERM/SIGINT shut it down: "
               "running actions get --grace seconds to finish, the rest are cancelled; a second signal cancels at once.")
    parser.add_argument("--config", help="runtime configuration file (.toml or .json; see tangram.RuntimeConfig)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; anything other "
                                                            "than loopback requires a token)")
    parser.add_argument("--port", type=port, default=P.DEFAULT_PORT,
                        help=f"TCP port (default {P.DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--token", default=None, help="shared secret clients must present (default: $TANGRAM_TOKEN; "
                                                      "prefer the variable: arguments are visible in ps)")
    parser.add_argument("--policy", default=None, help="scheduling policy (default: the config's, else tangram)")
    parser.add_argument("--objective", choices=OBJECTIVES, default=None,
                        help="what the policy's order serves: 'step' (a synchronous trainer's step; the default) or "
                             "'act' (mean ACT, for asynchronous trainers; docs/scheduling.md, Objectives). Default: "
                             "the config's")
    parser.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                        help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (overrides the config's "
                             "metrics_port)")
    parser.add_argument("--log-actions", default=None, metavar="FILE",
                        help="append one JSON line per finished action to FILE: its record (tangram.ActionRecord's "
                             "fields)")
    parser.add_argument("--max-frame", type=int, default=P.DEFAULT_MAX_FRAME,
                        help=f"largest frame accepted from a client, bytes (default {P.DEFAULT_MAX_FRAME})")
    parser.add_argument("--grace", type=non_negative_seconds, default=10.0,
                        help="seconds running actions get to finish at shutdown (default 10)")
    parser.add_argument("--sandbox-fusion-port", type=port, default=None, metavar="PORT",
                        help="also serve Sandbox Fusion's HTTP API (POST /run_code, GET /v1/ping) on PORT, same host, "
                             "orchestrator and token (Sandbox Fusion's own default port is 8080; 0 picks a free one)")
    parser.add_argument("--sandbox-fusion-fresh", action="store_true",
                        help="run each Sandbox Fusion request without a session in a new sandbox, ended after it "
                             "(default: a pooled one, in a fresh directory, its processes killed)")
    parser.add_argument("--sandbox-fusion-cpu", type=float, default=1.0, metavar="CORES",
                        help="cores each Sandbox Fusion request is guaranteed (default 1: a single-threaded program "
                             "runs at full speed, so its run_timeout holds under load; 0.5 runs two per core when "
                             "every core is taken)")
    parser.add_argument("--sandbox-fusion-max-sessions", type=positive_int, default=None, metavar="N",
                        help="Sandbox Fusion sessions open at once; a new one past it is refused in-band (default 256, "
                             "or the descriptor limit / 16 if lower)")
    parser.add_argument("--sandbox-fusion-max-connections", type=positive_int, default=None, metavar="N",
                        help="HTTP connections open at once; more get 503 (default 1024, or half the descriptor limit "
                             "if lower)")
    parser.add_argument("--sandbox-fusion-client-timeout", type=positive_number, default=None, metavar="SECONDS",
                        help="seconds an HTTP client has to send a request's head or body, or to take its answer "
                             "(default 60)")
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                        help="schedule a Ray cluster: connect to it (ray.init(address=ADDRESS); default 'auto', the "
                             "cluster this host belongs to) and run every action on its nodes, one scheduler for all "
                             "of them (tangram.ray.RayOrchestrator, options from the config's [managers.ray]); a "
                             "second scheduler on the same cluster is refused (docs/ray.md)")
    parser.add_argument("--manager", action="append", default=[], metavar="KIND=NAME",
                        help="serve KIND's actions with manager NAME (a registered name, or module:Class), e.g. "
                             "cpu=mock to measure the protocol alone (options from the config's [managers.NAME]); "
                             "repeatable")
    return parser


RayOrchestratorFactory = Callable[[str, RuntimeConfig, "str | None", str], Orchestrator]


def cli_main(argv: list[str] | None = None, ray_orchestrator: RayOrchestratorFactory | None = None) -> int:
    """`tangram serve`. `ray_orchestrator(address, config, policy, serves)` makes the
    orchestrator of `--ray` (the command passes tangram.ray.connect_orchestrator: the
    server's layer sits below the Ray backend's)."""
    parser = _parser()
    args = parser.parse_args(argv)
    token = args.token if args.token is not None else os.environ.get("TANGRAM_TOKEN") or None
    try:
        config = _load_config(args.config) if args.config else RuntimeConfig()
        if args.objective is not None:
            config = dataclasses.replace(config, objective=args.objective)
        if args.metrics_port is not None:
            config = dataclasses.replace(config, metrics_port=args.metrics_port)
        managers: dict[str, ResourceManager] = {}
        for item in args.manager:
            kind, sep, name = item.partition("=")
            if not sep or not kind or not name:
                raise ValidationError("--manager", f"expected KIND=NAME, got {item!r}")
            cls = _import_manager(name) if ":" in name else manager_class(name)
            try:
                managers[kind] = cls(**dict(config.managers.get(name, {})))
            except TypeError as e:  # options the manager does not take
                raise ValidationError(f"managers.{name}", f"bad options for {cls.__name__}: {e}") from None
        options: dict[str, Any] = dict(host=args.host, port=args.port, token=token, max_frame=args.max_frame,
                                       sandbox_fusion_port=args.sandbox_fusion_port,
                                       sandbox_fusion_fresh=args.sandbox_fusion_fresh,
                                       sandbox_fusion_cpu=args.sandbox_fusion_cpu,
                                       sandbox_fusion_options={k: v for k, v in (
                                           ("max_sessions", args.sandbox_fusion_max_sessions),
                                           ("max_connections", args.sandbox_fusion_max_connections),
                                           ("client_timeout", args.sandbox_fusion_client_timeout)) if v is not None})
        if args.ray is not None:
            if managers:
                raise ValidationError("--manager", "not with --ray: the cluster's node agents run every action "
                                                   "(tangram.ray.RayManager)")
            if ray_orchestrator is None:
                raise ValidationError("--ray", "this entry point cannot reach the Ray backend; run `tangram serve`")
            serves = f"tangram serve on {socket.gethostname()}:{args.port}"
            server = Server(orchestrator=ray_orchestrator(args.ray, config, args.policy, serves), **options)
        else:
            server = Server(config, policy=args.policy, managers=managers, **options)
        gc.set_threshold(*GC_THRESHOLDS)
        with ActionLog(args.log_actions) if args.log_actions else contextlib.nullcontext() as log:
            if log is not None:
                server.orchestrator.records.add_listener(log.write)
            return asyncio.run(_serve(server, args.grace))
    except (TangramError, OSError) as e:
        print(f"tangram serve: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


def _load_config(path: str) -> RuntimeConfig:
    """The --config file; one that cannot be read or parsed, or whose shape is wrong, is a
    ValidationError naming the file."""
    try:
        return RuntimeConfig.from_file(path)
    except TangramError:
        raise
    except OSError as e:
        raise ValidationError("--config", f"cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValidationError("--config", f"{path!r} is not UTF-8 text: {e}") from None
    except ValueError as e:  # JSONDecodeError and TOMLDecodeError say the line and column
        raise ValidationError("--config", f"{path!r} is not valid {'JSON' if path.endswith('.json') else 'TOML'}: "
                                          f"{e}") from None
    except (TypeError, KeyError, AttributeError) as e:  # a setting of the wrong shape
        raise ValidationError("--config", f"{path!r}: a setting has the wrong shape "
                                          f"({type(e).__name__}: {e})") from None


def _import_manager(target: str) -> type[ResourceManager]:
    import importlib

    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValidationError("--manager", f"cannot import {target!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, ResourceManager)):
        raise ValidationError("--manager", f"{target} is not a ResourceManager subclass")
    return cls


# The server is a long-lived process whose orchestrator keeps up to `max_records` action
# records (100,000 by default): with CPython's default thresholds (700, 10, 10) the cyclic
# garbage collector rescans that growing population so often that throughput halves by
# the time the record log is full. Fewer, larger young collections keep it steady
# (docs/server.md, Measurements); startup objects are frozen out of collections.
GC_THRESHOLDS = (10_000, 20, 20)


class ActionLog:
    """`tangram serve --log-actions FILE`: one JSON object per finished action, a line each,
    with the fields of its ActionRecord, appended as it ends and flushed at once (a reader
    tailing the file sees every ended action; a crash loses none already written)."""

    def __init__(self, path: str) -> None:
        try:
            self._file = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise ValidationError("--log-actions", f"cannot open {path!r} for appending: {e.strerror}") from None

    def write(self, record: ActionRecord) -> None:
        self._file.write(json.dumps(dataclasses.asdict(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def __enter__(self) -> "ActionLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


async def _serve(server: Server, grace: float) -> int:
    await server.start()
    gc.freeze()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            server.force_close()
        else:
            stop.set()  # first: the note below may fail to reach stderr
            _note(f"tangram serve: {signal.Signals(signum).name}: shutting down (running actions get {grace:g} s)")

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    assert server.address is not None
    orch = server.orchestrator
    print(f"tangram serve: listening on {P.format_address(*server.address)} (policy {orch.policy}; managers "
          f"{', '.join(f'{k}={type(m).__name__}' for k, m in orch.managers.items())}; "
          f"token {'required' if server.token else 'not required'})", flush=True)
    if server.sandbox_fusion is not None and server.sandbox_fusion.address is not None:
        host, port = server.sandbox_fusion.address
        print(f"tangram serve: Sandbox Fusion API on http://{P.format_address(host, port)}/run_code", flush=True)
    ray_manager = orch.managers.get("ray")
    if ray_manager is not None:
        nodes = ", ".join(f"{n.name} ({n.resources.get('cpu', 0):g} cpu, {len(n.gpus)} gpu)"
                          for n in orch.inventory.nodes)
        print(f"tangram serve: scheduling the Ray cluster: {nodes}", flush=True)
        if is_loopback(server.host):
            print("tangram serve: listening on loopback: only clients on this node can reach it (--host 0.0.0.0 "
                  "with a token for the cluster's other nodes)", flush=True)
    await stop.wait()
    await server.close(grace)
    _note("tangram serve: stopped")
    return 0


def _note(text: str) -> None:
    """A line on stderr, which may be closed (a supervisor or a pipe that went away):
    shutting down must not depend on it, and a signal handler never raises."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a broken pipe, a closed descriptor or file
        pass
