// A burst of 200 actions on 8 nodes, driven to completion through the public C++ API.
//
// Shows that a C++ rollout server can link the core directly (target tangram_core), and
// doubles as a ctest test: it exits nonzero unless every action ends exactly once and
// every pool returns to exactly full capacity.
//
//   cmake --preset dev && cmake --build --preset dev && build/dev/tangram_burst_example
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tangram/model.h"
#include "tangram/scheduler.h"
#include "tangram/types.h"

namespace {

using tangram::ActionId;
using tangram::Decision;
using tangram::DecisionKind;
using tangram::Quantity;
using tangram::TimeNs;

constexpr int kNodes = 8;
constexpr int kActions = 200;
constexpr std::int32_t kCpu = 0;
constexpr std::int32_t kMemory = 1;
constexpr Quantity kNodeCpu = 16 * tangram::kMilli;         // 16 cores
constexpr Quantity kNodeMemory = 65536 * tangram::kMilli;   // 64 GiB in milli-MiB

// Deterministic, portable pseudo-random numbers (std distributions differ between
// standard libraries).
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {  // inclusive
    return lo + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
};

tangram::Inventory make_inventory() {
  tangram::Inventory inventory;
  inventory.kinds = {"cpu", "memory"};
  for (int n = 0; n < kNodes; ++n) {
    tangram::NodeSpec node;
    node.name = "node" + std::to_string(n);
    node.capacity = {kNodeCpu, kNodeMemory};
    inventory.nodes.push_back(std::move(node));
  }
  return inventory;
}

std::vector<tangram::ActionSpec> make_burst() {
  SplitMix64 rng{42};
  std::vector<tangram::ActionSpec> actions;
  actions.reserve(kActions);
  for (int i = 0; i < kActions; ++i) {
    tangram::ActionSpec a;
    a.id = static_cast<ActionId>(i + 1);
    a.trajectory = static_cast<tangram::TrajectoryId>(i / 4 + 1);  // 4 actions each
    a.demand = {0, rng.uniform(256, 4096) * tangram::kMilli};      // memory in MiB
    if (i % 3 == 0) {
      // Elastic: 1..8 cores, Amdahl speed-up.
      a.demand[kCpu] = 1 * tangram::kMilli;
      a.elastic_kind = kCpu;
      a.elastic_max = 8 * tangram::kMilli;
      a.model.kind = tangram::ModelKind::kAmdahl;
      a.model.seconds = static_cast<double>(rng.uniform(10, 120));
      a.model.parallel_fraction = static_cast<double>(rng.uniform(50, 95)) / 100.0;
    } else {
      // Constant: a fixed 1..4 cores for a fixed time.
      a.demand[kCpu] = rng.uniform(1, 4) * tangram::kMilli;
      a.model.kind = tangram::ModelKind::kConstant;
      a.model.seconds = static_cast<double>(rng.uniform(1, 60));
    }
    actions.push_back(std::move(a));
  }
  return actions;
}

int fail(const char* what) {
  std::fprintf(stderr, "FAIL: %s\n", what);
  return 1;
}

}  // namespace

int main() {
  try {
    tangram::PolicyConfig policy;
    policy.kind = tangram::PolicyKind::kTangram;
    tangram::Scheduler scheduler(make_inventory(), policy);

    const std::vector<tangram::ActionSpec> burst = make_burst();
    std::set<ActionId> live;  // submitted, not yet terminal
    for (const auto& a : burst) live.insert(a.id);

    // Pending completions, ordered by modelled finish time (then id, for determinism).
    std::set<std::pair<TimeNs, ActionId>> events;
    // A running action's modelled finish, its grant, and the share of its work left at
    // `since` (its start, or its last kResize): a resize moves its finish.
    struct Running {
      TimeNs finish, since;
      Quantity grant;
      double work_left;
    };
    std::map<ActionId, Running> running;
    std::size_t ended = 0;
    std::size_t rejected = 0;
    double act_sum_seconds = 0;  // all submitted at t = 0: ACT = finish time
    std::string error;

    auto apply = [&](const std::vector<Decision>& decisions, TimeNs now) {
      for (const Decision& d : decisions) {
        switch (d.kind) {
          case DecisionKind::kStart: {
            if (live.count(d.action) == 0) {
              error = "kStart for an action that is not live";
              return;
            }
            const TimeNs start = d.time > now ? d.time : now;
            const TimeNs finish = start + tangram::to_ns(scheduler.runtime(d.action, d.grant));
            events.emplace(finish, d.action);
            running[d.action] = Running{finish, start, d.grant, 1.0};
            break;
          }
          case DecisionKind::kResize: {  // the work left runs on at the new grant
            auto it = running.find(d.action);
            if (it == running.end()) {
              error = "kResize for an action that is not running";
              return;
            }
            Running& r = it->second;
            const double before = scheduler.runtime(d.action, r.grant);
            if (before > 0) r.work_left -= tangram::to_seconds(now - r.since) / before;
            if (r.work_left < 0) r.work_left = 0;
            events.erase({r.finish, d.action});
            r.finish = now + tangram::to_ns(r.work_left * scheduler.runtime(d.action, d.grant));
            r.since = now;
            r.grant = d.grant;
            events.emplace(r.finish, d.action);
            break;
          }
          case DecisionKind::kReject:
            ++rejected;
            ++ended;
            live.erase(d.action);
            std::fprintf(stderr, "rejected %" PRIu64 ": %s\n", d.action,
                         scheduler.message(d.reason).c_str());
            break;
          case DecisionKind::kRestore:
          case DecisionKind::kEvict:
            error = "unexpected service decision (no services in this inventory)";
            return;
        }
      }
    };

    std::vector<Decision> out;
    scheduler.submit(burst.data(), burst.size(), /*now=*/0, out);
    scheduler.check_invariants();
    std::size_t first_pass = 0;
    for (const Decision& d : out) first_pass += d.kind == DecisionKind::kStart;
    apply(out, 0);
    if (!error.empty()) return fail(error.c_str());
    std::printf("submitted %d actions on %d nodes; started in the first pass: %zu, waiting: %zu\n",
                kActions, kNodes, first_pass, scheduler.waiting_count());

    TimeNs now = 0;
    std::vector<ActionId> batch;
    while (!events.empty()) {
      // Complete everything that finishes at the earliest pending time, in one batch.
      now = events.begin()->first;
      batch.clear();
      while (!events.empty() && events.begin()->first == now) {
        batch.push_back(events.begin()->second);
        events.erase(events.begin());
      }
      scheduler.complete(batch.data(), batch.size(), now, out);
      scheduler.check_invariants();
      for (ActionId id : batch) {
        if (scheduler.state(id) != tangram::ActionState::kUnknown)
          return fail("a completed action is still live");
        live.erase(id);
        running.erase(id);
        ++ended;
        act_sum_seconds += tangram::to_seconds(now);
      }
      apply(out, now);
      if (!error.empty()) return fail(error.c_str());

      // Nothing running but actions still waiting: only a tick can help.
      if (events.empty() && scheduler.waiting_count() > 0) {
        const TimeNs wake = scheduler.next_wakeup();
        if (wake == tangram::kNever) return fail("actions wait but nothing runs and no wakeup is due");
        now = wake > now ? wake : now;
        scheduler.tick(now, out);
        scheduler.check_invariants();
        apply(out, now);
        if (!error.empty()) return fail(error.c_str());
      }
    }

    const std::size_t done = ended - rejected;
    std::printf("all done at t=%.3f s; completed %zu, rejected %zu; average ACT %.3f s\n",
                tangram::to_seconds(now), done, rejected,
                done > 0 ? act_sum_seconds / static_cast<double>(done) : 0.0);

    int failures = 0;
    if (ended != static_cast<std::size_t>(kActions) || !live.empty()) {
      std::fprintf(stderr, "FAIL: %zu of %d actions ended\n", ended, kActions);
      ++failures;
    }
    if (rejected != 0) {
      std::fprintf(stderr, "FAIL: %zu actions rejected, but every one fits a node\n", rejected);
      ++failures;
    }
    if (scheduler.waiting_count() != 0 || scheduler.running_count() != 0) {
      std::fprintf(stderr, "FAIL: %zu waiting and %zu running at the end\n",
                   scheduler.waiting_count(), scheduler.running_count());
      ++failures;
    }
    const Quantity capacity[] = {kNodeCpu, kNodeMemory};
    for (std::int32_t node = 0; node < kNodes; ++node) {
      for (std::int32_t kind : {kCpu, kMemory}) {
        const Quantity free = scheduler.free(node, kind);
        if (free != capacity[kind]) {
          std::fprintf(stderr, "FAIL: node %d kind %d: free %" PRId64 " != capacity %" PRId64 "\n",
                       node, kind, free, capacity[kind]);
          ++failures;
        }
      }
    }
    if (failures != 0) return 1;
    std::printf("OK: all %d actions ended, every pool back to full capacity\n", kActions);
    return 0;
  } catch (const tangram::Error& e) {
    std::fprintf(stderr, "FAIL: tangram::Error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: exception: %s\n", e.what());
    return 1;
  }
}
