// Unit tests of the scheduler core through its public API (tangram/scheduler.h).
//
// A comment above each test states the invariant it holds the core to. Random workloads
// use a seeded std::mt19937 (raw outputs only, so they are the same everywhere) and call
// Scheduler::check_invariants() after every event. Tests in the Regressions suite pin bugs
// found while the core was written; the comment above each says what went wrong.
//
// Everything here runs in a few seconds, also under ASan/UBSan (the asan preset).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tangram/model.h"
#include "tangram/scheduler.h"
#include "tangram/types.h"

namespace {

using tangram::ActionId;
using tangram::ActionSpec;
using tangram::ActionState;
using tangram::Decision;
using tangram::DecisionKind;
using tangram::Error;
using tangram::ErrorCode;
using tangram::Inventory;
using tangram::kMilli;
using tangram::kNever;
using tangram::kNone;
using tangram::ModelKind;
using tangram::NodeSpec;
using tangram::PolicyConfig;
using tangram::PolicyKind;
using tangram::Quantity;
using tangram::Scheduler;
using tangram::TimeNs;
using tangram::TrajectoryId;

// ---------------------------------------------------------------- helpers

constexpr Quantity U(std::int64_t base_units) { return base_units * kMilli; }
TimeNs S(double seconds) { return tangram::to_ns(seconds); }

Inventory cpu_inventory(int nodes, std::int64_t cores) {
  Inventory inv;
  inv.kinds = {"cpu"};
  for (int n = 0; n < nodes; ++n) inv.nodes.push_back(NodeSpec{"node" + std::to_string(n), {U(cores)}, {}});
  return inv;
}

Inventory cpu_mem_inventory(int nodes, std::int64_t cores, std::int64_t mib) {
  Inventory inv;
  inv.kinds = {"cpu", "memory"};
  for (int n = 0; n < nodes; ++n) inv.nodes.push_back(NodeSpec{"node" + std::to_string(n), {U(cores), U(mib)}, {}});
  return inv;
}

PolicyConfig policy_of(PolicyKind kind) {
  PolicyConfig p;
  p.kind = kind;
  return p;
}

ActionSpec action(ActionId id, std::vector<Quantity> demand, double seconds = 1.0) {
  ActionSpec a;
  a.id = id;
  a.demand = std::move(demand);
  a.model.kind = ModelKind::kConstant;
  a.model.seconds = seconds;
  return a;
}

ActionSpec amdahl(ActionId id, std::vector<Quantity> demand, std::int32_t kind, Quantity max, double seconds,
                  double p) {
  ActionSpec a = action(id, std::move(demand), seconds);
  a.elastic_kind = kind;
  a.elastic_max = max;
  a.model.kind = ModelKind::kAmdahl;
  a.model.parallel_fraction = p;
  return a;
}

std::vector<ActionId> ids_of(const std::vector<Decision>& out, DecisionKind kind) {
  std::vector<ActionId> ids;
  for (const Decision& d : out)
    if (d.kind == kind) ids.push_back(d.action);
  return ids;
}
std::vector<ActionId> started(const std::vector<Decision>& out) { return ids_of(out, DecisionKind::kStart); }

const Decision* find_start(const std::vector<Decision>& out, ActionId id) {
  for (const Decision& d : out)
    if (d.kind == DecisionKind::kStart && d.action == id) return &d;
  return nullptr;
}

// A scheduler plus the `out` vector, checking the invariants after every event.
struct Harness {
  Scheduler s;
  std::vector<Decision> out;
  Harness(Inventory inv, PolicyConfig policy) : s(std::move(inv), std::move(policy)) {}

  const std::vector<Decision>& submit(std::vector<ActionSpec> batch, double now) {
    s.submit(batch.data(), batch.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const std::vector<Decision>& complete(std::vector<ActionId> ids, double now) {
    s.complete(ids.data(), ids.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const std::vector<Decision>& cancel(std::vector<ActionId> ids, double now) {
    s.cancel(ids.data(), ids.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const std::vector<Decision>& end(std::vector<TrajectoryId> ids, double now) {
    s.end_trajectories(ids.data(), ids.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const std::vector<Decision>& tick(double now) { return tick_ns(S(now)); }
  const std::vector<Decision>& tick_ns(TimeNs now) {
    s.tick(now, out);
    s.check_invariants();
    return out;
  }
};

// Runs f, which must throw tangram::Error with this code and field.
template <class F>
void expect_error(F&& f, ErrorCode code, const std::string& field) {
  try {
    f();
    ADD_FAILURE() << "expected tangram::Error for field '" << field << "', nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_EQ(e.field(), field) << e.what();
    EXPECT_FALSE(e.reason().empty());
    EXPECT_EQ(std::string(e.what()), e.field() + ": " + e.reason());
  }
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---------------------------------------------------------------- random workloads

// Everything the tests know about every action, advanced only by calls that succeeded
// and by their decisions. Checks the decisions against it as they come.
struct Ledger {
  std::set<ActionId> waiting, running;
  std::map<ActionId, int> starts, ends;
  std::map<ActionId, TrajectoryId> trajectory;
  std::map<TrajectoryId, int> live_in;  // live actions per trajectory
  std::size_t rejects = 0;

  void submitted(const std::vector<ActionSpec>& batch, const std::vector<Decision>& out) {
    std::set<ActionId> fresh;
    for (const ActionSpec& a : batch) {
      ASSERT_EQ(starts.count(a.id) + ends.count(a.id), 0u) << "test reuses id " << a.id;
      waiting.insert(a.id);
      fresh.insert(a.id);
      trajectory[a.id] = a.trajectory;
      ++live_in[a.trajectory];
    }
    apply(out, &fresh);
  }
  // `fresh`: the ids of the submit batch these decisions answer (kReject only for those).
  void apply(const std::vector<Decision>& out, const std::set<ActionId>* fresh = nullptr) {
    for (const Decision& d : out) {
      if (d.kind == DecisionKind::kStart) {
        ASSERT_EQ(waiting.count(d.action), 1u) << "start for an action that does not wait: " << d.action;
        waiting.erase(d.action);
        running.insert(d.action);
        ++starts[d.action];
      } else if (d.kind == DecisionKind::kReject) {
        ASSERT_TRUE(fresh && fresh->count(d.action)) << "reject outside the submit of action " << d.action;
        ASSERT_EQ(waiting.count(d.action), 1u);
        ASSERT_EQ(starts.count(d.action), 0u);
        waiting.erase(d.action);
        ended(d.action);
        ++rejects;
      }
    }
  }
  void ended(ActionId id) {
    ++ends[id];
    if (--live_in[trajectory[id]] == 0) live_in.erase(trajectory[id]);
  }
  void completed(const std::vector<ActionId>& ids) {
    for (ActionId id : ids) {
      ASSERT_EQ(running.erase(id), 1u);
      ended(id);
    }
  }
  void cancelled(const std::vector<ActionId>& ids) {
    for (ActionId id : ids) {
      ASSERT_EQ(waiting.erase(id) + running.erase(id), 1u);
      ended(id);
    }
  }
  void agrees_with(const Scheduler& s) const {
    EXPECT_EQ(s.waiting_count(), waiting.size());
    EXPECT_EQ(s.running_count(), running.size());
    for (ActionId id : waiting) ASSERT_EQ(s.state(id), ActionState::kWaiting) << id;
    for (ActionId id : running) ASSERT_EQ(s.state(id), ActionState::kRunning) << id;
  }
};

// Random bursts of submits, completes, cancels, ticks and trajectory ends, checking the
// invariants and the free amounts after every call. `trace` collects every decision.
struct RandomRun {
  PolicyConfig policy;
  Inventory inv;
  std::mt19937 rng;
  Harness h;
  Ledger ledger;
  ActionId next_id = 1;
  double now = 0;
  std::vector<Decision> trace;
  std::map<ActionId, std::int32_t> affinity;

  RandomRun(PolicyKind kind, std::uint32_t seed)
      : policy(make_policy(kind)), inv(cpu_mem_inventory(4, 8, 16384)), rng(seed), h(inv, policy) {}

  static PolicyConfig make_policy(PolicyKind kind) {
    PolicyConfig p = policy_of(kind);
    p.starvation_seconds = 20;
    p.trajectory_slot_cpu = U(2);                        // 4 slots of 2 cores, 4096 MiB
    if (kind == PolicyKind::kIsolated) p.pools = {{0, 1.0}, {1, 1.0}};  // exact halves
    return p;
  }

  std::uint32_t pick(std::uint32_t n) { return static_cast<std::uint32_t>(rng() % n); }

  ActionSpec random_action() {
    Quantity cpu = 500 * static_cast<Quantity>(pick(7));   // 0 .. 3 cores by halves
    Quantity mem = U(256) * static_cast<Quantity>(1 + pick(16));  // 256 .. 4096 MiB
    if (pick(25) == 0) cpu = U(12);                      // can never fit: rejected
    ActionSpec a = action(next_id++, {cpu, mem}, 1.0 + pick(20));
    if (pick(3) == 0) {
      if (a.demand[0] == 0) a.demand[0] = U(1);
      a.elastic_kind = 0;
      a.elastic_max = a.demand[0] + U(pick(6));
      a.model.kind = ModelKind::kAmdahl;
      a.model.parallel_fraction = 0.5 + 0.1 * pick(5);
    }
    if (pick(5) == 0) {
      a.affinity_node = static_cast<std::int32_t>(pick(4));
      affinity[a.id] = a.affinity_node;
    }
    a.priority = pick(8) == 0 ? 1 : 0;
    a.trajectory = 1 + pick(12);
    a.task = pick(2);
    return a;
  }

  void check_free() {
    for (std::int32_t n = 0; n < 4; ++n)
      for (std::int32_t k = 0; k < 2; ++k) {
        Quantity f = h.s.free(n, k);
        ASSERT_GE(f, 0) << "node " << n << " kind " << k;
        ASSERT_LE(f, inv.nodes[n].capacity[k]) << "node " << n << " kind " << k;
      }
  }

  void after() {
    trace.insert(trace.end(), h.out.begin(), h.out.end());
    ledger.agrees_with(h.s);
    check_free();
    // Starts honour node affinity (under the trajectory policy a bound slot decides).
    if (policy.kind != PolicyKind::kTrajectory)
      for (const Decision& d : h.out) {
        if (d.kind == DecisionKind::kStart && affinity.count(d.action)) {
          ASSERT_EQ(d.node, affinity[d.action]) << "action " << d.action << " off its affinity node";
        }
      }
  }

  void step() {
    now += pick(3);  // 0, 1 or 2 s: several events at the same time too
    switch (pick(10)) {
      case 0: case 1: case 2: case 3: {
        std::vector<ActionSpec> batch;
        for (std::uint32_t i = 0, n = 1 + pick(6); i < n; ++i) batch.push_back(random_action());
        h.submit(batch, now);
        ledger.submitted(batch, h.out);
        break;
      }
      case 4: case 5: case 6: {
        std::vector<ActionId> done;
        for (ActionId id : ledger.running)
          if (pick(3) == 0) done.push_back(id);
        h.complete(done, now);
        ledger.completed(done);
        ledger.apply(h.out);
        break;
      }
      case 7: {
        std::vector<ActionId> live(ledger.waiting.begin(), ledger.waiting.end());
        live.insert(live.end(), ledger.running.begin(), ledger.running.end());
        std::vector<ActionId> gone;
        if (!live.empty()) gone.push_back(live[pick(static_cast<std::uint32_t>(live.size()))]);
        h.cancel(gone, now);
        ledger.cancelled(gone);
        ledger.apply(h.out);
        break;
      }
      case 8:
        h.tick(now);
        ledger.apply(h.out);
        break;
      case 9: {
        std::vector<TrajectoryId> over;
        for (TrajectoryId t = 1; t <= 12; ++t)
          if (!ledger.live_in.count(t) && pick(2) == 0) over.push_back(t);
        h.end(over, now);
        ledger.apply(h.out);
        break;
      }
    }
    after();
  }

  // Cancels whatever waits, completes whatever runs, ends every trajectory.
  void drain() {
    now += 1;
    std::vector<ActionId> w(ledger.waiting.begin(), ledger.waiting.end());
    h.cancel(w, now);
    ledger.cancelled(w);
    ledger.apply(h.out);
    after();
    std::vector<ActionId> r(ledger.running.begin(), ledger.running.end());
    h.complete(r, now);
    ledger.completed(r);
    ledger.apply(h.out);
    after();
    std::vector<TrajectoryId> all;
    for (TrajectoryId t = 1; t <= 12; ++t) all.push_back(t);
    h.end(all, now);
    ledger.apply(h.out);
    after();
  }
};

class RandomBursts : public ::testing::TestWithParam<PolicyKind> {};

// Capacity is never exceeded: after every call, check_invariants() holds (free + used ==
// capacity per bin, free >= 0) and every node's free amount is within [0, capacity]. After
// everything has ended, every pool is back to exactly full: free(node, kind) == capacity.
TEST_P(RandomBursts, CapacityNeverExceededAndPoolsReturnToExactlyFull) {
  for (std::uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    RandomRun run(GetParam(), seed);
    for (int i = 0; i < 400; ++i) {
      run.step();
      if (::testing::Test::HasFatalFailure()) return;
    }
    EXPECT_GT(run.ledger.starts.size(), 100u) << "the workload should start plenty of actions";
    run.drain();
    EXPECT_EQ(run.h.s.waiting_count(), 0u);
    EXPECT_EQ(run.h.s.running_count(), 0u);
    for (std::int32_t n = 0; n < 4; ++n)
      for (std::int32_t k = 0; k < 2; ++k)
        EXPECT_EQ(run.h.s.free(n, k), run.inv.nodes[n].capacity[k]) << "node " << n << " kind " << k;
  }
}

// Every action ends exactly once: a submitted action is started at most once and only
// while it waits, is rejected only by its own submit (and then never starts), and ends by
// exactly one of reject, complete or cancel. Once ended it is unknown to the core, and
// completing or cancelling it again is refused with kUnknownAction.
TEST_P(RandomBursts, EveryActionEndsExactlyOnce) {
  RandomRun run(GetParam(), 7);
  for (int i = 0; i < 400; ++i) {
    run.step();
    if (::testing::Test::HasFatalFailure()) return;
  }
  run.drain();
  const ActionId submitted = run.next_id - 1;
  ASSERT_EQ(run.ledger.ends.size(), submitted);
  for (ActionId id = 1; id <= submitted; ++id) {
    EXPECT_EQ(run.ledger.ends[id], 1) << "action " << id;
    EXPECT_LE(run.ledger.starts.count(id) ? run.ledger.starts[id] : 0, 1) << "action " << id;
    EXPECT_EQ(run.h.s.state(id), ActionState::kUnknown) << "action " << id;
  }
  EXPECT_GT(run.ledger.rejects, 0u) << "the workload includes actions that can never fit";
  std::vector<Decision> out;
  ActionId first = 1;
  expect_error([&] { run.h.s.complete(&first, 1, S(run.now), out); }, ErrorCode::kUnknownAction, "ids[0]");
  expect_error([&] { run.h.s.cancel(&first, 1, S(run.now), out); }, ErrorCode::kUnknownAction, "ids[0]");
}

// Determinism: two schedulers fed the same events give identical decisions, field by
// field, in the same order.
TEST_P(RandomBursts, SameEventsGiveIdenticalDecisions) {
  RandomRun a(GetParam(), 11), b(GetParam(), 11);
  for (int i = 0; i < 300; ++i) {
    a.step();
    b.step();
    if (::testing::Test::HasFatalFailure()) return;
  }
  ASSERT_EQ(a.trace.size(), b.trace.size());
  ASSERT_GT(a.trace.size(), 100u);
  for (std::size_t i = 0; i < a.trace.size(); ++i) {
    const Decision& x = a.trace[i];
    const Decision& y = b.trace[i];
    ASSERT_TRUE(x.kind == y.kind && x.action == y.action && x.node == y.node && x.device == y.device &&
                x.service == y.service && x.elastic_kind == y.elastic_kind && x.grant == y.grant &&
                x.time == y.time && x.reason == y.reason)
        << "decision " << i << " differs";
  }
  for (ActionId id = 1; id < a.next_id; ++id) ASSERT_EQ(a.h.s.explain(id), b.h.s.explain(id));
}

INSTANTIATE_TEST_SUITE_P(Policies, RandomBursts,
                         ::testing::Values(PolicyKind::kTangram, PolicyKind::kFifo, PolicyKind::kTrajectory,
                                           PolicyKind::kIsolated, PolicyKind::kOptimus),
                         [](const ::testing::TestParamInfo<PolicyKind>& info) {
                           return std::string(tangram::policy_name(info.param));
                         });

// ---------------------------------------------------------------- GPU services

// A simulation in virtual time of GPU services whose total memory exceeds the GPUs, so
// they are restored and evicted over and over, with a quota on some actions. Actions end
// at start + runtime; ticks happen at next_wakeup().
struct GpuRun {
  static constexpr int kServices = 6;
  Inventory inv;
  Harness h;
  std::mt19937 rng;
  Ledger ledger;
  std::vector<Decision> trace;
  // The tests' own model of the services: device (node, gpu) or offloaded, ready time,
  // running actions.
  std::vector<std::pair<std::int32_t, std::int32_t>> where;
  std::vector<TimeNs> ready;
  std::vector<int> running_on;
  std::map<ActionId, std::int32_t> service_of;
  std::set<std::pair<TimeNs, ActionId>> finishing;
  std::size_t restores = 0, evicts = 0, service_starts = 0;
  TimeNs now = 0;

  static Inventory make_inventory() {
    Inventory inv;
    inv.kinds = {"cpu"};
    inv.nodes.push_back(NodeSpec{"a", {U(16)}, {{U(16000)}, {U(16000)}}});
    inv.nodes.push_back(NodeSpec{"b", {U(16)}, {{U(24000)}}});
    // Too small for any service: plain GPU actions can always get memory here eventually
    // (idle cached services are evicted only for other services, see KnownBugs).
    inv.nodes.push_back(NodeSpec{"c", {U(16)}, {{U(4000)}}});
    for (int s = 0; s < kServices; ++s)
      inv.services.push_back({"svc" + std::to_string(s), U(9000 + 1400 * s), 0.25 * (1 + s % 3), 1 + s % 3});
    inv.quotas.push_back({"api", 20.0, 4, 8, 0});
    return inv;
  }

  GpuRun(PolicyKind kind, std::uint32_t seed)
      : inv(make_inventory()), h(inv, make_policy(kind)), rng(seed), where(kServices, {kNone, kNone}),
        ready(kServices, 0), running_on(kServices, 0) {}

  static PolicyConfig make_policy(PolicyKind kind) {
    PolicyConfig p = policy_of(kind);
    if (kind == PolicyKind::kIsolated) p.pools = {{0, 1.0}};
    return p;
  }

  std::uint32_t pick(std::uint32_t n) { return static_cast<std::uint32_t>(rng() % n); }

  void apply(const std::vector<Decision>& out) {
    for (const Decision& d : out) {
      switch (d.kind) {
        case DecisionKind::kRestore:
          ASSERT_EQ(where[d.service].first, kNone) << "restore of a resident service " << d.service;
          where[d.service] = {d.node, d.device};
          ready[d.service] = d.time;
          ASSERT_GE(d.time, now);
          ++restores;
          break;
        case DecisionKind::kEvict:
          ASSERT_EQ(running_on[d.service], 0) << "evicted service " << d.service << " has running actions";
          ASSERT_LE(ready[d.service], now) << "evicted service " << d.service << " while restoring";
          ASSERT_EQ(where[d.service], std::make_pair(d.node, d.device));
          where[d.service] = {kNone, kNone};
          ++evicts;
          break;
        case DecisionKind::kStart: {
          ASSERT_EQ(d.time, now);
          auto it = service_of.find(d.action);
          if (it != service_of.end()) {
            std::int32_t svc = it->second;
            ASSERT_EQ(d.service, svc);
            ASSERT_EQ(where[svc], std::make_pair(d.node, d.device)) << "action off its service's device";
            ASSERT_LE(ready[svc], now) << "action started on a service still restoring";
            ++running_on[svc];
            ASSERT_LE(running_on[svc], inv.services[svc].max_batch);
            ++service_starts;
          }
          finishing.emplace(now + S(h.s.runtime(d.action, d.grant)), d.action);
          break;
        }
        case DecisionKind::kReject:
          break;
      }
    }
  }

  void after(const std::set<ActionId>* fresh = nullptr) {
    apply(h.out);
    ledger.apply(h.out, fresh);
    trace.insert(trace.end(), h.out.begin(), h.out.end());
    ledger.agrees_with(h.s);
    for (std::int32_t n = 0; n < 3; ++n)
      for (std::int32_t g = 0; g < static_cast<std::int32_t>(inv.nodes[n].gpus.size()); ++g) {
        ASSERT_GE(h.s.gpu_free(n, g), 0) << "GPU " << n << "/" << g;
        ASSERT_LE(h.s.gpu_free(n, g), inv.nodes[n].gpus[g].memory);
      }
    for (std::int32_t s = 0; s < kServices; ++s) ASSERT_EQ(h.s.service_location(s), where[s]) << "service " << s;
  }

  ActionSpec random_action(ActionId id) {
    ActionSpec a = action(id, {U(1 + pick(3))}, 0.1 * (1 + pick(30)));
    a.trajectory = id;
    if (pick(5) != 0) {
      a.service = static_cast<std::int32_t>(pick(kServices));
      if (pick(4) == 0) a.gpu_memory = U(100);  // activations beside the service's weights
    } else {
      a.gpu_memory = U(1000) * (1 + pick(4));
    }
    if (pick(4) == 0) a.quota = 0;
    return a;
  }

  void run(int arrivals) {
    ActionId next_id = 1;
    TimeNs next_arrival = 0;
    for (int guard = 0; guard < 100000; ++guard) {
      const TimeNs wake = h.s.next_wakeup();
      TimeNs t = kNever;
      if (next_id <= static_cast<ActionId>(arrivals)) t = next_arrival;
      if (!finishing.empty()) t = std::min(t, finishing.begin()->first);
      if (wake != kNever) {
        ASSERT_GT(wake, now) << "next_wakeup() is not in the future";
        t = std::min(t, wake);
      }
      if (t == kNever) break;
      now = t;
      if (!finishing.empty() && finishing.begin()->first == now) {
        std::vector<ActionId> done;
        while (!finishing.empty() && finishing.begin()->first == now) {
          done.push_back(finishing.begin()->second);
          finishing.erase(finishing.begin());
        }
        for (ActionId id : done)
          if (service_of.count(id)) --running_on[service_of[id]];
        h.s.complete(done.data(), done.size(), now, h.out);
        h.s.check_invariants();
        ledger.completed(done);
        after();
      } else if (next_id <= static_cast<ActionId>(arrivals) && next_arrival == now) {
        std::vector<ActionSpec> batch;
        for (std::uint32_t i = 0, n = 1 + pick(3); i < n && next_id <= static_cast<ActionId>(arrivals); ++i) {
          batch.push_back(random_action(next_id++));
          if (batch.back().service != kNone) service_of[batch.back().id] = batch.back().service;
        }
        next_arrival = now + S(0.1 * pick(12));  // bursts and lulls: services go idle
        h.s.submit(batch.data(), batch.size(), now, h.out);
        h.s.check_invariants();
        std::set<ActionId> fresh;
        for (const ActionSpec& a : batch) {
          ledger.waiting.insert(a.id);
          ledger.trajectory[a.id] = a.trajectory;
          ++ledger.live_in[a.trajectory];
          fresh.insert(a.id);
        }
        after(&fresh);
      } else {
        h.tick_ns(now);
        after();
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
    for (ActionId id : ledger.waiting) ADD_FAILURE() << "stuck: action " << id << ": " << h.s.explain(id);
    ASSERT_EQ(ledger.waiting.size(), 0u) << "actions still wait with no event left to wake them";
    ASSERT_EQ(ledger.running.size(), 0u);
  }
};

class GpuServices : public ::testing::TestWithParam<PolicyKind> {};

// GPU memory is never oversubscribed, through many restore/evict cycles of services whose
// total memory exceeds the GPUs: gpu_free() stays in [0, total]; a service with running
// actions (or still restoring) is never evicted; a service's actions start only on its
// device, once it is ready and with at most max_batch running; service_location() agrees
// with the restore/evict decisions; everything ends and all memory is back except that of
// the services left resident.
TEST_P(GpuServices, MemoryBoundHoldsThroughEvictions) {
  GpuRun run(GetParam(), 5);
  run.run(600);
  if (HasFatalFailure()) return;
  EXPECT_GE(run.evicts, 20u) << "the workload should force many evictions";
  EXPECT_GE(run.restores, run.evicts);
  EXPECT_GE(run.service_starts, 300u);
  for (std::int32_t n = 0; n < 3; ++n)
    for (std::int32_t g = 0; g < static_cast<std::int32_t>(run.inv.nodes[n].gpus.size()); ++g) {
      Quantity resident = 0;
      for (std::int32_t s = 0; s < GpuRun::kServices; ++s)
        if (run.where[s] == std::make_pair(n, g)) resident += run.inv.services[s].memory;
      EXPECT_EQ(run.h.s.gpu_free(n, g) + resident, run.inv.nodes[n].gpus[g].memory);
    }
  for (std::int32_t cpu_node = 0; cpu_node < 3; ++cpu_node) EXPECT_EQ(run.h.s.free(cpu_node, 0), U(16));
}

// Determinism with services and a quota in play: the same events give the same
// restore/evict/start decisions.
TEST_P(GpuServices, SameEventsGiveIdenticalDecisions) {
  GpuRun a(GetParam(), 9), b(GetParam(), 9);
  a.run(250);
  b.run(250);
  if (HasFatalFailure()) return;
  ASSERT_EQ(a.trace.size(), b.trace.size());
  for (std::size_t i = 0; i < a.trace.size(); ++i) {
    const Decision& x = a.trace[i];
    const Decision& y = b.trace[i];
    ASSERT_TRUE(x.kind == y.kind && x.action == y.action && x.node == y.node && x.device == y.device &&
                x.service == y.service && x.grant == y.grant && x.time == y.time)
        << "decision " << i << " differs";
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, GpuServices,
                         ::testing::Values(PolicyKind::kTangram, PolicyKind::kFifo, PolicyKind::kIsolated,
                                           PolicyKind::kOptimus),
                         [](const ::testing::TestParamInfo<PolicyKind>& info) {
                           return std::string(tangram::policy_name(info.param));
                         });

// Two services that cannot both be resident on the only GPU: serving them alternately
// evicts the idle one each time, never the busy one; an action of a service waits while it
// restores and starts at exactly its ready time.
TEST(GpuServicesSmall, AlternatingServicesEvictTheIdleOne) {
  Inventory inv = cpu_inventory(1, 8);
  inv.nodes[0].gpus = {{U(10000)}};
  inv.services = {{"rm0", U(6000), 2.0, 1}, {"rm1", U(6000), 2.0, 1}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec a0 = action(1, {U(1)}, 5);
  a0.service = 0;
  auto out = h.submit({a0}, 0);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, DecisionKind::kRestore);
  EXPECT_EQ(out[0].service, 0);
  EXPECT_EQ(out[0].time, S(2));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000));
  EXPECT_FALSE(h.s.service_ready(0));
  EXPECT_EQ(h.s.next_wakeup(), S(2));
  EXPECT_TRUE(contains(h.s.explain(1), "restoring")) << h.s.explain(1);
  EXPECT_TRUE(h.tick(1.999).empty());
  EXPECT_EQ(started(h.tick(2)), std::vector<ActionId>{1});
  // rm1 needs room, but rm0 runs an action: it may not be evicted.
  ActionSpec a1 = action(2, {U(1)}, 5);
  a1.service = 1;
  out = h.submit({a1}, 3);
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(contains(h.s.explain(2), "no GPU can make room")) << h.s.explain(2);
  EXPECT_EQ(h.s.service_location(0), std::make_pair(0, 0));
  // rm0 goes idle: now it is evicted for rm1.
  out = h.complete({1}, 7);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].kind, DecisionKind::kEvict);
  EXPECT_EQ(out[0].service, 0);
  EXPECT_EQ(out[1].kind, DecisionKind::kRestore);
  EXPECT_EQ(out[1].service, 1);
  EXPECT_EQ(out[1].time, S(9));
  EXPECT_EQ(h.s.service_location(0), std::make_pair(kNone, kNone));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000));
  EXPECT_EQ(started(h.tick(9)), std::vector<ActionId>{2});
  EXPECT_EQ(h.s.placement(2).device, 0);
}

// tangram restores whole queues, not single actions: when room frees for one of several
// offloaded services, the one with the most waiting actions per second of (restore + queued
// work / max_batch) gets it, even though another's single action is first in the action
// order; fifo restores for the first action in arrival order. A service whose first waiting
// action has waited starvation_seconds goes before any ratio.
TEST(GpuServicesSmall, TangramRestoresTheLargestQueueFirst) {
  Inventory inv = cpu_inventory(1, 8);
  inv.nodes[0].gpus = {{U(10000)}};
  inv.services = {{"rm0", U(6000), 2.0, 4}, {"rm1", U(6000), 2.0, 4}, {"rm2", U(6000), 2.0, 4}};
  auto run = [&](PolicyConfig policy) {
    Harness h(inv, policy);
    ActionSpec a0 = action(1, {U(1)}, 10);
    a0.service = 0;
    h.submit({a0}, 0);
    EXPECT_EQ(started(h.tick(2)), std::vector<ActionId>{1});
    ActionSpec b = action(2, {U(1)}, 0.5);  // rm1: one short action, first to arrive
    b.service = 1;
    EXPECT_TRUE(h.submit({b}, 3).empty());  // rm0 is busy: no room
    std::vector<ActionSpec> cs;
    for (ActionId id = 3; id <= 5; ++id) {  // rm2: three longer ones, later
      cs.push_back(action(id, {U(1)}, 2));
      cs.back().service = 2;
    }
    EXPECT_TRUE(h.submit(cs, 8).empty());
    auto out = h.complete({1}, 12);  // rm0 idle: room for one of rm1, rm2
    std::vector<std::pair<DecisionKind, std::int32_t>> got;
    for (const Decision& d : out) got.emplace_back(d.kind, d.service);
    return got;
  };
  using V = std::vector<std::pair<DecisionKind, std::int32_t>>;
  // rm2: 3 waiting / (2 s + 6 s / 4) beats rm1: 1 waiting / (2 s + 0.5 s / 4).
  EXPECT_EQ(run(policy_of(PolicyKind::kTangram)), (V{{DecisionKind::kEvict, 0}, {DecisionKind::kRestore, 2}}));
  EXPECT_EQ(run(policy_of(PolicyKind::kFifo)), (V{{DecisionKind::kEvict, 0}, {DecisionKind::kRestore, 1}}));
  // rm1's action has waited 9 s >= 5 s (starving), rm2's 4 s: rm1 first.
  PolicyConfig starving = policy_of(PolicyKind::kTangram);
  starving.starvation_seconds = 5;
  EXPECT_EQ(run(starving), (V{{DecisionKind::kEvict, 0}, {DecisionKind::kRestore, 1}}));
}

// A service's batch is full while max_batch of its actions run; the next starts when one
// of them completes.
TEST(GpuServicesSmall, BatchFullWaits) {
  Inventory inv = cpu_inventory(1, 8);
  inv.nodes[0].gpus = {{U(10000)}};
  inv.services = {{"rm", U(6000), 0.0, 2}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 3; ++id) {
    batch.push_back(action(id, {U(1)}, 1));
    batch.back().service = 0;
  }
  auto out = h.submit(batch, 0);
  EXPECT_EQ(out[0].kind, DecisionKind::kRestore);
  EXPECT_EQ(out[0].time, 0);  // restore_seconds 0: ready at once
  EXPECT_EQ(started(out), (std::vector<ActionId>{1, 2}));
  EXPECT_TRUE(contains(h.s.explain(3), "batch is full")) << h.s.explain(3);
  EXPECT_EQ(started(h.complete({2}, 1)), std::vector<ActionId>{3});
}

// ---------------------------------------------------------------- infeasible and invalid

// An action that can never fit (no node, GPU or quota could hold it even empty) is
// rejected by its own submit with a message naming the shortfall; it never becomes live,
// and the feasible actions of the same batch are unaffected.
TEST(Infeasible, RejectedAtSubmitWithAMessage) {
  Inventory inv = cpu_mem_inventory(2, 8, 4096);
  inv.nodes[0].gpus = {{U(8000)}};
  inv.services = {{"huge", U(9000), 1.0, 1}};
  inv.quotas = {{"llm", 0, 1, 0, 1000}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec too_big = action(1, {U(10), U(100)});
  ActionSpec ok = action(2, {U(1), U(100)});
  ActionSpec too_much_gpu = action(3, {U(1), 0});
  too_much_gpu.gpu_memory = U(9000);
  ActionSpec huge_service = action(4, {U(1), 0});
  huge_service.service = 0;
  ActionSpec too_many_tokens = action(5, {U(1), 0});
  too_many_tokens.quota = 0;
  too_many_tokens.tokens = 1001;
  ActionSpec affinity_too_big = action(6, {U(1), U(5000)});
  affinity_too_big.affinity_node = 1;
  const auto& out = h.submit({too_big, ok, too_much_gpu, huge_service, too_many_tokens, affinity_too_big}, 0);
  EXPECT_EQ(ids_of(out, DecisionKind::kReject), (std::vector<ActionId>{1, 3, 4, 5, 6}));
  EXPECT_EQ(started(out), std::vector<ActionId>{2});
  std::map<ActionId, std::string> why;
  for (const Decision& d : out)
    if (d.kind == DecisionKind::kReject) {
      EXPECT_EQ(d.time, 0);
      why[d.action] = h.s.message(d.reason);
    }
  EXPECT_TRUE(contains(why[1], "action 1 can never run")) << why[1];
  EXPECT_TRUE(contains(why[1], "cpu needs 10, largest is 8")) << why[1];
  EXPECT_TRUE(contains(why[3], "gpu_memory needs 9000, largest is 8000")) << why[3];
  EXPECT_TRUE(contains(why[4], "service 'huge'")) << why[4];
  EXPECT_TRUE(contains(why[5], "1001 tokens")) << why[5];
  EXPECT_TRUE(contains(why[6], "affinity node")) << why[6];
  for (ActionId id : {1, 3, 4, 5, 6}) EXPECT_EQ(h.s.state(id), ActionState::kUnknown);
  EXPECT_EQ(h.s.waiting_count(), 0u);
  EXPECT_EQ(h.s.running_count(), 1u);
  // The message table belongs to the last call; the id of a rejected action is free again.
  h.tick(1);
  expect_error([&] { h.s.message(0); }, ErrorCode::kInvalidArgument, "reason");
  EXPECT_EQ(started(h.submit({action(1, {U(1), 0})}, 1)), std::vector<ActionId>{1});
}

class Validation : public ::testing::Test {
 protected:
  Validation() : h(make_inventory(), policy_of(PolicyKind::kTangram)) {}
  static Inventory make_inventory() {
    Inventory inv = cpu_mem_inventory(1, 8, 8192);
    inv.nodes[0].gpus = {{U(16000)}};
    inv.services = {{"rm", U(1000), 0.0, 1}};
    inv.quotas = {{"api", 1.0, 1, 0, 0}};
    return inv;
  }
  // Submitting `batch` (at the current time, or at `now`) must fail with (code, field) and
  // apply none of it. (A refused submit does move now(): KnownBugs.)
  void refused(std::vector<ActionSpec> batch, ErrorCode code, const std::string& field, TimeNs now = -1) {
    const std::size_t waiting = h.s.waiting_count(), running = h.s.running_count();
    std::vector<ActionState> states;
    for (const ActionSpec& a : batch) states.push_back(h.s.state(a.id));
    if (now < 0) now = h.s.now();
    expect_error([&] { h.s.submit(batch.data(), batch.size(), now, h.out); }, code, field);
    h.s.check_invariants();
    EXPECT_EQ(h.s.waiting_count(), waiting);
    EXPECT_EQ(h.s.running_count(), running);
    for (std::size_t i = 0; i < batch.size(); ++i) EXPECT_EQ(h.s.state(batch[i].id), states[i]) << batch[i].id;
  }
  ActionSpec ok(ActionId id) { return action(id, {U(1), U(100)}); }
  Harness h;
};

// A negative demand is refused with kInvalidArgument naming the kind.
TEST_F(Validation, NegativeDemand) {
  refused({action(1, {-1, 0})}, ErrorCode::kInvalidArgument, "actions[0].demand.cpu");
  refused({ok(1), action(2, {0, -U(1)})}, ErrorCode::kInvalidArgument, "actions[1].demand.memory");
  refused({action(1, {U(1)})}, ErrorCode::kInvalidArgument, "actions[0].demand");  // wrong length
  refused({action(1, {U(2000000000000), 0})}, ErrorCode::kInvalidArgument, "actions[0].demand.cpu");
}

// An elastic upper bound below the minimum demand is refused, naming elastic_max; so are a
// zero elastic minimum and an elastic kind that does not exist.
TEST_F(Validation, ElasticBounds) {
  refused({amdahl(1, {U(2), 0}, 0, U(1), 10, 0.5)}, ErrorCode::kInvalidArgument, "actions[0].elastic_max");
  refused({amdahl(1, {0, 0}, 0, U(4), 10, 0.5)}, ErrorCode::kInvalidArgument, "actions[0].demand.cpu");
  refused({amdahl(1, {U(1), 0}, 2, U(4), 10, 0.5)}, ErrorCode::kInvalidArgument, "actions[0].elastic_kind");
  refused({amdahl(1, {U(1), 0}, 0, U(4), 10, 1.5)}, ErrorCode::kInvalidArgument, "actions[0].model.parallel_fraction");
}

// Indices of services, quotas, nodes, tables and task pools that do not exist are refused
// with kUnknownName naming the field.
TEST_F(Validation, UnknownIndices) {
  ActionSpec a = ok(1);
  a.service = 1;
  refused({a}, ErrorCode::kUnknownName, "actions[0].service");
  a = ok(1);
  a.quota = 1;
  refused({a}, ErrorCode::kUnknownName, "actions[0].quota");
  a = ok(1);
  a.quota = -5;
  refused({a}, ErrorCode::kUnknownName, "actions[0].quota");
  a = ok(1);
  a.affinity_node = 3;
  refused({ok(7), a}, ErrorCode::kUnknownName, "actions[1].affinity_node");
  a = ok(1);
  a.model.kind = ModelKind::kTable;
  a.model.table = 0;
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].model.table");
  a = ok(1);
  a.tokens = 5;  // tokens without a quota
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].tokens");
  a = ok(1);
  a.model.seconds = std::nan("");
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].model.seconds");
  a = ok(1);
  a.service = 0;
  a.affinity_node = 0;
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].affinity_node");

  PolicyConfig iso = policy_of(PolicyKind::kIsolated);
  iso.pools = {{3, 1.0}};
  Harness hi(cpu_inventory(1, 4), iso);
  ActionSpec t = action(1, {U(1)});
  t.task = 4;
  expect_error([&] { hi.s.submit(&t, 1, 0, hi.out); }, ErrorCode::kUnknownName, "actions[0].task");
  expect_error([] { tangram::policy_from_name("lifo"); }, ErrorCode::kUnknownName, "policy");
}

// Duplicate ids are refused with kDuplicateId, within one batch and against live actions,
// and the whole batch is refused (nothing of it is applied).
TEST_F(Validation, DuplicateIds) {
  refused({ok(1), ok(2), ok(1)}, ErrorCode::kDuplicateId, "actions[2].id");
  h.submit({ok(1)}, 1);
  refused({ok(2), ok(1)}, ErrorCode::kDuplicateId, "actions[1].id");
  EXPECT_EQ(h.s.state(2), ActionState::kUnknown);
  std::vector<Decision> out;
  ActionId twice[] = {1, 1};
  expect_error([&] { h.s.complete(twice, 2, S(2), out); }, ErrorCode::kDuplicateId, "ids[1]");
  EXPECT_EQ(h.s.state(1), ActionState::kRunning);
}

// Completing an id that is not live is kUnknownAction; completing a waiting action is
// kInvalidState (cancel is the way out of the queue); neither applies anything.
TEST_F(Validation, CompleteUnknownOrWaiting) {
  h.submit({ok(1), action(2, {U(8), U(100)})}, 1);  // 2 waits for 1's core
  ASSERT_EQ(h.s.state(2), ActionState::kWaiting);
  std::vector<Decision> out;
  ActionId unknown[] = {1, 99};
  expect_error([&] { h.s.complete(unknown, 2, S(2), out); }, ErrorCode::kUnknownAction, "ids[1]");
  EXPECT_EQ(h.s.state(1), ActionState::kRunning);  // the valid id was not applied
  ActionId waiting[] = {2};
  expect_error([&] { h.s.complete(waiting, 1, S(2), out); }, ErrorCode::kInvalidState, "ids[0]");
  expect_error([&] { h.s.placement(2); }, ErrorCode::kInvalidState, "id");
  expect_error([&] { h.s.runtime(99, U(1)); }, ErrorCode::kUnknownAction, "id");
  EXPECT_TRUE(contains(h.s.explain(99), "not live")) << h.s.explain(99);
  // Trajectory 0 still has live actions: it cannot end.
  TrajectoryId t0 = 0;
  expect_error([&] { h.s.end_trajectories(&t0, 1, S(2), out); }, ErrorCode::kInvalidState, "trajectories[0]");
  h.s.check_invariants();
  EXPECT_EQ(started(h.complete({1}, 3)), std::vector<ActionId>{2});
}

// Time must never go backwards, for every event; a refused call leaves now() unchanged.
TEST_F(Validation, TimeGoingBackwards) {
  h.submit({ok(1)}, 5);
  refused({ok(2)}, ErrorCode::kInvalidArgument, "now", S(4.5));
  std::vector<Decision> out;
  expect_error([&] { h.s.tick(S(4), out); }, ErrorCode::kInvalidArgument, "now");
  ActionId one = 1;
  expect_error([&] { h.s.complete(&one, 1, S(4), out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.cancel(&one, 1, S(4), out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.end_trajectories(nullptr, 0, S(4), out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.tick(-1, out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.tick(S(2e9), out); }, ErrorCode::kInvalidArgument, "now");
  EXPECT_EQ(h.s.now(), S(5));
  EXPECT_EQ(h.s.state(1), ActionState::kRunning);
  h.tick(5);  // the same time is fine
}

// Bad inventories and policies are refused at construction, naming the field.
TEST(ValidationConstruction, InventoryAndPolicy) {
  Inventory none;
  expect_error([&] { Scheduler s(none, PolicyConfig{}); }, ErrorCode::kInvalidArgument, "inventory.kinds");
  Inventory dup = cpu_inventory(1, 4);
  dup.kinds = {"cpu"};
  dup.quotas = {{"q", 1, 1, 0, 0}, {"q", 1, 1, 0, 0}};
  expect_error([&] { Scheduler s(dup, PolicyConfig{}); }, ErrorCode::kInvalidArgument, "inventory.quotas[1].name");
  Inventory svc = cpu_inventory(1, 4);
  svc.services = {{"rm", U(1), 0, 1}};
  expect_error([&] { Scheduler s(svc, PolicyConfig{}); }, ErrorCode::kInvalidArgument, "inventory.services[0]");
  PolicyConfig traj = policy_of(PolicyKind::kTrajectory);
  traj.trajectory_slot_cpu = U(16);
  expect_error([&] { Scheduler s(cpu_inventory(1, 4), traj); }, ErrorCode::kInvalidArgument,
               "policy(trajectory).trajectory_slot_cpu");
  expect_error([&] { Scheduler s(cpu_inventory(1, 4), policy_of(PolicyKind::kIsolated)); },
               ErrorCode::kInvalidArgument, "policy(isolated).pools");
  PolicyConfig starve;
  starve.starvation_seconds = 0;
  expect_error([&] { Scheduler s(cpu_inventory(1, 4), starve); }, ErrorCode::kInvalidArgument,
               "policy(tangram).starvation_seconds");
}

// ---------------------------------------------------------------- quotas

Inventory quota_inventory(tangram::QuotaSpec q) {
  Inventory inv = cpu_inventory(1, 64);
  inv.quotas = {std::move(q)};
  return inv;
}

ActionSpec quota_action(ActionId id, std::int64_t tokens = 0) {
  ActionSpec a = action(id, {U(1)}, 100);
  a.quota = 0;
  a.tokens = tokens;
  return a;
}

// GCRA with rate 2/s and burst 1: ticking at next_wakeup(), starts are spaced exactly
// 0.5 s apart, one per tick, in arrival order; a tick just before the due time starts
// nothing.
TEST(Quota, RateSpacesStarts) {
  Harness h(quota_inventory({"api", 2.0, 1, 0, 0}), policy_of(PolicyKind::kFifo));
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(quota_action(id));
  EXPECT_EQ(started(h.submit(batch, 0)), std::vector<ActionId>{1});
  EXPECT_TRUE(contains(h.s.explain(2), "rate limit")) << h.s.explain(2);
  std::vector<TimeNs> starts = {0};
  for (ActionId id = 2; id <= 5; ++id) {
    const TimeNs wake = h.s.next_wakeup();
    ASSERT_EQ(wake, starts.back() + S(0.5));
    EXPECT_TRUE(h.tick_ns(wake - 1).empty());
    const auto& out = h.tick_ns(wake);
    ASSERT_EQ(started(out), std::vector<ActionId>{id});
    starts.push_back(out[0].time);
  }
  EXPECT_EQ(h.s.next_wakeup(), kNever);  // nobody waits
}

// GCRA with burst 3: three start back to back, then the rate applies.
TEST(Quota, BurstThenRate) {
  Harness h(quota_inventory({"api", 1.0, 3, 0, 0}), policy_of(PolicyKind::kTangram));
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(quota_action(id));
  EXPECT_EQ(started(h.submit(batch, 0)).size(), 3u);
  EXPECT_EQ(h.s.next_wakeup(), S(1));
  EXPECT_EQ(started(h.tick(1)).size(), 1u);
  EXPECT_EQ(h.s.next_wakeup(), S(2));
}

// The concurrency cap: at most max_concurrency run at once; a completion lets exactly one
// more in; next_wakeup() stays kNever (only a completion can help).
TEST(Quota, ConcurrencyCap) {
  Harness h(quota_inventory({"api", 0, 1, 2, 0}), policy_of(PolicyKind::kTangram));
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(quota_action(id));
  EXPECT_EQ(started(h.submit(batch, 0)).size(), 2u);
  EXPECT_EQ(h.s.next_wakeup(), kNever);
  EXPECT_TRUE(contains(h.s.explain(3), "concurrency limit (2 in flight)")) << h.s.explain(3);
  EXPECT_TRUE(h.tick(100).empty());
  EXPECT_EQ(started(h.complete({1}, 101)).size(), 1u);
  EXPECT_EQ(h.s.running_count(), 2u);
  EXPECT_EQ(started(h.cancel({2}, 102)).size(), 1u);
  EXPECT_EQ(h.s.running_count(), 2u);
  EXPECT_EQ(h.s.waiting_count(), 1u);
}

// The token budget: 600 tokens per minute (10 per second), full at the start. Two actions
// of 300 tokens start at once; the third waits exactly 30 s for the refill; one needing
// more than a minute's budget is rejected at submit.
TEST(Quota, TokenBudget) {
  Harness h(quota_inventory({"llm", 0, 1, 0, 600}), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(started(h.submit({quota_action(1, 300), quota_action(2, 300), quota_action(3, 300)}, 0)).size(), 2u);
  EXPECT_EQ(h.s.next_wakeup(), S(30));
  EXPECT_TRUE(contains(h.s.explain(3), "token budget")) << h.s.explain(3);
  EXPECT_TRUE(h.tick(29.9).empty());
  EXPECT_EQ(started(h.tick(30)), std::vector<ActionId>{3});
  const auto& out = h.submit({quota_action(4, 601)}, 31);
  EXPECT_EQ(ids_of(out, DecisionKind::kReject), std::vector<ActionId>{4});
}

// ---------------------------------------------------------------- elasticity

// Spare elastic units go, one unit at a time, to the action with the largest marginal cut
// in run time: with 2 spare cores, the highly parallel action gets both.
TEST(Elastic, SpareUnitsGoToLargestMarginalGain) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  // t(1)=100 for both; parallel: t(2)=55, t(3)=40; serial-ish: t(2)=90.
  const auto& out = h.submit({amdahl(1, {U(1)}, 0, U(4), 100, 0.9), amdahl(2, {U(1)}, 0, U(4), 100, 0.2)}, 0);
  ASSERT_EQ(started(out).size(), 2u);
  EXPECT_EQ(find_start(out, 1)->grant, U(3));
  EXPECT_EQ(find_start(out, 2)->grant, U(1));
  EXPECT_EQ(find_start(out, 1)->elastic_kind, 0);
  EXPECT_EQ(h.s.free(0, 0), 0);
  EXPECT_EQ(h.s.placement(1).grant, U(3));
  EXPECT_DOUBLE_EQ(h.s.runtime(1, U(3)), 40.0);
}

// An elastic action alone gets extra units up to its bound, but only while each unit cuts
// at least min_relative_gain of its run time.
TEST(Elastic, SpareUnitsStopAtBoundAndMinimumGain) {
  Harness h(cpu_inventory(1, 16), policy_of(PolicyKind::kTangram));
  const auto& out = h.submit({amdahl(1, {U(2)}, 0, U(6), 60, 1.0)}, 0);
  EXPECT_EQ(out[0].grant, U(6));  // perfectly parallel: gains stay large, the bound stops it
  h.complete({1}, 1);
  // p = 0.5 from 1 core: t(u) = 10 (0.5 + 0.5 / u); the cut from 4 to 5 is 0.25 s of 6.25 s
  // (4% < 5%), so the grant stops at 4.
  EXPECT_EQ(h.submit({amdahl(2, {U(1)}, 0, U(16), 10, 0.5)}, 2)[0].grant, U(4));
}

// Spare units are granted only when nobody waits: while an action waits for the node, an
// elastic action starts with exactly its minimum.
TEST(Elastic, NoSpareUnitsWhileSomeoneWaits) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  // The elastic one is shorter, so it is first in order and starts; the big one waits.
  const auto& out = h.submit({amdahl(1, {U(1)}, 0, U(4), 10, 0.9), action(2, {U(4)}, 100)}, 0);
  ASSERT_EQ(started(out), std::vector<ActionId>{1});
  EXPECT_EQ(out[0].grant, U(1));
  EXPECT_EQ(h.s.free(0, 0), U(3));
  // A waiter confined to another node does not contend for this one.
  Harness h2(cpu_inventory(2, 4), policy_of(PolicyKind::kTangram));
  h2.submit({action(10, {U(4)}, 100)}, 0);  // fills node 0
  ActionSpec waiter = action(11, {U(2)}, 100);
  waiter.affinity_node = 0;
  ActionSpec el = amdahl(12, {U(1)}, 0, U(4), 10, 0.9);
  el.affinity_node = 1;
  const auto& out2 = h2.submit({waiter, el}, 1);
  ASSERT_EQ(started(out2), std::vector<ActionId>{12});
  EXPECT_EQ(out2[0].grant, U(4));
}

// An action waiting for its quota (or its GPU service) waits for something other than cores:
// it does not keep spare units from an elastic action on its node.
TEST(Elastic, QuotaWaitersDoNotHoldBackSpareUnits) {
  Inventory inv = cpu_inventory(1, 4);
  inv.quotas = {tangram::QuotaSpec{"api", 1.0, 1, 0, 0}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec first = action(1, {U(1)}, 1);
  first.quota = 0;
  ASSERT_EQ(started(h.submit({first}, 0)), std::vector<ActionId>{1});  // the burst of one
  ActionSpec second = action(2, {U(1)}, 1);
  second.quota = 0;
  const auto& out = h.submit({second, amdahl(3, {U(1)}, 0, U(4), 100, 0.9)}, 0);
  ASSERT_EQ(started(out), std::vector<ActionId>{3});
  EXPECT_TRUE(contains(h.s.explain(2), "rate limit")) << h.s.explain(2);
  EXPECT_EQ(find_start(out, 3)->grant, U(3));  // all the free cores: 4 - 1 held by action 1
}

// The Optimus-style policy hands out spare units even while others wait (the difference
// from kTangram), in arrival order, by the same largest-marginal-gain rule.
TEST(Elastic, OptimusGrantsSpareUnitsWhileOthersWait) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kOptimus));
  // Arrival order: the elastic action first; the 4-core one waits for the whole node.
  const auto& out = h.submit({amdahl(1, {U(1)}, 0, U(4), 10, 0.9), action(2, {U(4)}, 100)}, 0);
  ASSERT_EQ(started(out), std::vector<ActionId>{1});
  EXPECT_EQ(out[0].grant, U(4));  // tangram would keep it at 1 (NoSpareUnitsWhileSomeoneWaits)
  EXPECT_EQ(h.s.free(0, 0), 0);
  // Once it ends, the waiter gets the node.
  EXPECT_EQ(started(h.complete({1}, 5)), std::vector<ActionId>{2});
  EXPECT_EQ(std::string(tangram::policy_name(PolicyKind::kOptimus)), "optimus");
  EXPECT_EQ(tangram::policy_from_name("optimus"), PolicyKind::kOptimus);
}

// Fixed-point: grants and releases of elastic units return the pool to exactly full.
TEST(Elastic, GrantsReturnExactly) {
  Harness h(cpu_mem_inventory(1, 7, 1000), policy_of(PolicyKind::kTangram));
  h.submit({amdahl(1, {1500, 1}, 0, 5500, 10, 0.9), amdahl(2, {250, 3}, 0, 2250, 10, 0.7)}, 0);
  EXPECT_EQ(h.s.free(0, 0) + h.s.placement(1).grant + h.s.placement(2).grant, U(7));
  h.complete({1, 2}, 1);
  EXPECT_EQ(h.s.free(0, 0), U(7));
  EXPECT_EQ(h.s.free(0, 1), U(1000));
}

// ---------------------------------------------------------------- policies

// The trajectory policy gives each trajectory its own slot from its first action until
// end_trajectories: a slot stays bound while its trajectory is between actions, later
// actions of the trajectory run in it with the whole slot as their grant, and another
// trajectory gets it only after the first one ends.
TEST(TrajectoryPolicy, OwnSlotUntilEnd) {
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = U(2);
  Harness h(cpu_inventory(1, 4), p);  // two slots of 2 cores
  auto in = [](ActionSpec a, TrajectoryId t) {
    a.trajectory = t;
    return a;
  };
  auto out = h.submit({in(amdahl(1, {U(1)}, 0, U(8), 10, 0.9), 1), in(action(2, {U(1)}, 10), 2),
                       in(action(3, {U(1)}, 10), 3)},
                      0);
  ASSERT_EQ(started(out), (std::vector<ActionId>{1, 2}));
  EXPECT_EQ(find_start(out, 1)->grant, U(2));  // the whole slot, not 8 and not 1
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  EXPECT_TRUE(contains(h.s.explain(3), "no free trajectory slot")) << h.s.explain(3);
  // Trajectory 1 is between actions: its slot stays its own.
  EXPECT_TRUE(h.complete({1}, 1).empty());
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  out = h.submit({in(action(4, {U(1)}, 10), 1), in(action(5, {U(1)}, 10), 1)}, 2);
  EXPECT_EQ(started(out), (std::vector<ActionId>{4, 5}));  // both fit in its slot
  h.complete({4, 5}, 3);
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  // Trajectory 1 ends: trajectory 3 gets the slot.
  EXPECT_EQ(started(h.end({1}, 4)), std::vector<ActionId>{3});
  h.complete({2, 3}, 5);
  h.end({2, 3}, 5);
  EXPECT_EQ(h.s.free(0, 0), U(4));
}

// Under kTrajectory a class is per trajectory; an ended trajectory's classes are freed and
// their slots reused, so a long run of short trajectories does not grow by one class each.
// Waits, parks and wakes go through reused slots (the harness checks every invariant,
// including that no stale heap or park entry is taken for a reused class).
TEST(TrajectoryPolicy, EndedTrajectoriesFreeTheirClasses) {
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = U(2);
  Harness h(cpu_inventory(1, 4), p);  // two slots
  auto in = [](ActionSpec a, TrajectoryId t) {
    a.trajectory = t;
    return a;
  };
  ActionId id = 1;
  double now = 0;
  for (TrajectoryId t = 1; t <= 600; t += 3) {
    // Three trajectories for two slots: the third waits (its class parks), then runs.
    std::vector<ActionSpec> batch;
    for (TrajectoryId u = t; u < t + 3; ++u) batch.push_back(in(action(id++, {U(1 + (u % 2))}, 1), u));
    EXPECT_EQ(started(h.submit(batch, now)).size(), 2u);
    h.complete({id - 3, id - 2}, now + 1);
    EXPECT_EQ(started(h.end({t, t + 1}, now + 1)), std::vector<ActionId>{id - 1});
    h.complete({id - 1}, now + 2);
    h.end({t + 2}, now + 2);
    now += 3;
    EXPECT_EQ(h.s.class_count(), 0u);
  }
  EXPECT_EQ(h.s.free(0, 0), U(4));
}

// The isolated policy keeps task pools apart: a pool whose share is full makes its own
// actions wait even while another pool's share is idle, and an action larger than its
// pool's share is rejected although the node could hold it.
TEST(IsolatedPolicy, PoolsStayApart) {
  PolicyConfig p = policy_of(PolicyKind::kIsolated);
  p.pools = {{0, 1.0}, {1, 1.0}};
  Harness h(cpu_inventory(1, 8), p);
  auto in = [](ActionSpec a, std::uint32_t task) {
    a.task = task;
    return a;
  };
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(in(action(id, {U(1)}, 10), 0));
  EXPECT_EQ(started(h.submit(batch, 0)).size(), 4u);
  EXPECT_EQ(h.s.state(5), ActionState::kWaiting);
  EXPECT_EQ(h.s.free(0, 0), U(4));  // pool 1's half, idle
  EXPECT_EQ(started(h.submit({in(action(6, {U(3)}, 10), 1)}, 1)), std::vector<ActionId>{6});
  EXPECT_EQ(h.s.state(5), ActionState::kWaiting);
  EXPECT_EQ(ids_of(h.submit({in(action(7, {U(6)}, 10), 1)}, 2), DecisionKind::kReject), std::vector<ActionId>{7});
  EXPECT_TRUE(h.complete({6}, 3).empty());  // pool 1's release does not help pool 0
  EXPECT_EQ(started(h.complete({1}, 4)), std::vector<ActionId>{5});
}

// FIFO keeps arrival order (run time plays no part) and grants exactly the minimum; the
// tangram policy, given the same events, runs the shortest first.
TEST(FifoPolicy, ArrivalOrderAndMinimumGrants) {
  auto run = [](PolicyKind kind) {
    Harness h(cpu_inventory(1, 1), policy_of(kind));
    std::vector<ActionId> order;
    auto out = h.submit({action(1, {U(1)}, 100), action(2, {U(1)}, 50), action(3, {U(1)}, 1)}, 0);
    for (double t = 1; order.size() < 3; ++t) {
      for (ActionId id : started(out)) order.push_back(id);
      if (order.size() < 3) out = h.complete({order.back()}, t);
    }
    return order;
  };
  EXPECT_EQ(run(PolicyKind::kFifo), (std::vector<ActionId>{1, 2, 3}));
  EXPECT_EQ(run(PolicyKind::kTangram), (std::vector<ActionId>{3, 2, 1}));

  Harness h(cpu_inventory(1, 8), policy_of(PolicyKind::kFifo));
  const auto& out = h.submit({amdahl(1, {U(1)}, 0, U(8), 100, 1.0)}, 0);
  EXPECT_EQ(out[0].grant, U(1));  // an idle node, but fifo gives the minimum
  EXPECT_EQ(h.s.free(0, 0), U(7));
}

// FIFO backfills: an earlier action that does not fit (and has not starved) does not stop
// a later one that does.
TEST(FifoPolicy, BackfillBeforeStarvation) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kFifo));
  h.submit({action(1, {U(2)}, 100)}, 0);
  auto out = h.submit({action(2, {U(4)}, 1), action(3, {U(1)}, 1)}, 1);
  EXPECT_EQ(started(out), std::vector<ActionId>{3});
  EXPECT_TRUE(contains(h.s.explain(2), "for resources: needs cpu=4")) << h.s.explain(2);
}

// Higher priority classes go first, whatever their run time or arrival.
TEST(Priority, HigherClassFirst) {
  for (PolicyKind kind : {PolicyKind::kTangram, PolicyKind::kFifo}) {
    Harness h(cpu_inventory(1, 1), policy_of(kind));
    ActionSpec urgent = action(2, {U(1)}, 1000);
    urgent.priority = 5;
    EXPECT_EQ(started(h.submit({action(1, {U(1)}, 1), urgent}, 0)), std::vector<ActionId>{2});
  }
}

// The starvation guard: before starvation_seconds, small actions backfill around a big one
// that waits; once the big one has waited that long, a release makes it hold the node, later
// small ones wait ("held back" when confined to that node), and the big one starts as soon
// as the node drains.
TEST(Starvation, BigActionBlocksLaterSmallOnes) {
  for (PolicyKind kind : {PolicyKind::kFifo, PolicyKind::kTangram}) {
    SCOPED_TRACE(tangram::policy_name(kind));
    PolicyConfig p = policy_of(kind);
    p.starvation_seconds = 10;
    Harness h(cpu_inventory(2, 4), p);
    auto on0 = [](ActionSpec a) {
      a.affinity_node = 0;
      return a;
    };
    h.submit({on0(action(1, {U(1)}, 100)), on0(action(2, {U(1)}, 100)), on0(action(3, {U(1)}, 100))}, 0);
    // Big: short estimate so it also ranks first under the tangram policy's order.
    EXPECT_TRUE(h.submit({on0(action(10, {U(4)}, 1))}, 1).empty());
    // Before the threshold a small one backfills.
    EXPECT_EQ(started(h.submit({on0(action(4, {U(1)}, 100))}, 5)), std::vector<ActionId>{4});
    // Waited 11 s: the release of 1 makes it claim node 0; 20 may not take the freed core.
    EXPECT_TRUE(h.complete({1}, 12).empty());
    EXPECT_TRUE(h.submit({on0(action(20, {U(1)}, 100))}, 12).empty());
    EXPECT_TRUE(contains(h.s.explain(20), "held back")) << h.s.explain(20);
    // Node 1 is not its to claim: actions there still run.
    ActionSpec elsewhere = action(21, {U(1)}, 100);
    elsewhere.affinity_node = 1;
    EXPECT_EQ(started(h.submit({elsewhere}, 12)), std::vector<ActionId>{21});
    EXPECT_TRUE(h.complete({2, 3}, 13).empty());
    EXPECT_EQ(started(h.complete({4}, 14)), std::vector<ActionId>{10});
    EXPECT_EQ(started(h.complete({10}, 15)), std::vector<ActionId>{20});
  }
}

// The same guard for an action that may use any node: once it starves, a release stops the
// whole pass, so no later action starts anywhere until it fits.
TEST(Starvation, UnconfinedBigActionStopsThePass) {
  PolicyConfig p = policy_of(PolicyKind::kFifo);
  p.starvation_seconds = 10;
  Harness h(cpu_inventory(2, 4), p);
  h.submit({action(1, {U(3)}, 100), action(2, {U(3)}, 100)}, 0);
  EXPECT_TRUE(h.submit({action(10, {U(4)}, 1)}, 1).empty());
  EXPECT_EQ(started(h.submit({action(3, {U(1)}, 100)}, 2)), std::vector<ActionId>{3});
  EXPECT_TRUE(h.complete({3}, 11).empty());  // big has waited 10 s: it holds everything
  EXPECT_TRUE(h.submit({action(4, {U(1)}, 100)}, 11).empty());
  // Node 0 empties: big starts there, and the pass goes on: 4 takes node 1's free core.
  EXPECT_EQ(started(h.complete({1}, 12)), (std::vector<ActionId>{10, 4}));
}

// The guard also holds when nothing was released since the big action started waiting:
// a class parked for resources is looked at again once its head starves, so a later small
// action that arrives past the threshold waits. (Regression: the core as first committed
// left the starving class parked and let it start.)
TEST(Starvation, ParkedStarvingActionHoldsBackLaterSubmits) {
  PolicyConfig p = policy_of(PolicyKind::kFifo);
  p.starvation_seconds = 10;
  Harness h(cpu_inventory(1, 4), p);
  h.submit({action(1, {U(1)}, 100), action(2, {U(1)}, 100), action(3, {U(1)}, 100)}, 0);
  EXPECT_TRUE(h.submit({action(10, {U(4)}, 1)}, 1).empty());  // waits (parked)
  EXPECT_EQ(started(h.submit({action(19, {U(1)}, 100)}, 5)), std::vector<ActionId>{19});  // backfill
  h.complete({19}, 6);
  // 19 s after the big one arrived, with no release since the last backfill, a small one
  // arrives: it must wait.
  EXPECT_TRUE(h.submit({action(20, {U(1)}, 1)}, 20).empty()) << "action 20 starts past a starving action";
  EXPECT_EQ(started(h.complete({1, 2, 3}, 21)), std::vector<ActionId>{10});
}

// ---------------------------------------------------------------- regressions

// WAS: under the trajectory policy, a service action of a trajectory whose slot is on
// another node than the service's device is started in the trajectory's slot, on the wrong
// node: the start names node 0 and "device 0" (node 0's GPU), while the service is resident
// on node 1, GPU 0.
TEST(Regressions, TrajectoryServiceActionRunsOnItsServicesNode) {
  Inventory inv = cpu_inventory(2, 4);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.nodes[1].gpus = {{U(1000)}};
  inv.services = {{"s0", U(500), 0, 1}, {"s1", U(500), 0, 1}};  // homes: GPU a/0, GPU b/0
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = U(2);
  Harness h(inv, p);
  ActionSpec cpu = action(1, {U(1)}, 10);
  cpu.trajectory = 7;
  ASSERT_EQ(h.submit({cpu}, 0)[0].node, 0);  // trajectory 7 binds a slot on node 0
  ActionSpec svc = action(2, {U(1)}, 10);
  svc.trajectory = 7;
  svc.service = 1;
  const auto& out = h.submit({svc}, 0);
  const Decision* d = find_start(out, 2);
  if (d != nullptr) {
    EXPECT_EQ(std::make_pair(d->node, d->device), h.s.service_location(1));
  } else {
    EXPECT_EQ(h.s.state(2), ActionState::kWaiting);
  }
}

// WAS: an action of a GPU service that needs more tokens than its quota grants per minute
// can never run, but it is not rejected at submit (the token check is skipped for service
// actions): it waits forever, its service is restored for nothing, and next_wakeup() keeps
// promising a refill that can never be enough.
TEST(Regressions, ServiceActionOverTokenBudgetIsRejected) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.services = {{"rm", U(500), 0, 1}};
  inv.quotas = {{"llm", 0, 1, 0, 100}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec a = action(1, {U(1)}, 10);
  a.service = 0;
  a.quota = 0;
  a.tokens = 1000;
  EXPECT_EQ(ids_of(h.submit({a}, 0), DecisionKind::kReject), std::vector<ActionId>{1});
}

// WAS: isolated shares are computed in whole parts per million, rounded down, so three
// equal pools on a 3-core node get 0.999 cores each: a 1-core action (exactly a pool's
// share) is rejected, and the node's free total is 2.998 cores, not 3 (the pools do not
// add up to the node).
TEST(Regressions, IsolatedPoolsSplitTheNodeExactly) {
  PolicyConfig p = policy_of(PolicyKind::kIsolated);
  p.pools = {{0, 1.0}, {1, 1.0}, {2, 1.0}};
  Harness h(cpu_inventory(1, 3), p);
  EXPECT_EQ(h.s.free(0, 0), U(3));
  EXPECT_EQ(started(h.submit({action(1, {U(1)}, 10)}, 0)), std::vector<ActionId>{1});
}

// WAS (liveness): idle resident services are evicted only to restore another service.
// GPU memory they hold is never reclaimed for an action's own gpu_memory, neither beside
// its (resident) service nor for a plain GPU action: with nothing running, such an action
// waits forever ("for resources", next_wakeup() == kNever) although evicting the idle
// service would let it run at once. Once it starves, the guard also holds back every later
// action on the node, so the whole node stalls.
Harness two_cached_services() {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(10000)}};
  inv.services = {{"A", U(6000), 0, 1}, {"B", U(4000), 0, 1}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec b = action(1, {U(1)}, 1);
  b.service = 1;
  h.submit({b}, 0);
  h.complete({1}, 1);
  ActionSpec a = action(2, {U(1)}, 1);
  a.service = 0;
  h.submit({a}, 2);
  h.complete({2}, 3);
  EXPECT_EQ(h.s.gpu_free(0, 0), 0);  // A and B both resident and idle
  return h;
}

// An action of resident service A needing 500 MiB beside it must not wait forever while
// idle service B holds the rest of the GPU.
TEST(Regressions, IdleServiceEvictedForServiceActionsGpuMemory) {
  Harness h = two_cached_services();
  ActionSpec a = action(3, {U(1)}, 1);
  a.service = 0;
  a.gpu_memory = U(500);
  h.submit({a}, 4);
  EXPECT_TRUE(h.s.state(3) == ActionState::kRunning || h.s.next_wakeup() != kNever) << h.s.explain(3);
}

// A plain action needing 500 MiB of GPU memory must not wait forever while idle services A
// and B fill the GPU.
TEST(Regressions, IdleServiceEvictedForPlainGpuAction) {
  Harness h = two_cached_services();
  ActionSpec a = action(3, {U(1)}, 1);
  a.gpu_memory = U(500);
  h.submit({a}, 4);
  EXPECT_TRUE(h.s.state(3) == ActionState::kRunning || h.s.next_wakeup() != kNever) << h.s.explain(3);
}

// WAS: a submit refused by validation still moves the clock: Scheduler::submit sets now()
// before it validates the batch ("Nothing of the refused batch has been applied",
// types.h). A caller that fixes the batch and resubmits it at the original time is then
// told that time went backwards.
TEST(Regressions, RefusedSubmitLeavesTheClockAlone) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  h.submit({action(1, {U(1)})}, 1);
  std::vector<ActionSpec> bad = {action(2, {-1})};
  EXPECT_THROW(h.s.submit(bad.data(), bad.size(), S(10), h.out), Error);
  EXPECT_EQ(h.s.now(), S(1));
  EXPECT_NO_THROW(h.tick(2));
}

// WAS: when a starving action stops the pass, explain() for the actions behind it says
// "waiting not yet considered by a scheduling pass", although a pass ran and they wait
// because the starving action holds the resources.
TEST(Regressions, ExplainAfterStarvationStopsThePass) {
  PolicyConfig p = policy_of(PolicyKind::kFifo);
  p.starvation_seconds = 10;
  Harness h(cpu_inventory(1, 4), p);
  h.submit({action(1, {U(1)}, 100), action(2, {U(1)}, 100), action(3, {U(1)}, 100)}, 0);
  h.submit({action(10, {U(4)}, 1)}, 1);
  h.complete({1}, 11);
  EXPECT_TRUE(h.submit({action(20, {U(1)}, 1)}, 12).empty());
  EXPECT_FALSE(contains(h.s.explain(20), "not yet considered")) << h.s.explain(20);
}

}  // namespace

// ---------------------------------------------------------------- node membership

namespace {

// Nodes with a start decision in `out`.
std::set<std::int32_t> start_nodes(const std::vector<Decision>& out) {
  std::set<std::int32_t> nodes;
  for (const Decision& d : out)
    if (d.kind == DecisionKind::kStart) nodes.insert(d.node);
  return nodes;
}

struct NodeHarness : Harness {
  using Harness::Harness;
  const std::vector<Decision>& online(std::int32_t node, bool on, double now) {
    s.set_node_online(node, on, S(now), out);
    s.check_invariants();
    return out;
  }
  std::int32_t add(NodeSpec node, double now) {
    std::int32_t n = s.add_node(std::move(node), S(now), out);
    s.check_invariants();
    return n;
  }
};

}  // namespace

// Nothing is placed on an offline node: its running actions keep their resources until
// they are completed, freed room there starts nothing, new submits go elsewhere or wait.
// When it comes back, its pools are exact (capacity minus what still runs) and waiting
// work starts there; after everything ends every pool is exactly full.
TEST(NodeMembership, OfflineNodeGetsNoPlacementsAndPoolsAreExactWhenItReturns) {
  NodeHarness h(cpu_inventory(2, 4), policy_of(PolicyKind::kTangram));
  auto out = h.submit({action(1, {U(2)}), action(2, {U(2)}), action(3, {U(2)}), action(4, {U(2)})}, 0);
  ASSERT_EQ(started(out).size(), 4u);
  std::vector<ActionId> on1;
  for (ActionId id = 1; id <= 4; ++id)
    if (h.s.placement(id).node == 1) on1.push_back(id);
  ASSERT_EQ(on1.size(), 2u);
  EXPECT_TRUE(h.s.node_online(1));
  EXPECT_TRUE(h.online(1, false, 1).empty());
  EXPECT_FALSE(h.s.node_online(1));
  EXPECT_EQ(h.s.free(1, 0), 0);
  // Room frees on the offline node: the waiting action does not go there.
  h.submit({action(5, {U(2)})}, 2);
  EXPECT_TRUE(started(h.out).empty());
  h.complete({on1[0]}, 3);
  EXPECT_TRUE(started(h.out).empty()) << "placed on an offline node";
  EXPECT_EQ(h.s.free(1, 0), U(2));
  EXPECT_EQ(h.s.running_count(), 3u);
  // Room on the online node: it goes there.
  std::vector<ActionId> on0;
  for (ActionId id = 1; id <= 4; ++id)
    if (h.s.state(id) == ActionState::kRunning && h.s.placement(id).node == 0) on0.push_back(id);
  h.complete({on0[0]}, 4);
  EXPECT_EQ(start_nodes(h.out), std::set<std::int32_t>{0});
  // Idempotent, then back: exactly the freed 2 cores there, and new work lands on it.
  EXPECT_TRUE(h.online(1, false, 5).empty());
  EXPECT_TRUE(h.online(1, true, 6).empty());
  EXPECT_EQ(h.s.free(1, 0), U(2));
  h.submit({action(6, {U(2)})}, 7);
  EXPECT_EQ(start_nodes(h.out), std::set<std::int32_t>{1});
  std::vector<ActionId> rest;
  for (ActionId id = 1; id <= 6; ++id)
    if (h.s.state(id) == ActionState::kRunning) rest.push_back(id);
  h.complete(rest, 8);
  EXPECT_EQ(h.s.free(0, 0), U(4));
  EXPECT_EQ(h.s.free(1, 0), U(4));
}

// Waiting work is started when its node comes back online: an action with affinity to an
// offline node waits (it is not rejected) and starts there as soon as the node is back;
// an action whose shape fits only the offline node's capacity waits too, and even when it
// starves it holds nothing back on the online nodes.
TEST(NodeMembership, WaitersForAnOfflineNodeStartWhenItReturnsAndHoldNothingBack) {
  Inventory inv = cpu_inventory(2, 2);
  inv.nodes[1].capacity = {U(8)};
  PolicyConfig p = policy_of(PolicyKind::kTangram);
  p.starvation_seconds = 10;
  NodeHarness h(inv, p);
  h.online(1, false, 0);
  ActionSpec pinned = action(1, {U(1)});
  pinned.affinity_node = 1;
  auto out = h.submit({pinned, action(2, {U(6)}, 5)}, 0);
  EXPECT_TRUE(started(out).empty());
  EXPECT_EQ(h.s.state(1), ActionState::kWaiting);
  EXPECT_EQ(h.s.state(2), ActionState::kWaiting);
  // Long past starvation: small actions still run on node 0.
  out = h.submit({action(3, {U(1)}), action(4, {U(1)})}, 100);
  EXPECT_EQ(started(out).size(), 2u);
  EXPECT_EQ(start_nodes(out), std::set<std::int32_t>{0});
  out = h.online(1, true, 101);
  EXPECT_EQ(start_nodes(out), std::set<std::int32_t>{1});
  EXPECT_EQ(started(out).size(), 2u);
  EXPECT_EQ(h.s.free(1, 0), U(1));
}

// add_node adds capacity: waiting work starts on the new node; a shape that fitted no node
// (rejected before) is feasible once a node that holds it joins; indices of existing nodes
// are unchanged; duplicate or malformed nodes are refused with nothing applied.
TEST(NodeMembership, AddedNodeReceivesWorkAndMakesBigShapesFeasible) {
  NodeHarness h(cpu_mem_inventory(1, 2, 1024), policy_of(PolicyKind::kTangram));
  auto out = h.submit({action(1, {U(1), 0}), action(2, {U(1), 0}), action(3, {U(1), 0}), action(4, {U(1), 0})}, 0);
  EXPECT_EQ(started(out).size(), 2u);
  out = h.submit({action(5, {U(6), 0})}, 1);
  ASSERT_EQ(ids_of(out, DecisionKind::kReject), std::vector<ActionId>{5});
  expect_error([&] { h.s.add_node(NodeSpec{"node0", {U(8), U(1024)}, {}}, S(2), h.out); }, ErrorCode::kInvalidArgument,
               "node.name");
  expect_error([&] { h.s.add_node(NodeSpec{"big", {U(8)}, {}}, S(2), h.out); }, ErrorCode::kInvalidArgument,
               "node.capacity");
  expect_error([&] { h.s.add_node(NodeSpec{"big", {U(8), U(1024)}, {{0}}}, S(2), h.out); },
               ErrorCode::kInvalidArgument, "node.gpus[0].memory");
  expect_error([&] { h.s.set_node_online(7, false, S(2), h.out); }, ErrorCode::kUnknownName, "node");
  EXPECT_EQ(h.s.inventory().nodes.size(), 1u);
  std::int32_t n = h.add(NodeSpec{"big", {U(8), U(1024)}, {}}, 2);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(start_nodes(h.out), std::set<std::int32_t>{1});
  EXPECT_EQ(started(h.out).size(), 2u);
  out = h.submit({action(6, {U(6), 0})}, 3);
  EXPECT_EQ(start_nodes(out), std::set<std::int32_t>{1}) << "the shape fits the new node";
  std::vector<ActionId> all = {1, 2, 3, 4, 6};
  h.complete(all, 4);
  EXPECT_EQ(h.s.free(0, 0), U(2));
  EXPECT_EQ(h.s.free(1, 0), U(8));
  EXPECT_EQ(h.s.free(1, 1), U(1024));
}

// A GPU service resident on a node that goes offline: its waiting actions do not start
// beside it there; once its running action there has ended it is evicted and restored on
// an online node, where they run. A GPU node added to an inventory without GPUs gains the
// GPU dimension: gpu_memory actions placed there get a device on it.
TEST(NodeMembership, ServicesLeaveAnOfflineNodeAndGpuNodesCanJoin) {
  Inventory inv = cpu_inventory(2, 4);
  inv.nodes[0].gpus = {{U(10000)}};
  inv.nodes[1].gpus = {{U(10000)}};
  inv.services = {{"rm", U(6000), 1.0, 1}};
  NodeHarness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec a = action(1, {U(1)});
  a.service = 0;
  h.submit({a}, 0);
  h.tick(1);
  ASSERT_EQ(h.s.state(1), ActionState::kRunning);
  const std::int32_t home = h.s.service_location(0).first;
  ActionSpec b = action(2, {U(1)});
  b.service = 0;
  h.submit({b}, 1.5);
  EXPECT_EQ(h.s.state(2), ActionState::kWaiting);  // batch of one is full
  h.online(home, false, 2);
  EXPECT_EQ(h.s.service_location(0).first, home);  // still running there: not evicted
  auto out = h.complete({1}, 3);
  EXPECT_TRUE(started(out).empty()) << "started beside a service on an offline node";
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].kind, DecisionKind::kEvict);
  EXPECT_EQ(out[1].kind, DecisionKind::kRestore);
  EXPECT_EQ(out[1].node, 1 - home);
  out = h.tick(4);
  ASSERT_EQ(started(out), std::vector<ActionId>{2});
  EXPECT_EQ(out[0].node, 1 - home);
  h.complete({2}, 5);

  NodeHarness g(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  ActionSpec c = action(1, {U(1)});
  g.submit({c}, 0);
  std::int32_t n = g.add(NodeSpec{"gpu", {U(4)}, {{U(8000)}}}, 1);
  ActionSpec d = action(2, {U(1)});
  d.gpu_memory = U(3000);
  out = g.submit({d}, 2);
  ASSERT_EQ(started(out), std::vector<ActionId>{2});
  EXPECT_EQ(out[0].node, n);
  EXPECT_EQ(out[0].device, 0);
  EXPECT_EQ(g.s.gpu_free(n, 0), U(5000));
  g.complete({1, 2}, 3);
  EXPECT_EQ(g.s.gpu_free(n, 0), U(8000));
}

class NodeChurn : public ::testing::TestWithParam<PolicyKind> {};

// Random workloads while nodes go offline, come back and join, under every policy:
// capacity is never exceeded (check_invariants after every event: free + used == capacity,
// offline bins hidden from placement); no start decision ever names an offline node; every
// action ends exactly once; after everything ends with all nodes online, every pool is
// exactly full.
TEST_P(NodeChurn, NothingPlacedOfflineAndPoolsExactAfterReturn) {
  RandomRun run(GetParam(), 31);
  Harness& h = run.h;
  std::vector<std::uint8_t> online(4, 1);
  std::int32_t nodes = 4, toggles = 0, on_joined = 0;
  auto check_starts = [&] {
    for (const Decision& d : h.out)
      if (d.kind == DecisionKind::kStart) {
        ASSERT_TRUE(online[d.node]) << "start on offline node " << d.node;
        on_joined += d.node >= 4 ? 1 : 0;
      }
  };
  for (int i = 0; i < 400; ++i) {
    if (run.pick(8) == 0) {
      run.now += 1;
      if (nodes < 6 && run.pick(6) == 0) {
        NodeSpec spec{"joined" + std::to_string(nodes), {U(8), U(16384)}, {}};
        h.s.add_node(std::move(spec), S(run.now), h.out);
        h.s.check_invariants();
        online.push_back(1);
        ++nodes;
        run.inv.nodes.push_back(h.s.inventory().nodes.back());
      } else {
        std::int32_t n = static_cast<std::int32_t>(run.pick(static_cast<std::uint32_t>(nodes)));
        online[n] = !online[n];
        ++toggles;
        h.s.set_node_online(n, online[n], S(run.now), h.out);
        h.s.check_invariants();
      }
      run.ledger.apply(h.out);
    } else {
      run.step();
    }
    check_starts();
    if (HasFatalFailure()) return;
  }
  EXPECT_GE(toggles, 20);
  EXPECT_GT(nodes, 4) << "no node joined";
  // (Under kTrajectory the 12 trajectories rarely need more than the first nodes' slots.)
  if (GetParam() != PolicyKind::kTrajectory) {
    EXPECT_GT(on_joined, 0) << "joined nodes got no work";
  }
  for (std::int32_t n = 0; n < nodes; ++n) {
    if (online[n]) continue;
    h.s.set_node_online(n, true, S(run.now), h.out);
    h.s.check_invariants();
    online[n] = 1;
    run.ledger.apply(h.out);
  }
  run.drain();
  if (HasFatalFailure()) return;
  for (const auto& [id, n] : run.ledger.starts) ASSERT_LE(n, 1) << "action " << id << " started twice";
  for (const auto& [id, n] : run.ledger.ends) ASSERT_EQ(n, 1) << "action " << id << " ended " << n << " times";
  for (std::int32_t n = 0; n < nodes; ++n)
    for (std::int32_t k = 0; k < 2; ++k) EXPECT_EQ(h.s.free(n, k), h.s.inventory().nodes[n].capacity[k]);
}

INSTANTIATE_TEST_SUITE_P(Policies, NodeChurn,
                         ::testing::Values(PolicyKind::kTangram, PolicyKind::kFifo, PolicyKind::kTrajectory,
                                           PolicyKind::kIsolated, PolicyKind::kOptimus),
                         [](const ::testing::TestParamInfo<PolicyKind>& info) {
                           return std::string(tangram::policy_name(info.param));
                         });
