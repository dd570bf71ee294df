// Elastic actions: spare units by largest marginal gain, never into the room a waiting
// action asks for (tangram) or always (optimus), bounded by elastic_max and the gain rule (the wait a step causes
// others, or min_relative_gain); exact releases.
#include <string>

#include "harness.h"

namespace tangram_test {
namespace {

// Spare elastic units go, one unit at a time, to the action with the largest marginal cut
// in run time: with 2 spare cores, the highly parallel action gets both.
TEST(Elastic, SpareUnitsGoToLargestMarginalGain) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  // t(1)=100 for both; parallel: t(2)=55, t(3)=40; serial-ish: t(2)=90. Cuts 45, then 15
  // (against 10) both go to the parallel one. Equal estimates: arrival order.
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(4), 100, 0.9), amdahl(2, {U(1)}, 0, U(4), 100, 0.2)}, 0),
            (Decisions{start(1).on(0).grant(0, U(3)).at(0), start(2).on(0).grant(0, U(1)).at(0)}));
  EXPECT_EQ(h.s.free(0, 0), 0);
  EXPECT_EQ(h.s.placement(1), Decision(start(1).on(0).grant(0, U(3)).at(0)));
  EXPECT_DOUBLE_EQ(h.s.runtime(1, U(3)), 40.0);
}

// tangram's row with the relative gain rule instead of the wait rule.
PolicyConfig relative_gain() {
  PolicyConfig p;
  tangram::PolicyRules r = tangram::policy_row(PolicyKind::kTangram).rules;
  r.gain = tangram::GainRule::kRelative;
  p.row = tangram::PolicyRow{"tangram-relative", r};
  return p;
}

// Under the relative rule an elastic action alone gets extra units up to its bound, but only
// while each unit cuts at least min_relative_gain of its run time.
TEST(Elastic, SpareUnitsStopAtBoundAndMinimumGain) {
  Harness h(cpu_inventory(1, 16), relative_gain());
  // Perfectly parallel: gains stay large, the bound stops it.
  EXPECT_EQ(h.submit({amdahl(1, {U(2)}, 0, U(6), 60, 1.0)}, 0), (Decisions{start(1).on(0).grant(0, U(6)).at(0)}));
  EXPECT_EQ(h.complete({1}, 1), Decisions{});
  // p = 0.5 from 1 core: t(u) = 10 (0.5 + 0.5 / u); the cut from 4 to 5 is 0.25 s of 6.25 s
  // (4% < 5%), so the grant stops at 4.
  EXPECT_EQ(h.submit({amdahl(2, {U(1)}, 0, U(16), 10, 0.5)}, 2), (Decisions{start(2).on(0).grant(0, U(4)).at(2)}));
}

// Under the wait rule (tangram's) a step is granted while its cut exceeds the wait it causes
// the others on the node: alone, every step that saves anything; beside others, fewer.
TEST(Elastic, SpareUnitsWeighTheWaitTheyCauseOthers) {
  Harness h(cpu_inventory(1, 16), policy_of(PolicyKind::kTangram));
  // p = 0.5 from 1 core: t(u) = 10 (0.5 + 0.5 / u). Alone (nobody to wait): up to its bound.
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(16), 10, 0.5)}, 0), (Decisions{start(1).on(0).grant(0, U(16)).at(0)}));
  EXPECT_EQ(h.complete({1}, 1), Decisions{});
  // Beside 8 one-core actions: a step from g cuts 5 / (g (g + 1)) s and adds 5 core-seconds,
  // a wait of 5 / 16 s for each of the 8 others, weighted by the share in use, (8 + g) / 16.
  // From 1: cut 2.5 > 8 x 9/16 x 5/16 = 1.41, granted; from 2: 0.83 < 1.56, refused.
  std::vector<ActionSpec> busy;
  for (ActionId id = 10; id < 18; ++id) busy.push_back(action(id, {U(1)}, 100));
  EXPECT_EQ(h.submit(busy, 2).size(), 8u);
  EXPECT_EQ(h.submit({amdahl(2, {U(1)}, 0, U(16), 10, 0.5)}, 3), (Decisions{start(2).on(0).grant(0, U(2)).at(3)}));
  // The relative rule ignores the others: 4 cores (SpareUnitsStopAtBoundAndMinimumGain).
  Harness r(cpu_inventory(1, 16), relative_gain());
  EXPECT_EQ(r.submit(busy, 2).size(), 8u);
  EXPECT_EQ(r.submit({amdahl(2, {U(1)}, 0, U(16), 10, 0.5)}, 3), (Decisions{start(2).on(0).grant(0, U(4)).at(3)}));
}

// Spare units are granted only when nobody waits: while an action waits for the node, an
// elastic action starts with exactly its minimum.
TEST(Elastic, NoSpareUnitsWhileSomeoneWaits) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  // The elastic one is shorter, so it is first in order and starts; the big one waits.
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(4), 10, 0.9), action(2, {U(4)}, 100)}, 0),
            (Decisions{start(1).on(0).grant(0, U(1)).at(0)}));
  EXPECT_EQ(h.s.free(0, 0), U(3));
  // A waiter confined to another node does not contend for this one.
  Harness h2(cpu_inventory(2, 4), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h2.submit({action(10, {U(4)}, 100)}, 0), (Decisions{start(10).on(0).at(0)}));  // fills node 0
  ActionSpec waiter = action(11, {U(2)}, 100);
  waiter.affinity_node = 0;
  ActionSpec el = amdahl(12, {U(1)}, 0, U(4), 10, 0.9);
  el.affinity_node = 1;
  // t(u) = 10 (0.1 + 0.9 / u): cuts 4.5, 1.5, 0.75 s, each over 5%: up to its bound, 4.
  EXPECT_EQ(h2.submit({waiter, el}, 1), (Decisions{start(12).on(1).grant(0, U(4)).at(1)}));
}

// A waiter short of memory keeps back the cores it asks for, not all of them: the idle
// cores speed up the running elastic action whose memory it waits for.
TEST(Elastic, MemoryWaitersKeepBackOnlyTheirCores) {
  Harness h(cpu_mem_inventory(1, 8, 4096), policy_of(PolicyKind::kTangram));
  // The elastic one is shorter, so it starts first and takes 3 GiB; the other needs 2 GiB
  // and 2 cores and waits for memory. t(u) = 10 (0.1 + 0.9 / u): alone every step pays, so
  // it grows to 8 - 2 = 6 cores, leaving the waiter's 2.
  EXPECT_EQ(h.submit({amdahl(1, {U(1), U(3072)}, 0, U(8), 10, 0.9), action(2, {U(2), U(2048)}, 100)}, 0),
            (Decisions{start(1).on(0).grant(0, U(6)).at(0)}));
  EXPECT_EQ(h.s.free(0, 0), U(2));
  EXPECT_EQ(h.complete({1}, 3), (Decisions{start(2).on(0).at(3)}));
}

// An action waiting for its quota (or its GPU service) waits for something other than cores:
// it does not keep spare units from an elastic action on its node.
TEST(Elastic, QuotaWaitersDoNotHoldBackSpareUnits) {
  Inventory inv = cpu_inventory(1, 4);
  inv.quotas = {tangram::QuotaSpec{"api", 1.0, 1, 0, 0}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec first = action(1, {U(1)}, 1);
  first.quota = 0;
  EXPECT_EQ(h.submit({first}, 0), (Decisions{start(1).on(0).at(0)}));  // the burst of one
  ActionSpec second = action(2, {U(1)}, 1);
  second.quota = 0;
  // All the free cores: 4 - 1 held by action 1.
  EXPECT_EQ(h.submit({second, amdahl(3, {U(1)}, 0, U(4), 100, 0.9)}, 0),
            (Decisions{start(3).on(0).grant(0, U(3)).at(0)}));
  EXPECT_EQ(h.s.explain(2), "waiting for quota 'api' rate limit; next admission at 1.000000 s");
}

// The Optimus-style policy hands out spare units even while others wait (the difference
// from kTangram), in arrival order, by the same largest-marginal-gain rule.
TEST(Elastic, OptimusGrantsSpareUnitsWhileOthersWait) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kOptimus));
  // Arrival order: the elastic action first; the 4-core one waits for the whole node.
  // Tangram would keep it at 1 (NoSpareUnitsWhileSomeoneWaits).
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(4), 10, 0.9), action(2, {U(4)}, 100)}, 0),
            (Decisions{start(1).on(0).grant(0, U(4)).at(0)}));
  EXPECT_EQ(h.s.free(0, 0), 0);
  // Once it ends, the waiter gets the node.
  EXPECT_EQ(h.complete({1}, 5), (Decisions{start(2).on(0).at(5)}));
  EXPECT_EQ(std::string(tangram::policy_name(PolicyKind::kOptimus)), "optimus");
  EXPECT_EQ(tangram::policy_from_name("optimus"), PolicyKind::kOptimus);
}

// Fixed-point: grants in milli-units that are not whole cores, and their releases, return
// the pool to exactly full.
TEST(Elastic, GrantsReturnExactly) {
  Harness h(cpu_mem_inventory(1, 7, 1000), policy_of(PolicyKind::kTangram));
  // Action 2 goes first (4.75 s at its minimum rounded up to a core, against action 1's
  // 7.75 s at 2 cores); each starts topped up to a whole core (2 to 1 core, 1 to 2). Then
  // the 4 spare cores, a step at a time to the largest cut, each ending on a whole core:
  // action 1's two (2.25, 1.12 s), action 2's one (0.88 s), action 1's one (0.68 s, more
  // than action 2's last quarter, 0.1 s). All 7 cores are granted.
  EXPECT_EQ(h.submit({amdahl(1, {1500, 1}, 0, 5500, 10, 0.9), amdahl(2, {250, 3}, 0, 2250, 10, 0.7)}, 0),
            (Decisions{start(2).on(0).grant(0, 2000).at(0), start(1).on(0).grant(0, 5000).at(0)}));
  EXPECT_EQ(h.s.free(0, 0), 0);
  EXPECT_EQ(h.s.free(0, 1), U(1000) - 4);
  EXPECT_EQ(h.complete({1, 2}, 1), Decisions{});
  EXPECT_EQ(h.s.free(0, 0), U(7));
  EXPECT_EQ(h.s.free(0, 1), U(1000));
}

}  // namespace
}  // namespace tangram_test
