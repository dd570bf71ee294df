"""Per-action records and the Prometheus metrics derived from them."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from dataclasses import asdict, dataclass, fields
from operator import attrgetter
from typing import Any, Callable, Iterable, Iterator

OUTCOMES = ("ok", "failed", "crashed", "timeout", "limit", "cancelled", "infeasible")


@dataclass(slots=True)
class ActionRecord:
    """What happened to one action. Times are the orchestrator's clock in seconds (0 at
    start); `start`/`node`/`device`/`grant` stay None when it never ran. `wait_reason` is
    the core's explanation of why it waited (taken when it did not start at once: quota,
    service restoring, resources...), empty when it started in the pass of its submit.
    `estimate` says what run time it was planned with and where that came from ("declared",
    or learned from earlier runs: tangram.estimates)."""

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
    estimate: str = ""
    quota: str = ""  # the API quota it was admitted under ("" for none)

    @property
    def act(self) -> float | None:
        """Action completion time: end - submit (wait + run)."""
        return None if self.end is None else self.end - self.submit

    @property
    def wait(self) -> float | None:
        return None if self.start is None else self.start - self.submit


_RECORD_FIELDS = tuple(f.name for f in fields(ActionRecord))
_record_values = attrgetter(*_RECORD_FIELDS)  # the record as a tuple, in one C call
_END, _SUBMIT = _RECORD_FIELDS.index("end"), _RECORD_FIELDS.index("submit")


class RecordLog:
    """The last `limit` finished records, plus optional listeners (an exporter, a file).

    Kept as plain tuples: the garbage collector stops tracking a tuple of numbers and
    strings, where it would rescan 100,000 record objects on every full collection
    (which halved the orchestrator's throughput as the log filled)."""

    def __init__(self, limit: int = 100_000, decode: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None
                 ) -> None:
        # decode: entries appended in another form (a Client's: the server's packed bytes)
        # become field values only when read, so an action that nobody's records look at
        # costs no decoding.
        self._finished: deque[tuple[Any, ...]] = deque(maxlen=limit)
        self._listeners: list[Callable[[ActionRecord], None]] = []
        self._decode = decode

    def add_listener(self, fn: Callable[[ActionRecord], None]) -> None:
        self._listeners.append(fn)

    def finish(self, record: ActionRecord) -> None:
        self._finished.append(_record_values(record))
        for fn in self._listeners:
            fn(record)

    def append(self, entry: tuple[Any, ...]) -> None:
        """A finished record given as its field values, in ActionRecord's order, or in the
        form the log's `decode` turns into them."""
        self._finished.append(entry)
        if self._listeners:
            record = ActionRecord(*(entry if self._decode is None else self._decode(entry)))
            for fn in self._listeners:
                fn(record)

    def __iter__(self) -> Iterator[ActionRecord]:
        decode = self._decode
        if decode is None:
            return (ActionRecord(*values) for values in list(self._finished))
        return (ActionRecord(*decode(entry)) for entry in list(self._finished))

    def __len__(self) -> int:
        return len(self._finished)

    def recent_acts(self, since: float) -> list[float]:
        """The ACT of every kept record that ended at or after `since` (an end time on the
        records' clock), newest first: a walk from the newest back to the first older one
        (records end in time order). Entries kept in another form (a Client's) have none."""
        if self._decode is not None:
            return []
        acts = []
        for entry in reversed(self._finished):
            end = entry[_END]
            if end is None or end < since:
                break
            acts.append(end - entry[_SUBMIT])
        return acts

    def as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) | {"act": r.act} for r in self]


# ACT spans milliseconds (an API call) to minutes (a test suite, a queue under a burst).
ACT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """Prometheus metrics of one orchestrator, in its own registry (several orchestrators
    in one process do not collide). Histograms and counters are updated as actions end;
    queue lengths and utilisation are read from the core when scraped, at no per-action
    cost.

      tangram_action_completion_seconds{kind,quota}   ACT histogram (wait + run)
      tangram_action_wait_seconds{kind,quota}         wait histogram (submit to start)
      tangram_actions_total{kind,quota,outcome}       terminal states
      tangram_actions_waiting{kind} / _running{kind}
      tangram_resource_utilisation{node,resource}   held / capacity, from the core

    The histograms and counters are plain per-kind lists, turned into metric families
    when scraped: prometheus_client's Histogram and Counter objects take a lock and loop
    over the buckets in Python per observation, about twice the cost per action
    (bench/server_costs.py measures both). A lock keeps a scrape
    (from the HTTP server's thread) consistent with the updates of the event loop.
    """

    def __init__(self, orchestrator: Any) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, str, str | None], int] = {}
        # (kind, quota) -> (counts per bucket, the last one +Inf, not cumulative; [sum])
        self._act: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        self._wait: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        metrics = self
        orch = orchestrator

        class _Collector:
            def collect(self) -> Iterable[Any]:
                return metrics._families(orch)

            def describe(self) -> Iterable[Any]:
                return []

        self.registry.register(_Collector())  # type: ignore[arg-type]

    def observe(self, record: ActionRecord) -> None:
        labels = (record.kind, record.quota)
        with self._lock:
            key = (*labels, record.outcome)
            self._outcomes[key] = self._outcomes.get(key, 0) + 1
            if record.end is not None:
                _observe(self._act, labels, record.end - record.submit)
            if record.start is not None:
                _observe(self._wait, labels, record.start - record.submit)

    def _families(self, orch: Any) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        families: list[Any] = []
        with self._lock:
            outcomes = sorted(self._outcomes.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2])))
            hists = [(name, doc, sorted((k, list(c), s[0]) for k, (c, s) in table.items()))
                     for name, doc, table in (
                         ("tangram_action_completion_seconds", "Action completion time (wait + run)", self._act),
                         ("tangram_action_wait_seconds", "Time from submit to start", self._wait))]
        for name, doc, rows in hists:
            family = HistogramMetricFamily(name, doc, labels=["kind", "quota"])
            for labels, counts, total in rows:
                cumulative, buckets = 0, []
                for bound, count in zip((*(f"{b:g}" for b in ACT_BUCKETS), "+Inf"), counts):
                    cumulative += count
                    buckets.append((bound, cumulative))
                family.add_metric(list(labels), buckets, total)
            families.append(family)
        counter = CounterMetricFamily("tangram_actions", "Actions by terminal state", labels=["kind", "quota", "outcome"])
        for (kind, quota, outcome), count in outcomes:
            counter.add_metric([kind, quota, str(outcome)], count)
        families.append(counter)
        waiting = GaugeMetricFamily("tangram_actions_waiting", "Actions waiting", labels=["kind"])
        running = GaugeMetricFamily("tangram_actions_running", "Actions running", labels=["kind"])
        for kind, (w, r) in sorted(orch.queue_lengths_now().items()):
            waiting.add_metric([kind], w)
            running.add_metric([kind], r)
        util = GaugeMetricFamily("tangram_resource_utilisation", "Share of capacity held by running actions",
                                 labels=["node", "resource"])
        for (node, resource), share in sorted(orch.utilisation_now().items()):
            util.add_metric([node, resource], share)
        return [*families, waiting, running, util]

    def text(self) -> bytes:
        """The exposition format, as a scrape would return it."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Serves /metrics over HTTP on (addr, port); returns the server (call .shutdown())."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server


def _observe(table: dict[tuple[str, str], tuple[list[int], list[float]]], labels: tuple[str, str],
             value: float) -> None:
    row = table.get(labels)
    if row is None:
        row = table[labels] = ([0] * (len(ACT_BUCKETS) + 1), [0.0])
    row[0][bisect_left(ACT_BUCKETS, value)] += 1  # the first bucket whose bound is >= value ("le")
    row[1][0] += value
