"""A local search API for the demo, with its own rate limit, as a real HTTP server.

    python -m tangram.demo.search_server --rate 20 --burst 5   # prints "port N", serves

GET /search?q=...  -> {"query": ..., "results": [{"title", "snippet"}...]}, or 429 when a
                      request comes faster than the server's token bucket allows
GET /stats         -> {"requests", "rejected", "max_in_window", "window"}: what it saw,
                      so a test (and the demo) can check the orchestrator kept within
                      the limit: max_in_window is the most requests it admitted in any
                      sliding window of `window` seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

CORPUS = [
    ("Sieve of Eratosthenes", "Mark multiples of each prime from its square; what stays unmarked is prime."),
    ("Trial division", "Test divisors up to the square root; stop at the first that divides."),
    ("Prime counting function", "pi(n) counts primes up to n; pi(10^4) = 1229, pi(10^5) = 9592."),
    ("Python multiprocessing.Pool", "Pool(processes).map splits an iterable across worker processes."),
    ("Amdahl's law", "Speed-up with n workers is 1 / ((1 - p) + p / n) for parallel fraction p."),
    ("pytest -n", "pytest-xdist runs tests in parallel on n workers."),
]


class Limiter:
    """Token bucket (rate per second, burst) plus a log of admission times."""

    def __init__(self, rate: float, burst: int, window: float) -> None:
        self.rate, self.burst, self.window = rate, burst, window
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.lock = threading.Lock()
        self.admitted: deque[float] = deque()
        self.requests = self.rejected = self.max_in_window = 0

    def admit(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.requests += 1
            self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens < 1.0 - 1e-9:
                self.rejected += 1
                return False
            self.tokens -= 1.0
            self.admitted.append(now)
            while self.admitted and self.admitted[0] <= now - self.window:
                self.admitted.popleft()
            self.max_in_window = max(self.max_in_window, len(self.admitted))
            return True

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {"requests": self.requests, "rejected": self.rejected, "max_in_window": self.max_in_window,
                    "window": self.window, "rate": self.rate, "burst": self.burst}


def make_server(rate: float, burst: int, window: float = 1.0, port: int = 0) -> ThreadingHTTPServer:
    limiter = Limiter(rate, burst, window)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            if url.path == "/stats":
                return self._send(200, limiter.stats())
            if url.path != "/search":
                return self._send(404, {"error": "unknown path"})
            if not limiter.admit():
                return self._send(429, {"error": "rate limit exceeded"})
            query = parse_qs(url.query).get("q", [""])[0]
            words = set(query.lower().split())
            ranked = sorted(CORPUS, key=lambda doc: -len(words & set((doc[0] + " " + doc[1]).lower().split())))
            time.sleep(0.02)  # a remote API's latency
            self._send(200, {"query": query, "results": [{"title": t, "snippet": s} for t, s in ranked[:3]]})

        def _send(self, code: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--burst", type=int, default=5)
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = make_server(args.rate, args.burst, args.window, args.port)
    print(f"port {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
