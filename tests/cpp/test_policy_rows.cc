// Policies as data (csrc/tangram/policy.h): the built-in rows, names from one table, typed
// errors for bad rows, and a sixth policy that is only a row: shortest estimate first (as
// tangram) with spare units on every bin (as optimus). It runs through PolicyConfig::row
// with no change to the pass, and decides differently from both rows it borrows from.
#include <string>
#include <vector>

#include "harness.h"
#include "random_workloads.h"
#include "tangram/policy.h"

namespace tangram_test {
namespace {

using tangram::BinLayout;
using tangram::OrderRule;
using tangram::PolicyRow;
using tangram::PolicyRules;
using tangram::ResizeRule;
using tangram::RestoreRule;
using tangram::ServiceDevices;
using tangram::SpareRule;
using tangram::GainRule;

PolicyRow shortest_greedy() {
  PolicyRules r;
  r.order = OrderRule::kEstimate;
  r.bins = BinLayout::kNodes;
  r.spare = SpareRule::kEveryBin;
  r.restore = RestoreRule::kOnDemand;
  r.service_devices = ServiceDevices::kAny;
  r.resize = ResizeRule::kFixed;
  r.gain = GainRule::kRelative;
  return PolicyRow{"shortest-greedy", r};
}

TEST(PolicyRows, BuiltinNamesComeFromOneTable) {
  std::vector<std::string> names;
  for (const PolicyRow& row : tangram::builtin_policies()) names.push_back(row.name);
  EXPECT_EQ(names, (std::vector<std::string>{"tangram", "fifo", "trajectory", "isolated", "optimus"}));
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto kind = static_cast<PolicyKind>(i);
    EXPECT_EQ(tangram::policy_name(kind), names[i]);
    EXPECT_EQ(tangram::policy_from_name(names[i]), kind);
    EXPECT_EQ(tangram::policy_row(kind).name, names[i]);
  }
  expect_error([] { tangram::policy_from_name("shortest-greedy"); }, ErrorCode::kUnknownName, "policy");
}

// The rows say what sets the policies apart, and nothing else does.
TEST(PolicyRows, BuiltinRules) {
  auto rules = [](PolicyKind k) { return tangram::describe_rules(tangram::policy_row(k).rules); };
  using Named = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(rules(PolicyKind::kTangram), (Named{{"order", "estimate"}, {"bins", "node"}, {"spare", "uncontended"},
                                                {"restore", "queues_first"}, {"service_devices", "any"},
                                                {"resize", "malleable"}, {"gain", "wait"}}));
  EXPECT_EQ(rules(PolicyKind::kFifo), (Named{{"order", "arrival"}, {"bins", "node"}, {"spare", "none"},
                                             {"restore", "on_demand"}, {"service_devices", "any"}, {"resize", "fixed"},
                                             {"gain", "relative"}}));
  EXPECT_EQ(rules(PolicyKind::kTrajectory), (Named{{"order", "arrival"}, {"bins", "trajectory_slots"}, {"spare", "none"},
                                                   {"restore", "on_demand"}, {"service_devices", "home"},
                                                   {"resize", "fixed"}, {"gain", "relative"}}));
  EXPECT_EQ(rules(PolicyKind::kIsolated), (Named{{"order", "arrival"}, {"bins", "task_pools"}, {"spare", "none"},
                                                 {"restore", "on_demand"}, {"service_devices", "home"},
                                                 {"resize", "fixed"}, {"gain", "relative"}}));
  EXPECT_EQ(rules(PolicyKind::kOptimus), (Named{{"order", "arrival"}, {"bins", "node"}, {"spare", "every_bin"},
                                                {"restore", "on_demand"}, {"service_devices", "any"}, {"resize", "fixed"},
                                                {"gain", "relative"}}));
}

TEST(PolicyRows, ParseRulesNamesTheBadField) {
  const PolicyRules r = tangram::parse_rules({{"order", "estimate"}, {"bins", "node"}, {"spare", "every_bin"},
                                              {"restore", "on_demand"}, {"service_devices", "any"}, {"resize", "fixed"},
                                              {"gain", "relative"}},
                                             "rules");
  EXPECT_EQ(tangram::describe_rules(r), tangram::describe_rules(shortest_greedy().rules));
  expect_error([] {
    tangram::parse_rules({{"order", "estimate"}, {"bins", "node"}, {"spare", "always"}, {"restore", "on_demand"},
                          {"service_devices", "any"}, {"resize", "fixed"}},
                         "rules");
  }, ErrorCode::kInvalidArgument, "rules.spare");
  expect_error([] {
    tangram::parse_rules({{"order", "estimate"}, {"bins", "node"}, {"spare", "none"}, {"restore", "on_demand"},
                          {"service_devices", "any"}},
                         "rules");
  }, ErrorCode::kInvalidArgument, "rules.resize");
  expect_error([] {
    tangram::parse_rules({{"order", "estimate"}, {"bins", "node"}, {"spare", "none"}, {"restore", "on_demand"},
                          {"service_devices", "any"}, {"resize", "elastic"}},
                         "rules");
  }, ErrorCode::kInvalidArgument, "rules.resize");
  expect_error([] {
    tangram::parse_rules({{"order", "estimate"}, {"bins", "node"}, {"spare", "none"}, {"service_devices", "any"}},
                         "rules");
  }, ErrorCode::kInvalidArgument, "rules.restore");
  expect_error([] { tangram::parse_rules({{"colour", "red"}}, "rules"); }, ErrorCode::kInvalidArgument, "rules.colour");
  expect_error([] {
    tangram::parse_rules({{"order", "arrival"}, {"order", "estimate"}}, "rules");
  }, ErrorCode::kInvalidArgument, "rules.order");
}

TEST(PolicyRows, BadRowIsATypedError) {
  PolicyConfig p;
  p.row = shortest_greedy();
  p.row->name.clear();
  expect_error([&] { tangram::Scheduler s(cpu_inventory(1, 4), p); }, ErrorCode::kInvalidArgument, "policy().name");
  p.row = shortest_greedy();
  p.row->rules.spare = static_cast<SpareRule>(7);  // a row made by casting
  expect_error([&] { tangram::Scheduler s(cpu_inventory(1, 4), p); }, ErrorCode::kInvalidArgument, "policy(shortest-greedy).spare");
  p.row = shortest_greedy();
  p.row->rules.resize = static_cast<ResizeRule>(2);
  expect_error([&] { tangram::Scheduler s(cpu_inventory(1, 4), p); }, ErrorCode::kInvalidArgument, "policy(shortest-greedy).resize");
  p.row = shortest_greedy();
  p.row->rules.gain = GainRule::kWait;  // counts the actions running on a bin: malleable rows only
  expect_error([&] { tangram::Scheduler s(cpu_inventory(1, 4), p); }, ErrorCode::kInvalidArgument,
               "policy(shortest-greedy).rules.gain");
}

// One 4-core node; at t=0 a 3-core 10 s action, an elastic 1-4 core 1 s action (perfectly
// parallel), and a 2-core 5 s action. The sixth row takes shortest first (elastic, then
// the 2-core one; the 3-core one no longer fits and waits) and still gives the spare core
// to the elastic action although the 3-core one waits.
std::vector<ActionSpec> three_actions() {
  return {action(1, {U(3)}, 10), amdahl(2, {U(1)}, 0, U(4), 1, 1.0), action(3, {U(2)}, 5)};
}

TEST(PolicyRows, SixthPolicyIsOnlyARow) {
  PolicyConfig p;
  p.row = shortest_greedy();
  Harness h(cpu_inventory(1, 4), p);
  EXPECT_EQ(h.s.policy().row->name, "shortest-greedy");
  EXPECT_EQ(h.submit(three_actions(), 0), (Decisions{start(2).on(0).grant(0, U(2)).at(0), start(3).on(0).at(0)}));
  EXPECT_EQ(h.s.state(1), ActionState::kWaiting);
  EXPECT_EQ(h.s.free(0, 0), 0);
  // Completions free the room for the 3-core action.
  EXPECT_EQ(h.complete({2, 3}, 1), (Decisions{start(1).on(0).at(1)}));
}

// The same events under the two rows it borrows from: tangram orders the same way but keeps
// the spare core back (the 3-core action waits on that node); optimus spreads spare units
// the same way but takes arrival order, so the 3-core action starts first.
TEST(PolicyRows, SixthPolicyDiffersFromTheRowsItBorrowsFrom) {
  Harness tangram_h(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(tangram_h.submit(three_actions(), 0),
            (Decisions{start(2).on(0).grant(0, U(1)).at(0), start(3).on(0).at(0)}));
  Harness optimus_h(cpu_inventory(1, 4), policy_of(PolicyKind::kOptimus));
  EXPECT_EQ(optimus_h.submit(three_actions(), 0),
            (Decisions{start(1).on(0).at(0), start(2).on(0).grant(0, U(1)).at(0)}));
}

// An elastic action in its trajectory's slot takes the slot's free units up to its bound;
// under a row that also gives spare units, the slot stays its trajectory's own (hidden from
// everyone else's placement) after the spare-unit pass looked at it.
TEST(PolicyRows, SpareUnitsKeepATrajectorySlotBound) {
  PolicyConfig p;
  PolicyRules r = tangram::policy_row(PolicyKind::kTrajectory).rules;
  r.spare = SpareRule::kEveryBin;
  p.row = PolicyRow{"greedy-slots", r};
  p.trajectory_slot_cpu = 2.0;
  Harness h(cpu_inventory(1, 4), p);  // two slots of 2 cores; the harness checks invariants
  auto in_trajectory = [](ActionSpec a, TrajectoryId t) {
    a.trajectory = t;
    return a;
  };
  EXPECT_EQ(h.submit({in_trajectory(amdahl(1, {U(1)}, 0, U(4), 10, 0.9), 1)}, 0),
            (Decisions{start(1).on(0).grant(0, U(2)).at(0)}));
  EXPECT_EQ(h.submit({in_trajectory(action(2, {U(1)}, 10), 2), in_trajectory(action(3, {U(1)}, 10), 3)}, 1),
            (Decisions{start(2).on(0).at(1)}));
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
}

// Every combination of the rules is a policy the core runs: random bursts under each of
// the 144 rows keep every invariant (checked after every event) and account for every
// action, and the built-in rows decide exactly as their PolicyKind does.
class EveryRow : public ::testing::TestWithParam<int> {};

PolicyRules row_number(int n) {
  PolicyRules r;
  r.order = static_cast<OrderRule>(n % 2);
  r.bins = static_cast<BinLayout>(n / 2 % 3);
  r.spare = static_cast<SpareRule>(n / 6 % 3);
  r.restore = static_cast<RestoreRule>(n / 18 % 2);
  r.service_devices = static_cast<ServiceDevices>(n / 36 % 2);
  r.resize = static_cast<ResizeRule>(n / 72 % 2);
  return r;
}

TEST_P(EveryRow, RandomBurstsKeepTheInvariants) {
  PolicyConfig p;
  p.row = PolicyRow{"row" + std::to_string(GetParam()), row_number(GetParam())};
  RandomRun run(p, 5);
  for (int i = 0; i < 150; ++i) {
    run.step();
    if (::testing::Test::HasFatalFailure()) return;
  }
  run.drain();
  run.ledger.expect_each_ended_once(run.next_id - 1);
  for (std::int32_t n = 0; n < 4; ++n)
    for (std::int32_t k = 0; k < 2; ++k) EXPECT_EQ(run.h.s.free(n, k), run.inv.nodes[n].capacity[k]);
}

INSTANTIATE_TEST_SUITE_P(PolicyRows, EveryRow, ::testing::Range(0, 144));

TEST(PolicyRows, BuiltinRowsDecideAsTheirKinds) {
  for (const PolicyRow& row : tangram::builtin_policies()) {
    SCOPED_TRACE(row.name);
    PolicyConfig as_row;
    as_row.row = row;
    RandomRun by_kind(tangram::policy_from_name(row.name), 9), by_row(as_row, 9);
    for (int i = 0; i < 200; ++i) {
      by_kind.step();
      by_row.step();
      if (::testing::Test::HasFatalFailure()) return;
    }
    ASSERT_GT(by_kind.trace.size(), 50u);
    EXPECT_EQ(by_kind.trace, by_row.trace);
  }
}

}  // namespace
}  // namespace tangram_test
