// Waiting, parking and waking: backfill around a big action that waits, and the
// starvation guard once it has waited starvation_seconds (held back, the pass stopped).
#include <string>

#include "harness.h"

namespace tangram_test {
namespace {

ActionSpec on_node(ActionSpec a, std::int32_t node) {
  a.affinity_node = node;
  return a;
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
    EXPECT_EQ(h.submit({on_node(action(1, {U(1)}, 100), 0), on_node(action(2, {U(1)}, 100), 0),
                        on_node(action(3, {U(1)}, 100), 0)},
                       0),
              (Decisions{start(1).on(0).at(0), start(2).on(0).at(0), start(3).on(0).at(0)}));
    // Big: short estimate so it also ranks first under the tangram policy's order.
    EXPECT_EQ(h.submit({on_node(action(10, {U(4)}, 1), 0)}, 1), Decisions{});
    // Before the threshold a small one backfills.
    EXPECT_EQ(h.submit({on_node(action(4, {U(1)}, 100), 0)}, 5), (Decisions{start(4).on(0).at(5)}));
    // Waited 11 s: the release of 1 makes it claim node 0; 20 may not take the freed core.
    EXPECT_EQ(h.complete({1}, 12), Decisions{});
    EXPECT_EQ(h.submit({on_node(action(20, {U(1)}, 100), 0)}, 12), Decisions{});
    EXPECT_EQ(h.s.explain(20),
              "waiting held back: an action that has waited over 10 s has first claim on the resources it needs");
    // Node 1 is not its to claim: actions there still run.
    EXPECT_EQ(h.submit({on_node(action(21, {U(1)}, 100), 1)}, 12), (Decisions{start(21).on(1).at(12)}));
    EXPECT_EQ(h.complete({2, 3}, 13), Decisions{});
    EXPECT_EQ(h.complete({4}, 14), (Decisions{start(10).on(0).at(14)}));
    EXPECT_EQ(h.complete({10}, 15), (Decisions{start(20).on(0).at(15)}));
  }
}

// The same guard for an action that may use any node: once it starves, a release stops the
// whole pass, so no later action starts anywhere until it fits.
TEST(Starvation, UnconfinedBigActionStopsThePass) {
  PolicyConfig p = policy_of(PolicyKind::kFifo);
  p.starvation_seconds = 10;
  Harness h(cpu_inventory(2, 4), p);
  // Equal nodes: 1 takes the first; 2 no longer fits there.
  EXPECT_EQ(h.submit({action(1, {U(3)}, 100), action(2, {U(3)}, 100)}, 0),
            (Decisions{start(1).on(0).at(0), start(2).on(1).at(0)}));
  EXPECT_EQ(h.submit({action(10, {U(4)}, 1)}, 1), Decisions{});
  // One core free on each node: equal fits, the first.
  EXPECT_EQ(h.submit({action(3, {U(1)}, 100)}, 2), (Decisions{start(3).on(0).at(2)}));
  EXPECT_EQ(h.complete({3}, 11), Decisions{});  // big has waited 10 s: it holds everything
  EXPECT_EQ(h.submit({action(4, {U(1)}, 100)}, 11), Decisions{});
  // Node 0 empties: big starts there, and the pass goes on: 4 takes node 1's free core.
  EXPECT_EQ(h.complete({1}, 12), (Decisions{start(10).on(0).at(12), start(4).on(1).at(12)}));
}

// The guard also holds when nothing was released since the big action started waiting:
// a class parked for resources is looked at again once its head starves, so a later small
// action that arrives past the threshold waits.
TEST(Starvation, ParkedStarvingActionHoldsBackLaterSubmits) {
  PolicyConfig p = policy_of(PolicyKind::kFifo);
  p.starvation_seconds = 10;
  Harness h(cpu_inventory(1, 4), p);
  h.submit({action(1, {U(1)}, 100), action(2, {U(1)}, 100), action(3, {U(1)}, 100)}, 0);
  EXPECT_EQ(h.submit({action(10, {U(4)}, 1)}, 1), Decisions{});  // waits (parked)
  EXPECT_EQ(h.submit({action(19, {U(1)}, 100)}, 5), (Decisions{start(19).on(0).at(5)}));  // backfill
  EXPECT_EQ(h.complete({19}, 6), Decisions{});  // 10 has waited 5 s: not yet its claim
  // 19 s after the big one arrived, with no release since the last backfill, a small one
  // arrives: it must wait.
  EXPECT_EQ(h.submit({action(20, {U(1)}, 1)}, 20), Decisions{}) << "action 20 starts past a starving action";
  EXPECT_EQ(h.complete({1, 2, 3}, 21), (Decisions{start(10).on(0).at(21)}));
  EXPECT_EQ(h.s.state(20), ActionState::kWaiting);
}

}  // namespace
}  // namespace tangram_test
