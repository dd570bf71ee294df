// What the core says about itself: explain(), the queries, and the invariants that
// check_invariants() and the queries must keep through random workloads under every policy.
#include <locale>
#include <string>
#include <vector>

#include "harness.h"
#include "random_workloads.h"

namespace tangram_test {
namespace {

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
// while it waits, is rejected only by its own submit (exactly when its demand exceeds every
// bin: RandomRun checks each batch), and ends by exactly one of reject, complete or cancel;
// it started iff it ended running. Once ended it is unknown to the core, and completing or
// cancelling it again is refused with kUnknownAction.
TEST_P(RandomBursts, EveryActionEndsExactlyOnce) {
  RandomRun run(GetParam(), 7);
  for (int i = 0; i < 400; ++i) {
    run.step();
    if (::testing::Test::HasFatalFailure()) return;
  }
  run.drain();
  const ActionId submitted = run.next_id - 1;
  run.ledger.expect_each_ended_once(submitted);
  for (ActionId id = 1; id <= submitted; ++id) EXPECT_EQ(run.h.s.state(id), ActionState::kUnknown) << "action " << id;
  EXPECT_GT(run.ledger.rejects, 0u) << "the workload includes actions that can never fit";
  Decisions out;
  ActionId first = 1;
  expect_error([&] { run.h.s.complete(&first, 1, S(run.now), out); }, ErrorCode::kUnknownAction, "ids[0]");
  expect_error([&] { run.h.s.cancel(&first, 1, S(run.now), out); }, ErrorCode::kUnknownAction, "ids[0]");
}

// Determinism: two schedulers fed the same events give identical decisions, field by
// field, in the same order, and explain every action alike.
TEST_P(RandomBursts, SameEventsGiveIdenticalDecisions) {
  RandomRun a(GetParam(), 11), b(GetParam(), 11);
  for (int i = 0; i < 300; ++i) {
    a.step();
    b.step();
    if (::testing::Test::HasFatalFailure()) return;
  }
  ASSERT_GT(a.trace.size(), 100u);
  ASSERT_EQ(a.trace, b.trace);
  for (ActionId id = 1; id < a.next_id; ++id) ASSERT_EQ(a.h.s.explain(id), b.h.s.explain(id));
}

INSTANTIATE_TEST_SUITE_P(Policies, RandomBursts,
                         ::testing::Values(PolicyKind::kTangram, PolicyKind::kFifo, PolicyKind::kTrajectory,
                                           PolicyKind::kIsolated, PolicyKind::kOptimus),
                         policy_param_name);

// When a starving action stops the pass, explain() for the actions behind it names the
// claim that holds them back (a pass did consider them).
TEST(Regressions, ExplainAfterStarvationStopsThePass) {
  PolicyConfig p = policy_of(PolicyKind::kFifo);
  p.starvation_seconds = 10;
  Harness h(cpu_inventory(1, 4), p);
  h.submit({action(1, {U(1)}, 100), action(2, {U(1)}, 100), action(3, {U(1)}, 100)}, 0);
  h.submit({action(10, {U(4)}, 1)}, 1);
  EXPECT_EQ(h.complete({1}, 11), Decisions{});
  EXPECT_EQ(h.submit({action(20, {U(1)}, 1)}, 12), Decisions{});
  EXPECT_EQ(h.s.explain(20),
            "waiting held back: an action that has waited over 10 s has first claim on the resources it needs");
  EXPECT_EQ(h.s.explain(10), "waiting for resources: needs cpu=4; most free on one bin it may use: cpu=2");
}

// explain() writes numbers the same whatever the program's global C++ locale (here one
// whose decimal point is a comma and which groups thousands): the core builds its
// messages without iostreams.
TEST(Introspection, ExplainIgnoresTheGlobalLocale) {
  struct CommaDecimals : std::numpunct<char> {
    char do_decimal_point() const override { return ','; }
    char do_thousands_sep() const override { return '.'; }
    std::string do_grouping() const override { return "\3"; }
  };
  const std::locale before = std::locale::global(std::locale(std::locale::classic(), new CommaDecimals));
  Harness h(cpu_inventory(1, 4000), policy_of(PolicyKind::kFifo));
  h.submit({action(1, {U(3999) + 500}, 100), action(2, {U(1500) + 250}, 1)}, 0);  // milli-units
  const std::string why = h.s.explain(2);
  std::locale::global(before);
  EXPECT_EQ(why, "waiting for resources: needs cpu=1500.25; most free on one bin it may use: cpu=0.5");
}

// The queries on a running action agree with its start decision; on a waiting one they
// say it waits; once it ends it is unknown.
TEST(Introspection, QueriesFollowAnAction) {
  Harness h(cpu_mem_inventory(2, 4, 1024), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h.submit({amdahl(1, {U(1), U(100)}, 0, U(2), 10, 0.5), action(2, {U(4), U(100)}, 20)}, 3),
            (Decisions{start(1).on(0).grant(0, U(2)).at(3), start(2).on(1).at(3)}));
  EXPECT_EQ(h.s.placement(1), Decision(start(1).on(0).grant(0, U(2)).at(3)));
  EXPECT_EQ(h.s.state(1), ActionState::kRunning);
  EXPECT_EQ(h.s.explain(1), "running on node 0 (node0), cpu grant 2");
  EXPECT_DOUBLE_EQ(h.s.runtime(1, U(1)), 10.0);
  EXPECT_DOUBLE_EQ(h.s.runtime(1, U(2)), 7.5);
  EXPECT_EQ(h.s.free(0, 0), U(2));
  EXPECT_EQ(h.s.free(0, 1), U(924));
  EXPECT_EQ(h.submit({action(3, {U(4), 0}, 1)}, 4), Decisions{});
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  EXPECT_EQ(h.s.waiting_count(), 1u);
  EXPECT_EQ(h.s.running_count(), 2u);
  EXPECT_EQ(h.complete({2}, 5), (Decisions{start(3).on(1).at(5)}));
  EXPECT_EQ(h.s.state(2), ActionState::kUnknown);
  EXPECT_EQ(h.s.now(), S(5));
}

}  // namespace
}  // namespace tangram_test
