"""Per-action records and the Prometheus metrics derived from them."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Iterable, Iterator

OUTCOMES = ("ok", "failed", "crashed", "timeout", "limit", "cancelled", "infeasible")


@dataclass(slots=True)
class ActionRecord:
    """What happened to one action. Times are the orchestrator's clock in seconds (0 at
    start); `start`/`node`/`device`/`grant` stay None when it never ran. `wait_reason` is
    the core's explanation of why it waited (taken when it did not start at once: quota,
    service restoring, resources...), empty when it started in the pass of its submit."""

    id: int
    kind: str
    trajectory: int
    manager: str
    submit: float
    start: float | None = None
    end: float | None = None
    node: str | None = None
    device: int | None = None
    grant: float | None = None
    outcome: str | None = None
    wait_reason: str = ""
    error: str = ""

    @property
    def act(self) -> float | None:
        """Action completion time: end - submit (wait + run)."""
        return None if self.end is None else self.end - self.submit

    @property
    def wait(self) -> float | None:
        return None if self.start is None else self.start - self.submit


_RECORD_FIELDS = tuple(f.name for f in fields(ActionRecord))


class RecordLog:
    """The last `limit` finished records, plus optional listeners (an exporter, a file).

    Kept as plain tuples: the garbage collector stops tracking a tuple of numbers and
    strings, where it would rescan 100,000 record objects on every full collection
    (which halved the orchestrator's throughput as the log filled)."""

    def __init__(self, limit: int = 100_000) -> None:
        self._finished: deque[tuple[Any, ...]] = deque(maxlen=limit)
        self._listeners: list[Callable[[ActionRecord], None]] = []

    def add_listener(self, fn: Callable[[ActionRecord], None]) -> None:
        self._listeners.append(fn)

    def finish(self, record: ActionRecord) -> None:
        self._finished.append(tuple(getattr(record, name) for name in _RECORD_FIELDS))
        for fn in self._listeners:
            fn(record)

    def __iter__(self) -> Iterator[ActionRecord]:
        return (ActionRecord(*values) for values in list(self._finished))

    def __len__(self) -> int:
        return len(self._finished)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) | {"act": r.act} for r in self]


# ACT spans milliseconds (an API call) to minutes (a test suite, a queue under a burst).
ACT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """Prometheus metrics of one orchestrator, in its own registry (several orchestrators
    in one process do not collide). Histograms and counters are updated as actions end;
    queue lengths and utilisation are read from the core when scraped, at no per-action
    cost.

      tangram_action_completion_seconds{kind}   ACT histogram (wait + run)
      tangram_action_wait_seconds{kind}         wait histogram (submit to start)
      tangram_actions_total{kind,outcome}       terminal states
      tangram_actions_waiting{kind} / _running{kind}
      tangram_resource_utilisation{node,resource}   held / capacity, from the core
    """

    def __init__(self, orchestrator: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import GaugeMetricFamily

        self.registry = CollectorRegistry(auto_describe=True)
        self.act = Histogram("tangram_action_completion_seconds", "Action completion time (wait + run)",
                             ["kind"], buckets=ACT_BUCKETS, registry=self.registry)
        self.wait = Histogram("tangram_action_wait_seconds", "Time from submit to start", ["kind"],
                              buckets=ACT_BUCKETS, registry=self.registry)
        self.outcomes = Counter("tangram_actions", "Actions by terminal state", ["kind", "outcome"],
                                registry=self.registry)
        self._children: dict[tuple[str, str | None], tuple[Any, Any, Any]] = {}
        orch = orchestrator

        class _Live:
            def collect(self) -> Iterable[Any]:
                waiting = GaugeMetricFamily("tangram_actions_waiting", "Actions waiting", labels=["kind"])
                running = GaugeMetricFamily("tangram_actions_running", "Actions running", labels=["kind"])
                for kind, (w, r) in sorted(orch.queue_lengths().items()):
                    waiting.add_metric([kind], w)
                    running.add_metric([kind], r)
                util = GaugeMetricFamily("tangram_resource_utilisation", "Share of capacity held by running actions",
                                         labels=["node", "resource"])
                for (node, resource), share in sorted(orch.utilisation().items()):
                    util.add_metric([node, resource], share)
                return [waiting, running, util]

            def describe(self) -> Iterable[Any]:
                return []

        self.registry.register(_Live())  # type: ignore[arg-type]

    def observe(self, record: ActionRecord) -> None:
        # Labelled children are cached: labels() costs microseconds, an action tens.
        key = (record.kind, record.outcome)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.outcomes.labels(*key), self.act.labels(record.kind),
                                              self.wait.labels(record.kind))
        outcome, act, wait = children
        outcome.inc()
        if record.end is not None:
            act.observe(record.end - record.submit)
        if record.start is not None:
            wait.observe(record.start - record.submit)

    def text(self) -> bytes:
        """The exposition format, as a scrape would return it."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Serves /metrics over HTTP on (addr, port); returns the server (call .shutdown())."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
