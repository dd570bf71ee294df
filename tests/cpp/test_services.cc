// GPU services: restores, evictions, batches, the restore order, and GPU memory held by
// idle resident services reclaimed for actions that need it.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "random_workloads.h"

namespace tangram_test {
namespace {

// A simulation in virtual time of GPU services whose total memory exceeds the GPUs, so
// they are restored and evicted over and over, with a quota on some actions. Actions end
// at start + runtime; ticks happen at next_wakeup().
struct GpuRun {
  static constexpr int kServices = 6;
  Inventory inv;
  Harness h;
  std::mt19937 rng;
  Ledger ledger;
  Decisions trace;
  // The tests' own model of the services: device (node, gpu) or offloaded, ready time,
  // running actions.
  std::vector<std::pair<std::int32_t, std::int32_t>> where;
  std::vector<TimeNs> ready;
  std::map<std::pair<std::int32_t, std::int32_t>, TimeNs> ops_end;  // (node, device) -> its last restore or offload's end
  std::vector<int> running_on;
  std::map<ActionId, std::int32_t> service_of;
  std::set<std::pair<TimeNs, ActionId>> finishing;
  std::size_t restores = 0, evicts = 0, service_starts = 0, service_rejects = 0;
  TimeNs now = 0;

  static Inventory make_inventory() {
    Inventory inv;
    inv.kinds = {"cpu"};
    inv.nodes.push_back(NodeSpec{"a", {U(16)}, {{U(16000)}, {U(16000)}}});
    inv.nodes.push_back(NodeSpec{"b", {U(16)}, {{U(24000)}}});
    // Too small for any service: plain GPU actions also find memory here.
    inv.nodes.push_back(NodeSpec{"c", {U(16)}, {{U(4000)}}});
    for (int s = 0; s < kServices; ++s)
      inv.services.push_back({"svc" + std::to_string(s), U(9000 + 1400 * s), 0.25 * (1 + s % 3), 1 + s % 3, 0.125 * (s % 2)});
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

  // Plain GPU actions (at most 4000 MiB) fit every GPU. A service action needs its
  // service's memory plus its own on one device: any device, or under kIsolated the
  // service's home device (round robin over a/0, a/1, b/0, c/0), which c/0 (4000 MiB) and
  // for svc5 with extra memory a/1 (16000 MiB) cannot hold.
  bool can_ever_run(const ActionSpec& a) const {
    if (a.service == kNone) return true;
    const Quantity need = inv.services[a.service].memory + a.gpu_memory;
    if (h.s.policy().kind != PolicyKind::kIsolated) return need <= U(24000);
    const Quantity home[] = {U(16000), U(16000), U(24000), U(4000)};
    return need <= home[a.service % 4];
  }

  void apply(const Decisions& out) {
    for (const Decision& d : out) {
      switch (d.kind) {
        case DecisionKind::kRestore:
          ASSERT_EQ(where[d.service].first, kNone) << "restore of a resident service " << d.service;
          // Ready exactly restore_seconds after the device's earlier restores and offloads end
          // (or the event that decided it, if they have).
          {
            TimeNs& end = ops_end[{d.node, d.device}];
            ASSERT_EQ(d.time, std::max(now, end) + S(inv.services[d.service].restore_seconds)) << "service " << d.service;
            end = d.time;
          }
          where[d.service] = {d.node, d.device};
          ready[d.service] = d.time;
          ++restores;
          break;
        case DecisionKind::kEvict:
          ASSERT_EQ(d.time, now);
          ASSERT_EQ(running_on[d.service], 0) << "evicted service " << d.service << " has running actions";
          ASSERT_LE(ready[d.service], now) << "evicted service " << d.service << " while restoring";
          ASSERT_EQ(where[d.service], std::make_pair(d.node, d.device));
          {
            TimeNs& end = ops_end[{d.node, d.device}];
            end = std::max(now, end) + S(inv.services[d.service].offload_seconds);
          }
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
          } else {
            ASSERT_EQ(d.service, kNone);
            ASSERT_NE(d.device, kNone) << "plain GPU action " << d.action << " without a device";
          }
          finishing.emplace(now + S(h.s.runtime(d.action, d.grant)), d.action);
          break;
        }
        case DecisionKind::kReject:
          break;  // checked against can_ever_run() at submit
        case DecisionKind::kResize:
          break;  // a grant change: the run keeps its first modelled finish (any order of ends is valid)
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
        std::vector<ActionId> never_run;
        for (const ActionSpec& a : batch)
          if (!can_ever_run(a)) {
            never_run.push_back(a.id);
            service_rejects += 1;
          }
        ASSERT_EQ(ids_of(h.out, DecisionKind::kReject), never_run) << "rejects in batch order, exactly those";
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
    ledger.expect_each_ended_once(static_cast<ActionId>(arrivals));
  }
};

class GpuServices : public ::testing::TestWithParam<PolicyKind> {};

// GPU memory is never oversubscribed, through many restore/evict cycles of services whose
// total memory exceeds the GPUs: gpu_free() stays in [0, total]; a service with running
// actions (or still restoring) is never evicted; a service's actions start only on its
// device, once it is ready and with at most max_batch running; service_location() agrees
// with the restore/evict decisions; every action starts once and ends; all memory is back
// except that of the services left resident.
TEST_P(GpuServices, MemoryBoundHoldsThroughEvictions) {
  GpuRun run(GetParam(), 5);
  run.run(600);
  if (HasFatalFailure()) return;
  EXPECT_GE(run.evicts, 20u) << "the workload should force many evictions";
  std::size_t resident = 0;
  for (const auto& w : run.where) resident += w.first != kNone ? 1 : 0;
  EXPECT_EQ(run.restores, run.evicts + resident) << "every restore is undone by an evict, or still resident";
  EXPECT_EQ(run.service_starts + run.service_rejects, run.service_of.size())
      << "every service action that can run starts exactly once";
  if (GetParam() == PolicyKind::kIsolated) {
    EXPECT_GT(run.service_rejects, 0u) << "the workload includes service actions their home device cannot hold";
  } else {
    EXPECT_EQ(run.service_rejects, 0u);
  }
  for (std::int32_t n = 0; n < 3; ++n)
    for (std::int32_t g = 0; g < static_cast<std::int32_t>(run.inv.nodes[n].gpus.size()); ++g) {
      Quantity held = 0;
      for (std::int32_t s = 0; s < GpuRun::kServices; ++s)
        if (run.where[s] == std::make_pair(n, g)) held += run.inv.services[s].memory;
      EXPECT_EQ(run.h.s.gpu_free(n, g) + held, run.inv.nodes[n].gpus[g].memory);
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
  ASSERT_GT(a.trace.size(), 250u);
  ASSERT_EQ(a.trace, b.trace);
}

INSTANTIATE_TEST_SUITE_P(Policies, GpuServices,
                         ::testing::Values(PolicyKind::kTangram, PolicyKind::kFifo, PolicyKind::kIsolated,
                                           PolicyKind::kOptimus),
                         policy_param_name);

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
  EXPECT_EQ(h.submit({a0}, 0), (Decisions{restore(0).on(0, 0).at(2)}));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000));
  EXPECT_FALSE(h.s.service_ready(0));
  EXPECT_EQ(h.s.next_wakeup(), S(2));
  EXPECT_EQ(h.s.explain(1), "waiting for service 'rm0' to finish restoring at 2.000000 s");
  EXPECT_EQ(h.tick(1.999), Decisions{});
  EXPECT_EQ(h.tick(2), (Decisions{start(1).on(0, 0).service(0).at(2)}));
  // rm1 needs room, but rm0 runs an action: it may not be evicted.
  ActionSpec a1 = action(2, {U(1)}, 5);
  a1.service = 1;
  EXPECT_EQ(h.submit({a1}, 3), Decisions{});
  EXPECT_EQ(h.s.explain(2), "waiting for service 'rm1': no GPU can make room for it now (resident services are busy)");
  EXPECT_EQ(h.s.service_location(0), std::make_pair(0, 0));
  // rm0 goes idle: now it is evicted for rm1, which is ready 2 s later.
  EXPECT_EQ(h.complete({1}, 7), (Decisions{evict(0).on(0, 0).at(7), restore(1).on(0, 0).at(9)}));
  EXPECT_EQ(h.s.service_location(0), std::make_pair(kNone, kNone));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000));
  EXPECT_EQ(h.tick(9), (Decisions{start(2).on(0, 0).service(1).at(9)}));
  EXPECT_EQ(h.s.placement(2), Decision(start(2).on(0, 0).service(1).at(9)));
}

// A one-core, quarter-second action of `service`.
ActionSpec on(ActionId id, std::int32_t service) {
  ActionSpec a = action(id, {U(1)}, 0.25);
  a.service = service;
  return a;
}

// Room for a third service on a GPU where two idle ones sit: the one asked for rarely goes,
// not the one asked for every second, although it comes first in service order.
TEST(GpuServicesSmall, EvictsTheIdleServiceLeastLikelyToBeAskedForSoon) {
  for (PolicyKind kind : {PolicyKind::kTangram, PolicyKind::kFifo}) {
    Inventory inv = cpu_inventory(1, 8);
    inv.nodes[0].gpus = {{U(12000)}};
    inv.services = {{"popular", U(6000), 1.0, 1}, {"rare", U(6000), 1.0, 1}, {"new", U(6000), 1.0, 1}};
    Harness h(inv, policy_of(kind));
    EXPECT_EQ(h.submit({on(1, 1)}, 0), (Decisions{restore(1).on(0, 0).at(1)}));
    h.tick(1);
    h.complete({1}, 1.25);
    EXPECT_EQ(h.submit({on(2, 0)}, 3), (Decisions{restore(0).on(0, 0).at(4)}));
    h.tick(4);
    h.complete({2}, 4.25);
    for (ActionId id = 3; id <= 6; ++id) {  // popular: asked for every second
      const double t = 2.0 + static_cast<double>(id);
      EXPECT_EQ(h.submit({on(id, 0)}, t), (Decisions{start(id).on(0, 0).service(0).at(t)}));
      h.complete({id}, t + 0.25);
    }
    // Both idle; "popular" was asked for at 8 s, about every second, "rare" once, at 0 s.
    EXPECT_EQ(h.submit({on(7, 2)}, 10), (Decisions{evict(1).on(0, 0).at(10), restore(2).on(0, 0).at(11)}))
        << tangram::policy_name(kind);
    EXPECT_EQ(h.s.service_location(0), std::make_pair(0, 0));
  }
}

// Room for a third service on a node whose two GPUs each hold one idle service: the device
// of the one asked for rarely is cleared, although the popular one's device comes first.
TEST(GpuServicesSmall, ClearsTheDeviceWhoseIdleServicesAreLeastLikelyToBeAskedForSoon) {
  for (PolicyKind kind : {PolicyKind::kTangram, PolicyKind::kFifo}) {
    Inventory inv = cpu_inventory(1, 8);
    inv.nodes[0].gpus = {{U(6000)}, {U(6000)}};
    inv.services = {{"popular", U(6000), 1.0, 1}, {"rare", U(6000), 1.0, 1}, {"new", U(6000), 1.0, 1}};
    Harness h(inv, policy_of(kind));
    EXPECT_EQ(h.submit({on(1, 0)}, 0), (Decisions{restore(0).on(0, 0).at(1)}));
    h.tick(1);
    h.complete({1}, 1.25);
    EXPECT_EQ(h.submit({on(2, 1)}, 1.5), (Decisions{restore(1).on(0, 1).at(2.5)}));
    h.tick(2.5);
    h.complete({2}, 2.75);
    for (ActionId id = 3; id <= 8; ++id) {  // popular: asked for every second
      const double t = static_cast<double>(id);
      EXPECT_EQ(h.submit({on(id, 0)}, t), (Decisions{start(id).on(0, 0).service(0).at(t)}));
      h.complete({id}, t + 0.25);
    }
    // Both idle, one per device; "popular" was last asked for at 8 s, "rare" at 1.5 s.
    EXPECT_EQ(h.submit({on(9, 2)}, 10), (Decisions{evict(1).on(0, 1).at(10), restore(2).on(0, 1).at(11)}))
        << tangram::policy_name(kind);
    EXPECT_EQ(h.s.service_location(0), std::make_pair(0, 0));
  }
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
    EXPECT_EQ(h.submit({a0}, 0), (Decisions{restore(0).on(0, 0).at(2)}));
    EXPECT_EQ(h.tick(2), (Decisions{start(1).on(0, 0).service(0).at(2)}));
    ActionSpec b = action(2, {U(1)}, 0.5);  // rm1: one short action, first to arrive
    b.service = 1;
    EXPECT_EQ(h.submit({b}, 3), Decisions{});  // rm0 is busy: no room
    std::vector<ActionSpec> cs;
    for (ActionId id = 3; id <= 5; ++id) {  // rm2: three longer ones, later
      cs.push_back(action(id, {U(1)}, 2));
      cs.back().service = 2;
    }
    EXPECT_EQ(h.submit(cs, 8), Decisions{});
    return h.complete({1}, 12);  // rm0 idle: room for one of rm1, rm2 (the other finds none)
  };
  // rm2: 3 waiting / (2 s + 6 s / 4) beats rm1: 1 waiting / (2 s + 0.5 s / 4).
  EXPECT_EQ(run(policy_of(PolicyKind::kTangram)), (Decisions{evict(0).on(0, 0).at(12), restore(2).on(0, 0).at(14)}));
  EXPECT_EQ(run(policy_of(PolicyKind::kFifo)), (Decisions{evict(0).on(0, 0).at(12), restore(1).on(0, 0).at(14)}));
  // rm1's action has waited 9 s >= 5 s (starving), rm2's 4 s: rm1 first.
  PolicyConfig starving = policy_of(PolicyKind::kTangram);
  starving.starvation_seconds = 5;
  EXPECT_EQ(run(starving), (Decisions{evict(0).on(0, 0).at(12), restore(1).on(0, 0).at(14)}));
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
  // restore_seconds 0: ready at once, so the first two start in the same pass.
  EXPECT_EQ(h.submit(batch, 0), (Decisions{restore(0).on(0, 0).at(0), start(1).on(0, 0).service(0).at(0),
                                           start(2).on(0, 0).service(0).at(0)}));
  EXPECT_EQ(h.s.explain(3), "waiting for service 'rm': its batch is full (2 running)");
  EXPECT_EQ(h.complete({2}, 1), (Decisions{start(3).on(0, 0).service(0).at(1)}));
}

// Idle resident services give up GPU memory to actions that need it, not only to other
// services: with nothing running, an action needing GPU memory that idle services hold
// starts at once after the evictions it needs (it never waits with no wakeup due).
Harness two_cached_services() {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(10000)}};
  inv.services = {{"A", U(6000), 0, 1}, {"B", U(4000), 0, 1}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec b = action(1, {U(1)}, 1);
  b.service = 1;
  EXPECT_EQ(h.submit({b}, 0), (Decisions{restore(1).on(0, 0).at(0), start(1).on(0, 0).service(1).at(0)}));
  h.complete({1}, 1);
  ActionSpec a = action(2, {U(1)}, 1);
  a.service = 0;
  EXPECT_EQ(h.submit({a}, 2), (Decisions{restore(0).on(0, 0).at(2), start(2).on(0, 0).service(0).at(2)}));
  h.complete({2}, 3);
  EXPECT_EQ(h.s.gpu_free(0, 0), 0);  // A and B both resident and idle
  return h;
}

// An action of resident service A needing 500 MiB beside it: B, idle, is evicted (A is
// kept: the action needs it) and the action starts on A's device.
TEST(Regressions, IdleServiceEvictedForServiceActionsGpuMemory) {
  Harness h = two_cached_services();
  ActionSpec a = action(3, {U(1)}, 1);
  a.service = 0;
  a.gpu_memory = U(500);
  EXPECT_EQ(h.submit({a}, 4), (Decisions{evict(1).on(0, 0).at(4), start(3).on(0, 0).service(0).at(4)}));
  EXPECT_EQ(h.s.service_location(1), std::make_pair(kNone, kNone));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000) - U(500));
}

// A plain action needing 500 MiB of GPU memory while idle services A and B fill the GPU:
// one victim suffices; both are idle with no queued work, so service order picks A.
TEST(Regressions, IdleServiceEvictedForPlainGpuAction) {
  Harness h = two_cached_services();
  ActionSpec a = action(3, {U(1)}, 1);
  a.gpu_memory = U(500);
  EXPECT_EQ(h.submit({a}, 4), (Decisions{evict(0).on(0, 0).at(4), start(3).on(0, 0).at(4)}));
  EXPECT_EQ(h.s.service_location(1), std::make_pair(0, 0));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(6000) - U(500));
}

// A device's restores and offloads run one after another (ServiceSpec): a restore into an
// evicted service's memory is ready after the victim's offload and its own restore, and
// of two devices with alike eviction plans the one whose offload ends first is cleared
// (device order alone would clear device 0).
TEST(Services, RestoreIntoEvictedMemoryWaitsForTheOffload) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(4000)}, {U(4000)}};
  inv.services = {{"slow", U(4000), 1.0, 1, 5.0}, {"fast", U(4000), 1.0, 1, 0.5}, {"big", U(4000), 1.0, 1, 1.0}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  std::vector<ActionSpec> first;
  for (ActionId id = 1; id <= 2; ++id) {
    first.push_back(action(id, {U(1)}, 1));
    first.back().service = static_cast<std::int32_t>(id - 1);
  }
  EXPECT_EQ(h.submit(first, 0), (Decisions{restore(0).on(0, 0).at(1), restore(1).on(0, 1).at(1)}));
  h.tick(1);
  h.complete({1, 2}, 2);
  ActionSpec big = action(3, {U(1)}, 1);
  big.service = 2;
  EXPECT_EQ(h.submit({big}, 3), (Decisions{evict(1).on(0, 1).at(3), restore(2).on(0, 1).at(4.5)}));
  EXPECT_EQ(h.tick(4), Decisions{});
  EXPECT_EQ(h.tick(4.5), (Decisions{start(3).on(0, 1).service(2).at(4.5)}));
}

// An unmovable service (an inference server process) keeps asleep_memory on its device
// while offloaded: the eviction frees only the rest, and its next restore goes back to the
// same device, taking only the rest again, even when another device is empty.
TEST(Services, UnmovableServiceKeepsItsAsleepMemoryAndItsDevice) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(4000)}, {U(4000)}};
  tangram::ServiceSpec server{"server", U(3000), 1.0, 1, 1.0};
  server.asleep_memory = U(500);
  server.movable = false;
  inv.services = {server, {"other", U(3000), 1.0, 1, 1.0}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec a = action(1, {U(1)}, 1);
  a.service = 0;
  EXPECT_EQ(h.submit({a}, 0), (Decisions{restore(0).on(0, 0).at(1)}));
  h.tick(1);
  h.complete({1}, 2);
  // A plain action needing 3,500 MiB on the device: the server is evicted, but only
  // 2,500 MiB come back, so the action goes to device 1.
  ActionSpec big = action(2, {U(1)}, 1);
  big.gpu_memory = U(3500);
  EXPECT_EQ(h.submit({big}, 3), (Decisions{start(2).on(0, 1).at(3)}));
  ActionSpec plain = action(3, {U(1)}, 1);
  plain.gpu_memory = U(3000);
  EXPECT_EQ(h.submit({plain}, 4), (Decisions{evict(0).on(0, 0).at(4), start(3).on(0, 0).at(4)}));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(500));  // 4,000 - 3,000 for the action - 500 kept asleep
  h.complete({2, 3}, 5);
  EXPECT_EQ(h.s.gpu_free(0, 1), U(4000));
  // Back on device 0 (where its process is), though device 1 is empty: it takes 2,500 MiB.
  ActionSpec again = action(4, {U(1)}, 1);
  again.service = 0;
  EXPECT_EQ(h.submit({again}, 6), (Decisions{restore(0).on(0, 0).at(7)}));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(1000));
}

// When the node of an unmovable service's process goes offline, its process is given up
// (a discard: all of its memory there is free): its next restore is a fresh load on
// another device, which takes its whole memory.
TEST(Services, UnmovableServiceMovesWhenItsNodeGoesOffline) {
  Inventory inv = cpu_inventory(2, 4);
  inv.nodes[0].gpus = {{U(4000)}};
  inv.nodes[1].gpus = {{U(4000)}};
  tangram::ServiceSpec server{"server", U(3000), 1.0, 1, 1.0};
  server.asleep_memory = U(500);
  server.movable = false;
  inv.services = {server};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec a = action(1, {U(1)}, 1);
  a.service = 0;
  EXPECT_EQ(h.submit({a}, 0), (Decisions{restore(0).on(0, 0).at(1)}));
  h.tick(1);
  h.complete({1}, 2);
  EXPECT_EQ(h.online(0, false, 3), (Decisions{discard(0).on(0, 0).at(3)}));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000));
  ActionSpec b = action(2, {U(1)}, 1);
  b.service = 0;
  EXPECT_EQ(h.submit({b}, 4), (Decisions{restore(0).on(1, 0).at(5)}));
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000));  // the old process's memory is given back
  EXPECT_EQ(h.s.gpu_free(1, 0), U(1000));
}

// A restore the runtime reports done sooner than planned is ready at once; measured times
// replace the declared ones for later restores.
TEST(Services, ReportedRestoreIsReadyAtOnceAndMeasuredTimesApply) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(4000)}};
  inv.services = {{"reward", U(3000), 4.0, 1, 4.0}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec a = action(1, {U(1)}, 1);
  a.service = 0;
  EXPECT_EQ(h.submit({a}, 0), (Decisions{restore(0).on(0, 0).at(4)}));
  h.s.service_restored(0, 0, 0, S(0.5), h.out);
  h.s.check_invariants();
  EXPECT_EQ(h.out, (Decisions{start(1).on(0, 0).service(0).at(0.5)}));
  h.s.service_restored(0, 0, 0, S(0.6), h.out);  // nothing restoring: changes nothing
  EXPECT_EQ(h.out, Decisions{});
  h.s.set_service_times(0, 0.25, 0.125);
  EXPECT_THROW(h.s.set_service_times(0, -1.0, 0.0), Error);
  EXPECT_THROW(h.s.set_service_times(1, 1.0, 0.0), Error);
  h.complete({1}, 1);
  ActionSpec plain = action(2, {U(1)}, 1);
  plain.gpu_memory = U(2000);
  EXPECT_EQ(h.submit({plain}, 2), (Decisions{evict(0).on(0, 0).at(2), start(2).on(0, 0).at(2)}));
  h.complete({2}, 3);
  ActionSpec b = action(3, {U(1)}, 1);
  b.service = 0;
  EXPECT_EQ(h.submit({b}, 3), (Decisions{restore(0).on(0, 0).at(3.25)}));
}

// Offloaded services hold host memory on the node they were evicted from: a victim whose
// state would not fit the node's offload memory is discarded instead (its state given up),
// and a restore gives its own state's room back (so two services take turns in room for one).
TEST(Services, OffloadedStateMustFitTheNodesOffloadMemory) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(4000)}, {U(4000)}};
  inv.nodes[0].offload_memory = U(1000);
  tangram::ServiceSpec a{"a", U(3000), 1.0, 1, 1.0};
  a.host_memory = U(800);
  tangram::ServiceSpec b = a;
  b.name = "b";
  inv.services = {a, b};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec first = action(1, {U(1)}, 1);
  first.service = 0;
  ActionSpec second = action(2, {U(1)}, 1);
  second.service = 1;
  EXPECT_EQ(h.submit({first, second}, 0), (Decisions{restore(0).on(0, 0).at(1), restore(1).on(0, 1).at(1)}));
  h.tick(1);
  h.complete({1, 2}, 2);
  // Two plain actions needing 3,000 MiB each: a is evicted for the first (800 of 1,000 MiB
  // of host memory); b's state would not fit too (1,600 MiB), so b is discarded.
  ActionSpec big = action(3, {U(1)}, 1);
  big.gpu_memory = U(3000);
  ActionSpec big2 = action(4, {U(1)}, 1);
  big2.gpu_memory = U(3000);
  EXPECT_EQ(h.submit({big, big2}, 3), (Decisions{evict(0).on(0, 0).at(3), start(3).on(0, 0).at(3),
                                                 discard(1).on(0, 1).at(3), start(4).on(0, 1).at(3)}));
  EXPECT_EQ(h.s.service_location(1), std::make_pair(kNone, kNone));
  h.complete({3, 4}, 4);
  // a's restore gives its 800 MiB back; then b, restored, can be evicted keeping its state.
  ActionSpec again = action(5, {U(1)}, 1);
  again.service = 0;
  ActionSpec other = action(6, {U(1)}, 1);
  other.service = 1;
  EXPECT_EQ(h.submit({again, other}, 6), (Decisions{restore(0).on(0, 0).at(7), restore(1).on(0, 1).at(7)}));
  h.tick(7);
  h.complete({5, 6}, 8);
  ActionSpec plain = action(7, {U(1)}, 1);
  plain.gpu_memory = U(3000);
  EXPECT_EQ(h.submit({plain}, 9), (Decisions{evict(0).on(0, 0).at(9), start(7).on(0, 0).at(9)}));
  ActionSpec plain2 = action(8, {U(1)}, 1);
  plain2.gpu_memory = U(3000);
  EXPECT_EQ(h.submit({plain2}, 9), (Decisions{discard(1).on(0, 1).at(9), start(8).on(0, 1).at(9)}));
}

// A device out of placement (a GPU that needs a reset) fences its memory off: nothing new
// starts or is restored there, a service resident there is evicted once idle, memory
// returning to it stays fenced; back online, it is all free again.
TEST(Services, OfflineDeviceFencesItsMemory) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(4000)}, {U(4000)}};
  inv.services = {{"reward", U(3000), 1.0, 1, 1.0}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec score = action(1, {U(1)}, 1);
  score.service = 0;
  ActionSpec gpu = action(2, {U(1)}, 1);
  gpu.gpu_memory = U(500);
  EXPECT_EQ(h.submit({score, gpu}, 0), (Decisions{restore(0).on(0, 0).at(1), start(2).on(0, 0).at(0)}));
  h.tick(1);
  h.s.set_device_online(0, 0, false, S(2), h.out);
  h.s.check_invariants();
  EXPECT_EQ(h.out, Decisions{});  // the service runs action 1 there: it stays until that ends
  EXPECT_EQ(h.s.gpu_free(0, 0), 0);
  EXPECT_FALSE(h.s.device_online(0, 0));
  EXPECT_EQ(h.complete({1, 2}, 3), (Decisions{discard(0).on(0, 0).at(3)}));
  EXPECT_EQ(h.s.gpu_free(0, 0), 0);  // what came back is fenced
  ActionSpec again = action(3, {U(1)}, 1);
  again.service = 0;
  ActionSpec gpu2 = action(4, {U(1)}, 1);
  gpu2.gpu_memory = U(500);
  EXPECT_EQ(h.submit({again, gpu2}, 4), (Decisions{restore(0).on(0, 1).at(5), start(4).on(0, 1).at(4)}));
  h.s.set_device_online(0, 0, true, S(6), h.out);
  h.s.check_invariants();
  EXPECT_EQ(h.s.gpu_free(0, 0), U(4000));
}

// A restore goes to a device where no resident service has work, when one has room:
// services on one device share its compute (best fit alone would pack b beside busy a).
TEST(Services, RestoreAvoidsDevicesWhoseServicesAreBusy) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(10000)}, {U(10000)}};
  inv.services = {{"a", U(3000), 1.0, 1, 1.0}, {"b", U(3000), 1.0, 1, 1.0}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec first = action(1, {U(1)}, 1);
  first.service = 0;
  EXPECT_EQ(h.submit({first}, 0), (Decisions{restore(0).on(0, 0).at(1)}));
  h.tick(1);
  ActionSpec second = action(2, {U(1)}, 1);
  second.service = 1;
  EXPECT_EQ(h.submit({second}, 2), (Decisions{restore(1).on(0, 1).at(3)}));
}

// Devices with room are ranked by the actions running or waiting at their services, not by
// how many services have work: a restore avoids the device of one service busy with three
// actions for one whose two services run one each (the busy-service count or best fit
// alone would pick the first).
TEST(Services, RestoreGoesWhereTheFewestActionsShareTheDevice) {
  Inventory inv = cpu_inventory(1, 16);
  inv.nodes[0].gpus = {{U(7000)}, {U(12000)}};
  inv.services = {{"a", U(3000), 1.0, 4, 1.0}, {"b", U(3000), 1.0, 4, 1.0}, {"c", U(3000), 1.0, 4, 1.0},
                  {"d", U(3000), 1.0, 4, 1.0}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  auto call = [](ActionId id, std::int32_t service) {
    ActionSpec x = action(id, {U(1)}, 100);
    x.service = service;
    return x;
  };
  // a on the better fit; three of its actions run there.
  EXPECT_EQ(h.submit({call(1, 0), call(2, 0), call(3, 0)}, 0), (Decisions{restore(0).on(0, 0).at(1)}));
  h.tick(1);
  // b beside no work; one action.
  EXPECT_EQ(h.submit({call(4, 1)}, 2), (Decisions{restore(1).on(0, 1).at(3)}));
  h.tick(3);
  // c: device 0 shares with three actions, device 1 with one (best fit is device 0).
  EXPECT_EQ(h.submit({call(5, 2)}, 4), (Decisions{restore(2).on(0, 1).at(5)}));
  h.tick(5);
  // d: device 0 has one busy service and three actions, device 1 two busy services and two.
  EXPECT_EQ(h.submit({call(6, 3)}, 6), (Decisions{restore(3).on(0, 1).at(7)}));
  h.s.check_invariants();
}

// A service asked for every second, each action running 2 s (so one always runs), holds the
// only GPU; a service that does not fit beside it starves. Once its action has waited
// starvation_seconds, the busy service starts nothing new (explain says for whom), is
// evicted when its running actions end, and the starving one is restored. Without the drain
// it waited for as long as the stream lasted.
TEST(Services, SteadyStreamIsDrainedForAStarvingService) {
  for (PolicyKind kind : {PolicyKind::kTangram, PolicyKind::kFifo}) {
    Inventory inv = cpu_inventory(1, 16);
    inv.nodes[0].gpus = {{U(10000)}};
    inv.services = {{"a", U(6000), 1.0, 2, 1.0}, {"b", U(6000), 1.0, 2, 1.0}};
    PolicyConfig p = policy_of(kind);
    p.starvation_seconds = 10;
    Harness h(inv, p);
    auto call = [](ActionId id, std::int32_t service) {
      ActionSpec x = action(id, {U(1)}, 2);
      x.service = service;
      return x;
    };
    std::map<ActionId, double> ends;  // running -> its end
    auto note = [&](const Decisions& out, double now) {
      for (const Decision& d : out)
        if (d.kind == DecisionKind::kStart) ends[d.action] = now + 2;
    };
    note(h.submit({call(1, 0)}, 0), 0);
    note(h.tick(1), 1);
    note(h.submit({call(2, 1)}, 1.5), 1.5);
    double b_restored = -1;
    bool told = false;
    for (int i = 3; i < 100 && b_restored < 0; ++i) {
      const double now = 1.5 + 0.5 * (i - 2);
      std::vector<ActionId> done;
      for (auto it = ends.begin(); it != ends.end();)
        if (it->second <= now) {
          done.push_back(it->first);
          it = ends.erase(it);
        } else {
          ++it;
        }
      std::vector<Decision> seen;
      if (!done.empty()) seen = h.complete(done, now);
      if (i % 2) {
        const Decisions& out = h.submit({call(i, 0)}, now);
        seen.insert(seen.end(), out.begin(), out.end());
      }
      note(seen, now);
      for (const Decision& d : seen)
        if (d.kind == DecisionKind::kRestore && d.service == 1) b_restored = now;
      if (!ends.count(i) && i % 2 && h.s.explain(i).find("until it is evicted for service 'b'") != std::string::npos)
        told = true;
      h.s.check_invariants();
    }
    EXPECT_GT(b_restored, 11.5);  // not before it starved
    EXPECT_LE(b_restored, 15.0);  // a's running actions end within 2 s of the drain
    EXPECT_TRUE(told);
  }
}

// Memory kept asleep must fit the service and belongs to an unmovable one.
TEST(Services, AsleepMemoryValidated) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(4000)}};
  tangram::ServiceSpec s{"s", U(1000), 1.0, 1, 1.0};
  s.asleep_memory = U(100);
  inv.services = {s};
  try {
    Scheduler bad(inv, policy_of(PolicyKind::kTangram));
    FAIL() << "a movable service with asleep memory was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.field(), "inventory.services[0].asleep_memory");
  }
  inv.services[0].movable = false;
  inv.services[0].asleep_memory = U(1001);
  EXPECT_THROW(Scheduler(inv, policy_of(PolicyKind::kTangram)), Error);
}

// Replicas: three copies of one model (one per device, none surplus), max_batch 2. Actions
// that may use any copy go to the one that starts them soonest: with no whole batch ahead
// anywhere, the copy with the fewest live actions, so the burst is shared evenly (each copy
// restored for its first). Each start names the copy it runs on.
Inventory replica_inventory(std::int32_t copies, std::int32_t minimum) {
  Inventory inv = cpu_inventory(1, 16);
  inv.nodes[0].gpus.assign(static_cast<std::size_t>(copies), {U(4000)});
  for (std::int32_t r = 0; r < copies; ++r) {
    tangram::ServiceSpec copy{"rm#" + std::to_string(r), U(3000), 2.0, 2, 1.0};
    if (r > 0) copy.replica_of = 0;
    copy.surplus = r >= minimum;
    inv.services.push_back(copy);
  }
  return inv;
}

ActionSpec any_copy(ActionId id, double seconds = 1.0) {
  ActionSpec a = action(id, {U(1)}, seconds);
  a.service = 0;
  a.any_replica = true;
  return a;
}

TEST(Replicas, AnActionGoesToTheCopyThatServesItSoonest) {
  Harness h(replica_inventory(3, 3), policy_of(PolicyKind::kFifo));
  EXPECT_EQ(h.submit({any_copy(1), any_copy(2), any_copy(3), any_copy(4), any_copy(5)}, 0),
            (Decisions{restore(0).on(0, 0).at(2), restore(1).on(0, 1).at(2), restore(2).on(0, 2).at(2)}));
  EXPECT_EQ(h.tick(2), (Decisions{start(1).on(0, 0).service(0).at(2), start(2).on(0, 1).service(1).at(2),
                                  start(3).on(0, 2).service(2).at(2), start(4).on(0, 0).service(0).at(2),
                                  start(5).on(0, 1).service(1).at(2)}));
}

// A resident copy with a long queue against a copy that is not resident: the action goes
// to the other copy once the batches ahead of it take longer than that copy's restore.
TEST(Replicas, AQueueLongerThanARestoreBringsAnotherCopy) {
  Harness h(replica_inventory(2, 1), policy_of(PolicyKind::kFifo));
  h.submit({any_copy(1, 10)}, 0);
  h.tick(2);  // copy 0 resident, action 1 running there until 12
  // Copy 0: 1 live action, under a batch: 0 s; copy 1: a 2 s restore. To copy 0.
  EXPECT_EQ(h.submit({any_copy(2, 10)}, 3), (Decisions{start(2).on(0, 0).service(0).at(3)}));
  // Copy 0 holds a whole batch (2 live): one batch of 10 s ahead against a 2 s restore.
  EXPECT_EQ(h.submit({any_copy(3, 10)}, 4), (Decisions{restore(1).on(0, 1).at(6)}));
  // A short action: one batch of 1 s ahead on copy 0 is less than copy 1's remaining 2 s.
  EXPECT_EQ(h.submit({any_copy(4, 1)}, 4), Decisions{});
  // Copy 1 ready: no whole batch ahead there, one of 1 s at copy 0, so action 4 moves over too.
  EXPECT_EQ(h.tick(6), (Decisions{start(3).on(0, 1).service(1).at(6), start(4).on(0, 1).service(1).at(6)}));
}

// Late binding: actions queued at copy 0 while no device could take a second copy move to
// the surplus copy once one can (device 1 comes online), rather than wait out the batches
// ahead of them at copy 0; a start names the copy it runs on.
TEST(Replicas, QueuedActionsMoveToACopyThatCanServeThemSooner) {
  Harness h(replica_inventory(2, 1), policy_of(PolicyKind::kFifo));
  h.s.set_device_online(0, 1, false, 0, h.out);
  EXPECT_EQ(h.submit({any_copy(1, 10), any_copy(2, 10), any_copy(3, 10), any_copy(4, 10)}, 0),
            (Decisions{restore(0).on(0, 0).at(2)}));
  EXPECT_EQ(h.tick(2), (Decisions{start(1).on(0, 0).service(0).at(2), start(2).on(0, 0).service(0).at(2)}));
  h.out.clear();
  // Copy 0: a whole batch of 10 s ahead; copy 1 (device 1 now online): a 2 s restore.
  h.s.set_device_online(0, 1, true, S(3), h.out);
  h.s.check_invariants();
  EXPECT_EQ(h.out, (Decisions{restore(1).on(0, 1).at(5)}));
  EXPECT_EQ(h.tick(5), (Decisions{start(3).on(0, 1).service(1).at(5), start(4).on(0, 1).service(1).at(5)}));
  h.s.check_invariants();
}

// A queue longer than two batches of every copy: each pass routes again only its front,
// and an offloaded surplus copy with nothing routed to it is called in by the queue's last
// action, as a new call would be: 60 calls of 0.1 s at copy 0 make 29 batches ahead of the
// last, which outlast copy 1's 2 s restore, though the front's few batches do not. Once copy
// 1 is ready, the front moves over to it: 60, behind them in the order, waits there (routed
// again once it comes forward).
TEST(Replicas, ALongQueueCallsInASurplusCopyFromItsBack) {
  Harness h(replica_inventory(2, 1), policy_of(PolicyKind::kFifo));
  h.s.set_device_online(0, 1, false, 0, h.out);
  std::vector<ActionSpec> queue;
  for (ActionId id = 1; id <= 60; ++id) queue.push_back(any_copy(id, 0.1));
  EXPECT_EQ(h.submit(queue, 0), (Decisions{restore(0).on(0, 0).at(2)}));
  EXPECT_EQ(h.tick(2), (Decisions{start(1).on(0, 0).service(0).at(2), start(2).on(0, 0).service(0).at(2)}));
  h.out.clear();
  h.s.set_device_online(0, 1, true, S(2), h.out);
  EXPECT_EQ(h.out, (Decisions{restore(1).on(0, 1).at(4)}));
  h.s.check_invariants();
  EXPECT_EQ(h.tick(4), (Decisions{start(3).on(0, 1).service(1).at(4), start(4).on(0, 1).service(1).at(4)}));
  h.s.check_invariants();
}

// Under home devices (isolated) a group is its deployed copies: a call naming the undeployed
// surplus copy waits beside the group's queue without being counted, or moved, by its
// routing (it once indexed past the group's copies).
TEST(Replicas, ACallNamingAnUndeployedCopyStaysOutOfTheGroupsRouting) {
  PolicyConfig isolated = policy_of(PolicyKind::kIsolated);
  isolated.pools = {{0, 1.0}};
  Harness h(replica_inventory(3, 2), isolated);
  ActionSpec named = action(3, {U(1)}, 1.0);
  named.service = 2;
  h.submit({any_copy(1), any_copy(2), named}, 0);
  h.s.check_invariants();
  h.tick(2);
  h.s.check_invariants();
  EXPECT_EQ(h.s.state(3), tangram::ActionState::kRunning);
}

// A surplus copy goes beside another copy of its service only as a last resort (they would
// share the device's compute): with one device, a queue at copy 0 does not bring copy 1;
// a call naming copy 1 does, and then the queued call moves over to it too.
TEST(Replicas, ASurplusCopyGoesBesideAnotherCopyOnlyAsALastResort) {
  Inventory inv = replica_inventory(2, 1);
  inv.nodes[0].gpus = {{U(8000)}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  EXPECT_EQ(h.submit({any_copy(1, 10)}, 0), (Decisions{restore(0).on(0, 0).at(2)}));
  EXPECT_EQ(h.tick(2), (Decisions{start(1).on(0, 0).service(0).at(2)}));
  // Action 3 has a batch of 10 s ahead at copy 0, but no device without copy 0 for copy 1.
  EXPECT_EQ(h.submit({any_copy(2, 10), any_copy(3, 10)}, 3), (Decisions{start(2).on(0, 0).service(0).at(3)}));
  ActionSpec pinned = action(4, {U(1)}, 10);
  pinned.service = 1;
  EXPECT_EQ(h.submit({pinned}, 4), (Decisions{restore(1).on(0, 0).at(6)}));
  EXPECT_EQ(h.tick(6), (Decisions{start(3).on(0, 0).service(1).at(6), start(4).on(0, 0).service(1).at(6)}));
  h.s.check_invariants();
}

// An action naming a copy runs there; validation names the field.
TEST(Replicas, ActionsNamingACopyAndBadSpecs) {
  Harness h(replica_inventory(2, 1), policy_of(PolicyKind::kFifo));
  ActionSpec pinned = action(1, {U(1)}, 1);
  pinned.service = 1;
  EXPECT_EQ(h.submit({pinned}, 0), (Decisions{restore(1).on(0, 0).at(2)}));
  ActionSpec wrong = any_copy(2);
  wrong.service = 1;
  expect_error([&] { h.submit({wrong}, 1); }, ErrorCode::kInvalidArgument, "actions[0].service");
  ActionSpec none = action(3, {U(1)}, 1);
  none.any_replica = true;
  expect_error([&] { h.submit({none}, 1); }, ErrorCode::kInvalidArgument, "actions[0].any_replica");
  Inventory bad = replica_inventory(2, 1);
  bad.services[1].replica_of = 1;
  expect_error([&] { Harness x(bad, policy_of(PolicyKind::kFifo)); }, ErrorCode::kInvalidArgument,
               "inventory.services[1].replica_of");
  bad = replica_inventory(2, 1);
  bad.services[1].memory = U(2000);
  expect_error([&] { Harness x(bad, policy_of(PolicyKind::kFifo)); }, ErrorCode::kInvalidArgument,
               "inventory.services[1].replica_of");
  bad = replica_inventory(2, 1);
  bad.services[0].surplus = true;
  expect_error([&] { Harness x(bad, policy_of(PolicyKind::kFifo)); }, ErrorCode::kInvalidArgument,
               "inventory.services[0].surplus");
}

// GPU memory needed on a device holding an idle surplus copy and an idle other service:
// the copy, asked for more recently (so the costlier to evict by the expected gap until
// its next request), goes first all the same.
TEST(Replicas, IdleSurplusCopiesAreEvictedFirst) {
  Inventory inv = cpu_inventory(1, 16);
  inv.nodes[0].gpus = {{U(4000)}};
  tangram::ServiceSpec first{"rm#0", U(1500), 1.0, 1, 1.0};
  tangram::ServiceSpec copy = first;
  copy.name = "rm#1";
  copy.replica_of = 0;
  copy.surplus = true;
  inv.services = {first, copy, {"other", U(1500), 1.0, 1, 1.0}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec a = action(1, {U(1)}, 1);
  a.service = 2;
  EXPECT_EQ(h.submit({a}, 0), (Decisions{restore(2).on(0, 0).at(1)}));
  h.tick(1);
  h.complete({1}, 2);
  ActionSpec b = action(2, {U(1)}, 1);
  b.service = 1;  // the surplus copy, by name
  EXPECT_EQ(h.submit({b}, 3), (Decisions{restore(1).on(0, 0).at(4)}));
  h.tick(4);
  h.complete({2}, 5);
  ActionSpec big = action(3, {U(1)}, 1);
  big.gpu_memory = U(2000);
  const Decisions made = h.submit({big}, 6);
  ASSERT_FALSE(made.empty());
  EXPECT_EQ(made.front(), Decision(evict(1).on(0, 0).at(6)));
}

// A service keeps its device against a starving service's drain for starvation_seconds
// after it became ready, with a wake-up when that ends: else two services with queues drain
// each other in turn. Service a (ready at 5, two actions at a time) always has one running;
// b's action, submitted at 1, starves from 11. At 12 and 13 a is kept (ready for less than
// 10 s) and starts its next actions; the pass at 15 (the wake-up) drains it, and so does
// every later pass (tangram restores queues before its walk), so it starts only as many
// actions as waited at 15 (one: action 6, shorter, submitted at 16, goes first, and 5
// waits); once its last action ends at 23 it is evicted and b restored. (Without the residency, a would be drained at 12 and evicted at
// 13.)
TEST(Services, AServiceIsKeptFromADrainForStarvationSecondsAfterItBecameReady) {
  Inventory inv = cpu_inventory(1, 16);
  inv.nodes[0].gpus = {{U(4000)}};
  inv.services = {{"a", U(3000), 5.0, 2, 1.0}, {"b", U(3000), 1.0, 1, 1.0}};
  PolicyConfig p = policy_of(PolicyKind::kTangram);
  p.starvation_seconds = 10;
  Harness h(inv, p);
  auto on = [](ActionId id, std::int32_t service, double seconds) {
    ActionSpec a = action(id, {U(1)}, seconds);
    a.service = service;
    return a;
  };
  EXPECT_EQ(h.submit({on(1, 0, 7), on(2, 0, 8), on(3, 0, 9), on(4, 0, 10), on(5, 0, 11)}, 0),
            (Decisions{restore(0).on(0, 0).at(5)}));
  EXPECT_EQ(h.submit({on(9, 1, 1)}, 1), Decisions{});  // no room beside a
  EXPECT_EQ(h.tick(5), (Decisions{start(1).on(0, 0).service(0).at(5), start(2).on(0, 0).service(0).at(5)}));
  EXPECT_EQ(h.complete({1}, 12), (Decisions{start(3).on(0, 0).service(0).at(12)}));
  EXPECT_EQ(h.complete({2}, 13), (Decisions{start(4).on(0, 0).service(0).at(13)}));
  EXPECT_EQ(h.s.next_wakeup(), S(15));
  EXPECT_EQ(h.tick(15), Decisions{});  // drained (and its batch full)
  EXPECT_EQ(h.submit({on(6, 0, 1)}, 16), Decisions{});
  EXPECT_EQ(h.complete({3}, 21), (Decisions{start(6).on(0, 0).service(0).at(21)}));  // the drain's one start
  EXPECT_EQ(h.complete({4, 6}, 23), (Decisions{evict(0).on(0, 0).at(23), restore(1).on(0, 0).at(25)}));
}

// OrderRule::kEstimate: a queue whose arrivals have stopped keeps shortest first, except an
// action shortest first would start after the drain's end less its run time (W = 20 s of
// work over 2 batch slots: the 10 s action's latest start is the queue's first, so it
// starts beside the 1 s one). The queue drains at 11 s instead of 15 s.
TEST(ServiceTails, TheLongestActionOfAStoppedQueueStartsEarlyEnoughForTheDrain) {
  Inventory inv = cpu_inventory(1, 16);
  inv.nodes[0].gpus = {{U(4000)}};
  inv.services = {{"r", U(1000), 1.0, 2, 1.0}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  auto on = [](ActionId id, double seconds) {
    ActionSpec a = action(id, {U(1)}, seconds);
    a.service = 0;
    return a;
  };
  EXPECT_EQ(h.submit({on(1, 1), on(2, 2), on(3, 3), on(4, 4), on(5, 10)}, 0), (Decisions{restore(0).on(0, 0).at(1)}));
  EXPECT_EQ(h.tick(1), (Decisions{start(1).on(0, 0).service(0).at(1), start(5).on(0, 0).service(0).at(1)}));
  EXPECT_EQ(h.complete({1}, 2), (Decisions{start(2).on(0, 0).service(0).at(2)}));
  EXPECT_EQ(h.complete({2}, 4), (Decisions{start(3).on(0, 0).service(0).at(4)}));
  EXPECT_EQ(h.complete({3}, 7), (Decisions{start(4).on(0, 0).service(0).at(7)}));
}

// While requests still come (the last one now), and under `fifo`, and with one batch slot
// (where the order cannot change when the queue drains), the queue is shortest first
// (arrival order under fifo).
TEST(ServiceTails, AQueueStillGrowingOrWithOneSlotStaysShortestFirst) {
  auto run = [](std::int32_t max_batch, PolicyKind kind, bool late_request) {
    Inventory inv = cpu_inventory(1, 16);
    inv.nodes[0].gpus = {{U(4000)}};
    inv.services = {{"r", U(1000), 1.0, max_batch, 1.0}};
    Harness h(inv, policy_of(kind));
    auto on = [](ActionId id, double seconds) {
      ActionSpec a = action(id, {U(1)}, seconds);
      a.service = 0;
      return a;
    };
    h.submit({on(1, 1), on(2, 2), on(3, 3), on(4, 4), on(5, 10)}, 0);
    return late_request ? h.submit({on(6, 5)}, 1) : h.tick(1);
  };
  EXPECT_EQ(run(2, PolicyKind::kTangram, true),
            (Decisions{start(1).on(0, 0).service(0).at(1), start(2).on(0, 0).service(0).at(1)}));
  EXPECT_EQ(run(1, PolicyKind::kTangram, false), (Decisions{start(1).on(0, 0).service(0).at(1)}));
  EXPECT_EQ(run(2, PolicyKind::kFifo, false),
            (Decisions{start(1).on(0, 0).service(0).at(1), start(2).on(0, 0).service(0).at(1)}));
}

}  // namespace
}  // namespace tangram_test
