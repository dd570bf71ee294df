// libFuzzer target: random inventories, policies and event streams through the public
// tangram::Scheduler API.
//
//   cmake --preset fuzz && cmake --build --preset fuzz
//   mkdir -p build/fuzz/corpus
//   build/fuzz/tangram_fuzz -max_total_time=60 build/fuzz/corpus tests/fuzz/corpus
//
// The input bytes decode into a small inventory (1-4 nodes, 2-3 kinds, 0-2 GPUs per node,
// 0-3 services, some copies of the first, 0-1 quota), a policy (any built-in, or any row of rules), then a stream of events: submits
// of 1-4 actions (sometimes invalid: negative or absurd demands, elastic_max below the
// minimum, unknown kinds/nodes/services/tables, NaN run times, duplicate ids), completes
// and cancels (mostly of live ids), limits (mostly of running elastic actions, in range),
// end_trajectories, ticks (time mostly moves forward,
// sometimes backwards), and queries. tangram::Error is expected for invalid input and is
// caught; anything else thrown, a sanitizer report, a leak or a failed oracle below is a
// bug.
//
// Oracles, checked after every call (successful or refused):
//   * Scheduler::check_invariants() holds.
//   * The harness's own model of every action (waiting / running / terminal), advanced
//     only by successful calls and their decisions, agrees with waiting_count(),
//     running_count() and state(): a refused batch applied nothing; kStart is only for a
//     waiting action; kReject only for a waiting one; kResize only for a running one, at
//     most once per call, at the call's time, and placement() then reports its grant (as
//     it reports a kStart's grant for an action started in the call);
//     completed/cancelled actions are gone.
//   * A refused call leaves now() where it was.
//   * Valid batches of live ids (complete, cancel) at the current time are accepted; so is
//     a limit of a running elastic action within [its minimum, its submitted maximum], and
//     its grant is then at most that limit.
//   * Liveness: at the end, with every device back online and nothing new submitted, the
//     running actions complete one at a time (a quarter second apart) and the clock moves to
//     each next wakeup until nothing runs and nothing is due: no action may still wait (every
//     one started or was rejected), and no run of 50 wakeups may start nothing.
//   * At the end, after cancelling/completing everything and ending every trajectory,
//     every node's free amount of every kind is back to what it was at construction.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tangram/model.h"
#include "tangram/scheduler.h"
#include "tangram/types.h"

namespace {

// TANGRAM_FUZZ_TRACE=1 prints the inventory, the policy and every accepted call with its
// decisions to stderr: what a failing input did, to turn into a unit test.
const bool kTrace = std::getenv("TANGRAM_FUZZ_TRACE") != nullptr;
template <class... Args>
void trace(const char* format, Args... args) {
  if (kTrace) std::fprintf(stderr, format, args...);
}

using tangram::ActionId;
using tangram::ActionState;
using tangram::Decision;
using tangram::DecisionKind;
using tangram::Quantity;
using tangram::TimeNs;
using tangram::TrajectoryId;

[[noreturn]] void oracle_failed(const char* file, int line, const char* cond, const std::string& what) {
  std::fprintf(stderr, "%s:%d: fuzz oracle failed: %s\n  %s\n", file, line, cond, what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_CHECK(cond, what)                                     \
  do {                                                             \
    if (!(cond)) oracle_failed(__FILE__, __LINE__, #cond, (what)); \
  } while (0)

// Set to 0 (-DTANGRAM_FUZZ_CHECK_CLOCK=0) to look past a known clock bug.
#ifndef TANGRAM_FUZZ_CHECK_CLOCK
#define TANGRAM_FUZZ_CHECK_CLOCK 1
#endif

constexpr int kMaxEvents = 128;
constexpr int kMaxTotalActions = 400;

// Runtime callbacks (ModelKind::kCallback). Some are deliberately hostile.
double cb_amdahl(double units) { return units > 0 ? 1.0 + 4000.0 / units : 5.0; }
double cb_constant(double) { return 3.0; }
double cb_zero(double) { return 0.0; }
double cb_negative(double) { return -1.0; }
double cb_nan(double) { return std::numeric_limits<double>::quiet_NaN(); }
double cb_huge(double) { return 1e300; }

TimeNs saturating_add(TimeNs a, TimeNs b) {
  if (b > 0 && a > std::numeric_limits<TimeNs>::max() - b) return std::numeric_limits<TimeNs>::max();
  if (b < 0 && a < std::numeric_limits<TimeNs>::min() - b) return std::numeric_limits<TimeNs>::min();
  return a + b;
}

// A double that is usually in [lo, hi] and sometimes one of the awkward values.
double fuzz_double(FuzzedDataProvider& in, double lo, double hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 31)) {
    case 0: return -1.0;
    case 1: return std::numeric_limits<double>::quiet_NaN();
    case 2: return std::numeric_limits<double>::infinity();
    case 3: return 1e300;
    case 4: return 0.0;
    case 5: return -0.0;
    default: return lo + (hi - lo) * in.ConsumeProbability<double>();
  }
}

// A quantity that is usually in [0, typical] and sometimes invalid or extreme.
Quantity fuzz_quantity(FuzzedDataProvider& in, Quantity typical) {
  switch (in.ConsumeIntegralInRange<int>(0, 31)) {
    case 0: return -1;
    case 1: return -in.ConsumeIntegralInRange<Quantity>(1, 1'000'000);
    case 2: return std::numeric_limits<Quantity>::max();
    case 3: return static_cast<Quantity>(tangram::kMaxBaseUnits) * tangram::kMilli + 1;
    case 4: return 0;
    case 5: return typical;
    case 6: return typical + 1;
    case 7: case 8: case 9:
      return tangram::kMilli * in.ConsumeIntegralInRange<Quantity>(0, 16);
    default: return in.ConsumeIntegralInRange<Quantity>(0, typical > 0 ? typical : 1);
  }
}

class Harness {
 public:
  explicit Harness(FuzzedDataProvider& in) : in_(in) {}

  void run() {
    if (!construct()) return;
    const int events = in_.ConsumeIntegralInRange<int>(1, kMaxEvents);
    for (int e = 0; e < events && in_.remaining_bytes() > 0; ++e) step();
    settle();
    drain();
  }

 private:
  // ------------------------------------------------------------ setup

  bool construct() {
    tangram::Inventory inv;
    static const char* const kKindNames[] = {"cpu", "memory", "disk"};
    const int kinds = in_.ConsumeIntegralInRange<int>(2, 3);
    for (int k = 0; k < kinds; ++k) inv.kinds.emplace_back(kKindNames[k]);
    const int nodes = in_.ConsumeIntegralInRange<int>(1, 4);
    for (int n = 0; n < nodes; ++n) {
      tangram::NodeSpec node;
      node.name = "n" + std::to_string(n);
      for (int k = 0; k < kinds; ++k) {
        // Mostly whole units, sometimes odd milli amounts or empty.
        switch (in_.ConsumeIntegralInRange<int>(0, 7)) {
          case 0: node.capacity.push_back(0); break;
          case 1: node.capacity.push_back(in_.ConsumeIntegralInRange<Quantity>(1, 20'000)); break;
          default: node.capacity.push_back(tangram::kMilli * in_.ConsumeIntegralInRange<Quantity>(1, 32));
        }
      }
      const int gpus = in_.ConsumeIntegralInRange<int>(0, 2);
      for (int g = 0; g < gpus; ++g)
        node.gpus.push_back({tangram::kMilli * in_.ConsumeIntegralInRange<Quantity>(0, 80) * 1024});
      if (in_.ConsumeBool()) node.offload_memory = tangram::kMilli * in_.ConsumeIntegralInRange<Quantity>(-1, 64) * 1024;
      inv.nodes.push_back(std::move(node));
    }
    const int services = in_.ConsumeIntegralInRange<int>(0, 3);
    for (int s = 0; s < services; ++s) {
      if (s > 0 && in_.ConsumeIntegralInRange<int>(0, 2) == 0) {  // a copy of service 0 (a replica)
        tangram::ServiceSpec copy = inv.services[0];
        copy.name = "svc" + std::to_string(s);
        copy.replica_of = in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? s : 0;  // now and then an invalid one
        copy.surplus = in_.ConsumeBool();
        inv.services.push_back(std::move(copy));
        continue;
      }
      tangram::ServiceSpec svc;
      svc.name = "svc" + std::to_string(s);
      svc.memory = tangram::kMilli * in_.ConsumeIntegralInRange<Quantity>(0, 40) * 1024;
      svc.restore_seconds = in_.ConsumeIntegralInRange<int>(0, 20) / 2.0;
      svc.max_batch = in_.ConsumeIntegralInRange<std::int32_t>(1, 4);
      svc.offload_seconds = in_.ConsumeIntegralInRange<int>(0, 20) / 4.0;
      svc.host_memory = tangram::kMilli * in_.ConsumeIntegralInRange<Quantity>(0, 3) * 8 * 1024;
      if (in_.ConsumeIntegralInRange<int>(0, 2) == 0) {  // an inference server: pinned, keeps memory asleep
        svc.movable = false;
        svc.asleep_memory = svc.memory / in_.ConsumeIntegralInRange<Quantity>(1, 8) * in_.ConsumeIntegralInRange<int>(0, 1);
      }
      inv.services.push_back(std::move(svc));
    }
    if (in_.ConsumeBool()) {
      tangram::QuotaSpec q;
      q.name = "api";
      q.rate = in_.ConsumeIntegralInRange<int>(0, 20) / 2.0;
      q.burst = in_.ConsumeIntegralInRange<std::int64_t>(1, 4);
      q.max_concurrency = in_.ConsumeIntegralInRange<std::int64_t>(0, 3);
      q.tokens_per_minute = in_.ConsumeIntegralInRange<std::int64_t>(0, 3) * 1000;
      inv.quotas.push_back(std::move(q));
    }

    // A built-in policy, or (one input in four) a row of rules of its own: every
    // combination of the rules is a policy the core must run.
    tangram::PolicyConfig policy;
    const int builtins = static_cast<int>(tangram::builtin_policies().size());
    policy.kind = static_cast<tangram::PolicyKind>(in_.ConsumeIntegralInRange<int>(0, builtins - 1));
    if (in_.ConsumeIntegralInRange<int>(0, 3) == 0) {
      tangram::PolicyRules rules;
      rules.order = static_cast<tangram::OrderRule>(in_.ConsumeIntegralInRange<int>(0, 2));
      rules.bins = static_cast<tangram::BinLayout>(in_.ConsumeIntegralInRange<int>(0, 2));
      rules.spare = static_cast<tangram::SpareRule>(in_.ConsumeIntegralInRange<int>(0, 2));
      rules.restore = static_cast<tangram::RestoreRule>(in_.ConsumeIntegralInRange<int>(0, 1));
      rules.service_devices = static_cast<tangram::ServiceDevices>(in_.ConsumeIntegralInRange<int>(0, 1));
      rules.resize = static_cast<tangram::ResizeRule>(in_.ConsumeIntegralInRange<int>(0, 1));
      if (rules.resize == tangram::ResizeRule::kMalleable)  // the wait rule needs malleable grants
        rules.gain = static_cast<tangram::GainRule>(in_.ConsumeIntegralInRange<int>(0, 1));
      policy.row = tangram::PolicyRow{"fuzzed", rules};
    }
    policy.aging = in_.ConsumeIntegralInRange<int>(0, 4) / 4.0;
    policy.candidates = in_.ConsumeIntegralInRange<std::int32_t>(1, 8);
    policy.min_relative_gain = in_.ConsumeIntegralInRange<int>(0, 20) / 100.0;
    policy.starvation_seconds = in_.ConsumeIntegralInRange<int>(0, 120);
    const tangram::BinLayout bins = tangram::resolve_policy(policy).rules.bins;
    if (bins == tangram::BinLayout::kTrajectorySlots)
      policy.trajectory_slot_cpu = static_cast<double>(in_.ConsumeIntegralInRange<Quantity>(1, 8));
    if (bins == tangram::BinLayout::kTaskPools) policy.pools = {{0, 1.0}, {1, 1.0}};

    kinds_ = kinds;
    nodes_ = nodes;
    services_ = services;
    quotas_ = static_cast<int>(inv.quotas.size());
    if (kTrace) {
      for (const auto& node : inv.nodes) {
        trace("node %s:", node.name.c_str());
        for (Quantity q : node.capacity) trace(" %lld", static_cast<long long>(q));
        for (const auto& g : node.gpus) trace(" gpu %lld", static_cast<long long>(g.memory));
        trace("\n");
      }
      for (const auto& svc : inv.services)
        trace("service %s: memory %lld restore %.1f max_batch %d movable %d asleep %lld replica_of %d surplus %d\n",
              svc.name.c_str(), static_cast<long long>(svc.memory), svc.restore_seconds, svc.max_batch, svc.movable,
              static_cast<long long>(svc.asleep_memory), svc.replica_of, svc.surplus);
      for (const auto& q : inv.quotas)
        trace("quota: rate %.1f burst %lld concurrency %lld\n", q.rate, static_cast<long long>(q.burst),
              static_cast<long long>(q.max_concurrency));
      const tangram::PolicyRules rules = tangram::resolve_policy(policy).rules;
      trace("policy %d: order %d bins %d spare %d restore %d devices %d resize %d; starvation %.0f s, slot cpu %.0f\n",
            static_cast<int>(policy.kind), static_cast<int>(rules.order), static_cast<int>(rules.bins),
            static_cast<int>(rules.spare), static_cast<int>(rules.restore), static_cast<int>(rules.service_devices),
            static_cast<int>(rules.resize), policy.starvation_seconds, policy.trajectory_slot_cpu);
    }
    try {
      sched_.reset(new tangram::Scheduler(std::move(inv), std::move(policy)));
    } catch (const tangram::Error&) {
      return false;  // an inventory the core refuses; nothing to drive
    }
    check();

    // The move operations and the policy names, once per input.
    if (in_.ConsumeBool()) {
      tangram::Scheduler moved(std::move(*sched_));
      *sched_ = std::move(moved);
      check();
    }
    FUZZ_CHECK(tangram::policy_from_name(tangram::policy_name(sched_->policy().kind)) == sched_->policy().kind,
               "policy_from_name(policy_name(kind)) != kind");
    try {
      (void)tangram::policy_from_name(in_.ConsumeBool() ? "no-such-policy" : "");
      FUZZ_CHECK(false, "policy_from_name() accepted an unknown name");
    } catch (const tangram::Error& e) {
      FUZZ_CHECK(e.code() == tangram::ErrorCode::kUnknownName, "policy_from_name(): wrong error code");
    }

    // 0-2 runtime tables, sometimes unusable (unsorted, empty, negative, NaN).
    const int tables = in_.ConsumeIntegralInRange<int>(0, 2);
    for (int t = 0; t < tables; ++t) {
      std::vector<std::pair<double, double>> points;
      const int n = in_.ConsumeIntegralInRange<int>(0, 4);
      double units = 0;
      for (int i = 0; i < n; ++i) {
        units += in_.ConsumeIntegralInRange<int>(0, 4) * 1000.0;  // 0: repeated units
        points.emplace_back(units, fuzz_double(in_, 0.5, 60.0));
      }
      if (in_.ConsumeIntegralInRange<int>(0, 7) == 0 && n > 1) std::swap(points.front(), points.back());
      try {
        tables_.push_back(sched_->add_table(std::move(points)));
      } catch (const tangram::Error&) {
      }
      check();
    }

    for (int n = 0; n < nodes_; ++n)
      for (int k = 0; k < kinds_; ++k) initial_free_[{n, k}] = sched_->free(n, k);
    return true;
  }

  // ------------------------------------------------------------ events

  TimeNs next_time() {
    const TimeNs now = sched_->now();
    switch (in_.ConsumeIntegralInRange<int>(0, 31)) {
      case 0: return now > 0 ? now - in_.ConsumeIntegralInRange<TimeNs>(1, now) : -1;  // backwards
      case 1: return -1;
      case 2: return saturating_add(now, in_.ConsumeIntegralInRange<TimeNs>(0, 1'000'000'000'000'000'000));
      case 3: case 4: case 5: case 6: return now;
      case 7: {
        const TimeNs wake = sched_->next_wakeup();
        return wake == tangram::kNever ? now : wake;
      }
      default: return saturating_add(now, in_.ConsumeIntegralInRange<TimeNs>(0, 30'000'000'000));
    }
  }

  void step() {
    clock_before_ = sched_->now();
    switch (in_.ConsumeIntegralInRange<int>(0, 17)) {
      case 0: case 1: case 2: case 3: case 4: submit(); break;
      case 5: case 6: case 7: case 8: complete(); break;
      case 9: cancel(); break;
      case 10: end_trajectories(); break;
      case 11: tick(); break;
      case 12: limit(); break;
      case 13: service_report(); break;
      case 14: device_online(); break;
      case 15: back_off(); break;
      default: query(); break;
    }
  }

  ActionId pick_id() {
    // Mostly a live id; sometimes a finished one, a fresh one, or an arbitrary one.
    switch (in_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: return next_id_;
      case 1: return in_.ConsumeIntegralInRange<ActionId>(0, next_id_ + 2);
      case 2: return std::numeric_limits<ActionId>::max();
      default: break;
    }
    std::vector<ActionId> live(waiting_.begin(), waiting_.end());
    live.insert(live.end(), running_.begin(), running_.end());
    if (live.empty()) return in_.ConsumeIntegralInRange<ActionId>(0, next_id_ + 2);
    return live[in_.ConsumeIntegralInRange<std::size_t>(0, live.size() - 1)];
  }

  tangram::ActionSpec make_action() {
    tangram::ActionSpec a;
    const int id_choice = in_.ConsumeIntegralInRange<int>(0, 15);
    if (id_choice == 0 && (!waiting_.empty() || !running_.empty())) {
      a.id = pick_id();  // probably a duplicate of a live id
    } else if (id_choice == 1 && next_id_ > 1) {
      a.id = next_id_ - 1;  // duplicate within the batch or of a finished one
    } else {
      a.id = next_id_++;
    }
    a.trajectory = in_.ConsumeIntegralInRange<TrajectoryId>(1, 5);
    a.task = in_.ConsumeIntegralInRange<std::uint32_t>(0, 15) == 0 ? 2 : in_.ConsumeIntegralInRange<std::uint32_t>(0, 1);
    a.priority = in_.ConsumeIntegralInRange<std::int32_t>(-1, 2);

    int demand_size = kinds_;
    const int size_choice = in_.ConsumeIntegralInRange<int>(0, 31);
    if (size_choice == 0) demand_size = kinds_ - 1;
    if (size_choice == 1) demand_size = kinds_ + 1;
    for (int k = 0; k < demand_size; ++k)
      a.demand.push_back(fuzz_quantity(in_, k == 0 ? 4 * tangram::kMilli : 8 * tangram::kMilli));

    if (in_.ConsumeBool()) a.gpu_memory = fuzz_quantity(in_, 16 * 1024 * tangram::kMilli);

    // The elastic dimension.
    switch (in_.ConsumeIntegralInRange<int>(0, 15)) {
      case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7: break;  // not elastic
      case 8: a.elastic_kind = kinds_; break;   // unknown kind
      case 9: a.elastic_kind = -2; break;       // invalid
      default: a.elastic_kind = in_.ConsumeIntegralInRange<std::int32_t>(0, kinds_ - 1);
    }
    if (a.elastic_kind != tangram::kNone) {
      const Quantity minimum = (a.elastic_kind >= 0 && a.elastic_kind < demand_size) ? a.demand[a.elastic_kind] : 0;
      switch (in_.ConsumeIntegralInRange<int>(0, 7)) {
        case 0: a.elastic_max = minimum - 1; break;  // below the minimum
        case 1: a.elastic_max = minimum; break;
        case 2: a.elastic_max = fuzz_quantity(in_, 16 * tangram::kMilli); break;
        default:
          a.elastic_max = saturating_add(minimum, tangram::kMilli * in_.ConsumeIntegralInRange<Quantity>(1, 8));
      }
    } else if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) {
      a.elastic_max = fuzz_quantity(in_, 8 * tangram::kMilli);  // elastic_max without a kind
    }

    // The run-time model.
    switch (in_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: case 1: case 2: case 3:
        a.model.kind = tangram::ModelKind::kConstant;
        a.model.seconds = fuzz_double(in_, 0.0, 60.0);
        break;
      case 4: case 5: case 6:
        a.model.kind = tangram::ModelKind::kAmdahl;
        a.model.seconds = fuzz_double(in_, 0.0, 120.0);
        a.model.parallel_fraction = fuzz_double(in_, 0.0, 1.0);
        break;
      case 7: case 8: {
        a.model.kind = tangram::ModelKind::kTable;
        const int choice = in_.ConsumeIntegralInRange<int>(0, 5);
        if (choice == 0 || tables_.empty()) a.model.table = choice == 1 ? -1 : 7;  // unknown
        else a.model.table = tables_[in_.ConsumeIntegralInRange<std::size_t>(0, tables_.size() - 1)];
        break;
      }
      default: {
        a.model.kind = tangram::ModelKind::kCallback;
        static const tangram::RuntimeCallback kCallbacks[] = {
            cb_amdahl, cb_amdahl, cb_constant, cb_constant, nullptr, cb_zero, cb_negative, cb_nan, cb_huge};
        a.model.callback = kCallbacks[in_.ConsumeIntegralInRange<std::size_t>(0, std::size(kCallbacks) - 1)];
      }
    }
    if (in_.ConsumeIntegralInRange<int>(0, 31) == 0)
      a.model.kind = static_cast<tangram::ModelKind>(in_.ConsumeIntegralInRange<int>(4, 255));  // unknown kind

    // Placement constraints: usually none; sometimes valid; rarely out of range.
    auto constraint = [&](int count) -> std::int32_t {
      switch (in_.ConsumeIntegralInRange<int>(0, 15)) {
        case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7: case 8: case 9: return tangram::kNone;
        case 10: return count;  // one past the end
        case 11: return -7;
        default: return count > 0 ? in_.ConsumeIntegralInRange<std::int32_t>(0, count - 1) : tangram::kNone;
      }
    };
    a.affinity_node = constraint(nodes_);
    a.service = constraint(services_);
    a.any_replica = in_.ConsumeIntegralInRange<int>(0, 3) == 0;  // valid only for a group's first copy
    a.quota = constraint(quotas_);
    if (a.quota != tangram::kNone) a.tokens = in_.ConsumeIntegralInRange<int>(0, 7) == 0 ? -5 : in_.ConsumeIntegralInRange<std::int64_t>(0, 2000);
    return a;
  }

  void submit() {
    if (submitted_ >= kMaxTotalActions) return;
    const int count = in_.ConsumeIntegralInRange<int>(1, 4);
    std::vector<tangram::ActionSpec> batch;
    for (int i = 0; i < count; ++i) batch.push_back(make_action());
    const TimeNs now = next_time();
    try {
      sched_->submit(batch.data(), batch.size(), now, out_);
    } catch (const tangram::Error&) {
      refused();
      return;
    }
    submitted_ += count;
    for (const auto& a : batch) {
      trace("submit t=%.3f id %llu traj %llu demand", now / 1e9, static_cast<unsigned long long>(a.id),
            static_cast<unsigned long long>(a.trajectory));
      for (Quantity q : a.demand) trace(" %lld", static_cast<long long>(q));
      trace(" gpu %lld service %d any %d quota %d affinity %d elastic %d\n", static_cast<long long>(a.gpu_memory),
            a.service, a.any_replica, a.quota, a.affinity_node, a.elastic_kind);
    }
    for (const auto& a : batch) {
      FUZZ_CHECK(running_.count(a.id) == 0 && waiting_.insert(a.id).second,
                 "submit accepted an id that is already live or repeated in the batch: " +
                     std::to_string(a.id));
      trajectory_of_[a.id] = a.trajectory;
      if (a.elastic_kind >= 0) elastic_range_[a.id] = {a.demand[a.elastic_kind], a.elastic_max};
      else elastic_range_.erase(a.id);  // an id used again after its action ended
      trajectories_.insert(a.trajectory);
    }
    apply(now);
  }

  void complete() {
    std::vector<ActionId> ids;
    const int count = in_.ConsumeIntegralInRange<int>(1, 3);
    const bool valid_only = in_.ConsumeIntegralInRange<int>(0, 3) != 0;
    std::set<ActionId> seen;
    for (int i = 0; i < count; ++i) {
      if (valid_only) {
        if (running_.empty()) break;
        auto it = running_.begin();
        std::advance(it, in_.ConsumeIntegralInRange<std::size_t>(0, running_.size() - 1));
        if (!seen.insert(*it).second) continue;
        ids.push_back(*it);
      } else {
        ids.push_back(pick_id());
      }
    }
    if (ids.empty()) return;
    const TimeNs now = valid_only ? forward_time() : next_time();
    try {
      trace("complete %zu ids, first %llu\n", ids.size(), static_cast<unsigned long long>(ids[0]));
      sched_->complete(ids.data(), ids.size(), now, out_);
    } catch (const tangram::Error& e) {
      FUZZ_CHECK(!valid_only, std::string("complete() refused distinct running ids at a forward time: ") + e.what());
      refused();
      return;
    }
    for (ActionId id : ids) {
      FUZZ_CHECK(running_.count(id) == 1,
                 "complete() accepted an action that is not running: " + std::to_string(id) +
                     (waiting_.count(id) ? " (waiting)" : " (not live)"));
      running_.erase(id);
    }
    apply(now);
  }

  void cancel() {
    std::vector<ActionId> ids;
    const int count = in_.ConsumeIntegralInRange<int>(1, 3);
    const bool valid_only = in_.ConsumeIntegralInRange<int>(0, 3) != 0;
    std::set<ActionId> live(waiting_.begin(), waiting_.end());
    live.insert(running_.begin(), running_.end());
    std::set<ActionId> seen;
    for (int i = 0; i < count; ++i) {
      if (valid_only) {
        if (live.empty()) break;
        auto it = live.begin();
        std::advance(it, in_.ConsumeIntegralInRange<std::size_t>(0, live.size() - 1));
        if (!seen.insert(*it).second) continue;
        ids.push_back(*it);
      } else {
        ids.push_back(pick_id());
      }
    }
    if (ids.empty()) return;
    const TimeNs now = valid_only ? forward_time() : next_time();
    try {
      trace("cancel %zu ids, first %llu\n", ids.size(), static_cast<unsigned long long>(ids[0]));
      sched_->cancel(ids.data(), ids.size(), now, out_);
    } catch (const tangram::Error& e) {
      FUZZ_CHECK(!valid_only, std::string("cancel() refused distinct live ids at a forward time: ") + e.what());
      refused();
      return;
    }
    for (ActionId id : ids) {
      FUZZ_CHECK(running_.count(id) + waiting_.count(id) == 1,
                 "cancel() accepted an action that is not live: " + std::to_string(id));
      running_.erase(id);
      waiting_.erase(id);
    }
    apply(now);
  }

  void limit() {
    std::vector<ActionId> ids;
    std::vector<Quantity> limits;
    const bool valid_only = in_.ConsumeIntegralInRange<int>(0, 3) != 0;
    if (valid_only) {
      std::vector<ActionId> elastic;
      for (ActionId id : running_)
        if (elastic_range_.count(id)) elastic.push_back(id);
      if (elastic.empty()) return;
      const ActionId id = elastic[in_.ConsumeIntegralInRange<std::size_t>(0, elastic.size() - 1)];
      const auto [lo, hi] = elastic_range_.at(id);
      ids.push_back(id);
      limits.push_back(in_.ConsumeIntegralInRange<Quantity>(lo, hi));
    } else {
      const int count = in_.ConsumeIntegralInRange<int>(1, 3);
      for (int i = 0; i < count; ++i) {
        ids.push_back(pick_id());
        limits.push_back(fuzz_quantity(in_, 4 * tangram::kMilli));
      }
    }
    const TimeNs now = valid_only ? forward_time() : next_time();
    try {
      sched_->limit(ids.data(), limits.data(), ids.size(), now, out_);
    } catch (const tangram::Error& e) {
      FUZZ_CHECK(!valid_only, std::string("limit() refused a running elastic action's limit in range: ") + e.what());
      refused();
      return;
    }
    for (ActionId id : ids)
      FUZZ_CHECK(running_.count(id) == 1 && elastic_range_.count(id) == 1,
                 "limit() accepted an action that is not running and elastic: " + std::to_string(id));
    apply(now);
    for (std::size_t i = 0; i < ids.size(); ++i)
      FUZZ_CHECK(running_.count(ids[i]) == 0 || sched_->placement(ids[i]).grant <= limits[i],
                 "a grant above the limit just set for action " + std::to_string(ids[i]));
  }

  void end_trajectories() {
    std::vector<TrajectoryId> ids;
    const int count = in_.ConsumeIntegralInRange<int>(1, 2);
    for (int i = 0; i < count; ++i) ids.push_back(in_.ConsumeIntegralInRange<TrajectoryId>(0, 6));
    const TimeNs now = next_time();
    try {
      trace("end_trajectories %zu ids, first %llu\n", ids.size(), static_cast<unsigned long long>(ids[0]));
      sched_->end_trajectories(ids.data(), ids.size(), now, out_);
    } catch (const tangram::Error&) {
      refused();
      return;
    }
    for (TrajectoryId t : ids)
      FUZZ_CHECK(live_in_trajectory(t) == 0,
                 "end_trajectories() accepted trajectory " + std::to_string(t) + " with live actions");
    apply(now);
  }

  void tick() {
    const TimeNs now = next_time();
    try {
      trace("tick\n");
      sched_->tick(now, out_);
    } catch (const tangram::Error&) {
      refused();
      return;
    }
    apply(now);
  }

  // The runtime's reports: a restore done (sooner than planned, or matching nothing), or
  // measured restore and offload times (sometimes invalid: refused).
  void service_report() {
    if (services_ == 0) return;
    const std::int32_t svc = in_.ConsumeIntegralInRange<std::int32_t>(0, services_);  // services_: unknown
    if (in_.ConsumeBool()) {
      try {
        sched_->set_service_times(svc, in_.ConsumeIntegralInRange<int>(-1, 20) / 2.0, in_.ConsumeIntegralInRange<int>(0, 20) / 4.0);
      } catch (const tangram::Error&) {
        refused();
      }
      return;
    }
    const TimeNs now = next_time();
    try {
      sched_->service_restored(svc, in_.ConsumeIntegralInRange<std::int32_t>(0, nodes_), in_.ConsumeIntegralInRange<std::int32_t>(0, 1), now, out_);
    } catch (const tangram::Error&) {
      refused();
      return;
    }
    apply(now);
  }

  // A quota backoff: any time (it runs no pass, so the clock is not checked), an unknown
  // quota refused.
  void back_off() {
    const std::int32_t quota = in_.ConsumeIntegralInRange<std::int32_t>(-1, quotas_);  // -1, quotas_: unknown
    try {
      sched_->back_off_quota(quota, next_time());
    } catch (const tangram::Error&) {
      refused();
      return;
    }
    check();
  }

  void device_online() {
    const TimeNs now = next_time();
    try {
      sched_->set_device_online(in_.ConsumeIntegralInRange<std::int32_t>(0, nodes_), in_.ConsumeIntegralInRange<std::int32_t>(0, 2),
                                in_.ConsumeBool(), now, out_);
    } catch (const tangram::Error&) {
      refused();
      return;
    }
    apply(now);
  }

  void query() {
    const ActionId id = pick_id();
    try {
      (void)sched_->state(id);
      (void)sched_->explain(id);
    } catch (const tangram::Error&) {
    }
    if (running_.count(id)) {
      const Decision p = sched_->placement(id);
      FUZZ_CHECK(p.node >= 0 && p.node < nodes_, "placement() of a running action names no valid node");
    }
    if (running_.count(id) || waiting_.count(id)) {
      try {
        (void)sched_->runtime(id, fuzz_quantity(in_, 8 * tangram::kMilli));
      } catch (const tangram::Error&) {
      }
    }
    (void)sched_->next_wakeup();
    for (int n = 0; n < nodes_; ++n) {
      for (int k = 0; k < kinds_; ++k) FUZZ_CHECK(sched_->free(n, k) >= 0, "negative free amount");
    }
    for (int s = 0; s < services_; ++s) {
      (void)sched_->service_location(s);
      (void)sched_->service_ready(s);
    }
    check();
  }

  TimeNs forward_time() {
    return saturating_add(sched_->now(), in_.ConsumeIntegralInRange<TimeNs>(0, 10'000'000'000));
  }

  // ------------------------------------------------------------ bookkeeping

  std::size_t live_in_trajectory(TrajectoryId t) const {
    std::size_t n = 0;
    for (ActionId id : waiting_) n += trajectory_of_.at(id) == t;
    for (ActionId id : running_) n += trajectory_of_.at(id) == t;
    return n;
  }

  // Advances the model by a successful call's decisions.
  void apply(TimeNs now) {
    if (kTrace) {
      trace("  -> t=%.3f:", now / 1e9);
      for (const Decision& d : out_)
        trace(" %s(%llu n%d d%d s%d)", d.kind == DecisionKind::kStart ? "start" : d.kind == DecisionKind::kReject ? "reject"
                                       : d.kind == DecisionKind::kRestore ? "restore" : d.kind == DecisionKind::kEvict ? "evict" : "resize",
              static_cast<unsigned long long>(d.action), d.node, d.device, d.service);
      trace("\n");
    }
    std::set<ActionId> resized;
    for (const Decision& d : out_) {
      switch (d.kind) {
        case DecisionKind::kStart:
          FUZZ_CHECK(waiting_.count(d.action) == 1,
                     "kStart for an action that is not waiting: " + std::to_string(d.action) +
                         (running_.count(d.action) ? " (already running)" : " (not live)"));
          FUZZ_CHECK(d.node >= 0 && d.node < nodes_, "kStart on an invalid node");
          waiting_.erase(d.action);
          running_.insert(d.action);
          FUZZ_CHECK(resized.count(d.action) == 0, "kStart after a kResize of the same action");
          break;
        case DecisionKind::kReject:
          FUZZ_CHECK(waiting_.count(d.action) == 1,
                     "kReject for an action that is not waiting: " + std::to_string(d.action));
          (void)sched_->message(d.reason);
          waiting_.erase(d.action);
          break;
        case DecisionKind::kRestore:
        case DecisionKind::kEvict:
          FUZZ_CHECK(d.service >= 0 && d.service < services_, "service decision names an invalid service");
          break;
        case DecisionKind::kResize:
          FUZZ_CHECK(running_.count(d.action) == 1, "kResize for an action that is not running: " + std::to_string(d.action));
          FUZZ_CHECK(resized.insert(d.action).second, "two kResize for action " + std::to_string(d.action) + " in one call");
          FUZZ_CHECK(d.time == now, "kResize not at the call's time");
          FUZZ_CHECK(d.elastic_kind >= 0 && d.elastic_kind < kinds_, "kResize of an invalid kind");
          FUZZ_CHECK(d.node >= 0 && d.node < nodes_, "kResize on an invalid node");
          break;
        default:
          FUZZ_CHECK(false, "unknown decision kind");
      }
    }
    // Each resized action holds the grant its one kResize of the call gave it; an action
    // started in the call holds its kStart's grant (a top-up at the start and the spare
    // rule both set it before the decision is given; no kResize in the pass that started it).
    for (const Decision& d : out_) {
      if (d.kind == DecisionKind::kResize)
        FUZZ_CHECK(sched_->placement(d.action).grant == d.grant, "placement() disagrees with the kResize grant");
      if (d.kind == DecisionKind::kStart && running_.count(d.action) == 1)
        FUZZ_CHECK(sched_->placement(d.action).grant == d.grant, "placement() disagrees with the kStart grant");
    }
    check();
  }

  // After a refused event call: nothing was applied, not even the new time.
  void refused() {
#if TANGRAM_FUZZ_CHECK_CLOCK
    FUZZ_CHECK(sched_->now() == clock_before_,
               "a refused call moved the clock from " + std::to_string(clock_before_) + " to " +
                   std::to_string(sched_->now()));
#endif
    check();
  }

  void check() {
    sched_->check_invariants();
    FUZZ_CHECK(sched_->waiting_count() == waiting_.size(),
               "waiting_count() " + std::to_string(sched_->waiting_count()) + " != model " +
                   std::to_string(waiting_.size()));
    FUZZ_CHECK(sched_->running_count() == running_.size(),
               "running_count() " + std::to_string(sched_->running_count()) + " != model " +
                   std::to_string(running_.size()));
    for (ActionId id : waiting_)
      FUZZ_CHECK(sched_->state(id) == ActionState::kWaiting, "state() of a waiting action " + std::to_string(id));
    for (ActionId id : running_)
      FUZZ_CHECK(sched_->state(id) == ActionState::kRunning, "state() of a running action " + std::to_string(id));
  }

  // Drives the stream to its end without new work (the liveness oracle above).
  void settle() {
    for (std::int32_t n = 0; n < nodes_; ++n)
      for (std::int32_t d = 0; d < 3; ++d) {
        try {
          sched_->set_device_online(n, d, true, sched_->now(), out_);
          apply(sched_->now());
        } catch (const tangram::Error&) {
        }
      }
    int idle_wakeups = 0;
    while (!waiting_.empty()) {
      if (!running_.empty()) {
        const ActionId id = *running_.begin();
        const TimeNs now = sched_->now() + 250'000'000;
        trace("settle: complete %llu\n", static_cast<unsigned long long>(id));
        sched_->complete(&id, 1, now, out_);
        running_.erase(id);
        apply(now);
        idle_wakeups = 0;
        continue;
      }
      const TimeNs wake = sched_->next_wakeup();
      if (wake == tangram::kNever) break;
      const std::size_t before = waiting_.size();
      sched_->tick(std::max(wake, sched_->now()), out_);
      apply(sched_->now());
      idle_wakeups = waiting_.size() < before ? 0 : idle_wakeups + 1;
      FUZZ_CHECK(idle_wakeups <= 50, "settle: 50 wakeups in a row started nothing");
    }
    std::string stuck;
    for (ActionId id : waiting_) stuck += "\n  " + std::to_string(id) + ": " + sched_->explain(id);
    FUZZ_CHECK(waiting_.empty(), "settle: actions wait for good:" + stuck);
  }

  // Ends everything and checks that every pool is back to where it started.
  void drain() {
    for (int round = 0; round < 4 && (!waiting_.empty() || !running_.empty()); ++round) {
      if (!waiting_.empty()) {
        std::vector<ActionId> ids(waiting_.begin(), waiting_.end());
        const TimeNs now = sched_->now();
        try {
          sched_->cancel(ids.data(), ids.size(), now, out_);
        } catch (const tangram::Error& e) {
          FUZZ_CHECK(false, std::string("drain: cancel() of all waiting actions refused: ") + e.what());
        }
        for (ActionId id : ids) waiting_.erase(id);
        apply(now);
      }
      if (!running_.empty()) {
        std::vector<ActionId> ids(running_.begin(), running_.end());
        const TimeNs now = sched_->now();
        try {
          sched_->complete(ids.data(), ids.size(), now, out_);
        } catch (const tangram::Error& e) {
          FUZZ_CHECK(false, std::string("drain: complete() of all running actions refused: ") + e.what());
        }
        for (ActionId id : ids) running_.erase(id);
        apply(now);
      }
    }
    FUZZ_CHECK(waiting_.empty() && running_.empty(), "drain: actions still live after draining");
    for (TrajectoryId t : trajectories_) {
      clock_before_ = sched_->now();
      try {
        sched_->end_trajectories(&t, 1, sched_->now(), out_);
        apply(sched_->now());
      } catch (const tangram::Error&) {
        refused();
      }
    }
    for (const auto& [key, initial] : initial_free_) {
      const Quantity now_free = sched_->free(key.first, key.second);
      FUZZ_CHECK(now_free == initial, "drain: node " + std::to_string(key.first) + " kind " +
                                          std::to_string(key.second) + " free " + std::to_string(now_free) +
                                          " != initial " + std::to_string(initial));
    }
  }

  FuzzedDataProvider& in_;
  std::unique_ptr<tangram::Scheduler> sched_;
  int kinds_ = 0, nodes_ = 0, services_ = 0, quotas_ = 0;
  std::vector<std::int32_t> tables_;
  std::map<std::pair<int, int>, Quantity> initial_free_;
  std::vector<Decision> out_;

  TimeNs clock_before_ = 0;  // now() before the current event call
  ActionId next_id_ = 1;
  int submitted_ = 0;
  std::set<ActionId> waiting_, running_;
  std::map<ActionId, TrajectoryId> trajectory_of_;  // every id ever accepted
  std::map<ActionId, std::pair<Quantity, Quantity>> elastic_range_;  // elastic ones: [minimum, max]
  std::set<TrajectoryId> trajectories_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  Harness harness(in);
  harness.run();
  return 0;
}
