// Malleable grants (ResizeRule::kMalleable, tangram's row): a fractional minimum starts
// topped up to a whole unit, running elastic actions grow into room a completion frees,
// and give units back for a waiting head when that pays.
// Each case states the exact decisions; the arithmetic is in the comments.
#include <map>
#include <string>

#include "harness.h"
#include "random_workloads.h"

namespace tangram_test {
namespace {

using tangram::PolicyRow;
using tangram::PolicyRules;
using tangram::ResizeRule;

PolicyConfig tangram_policy() { return policy_of(PolicyKind::kTangram); }

// tangram's row with fixed grants: the same events never resize.
PolicyConfig tangram_fixed() {
  PolicyConfig p;
  PolicyRules r = tangram::policy_row(PolicyKind::kTangram).rules;
  r.resize = ResizeRule::kFixed;
  r.gain = tangram::GainRule::kRelative;  // the wait rule counts running actions: malleable rows only
  p.row = PolicyRow{"tangram-fixed", r};
  return p;
}

// Two equal elastic actions split a node's spare cores (4 each: t(u) = 10 (0.1 + 0.9 / u),
// each cut above 5% of t). When one completes, the other grows into the freed cores: one
// kResize with its new total grant.
TEST(Resize, GrowsAfterACompletion) {
  Harness h(cpu_inventory(1, 8), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(8), 10, 0.9), amdahl(2, {U(1)}, 0, U(8), 10, 0.9)}, 0),
            (Decisions{start(1).on(0).grant(0, U(4)).at(0), start(2).on(0).grant(0, U(4)).at(0)}));
  EXPECT_EQ(h.complete({2}, 1), (Decisions{resize(1).on(0).grant(0, U(8)).at(1)}));
  EXPECT_EQ(h.s.placement(1), Decision(start(1).on(0).grant(0, U(8)).at(0)));  // the current grant
  EXPECT_EQ(h.s.free(0, 0), 0);
  EXPECT_EQ(h.s.explain(1), "running on node 0 (node0), cpu grant 8 (from 4 at 1 s)");
  EXPECT_EQ(h.complete({1}, 2), Decisions{});
  EXPECT_EQ(h.s.free(0, 0), U(8));  // its current grant came back
}

// Four single-threaded programs declared from a quarter core to one (t(u) = 0.25 / u s: 1 s
// at a quarter) on 2 cores: each starts topped up to a whole core (the step cuts 0.75 s),
// so two run and two wait. With fixed grants all four start at a quarter, sharing the
// cores (each then takes about 0.5 s instead of 0.25; the spare rule tops one up with the
// core nobody waits for). When the free room cannot hold the step (0.5 core left after
// action 2's quarter, against a 0.75 step), a start stays at its minimum.
TEST(Resize, FractionalMinimumStartsToppedUpToAWholeUnit) {
  const auto programs = [] {
    return std::vector<ActionSpec>{amdahl(1, {250}, 0, U(1), 1, 1.0), amdahl(2, {250}, 0, U(1), 1, 1.0),
                                   amdahl(3, {250}, 0, U(1), 1, 1.0), amdahl(4, {250}, 0, U(1), 1, 1.0)};
  };
  Harness h(cpu_inventory(1, 2), tangram_policy());
  EXPECT_EQ(h.submit(programs(), 0),
            (Decisions{start(1).on(0).grant(0, U(1)).at(0), start(2).on(0).grant(0, U(1)).at(0)}));
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  EXPECT_EQ(h.complete({1}, 0.25), (Decisions{start(3).on(0).grant(0, U(1)).at(0.25)}));

  Harness fixed(cpu_inventory(1, 2), tangram_fixed());
  EXPECT_EQ(fixed.submit(programs(), 0),
            (Decisions{start(1).on(0).grant(0, U(1)).at(0), start(2).on(0).grant(0, 250).at(0),
                       start(3).on(0).grant(0, 250).at(0), start(4).on(0).grant(0, 250).at(0)}));

  Harness partial(cpu_inventory(1, 2), tangram_policy());
  EXPECT_EQ(partial.submit({action(9, {250}, 100)}, 0), (Decisions{start(9).on(0).at(0)}));
  EXPECT_EQ(partial.submit({amdahl(1, {250}, 0, U(1), 1, 1.0), amdahl(2, {250}, 0, U(1), 1, 1.0)}, 0),
            (Decisions{start(1).on(0).grant(0, U(1)).at(0), start(2).on(0).grant(0, 250).at(0)}));
}

// An action limits its own grant (Scheduler::limit): a suite with one test left holds 2
// cores (t(u) = 10 / u s), while a 1-core program waits (taking a core back would cost the
// suite 5 s of its 5 s left: no gain). Limited to 1, it gives the core back at once and
// the program starts in the same event; no completion grows it past its limit, and raised
// again it grows back into what is free.
TEST(Resize, LimitGivesUnitsBack) {
  Harness h(cpu_inventory(1, 2), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(2), 10, 1.0)}, 0), (Decisions{start(1).on(0).grant(0, U(2)).at(0)}));
  EXPECT_EQ(h.submit({action(2, {U(1)}, 1)}, 0), Decisions{});
  EXPECT_EQ(h.limit({1}, {U(1)}, 1), (Decisions{resize(1).on(0).grant(0, U(1)).at(1), start(2).on(0).at(1)}));
  EXPECT_EQ(h.s.explain(1), "running on node 0 (node0), cpu grant 1 (from 2 at 1 s), limited by the action to 1 of 2");
  EXPECT_EQ(h.complete({2}, 2), Decisions{});
  EXPECT_EQ(h.s.free(0, 0), U(1));
  EXPECT_EQ(h.limit({1}, {U(2)}, 3), (Decisions{resize(1).on(0).grant(0, U(2)).at(3)}));
  EXPECT_EQ(h.limit({1}, {U(2)}, 3), Decisions{});  // already there: nothing changes
}

// Under fixed grants a limit still gives units back; raised again, the grant stays.
TEST(Resize, LimitUnderFixedGrants) {
  Harness h(cpu_inventory(1, 2), tangram_fixed());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(2), 10, 1.0)}, 0), (Decisions{start(1).on(0).grant(0, U(2)).at(0)}));
  EXPECT_EQ(h.submit({action(2, {U(1)}, 1)}, 0), Decisions{});
  EXPECT_EQ(h.limit({1}, {U(1)}, 1), (Decisions{resize(1).on(0).grant(0, U(1)).at(1), start(2).on(0).at(1)}));
  EXPECT_EQ(h.complete({2}, 2), Decisions{});
  EXPECT_EQ(h.limit({1}, {U(2)}, 2), Decisions{});  // fixed grants never grow
  EXPECT_EQ(h.s.explain(1), "running on node 0 (node0), cpu grant 1");
}

// A refused limit names the field and changes nothing.
TEST(Resize, LimitValidation) {
  Harness h(cpu_inventory(1, 2), tangram_policy());
  h.submit({amdahl(1, {500}, 0, U(2), 10, 1.0), action(2, {U(1)}, 10), action(3, {U(2)}, 10)}, 0);
  const auto limit = [&](ActionId id, Quantity q) { return [&h, id, q] { h.limit({id}, {q}, 1); }; };
  expect_error(limit(3, U(2)), ErrorCode::kInvalidState, "ids[0]");       // waiting
  expect_error(limit(2, U(1)), ErrorCode::kInvalidArgument, "ids[0]");    // not elastic
  expect_error(limit(1, 499), ErrorCode::kInvalidArgument, "limits[0]");  // below its minimum
  expect_error(limit(1, U(2) + 1), ErrorCode::kInvalidArgument, "limits[0]");  // above its maximum
  expect_error(limit(9, U(1)), ErrorCode::kUnknownAction, "ids[0]");
  expect_error([&] { h.limit({1, 1}, {U(1), U(1)}, 1); }, ErrorCode::kDuplicateId, "ids[1]");
  expect_error([&] { h.limit({1}, {U(1)}, -1); }, ErrorCode::kInvalidArgument, "now");
  EXPECT_EQ(h.s.placement(1).grant, U(1));
  EXPECT_EQ(h.s.explain(1), "running on node 0 (node0), cpu grant 1");
}

// The same events with fixed grants: the survivor keeps its start grant.
TEST(Resize, FixedGrantsNeverResize) {
  Harness h(cpu_inventory(1, 8), tangram_fixed());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(8), 10, 0.9), amdahl(2, {U(1)}, 0, U(8), 10, 0.9)}, 0),
            (Decisions{start(1).on(0).grant(0, U(4)).at(0), start(2).on(0).grant(0, U(4)).at(0)}));
  EXPECT_EQ(h.complete({2}, 1), Decisions{});
  EXPECT_EQ(h.s.placement(1).grant, U(4));
  EXPECT_EQ(h.s.explain(1), "running on node 0 (node0), cpu grant 4");
  // A head short of cores waits rather than take any back.
  EXPECT_EQ(h.submit({action(3, {U(5)}, 1)}, 2), Decisions{});
}

// While an action waits for room on the node, freed room goes to nobody running: action 3
// (8 cores) waits after action 2 completes, and action 1 (at its minimum, nothing to take
// back) stays at 1 core. Action 3 starts once the node is empty.
TEST(Resize, NoGrowWhileSomeoneWaits) {
  Harness h(cpu_inventory(1, 8), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(8), 10, 0.9), action(2, {U(6)}, 10), action(3, {U(8)}, 100)}, 0),
            (Decisions{start(1).on(0).grant(0, U(1)).at(0), start(2).on(0).at(0)}));
  EXPECT_EQ(h.complete({2}, 1), Decisions{});
  EXPECT_EQ(h.s.placement(1).grant, U(1));
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  EXPECT_EQ(h.complete({1}, 2), (Decisions{start(3).on(0).at(2)}));
}

// Action 1 holds all 8 cores (t(u) = 100 (0.1 + 0.9 / u), t(8) = 21.25 s). At t=10 its work
// left is 1 - 10 / 21.25 = 0.529; action 2 needs 2 cores. Taking 8 -> 7 -> 6 costs
// 0.529 x 100 x 0.9 x ((1/7 - 1/8) + (1/6 - 1/7)) = 1.99 s of its run time; the head's wait
// would be the earliest finish there, action 1's own 0.529 x 21.25 = 11.25 s. It pays: the
// kResize comes before the head's start. When action 2 ends, action 1 grows back.
TEST(Resize, ShrinkLetsAHeadStart) {
  Harness h(cpu_inventory(1, 8), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(8), 100, 0.9)}, 0), (Decisions{start(1).on(0).grant(0, U(8)).at(0)}));
  EXPECT_EQ(h.submit({action(2, {U(2)}, 1)}, 10),
            (Decisions{resize(1).on(0).grant(0, U(6)).at(10), start(2).on(0).at(10)}));
  EXPECT_EQ(h.s.explain(1), "running on node 0 (node0), cpu grant 6 (from 8 at 10 s)");
  EXPECT_EQ(h.s.free(0, 0), 0);
  EXPECT_EQ(h.complete({2}, 11), (Decisions{resize(1).on(0).grant(0, U(8)).at(11)}));
  EXPECT_EQ(h.complete({1}, 12), Decisions{});
  EXPECT_EQ(h.s.free(0, 0), U(8));
}

// A pending wake that finds its released room taken by an earlier head still starts by a
// shrink on that node when one pays. Action 1 (1 to 8 cores, t(u) = 100 (0.1 + 0.9 / u),
// 32.5 s at 4) and action 2 (4 cores, 5 s) split the node. At t=1 action 3 (2 cores, 50 s,
// priority 1) waits: taking action 1 from 4 cores to 2 would cost 0.969 x 22.5 = 21.8 s
// against the 4 s until action 2 ends; action 4 (4 cores) parks: 3 units above action 1's
// minimum are short of it. Action 2's end frees 4 cores, which action 4 fits; action 3
// comes first and takes 2 of them; action 4 then starts by taking action 1 to 2 cores
// (a loss of (1 - 5 / 32.5) x 22.5 = 19.0 s against the 27.5 s until action 1 ends).
TEST(Resize, PendingWakeStartsByAShrinkOnTheReleasedNode) {
  Harness h(cpu_inventory(1, 8), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(8), 100, 0.9), action(2, {U(4)}, 5)}, 0),
            (Decisions{start(2).on(0).at(0), start(1).on(0).grant(0, U(4)).at(0)}));
  ActionSpec first = action(3, {U(2)}, 50);
  first.priority = 1;
  EXPECT_EQ(h.submit({first, action(4, {U(4)}, 1)}, 1), Decisions{});
  EXPECT_EQ(h.complete({2}, 5),
            (Decisions{start(3).on(0).at(5), resize(1).on(0).grant(0, U(2)).at(5), start(4).on(0).at(5)}));
}

// Action 2 needs 6 of action 1's 8 cores: down to 2, its run time would go from 21.25 s to
// 55 s per unit of work, a loss (33.75 x work left) above the wait it saves (21.25 x work
// left, action 1's own finish). No shrink: action 2 waits for action 1 to end.
TEST(Resize, ShrinkRefusedWhenItDoesNotPay) {
  Harness h(cpu_inventory(1, 8), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(8), 100, 0.9)}, 0), (Decisions{start(1).on(0).grant(0, U(8)).at(0)}));
  EXPECT_EQ(h.submit({action(2, {U(6)}, 1)}, 10), Decisions{});
  EXPECT_EQ(h.s.placement(1).grant, U(8));
  EXPECT_EQ(h.tick(15), Decisions{});  // the ratio does not change with time
  EXPECT_EQ(h.complete({1}, 20), (Decisions{start(2).on(0).at(20)}));
}

// Action 1 (2 to 4 cores, t(u) = 100 (0.1 + 1.8 / u)) holds 4 of 5 cores. A head needing 4
// cores cannot start: 1 free plus the 2 above action 1's minimum is 3. A head needing 3
// takes action 1 down to exactly its minimum (loss 45 x work left < its finish 55 x work
// left); one needing 1 more core then finds nothing to take.
TEST(Resize, NeverBelowMinimum) {
  Harness h(cpu_inventory(1, 5), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(2)}, 0, U(4), 100, 0.9)}, 0), (Decisions{start(1).on(0).grant(0, U(4)).at(0)}));
  EXPECT_EQ(h.submit({action(2, {U(4)}, 1)}, 1), Decisions{});
  EXPECT_EQ(h.cancel({2}, 2), Decisions{});
  EXPECT_EQ(h.submit({action(3, {U(3)}, 1)}, 2),
            (Decisions{resize(1).on(0).grant(0, U(2)).at(2), start(3).on(0).at(2)}));
  EXPECT_EQ(h.submit({action(4, {U(1)}, 1)}, 3), Decisions{});
  EXPECT_EQ(h.s.placement(1).grant, U(2));
  EXPECT_EQ(h.s.free(0, 0), 0);
}

// The work left carries across grant changes. Action 1 (1 to 4 cores, t(u) = 40 / u) starts
// with 4 cores beside action 2 (no cores, 10 s). At t=5 a head needing a core takes one:
// work left 1 - 5/10 = 0.5, from then on at t(3) = 13.33 s. At t a second head needs a
// core: work left 0.5 - (t - 5) / 13.33, loss = that x (t(2) - t(3)) = 5.83 - 0.5 t; the
// wait it saves is action 2's finish, 10 - t. It pays before t = 8.33 and not after:
// at 8 (loss 1.83 < 2), not at 8.5 (loss 1.58 > 1.5). Had the work left restarted at the
// resize (or kept counting at 4 cores), neither would hold.
void start_work_left_case(Harness& h) {
  EXPECT_EQ(h.submit({amdahl(1, {U(1), 0}, 0, U(4), 40, 1.0), action(2, {0, U(1)}, 10)}, 0),
            (Decisions{start(2).on(0).at(0), start(1).on(0).grant(0, U(4)).at(0)}));
  EXPECT_EQ(h.submit({action(3, {U(1), 0}, 1000)}, 5),
            (Decisions{resize(1).on(0).grant(0, U(3)).at(5), start(3).on(0).at(5)}));
}

TEST(Resize, WorkLeftCarriesAcrossResizes) {
  Harness paid(cpu_mem_inventory(1, 4, 1024), tangram_policy());
  start_work_left_case(paid);
  EXPECT_EQ(paid.submit({action(4, {U(1), 0}, 1000)}, 8),
            (Decisions{resize(1).on(0).grant(0, U(2)).at(8), start(4).on(0).at(8)}));
  EXPECT_EQ(paid.s.explain(1), "running on node 0 (node0), cpu grant 2 (from 3 at 8 s)");

  Harness refused(cpu_mem_inventory(1, 4, 1024), tangram_policy());
  start_work_left_case(refused);
  EXPECT_EQ(refused.submit({action(4, {U(1), 0}, 1000)}, 8.5), Decisions{});
  EXPECT_EQ(refused.s.placement(1).grant, U(3));
}

// Of two donors, the one that loses least gives first: equal models and grants, but action
// 1 has run longer (less work left), so a unit of it costs less.
TEST(Resize, SmallestLossGivesFirst) {
  Harness h(cpu_mem_inventory(1, 8, 1024), tangram_policy());
  EXPECT_EQ(h.submit({amdahl(1, {U(1), 0}, 0, U(4), 100, 0.9)}, 0), (Decisions{start(1).on(0).grant(0, U(4)).at(0)}));
  EXPECT_EQ(h.submit({amdahl(2, {U(1), 0}, 0, U(4), 100, 0.9)}, 5), (Decisions{start(2).on(0).grant(0, U(4)).at(5)}));
  EXPECT_EQ(h.submit({action(3, {U(1), 0}, 1)}, 10),
            (Decisions{resize(1).on(0).grant(0, U(3)).at(10), start(3).on(0).at(10)}));
}

// Random bursts under tangram keep every invariant (checked after every event) and each
// event resizes an action at most once (the ledger checks); over the runs, grants both
// grow and shrink.
TEST(Resize, RandomBurstsResizeAndKeepTheInvariants) {
  int grows = 0, shrinks = 0;
  for (std::uint32_t seed = 1; seed <= 8; ++seed) {
    RandomRun run(PolicyKind::kTangram, seed);
    for (int i = 0; i < 200; ++i) {
      run.step();
      if (::testing::Test::HasFatalFailure()) return;
    }
    run.drain();
    run.ledger.expect_each_ended_once(run.next_id - 1);
    std::map<ActionId, Quantity> grant;
    for (const Decision& d : run.trace) {
      if (d.kind == DecisionKind::kStart) grant[d.action] = d.grant;
      if (d.kind != DecisionKind::kResize) continue;
      ASSERT_EQ(grant.count(d.action), 1u) << "resize before start of " << d.action;
      ASSERT_NE(d.grant, grant[d.action]) << "a resize that changes nothing";
      (d.grant > grant[d.action] ? grows : shrinks) += 1;
      grant[d.action] = d.grant;
    }
  }
  EXPECT_GT(grows, 0);
  EXPECT_GT(shrinks, 0);
}

}  // namespace
}  // namespace tangram_test
