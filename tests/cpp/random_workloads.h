// Random workloads for the scheduler core's unit tests: a ledger that follows every action
// through the decisions, and a run of random bursts (submits, completes, cancels, ticks,
// trajectory ends) checked against it after every event.
//
// Random workloads use a seeded std::mt19937 (raw outputs only, so they are the same
// everywhere) and call Scheduler::check_invariants() after every event.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "harness.h"

namespace tangram_test {

// Everything the tests know about every action, advanced only by calls that succeeded
// and by their decisions. Checks the decisions against it as they come.
struct Ledger {
  enum class End { kRejected, kCancelledWaiting, kCancelledRunning, kCompleted };
  std::set<ActionId> waiting, running;
  std::map<ActionId, int> starts, ends;
  std::map<ActionId, End> how;  // how each ended action ended
  std::map<ActionId, TrajectoryId> trajectory;
  std::map<TrajectoryId, int> live_in;  // live actions per trajectory
  std::size_t rejects = 0;
  std::set<ActionId> resized_in_event;  // scratch of apply()

  void submitted(const std::vector<ActionSpec>& batch, const Decisions& out) {
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
  void apply(const Decisions& out, const std::set<ActionId>* fresh = nullptr) {
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
        ended(d.action, End::kRejected);
        ++rejects;
      } else if (d.kind == DecisionKind::kResize) {
        ASSERT_EQ(running.count(d.action), 1u) << "resize of an action that does not run: " << d.action;
        ASSERT_EQ(resized_in_event.insert(d.action).second, true) << "two resizes of action " << d.action << " in one event";
      }
    }
    resized_in_event.clear();
  }
  void ended(ActionId id, End end) {
    ++ends[id];
    how[id] = end;
    if (--live_in[trajectory[id]] == 0) live_in.erase(trajectory[id]);
  }
  void completed(const std::vector<ActionId>& ids) {
    for (ActionId id : ids) {
      ASSERT_EQ(running.erase(id), 1u);
      ended(id, End::kCompleted);
    }
  }
  void cancelled(const std::vector<ActionId>& ids) {
    for (ActionId id : ids) {
      if (waiting.erase(id) == 1) {
        ended(id, End::kCancelledWaiting);
      } else {
        ASSERT_EQ(running.erase(id), 1u) << "cancel of an action that is not live: " << id;
        ended(id, End::kCancelledRunning);
      }
    }
  }
  void agrees_with(const Scheduler& s) const {
    EXPECT_EQ(s.waiting_count(), waiting.size());
    EXPECT_EQ(s.running_count(), running.size());
    for (ActionId id : waiting) ASSERT_EQ(s.state(id), ActionState::kWaiting) << id;
    for (ActionId id : running) ASSERT_EQ(s.state(id), ActionState::kRunning) << id;
  }
  // Every action of ids 1..last ended exactly once, and started exactly once if it ended
  // running (completed or cancelled while running), never otherwise.
  void expect_each_ended_once(ActionId last) {
    ASSERT_EQ(ends.size(), last);
    for (ActionId id = 1; id <= last; ++id) {
      EXPECT_EQ(ends[id], 1) << "action " << id;
      const bool ran = how[id] == End::kCompleted || how[id] == End::kCancelledRunning;
      EXPECT_EQ(starts.count(id) ? starts[id] : 0, ran ? 1 : 0) << "action " << id;
    }
  }
};

// Random bursts of submits, completes, cancels, ticks and trajectory ends on 4 nodes of 8
// cores and 16384 MiB, checking the invariants and the free amounts after every call.
// `trace` collects every decision.
struct RandomRun {
  PolicyConfig policy;
  Inventory inv;
  std::mt19937 rng;
  Harness h;
  Ledger ledger;
  ActionId next_id = 1;
  double now = 0;
  Decisions trace;
  std::map<ActionId, std::int32_t> affinity;
  std::map<TrajectoryId, std::int32_t> slot_node;  // trajectory slots: where each live trajectory's slot is

  RandomRun(PolicyKind kind, std::uint32_t seed) : RandomRun(policy_of(kind), seed) {}
  // Any policy, a row of rules of its own included (PolicyConfig::row).
  RandomRun(PolicyConfig config, std::uint32_t seed)
      : policy(with_options(std::move(config))), inv(cpu_mem_inventory(4, 8, 16384)), rng(seed), h(inv, policy) {}

  static PolicyConfig with_options(PolicyConfig p) {
    p.starvation_seconds = 20;
    p.trajectory_slot_cpu = 2.0;  // trajectory slots: 4 of 2 cores and 4096 MiB per node
    p.pools = {{0, 1.0}, {1, 1.0}};  // task pools: exact halves
    return p;
  }
  tangram::BinLayout bins() const { return tangram::resolve_policy(policy).rules.bins; }

  // The capacity of every bin (all nodes alike, those added later too): an action is
  // rejected at submit exactly when its minimum demand exceeds it.
  std::vector<Quantity> bin_capacity() const {
    switch (bins()) {
      case tangram::BinLayout::kTrajectorySlots:
        return {U(2), U(4096)};
      case tangram::BinLayout::kTaskPools:
        return {U(4), U(8192)};
      default:
        return {U(8), U(16384)};
    }
  }

  std::uint32_t pick(std::uint32_t n) { return static_cast<std::uint32_t>(rng() % n); }

  ActionSpec random_action() {
    Quantity cpu = 500 * static_cast<Quantity>(pick(7));           // 0 .. 3 cores by halves
    Quantity mem = U(256) * static_cast<Quantity>(1 + pick(16));  // 256 .. 4096 MiB
    if (pick(25) == 0) cpu = U(12);                                // can never fit: rejected
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
    for (std::int32_t n = 0; n < static_cast<std::int32_t>(inv.nodes.size()); ++n)
      for (std::int32_t k = 0; k < 2; ++k) {
        Quantity f = h.s.free(n, k);
        ASSERT_GE(f, 0) << "node " << n << " kind " << k;
        ASSERT_LE(f, inv.nodes[n].capacity[k]) << "node " << n << " kind " << k;
      }
  }

  // Starts honour node affinity; with trajectory slots a trajectory's actions all run on its
  // slot's node, which its first start chose (by affinity, if it had one).
  void check_start_nodes() {
    for (const Decision& d : h.out) {
      if (d.kind != DecisionKind::kStart) continue;
      if (bins() == tangram::BinLayout::kTrajectorySlots) {
        const TrajectoryId t = ledger.trajectory[d.action];
        auto bound = slot_node.find(t);
        if (bound != slot_node.end()) {
          ASSERT_EQ(d.node, bound->second) << "action " << d.action << " off its trajectory's slot";
          continue;
        }
        slot_node[t] = d.node;
      }
      if (affinity.count(d.action)) {
        ASSERT_EQ(d.node, affinity[d.action]) << "action " << d.action << " off its affinity node";
      }
    }
  }

  void after() {
    trace.insert(trace.end(), h.out.begin(), h.out.end());
    ledger.agrees_with(h.s);
    check_free();
    check_start_nodes();
  }

  void end_trajectories(const std::vector<TrajectoryId>& over) {
    h.end(over, now);
    for (TrajectoryId t : over) slot_node.erase(t);
    ledger.apply(h.out);
  }

  void step() {
    now += pick(3);  // 0, 1 or 2 s: several events at the same time too
    switch (pick(10)) {
      case 0: case 1: case 2: case 3: {
        std::vector<ActionSpec> batch;
        for (std::uint32_t i = 0, n = 1 + pick(6); i < n; ++i) batch.push_back(random_action());
        h.submit(batch, now);
        const std::vector<Quantity> cap = bin_capacity();
        std::vector<ActionId> never_fit;
        for (const ActionSpec& a : batch)
          if (a.demand[0] > cap[0] || a.demand[1] > cap[1]) never_fit.push_back(a.id);
        ASSERT_EQ(ids_of(h.out, DecisionKind::kReject), never_fit) << "rejects in batch order, exactly those";
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
        end_trajectories(over);
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
    end_trajectories(all);
    after();
  }
};

}  // namespace tangram_test
