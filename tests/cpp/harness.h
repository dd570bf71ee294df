// Shared harness of the scheduler core's unit tests (tests/cpp/test_*.cc): inventory and
// action builders, a Scheduler that checks its invariants after every event, typed-error
// checks, and expected decisions built field by field.
//
// The core is deterministic, so scenario tests state the exact decisions an event gives:
//   EXPECT_EQ(h.submit({action(1, {U(2)})}, 0), (Decisions{start(1).on(0).at(0)}));
// A mismatch prints both lists decision by decision.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "tangram/model.h"
#include "tangram/scheduler.h"
#include "tangram/types.h"

// Field-by-field equality and printing for gtest (EXPECT_EQ on decisions and their lists).
namespace tangram {

inline bool operator==(const Decision& x, const Decision& y) {
  return x.kind == y.kind && x.action == y.action && x.node == y.node && x.device == y.device &&
         x.service == y.service && x.elastic_kind == y.elastic_kind && x.grant == y.grant && x.time == y.time &&
         x.reason == y.reason;
}
inline bool operator!=(const Decision& x, const Decision& y) { return !(x == y); }

inline void PrintTo(const Decision& d, std::ostream* os) {
  static const char* const kKinds[] = {"start", "restore", "evict", "reject", "resize"};
  const int kind = static_cast<int>(d.kind);
  if (kind >= 0 && kind < 5) *os << kKinds[kind] << "(";
  else *os << "kind " << kind << "(";
  if (d.kind == DecisionKind::kStart || d.kind == DecisionKind::kReject || d.kind == DecisionKind::kResize)
    *os << "action " << d.action << ", ";
  if (d.service != kNone) *os << "service " << d.service << ", ";
  if (d.node != kNone) *os << "node " << d.node << ", ";
  if (d.device != kNone) *os << "device " << d.device << ", ";
  if (d.elastic_kind != kNone || d.grant != 0) *os << "grant " << d.grant << " of kind " << d.elastic_kind << ", ";
  if (d.reason != kNone) *os << "reason " << d.reason << ", ";
  *os << "time " << d.time << " ns)";
}

}  // namespace tangram

namespace tangram_test {

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

using Decisions = std::vector<Decision>;

// ---------------------------------------------------------------- builders

constexpr Quantity U(std::int64_t base_units) { return base_units * kMilli; }
inline TimeNs S(double seconds) { return tangram::to_ns(seconds); }

inline Inventory cpu_inventory(int nodes, std::int64_t cores) {
  Inventory inv;
  inv.kinds = {"cpu"};
  for (int n = 0; n < nodes; ++n) inv.nodes.push_back(NodeSpec{"node" + std::to_string(n), {U(cores)}, {}});
  return inv;
}

inline Inventory cpu_mem_inventory(int nodes, std::int64_t cores, std::int64_t mib) {
  Inventory inv;
  inv.kinds = {"cpu", "memory"};
  for (int n = 0; n < nodes; ++n) inv.nodes.push_back(NodeSpec{"node" + std::to_string(n), {U(cores), U(mib)}, {}});
  return inv;
}

inline PolicyConfig policy_of(PolicyKind kind) {
  PolicyConfig p;
  p.kind = kind;
  return p;
}

// The test name suffix of a policy-parameterised suite: "tangram", "fifo", ...
inline std::string policy_param_name(const ::testing::TestParamInfo<PolicyKind>& info) {
  return tangram::policy_name(info.param);
}

inline ActionSpec action(ActionId id, std::vector<Quantity> demand, double seconds = 1.0) {
  ActionSpec a;
  a.id = id;
  a.demand = std::move(demand);
  a.model.kind = ModelKind::kConstant;
  a.model.seconds = seconds;
  return a;
}

// An elastic action in `kind` from demand[kind] up to `max`, t(u) = seconds ((1-p) + p min/u).
inline ActionSpec amdahl(ActionId id, std::vector<Quantity> demand, std::int32_t kind, Quantity max, double seconds,
                         double p) {
  ActionSpec a = action(id, std::move(demand), seconds);
  a.elastic_kind = kind;
  a.elastic_max = max;
  a.model.kind = ModelKind::kAmdahl;
  a.model.parallel_fraction = p;
  return a;
}

// ---------------------------------------------------------------- expected decisions

// A decision built field by field; fields left alone keep Decision's defaults (kNone, 0),
// which is what the core emits for them:
//   start(3).on(1, 0).service(2).at(5)   restore(0).on(0, 0).at(2)   reject(7, 0).at(1)
//   resize(4).on(0).grant(0, U(3)).at(2)
struct Expect {
  Decision d;
  Expect& on(std::int32_t node, std::int32_t device = kNone) {
    d.node = node;
    d.device = device;
    return *this;
  }
  // kStart, kEvict, kReject: when; kRestore: when the service is ready.
  Expect& at(double seconds) { return at_ns(S(seconds)); }
  Expect& at_ns(TimeNs t) {
    d.time = t;
    return *this;
  }
  Expect& grant(std::int32_t kind, Quantity units) {
    d.elastic_kind = kind;
    d.grant = units;
    return *this;
  }
  Expect& service(std::int32_t s) {
    d.service = s;
    return *this;
  }
  operator Decision() const { return d; }  // NOLINT: converts where a Decision is expected
};

inline Expect start(ActionId id) {
  Expect e;
  e.d.kind = DecisionKind::kStart;
  e.d.action = id;
  return e;
}
// `reason`: the index of its message among the event's messages (rejects in batch order).
inline Expect reject(ActionId id, std::int32_t reason) {
  Expect e;
  e.d.kind = DecisionKind::kReject;
  e.d.action = id;
  e.d.reason = reason;
  return e;
}
inline Expect restore(std::int32_t service) {
  Expect e;
  e.d.kind = DecisionKind::kRestore;
  e.d.service = service;
  return e;
}
// A running action's new total grant (ResizeRule::kMalleable).
inline Expect resize(ActionId id) {
  Expect e;
  e.d.kind = DecisionKind::kResize;
  e.d.action = id;
  return e;
}
inline Expect evict(std::int32_t service) {
  Expect e;
  e.d.kind = DecisionKind::kEvict;
  e.d.service = service;
  return e;
}
// An eviction that gives the service's state up (kDiscard): its next restore is a load.
inline Expect discard(std::int32_t service) {
  Expect e = evict(service);
  e.d.reason = tangram::kDiscard;
  return e;
}

// ---------------------------------------------------------------- views of decisions

inline std::vector<ActionId> ids_of(const Decisions& out, DecisionKind kind) {
  std::vector<ActionId> ids;
  for (const Decision& d : out)
    if (d.kind == kind) ids.push_back(d.action);
  return ids;
}
inline std::vector<ActionId> started(const Decisions& out) { return ids_of(out, DecisionKind::kStart); }

// ---------------------------------------------------------------- the scheduler under test

// A scheduler plus the `out` vector, checking the invariants after every event.
struct Harness {
  Scheduler s;
  Decisions out;
  Harness(Inventory inv, PolicyConfig policy) : s(std::move(inv), std::move(policy)) {}

  const Decisions& submit(std::vector<ActionSpec> batch, double now) {
    s.submit(batch.data(), batch.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const Decisions& complete(std::vector<ActionId> ids, double now) {
    s.complete(ids.data(), ids.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const Decisions& cancel(std::vector<ActionId> ids, double now) {
    s.cancel(ids.data(), ids.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const Decisions& limit(std::vector<ActionId> ids, std::vector<Quantity> limits, double now) {
    s.limit(ids.data(), limits.data(), ids.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const Decisions& end(std::vector<TrajectoryId> ids, double now) {
    s.end_trajectories(ids.data(), ids.size(), S(now), out);
    s.check_invariants();
    return out;
  }
  const Decisions& tick(double now) { return tick_ns(S(now)); }
  const Decisions& tick_ns(TimeNs now) {
    s.tick(now, out);
    s.check_invariants();
    return out;
  }
  const Decisions& online(std::int32_t node, bool on, double now) {
    s.set_node_online(node, on, S(now), out);
    s.check_invariants();
    return out;
  }
  std::int32_t add(NodeSpec node, double now) {
    const std::int32_t n = s.add_node(std::move(node), S(now), out);
    s.check_invariants();
    return n;
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

}  // namespace tangram_test
