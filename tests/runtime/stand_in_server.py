"""A stand-in for a vLLM or SGLang reward-model server: their HTTP protocols for health,
sleep and wake-up, and scoring, without a model or a GPU (standard library only).

    python stand_in_server.py --port P [--host 127.0.0.1] --protocol vllm|sglang
        [--load-seconds S] [--sleep-seconds S] [--wake-seconds S] [--score-seconds S]
        [--fail-after N] [--exit-after N] [--crash-at-startup CODE] [--spawn-child]
        [--ignore-sigterm] [--enable-sleep-mode] [--enable-memory-saver]

Both protocols
    GET /health     200 once the "model" is loaded (--load-seconds after start), 503 before
    GET /stats      what it saw: sleeps, wakes, scored requests, the most scoring requests
                    in flight at once, the CUDA_VISIBLE_DEVICES it was started with (and a
                    few other variables), its pid (and its child's with --spawn-child),
                    whether it is asleep
vLLM (each answers 404 unless VLLM_SERVER_DEV_MODE=1, as vLLM's development endpoints do)
    POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping -> {"is_sleeping": bool}
    POST /pooling   {"input": text} -> {"data": [{"index": 0, "data": [len(text)]}], "device": ...}
SGLang
    POST /release_memory_occupation {}, POST /resume_memory_occupation {}
    POST /classify  {"text": text} -> {"embedding": [len(text)], "device": ...}

A score is the length of the text, and every answer to a scoring request carries the
CUDA_VISIBLE_DEVICES the server was started with, so a test can check both the output and
the device. Scoring while asleep answers 503. As the real servers, it frees no memory
without its flag: a sleep answers 500 unless vLLM's stand-in runs with --enable-sleep-mode
and SGLang's with --enable-memory-saver. --fail-after N: scoring requests after the
first N answer 500. --exit-after N: the process exits with code 4 at the request after the
first N scored ones, without answering it. --crash-at-startup CODE: it writes a line to
stderr and exits with CODE while loading. --spawn-child: it starts a child process in its
process group (the child only sleeps), to check that a whole group is stopped.
--ignore-sigterm: it ignores SIGTERM (only SIGKILL stops it). Otherwise SIGTERM stops it
cleanly, exit code 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


class State:
    """What the server is doing and has seen; every field under `lock`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.loaded = False
        self.asleep = False
        self.sleeps = 0
        self.wakes = 0
        self.sleep_levels: list[int] = []
        self.scored = 0  # scoring requests received (answered or not)
        self.in_flight = 0
        self.max_concurrent = 0
        self.device = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.child: subprocess.Popen[bytes] | None = None

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"sleeps": self.sleeps, "wakes": self.wakes, "sleep_levels": list(self.sleep_levels),
                    "scored": self.scored, "max_concurrent": self.max_concurrent, "asleep": self.asleep,
                    "loaded": self.loaded, "cuda_visible_devices": self.device, "pid": os.getpid(),
                    "child_pid": self.child.pid if self.child is not None else None,
                    "env": {k: os.environ.get(k) for k in ("TANGRAM_GPU_MEMORY_MIB", "STAND_IN_TAG",
                                                           "VLLM_SERVER_DEV_MODE")},
                    "protocol": self.args.protocol}


def make_server(args: argparse.Namespace, state: State) -> ThreadingHTTPServer:
    vllm = args.protocol == "vllm"
    score_path, text_key = ("/pooling", "input") if vllm else ("/classify", "text")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *values: Any) -> None:  # noqa: A002 (http.server's name)
            sys.stderr.write(f"stand-in: {self.command} {self.path}: {format % values}\n")

        def _send(self, status: int, body: Any = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else None

        def _dev_mode(self) -> bool:
            if os.environ.get(DEV_MODE_ENV) == "1":
                return True
            self._send(404, {"detail": "Not Found"})  # vLLM registers these routes only in dev mode
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = urlsplit(self.path).path
            if path == "/health":
                with state.lock:
                    loaded = state.loaded
                return self._send(200 if loaded else 503, None if loaded else {"detail": "loading"})
            if path == "/stats":
                return self._send(200, state.stats())
            if vllm and path == "/is_sleeping":
                if self._dev_mode():
                    with state.lock:
                        asleep = state.asleep
                    self._send(200, {"is_sleeping": asleep})
                return
            self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            if url.path == score_path:
                return self._score()
            if vllm and url.path == "/sleep":
                if self._dev_mode():
                    level = int(parse_qs(url.query).get("level", ["1"])[0])
                    self._sleep(level)
                return
            if vllm and url.path == "/wake_up":
                if self._dev_mode():
                    self._wake()
                return
            if not vllm and url.path == "/release_memory_occupation":
                self._body()
                return self._sleep(None)
            if not vllm and url.path == "/resume_memory_occupation":
                self._body()
                return self._wake()
            self._send(404, {"detail": "Not Found"})

        def _sleep(self, level: int | None) -> None:
            if not (args.enable_sleep_mode if vllm else args.enable_memory_saver):
                flag = "--enable-sleep-mode" if vllm else "--enable-memory-saver"
                return self._send(500, {"detail": f"memory cannot be released: started without {flag}"})
            time.sleep(args.sleep_seconds)
            with state.lock:
                state.asleep = True
                state.sleeps += 1
                if level is not None:
                    state.sleep_levels.append(level)
            self._send(200, None if vllm else {"success": True, "message": "Memory released."})

        def _wake(self) -> None:
            time.sleep(args.wake_seconds)
            with state.lock:
                state.asleep = False
                state.wakes += 1
            self._send(200, None if vllm else {"success": True, "message": "Memory resumed."})

        def _score(self) -> None:
            body = self._body()
            with state.lock:
                state.scored += 1
                count = state.scored
                state.in_flight += 1
                state.max_concurrent = max(state.max_concurrent, state.in_flight)
                asleep = state.asleep
            if args.exit_after is not None and count > args.exit_after:
                sys.stderr.write(f"stand-in: exiting at scoring request {count}\n")
                sys.stderr.flush()
                os._exit(4)
            time.sleep(args.score_seconds)
            status, answer = self._answer(body, count, asleep)
            with state.lock:  # before answering: the client's next request may come at once
                state.in_flight -= 1
            self._send(status, answer)

        def _answer(self, body: Any, count: int, asleep: bool) -> tuple[int, Any]:
            if asleep:
                return 503, {"detail": "the model is asleep"}
            if args.fail_after is not None and count > args.fail_after:
                return 500, {"detail": f"stand-in failure at scoring request {count}"}
            if not isinstance(body, dict) or not isinstance(body.get(text_key), str):
                return 400, {"detail": f"expected a JSON object with a string {text_key!r}"}
            score = float(len(body[text_key]))
            if vllm:
                return 200, {"object": "list", "data": [{"index": 0, "object": "pooling", "data": [score]}],
                             "device": state.device}
            return 200, {"embedding": [score], "meta_info": {"id": str(count)}, "device": state.device}

    return ThreadingHTTPServer((args.host, args.port), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--protocol", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--sleep-seconds", type=float, default=0.0)
    parser.add_argument("--wake-seconds", type=float, default=0.0)
    parser.add_argument("--score-seconds", type=float, default=0.0)
    parser.add_argument("--fail-after", type=int, default=None)
    parser.add_argument("--exit-after", type=int, default=None)
    parser.add_argument("--crash-at-startup", type=int, default=None, metavar="CODE")
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--enable-sleep-mode", action="store_true", help="vLLM's flag")
    parser.add_argument("--enable-memory-saver", action="store_true", help="SGLang's flag")
    args = parser.parse_args(argv)

    state = State(args)
    print(f"stand-in: {args.protocol} server (pid {os.getpid()}) starting on {args.host}:{args.port}, "
          f"CUDA_VISIBLE_DEVICES={state.device}", flush=True)
    if args.crash_at_startup is not None:
        sys.stderr.write("stand-in: failing to load the model: CUDA out of memory (simulated)\n")
        return args.crash_at_startup
    if args.spawn_child:  # in this process group; it outlives this process unless the group is stopped
        state.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    server = make_server(args, state)
    server.daemon_threads = True  # a request in flight does not hold the exit up

    def loaded() -> None:
        time.sleep(args.load_seconds)
        with state.lock:
            state.loaded = True
        print("stand-in: model loaded", flush=True)

    threading.Thread(target=loaded, daemon=True).start()

    def stop(signum: int, frame: Any) -> None:
        print("stand-in: SIGTERM, stopping", flush=True)
        threading.Thread(target=server.shutdown, daemon=True).start()  # shutdown() waits for serve_forever

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else stop)
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
