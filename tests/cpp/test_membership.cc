// Node membership: nodes going offline and coming back, nodes joining (add_node).
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "random_workloads.h"

namespace tangram_test {
namespace {

// Nothing is placed on an offline node: its running actions keep their resources until
// they are completed, freed room there starts nothing, new submits go elsewhere or wait.
// When it comes back, its pools are exact (capacity minus what still runs) and waiting
// work starts there; after everything ends every pool is exactly full.
TEST(NodeMembership, OfflineNodeGetsNoPlacementsAndPoolsAreExactWhenItReturns) {
  Harness h(cpu_inventory(2, 4), policy_of(PolicyKind::kTangram));
  // Best fit packs node 0 first: after 1, node 0 (2 left of 4) beats the empty node 1.
  EXPECT_EQ(h.submit({action(1, {U(2)}), action(2, {U(2)}), action(3, {U(2)}), action(4, {U(2)})}, 0),
            (Decisions{start(1).on(0).at(0), start(2).on(0).at(0), start(3).on(1).at(0), start(4).on(1).at(0)}));
  EXPECT_TRUE(h.s.node_online(1));
  EXPECT_EQ(h.online(1, false, 1), Decisions{});
  EXPECT_FALSE(h.s.node_online(1));
  EXPECT_EQ(h.s.free(1, 0), 0);
  // Room frees on the offline node: the waiting action does not go there.
  EXPECT_EQ(h.submit({action(5, {U(2)})}, 2), Decisions{});
  EXPECT_EQ(h.complete({3}, 3), Decisions{}) << "placed on an offline node";
  EXPECT_EQ(h.s.free(1, 0), U(2));
  EXPECT_EQ(h.s.running_count(), 3u);
  // Room on the online node: it goes there.
  EXPECT_EQ(h.complete({1}, 4), (Decisions{start(5).on(0).at(4)}));
  // Idempotent, then back: exactly the freed 2 cores there, and new work lands on it.
  EXPECT_EQ(h.online(1, false, 5), Decisions{});
  EXPECT_EQ(h.online(1, true, 6), Decisions{});
  EXPECT_EQ(h.s.free(1, 0), U(2));
  EXPECT_EQ(h.submit({action(6, {U(2)})}, 7), (Decisions{start(6).on(1).at(7)}));  // node 0 is full
  EXPECT_EQ(h.complete({2, 4, 5, 6}, 8), Decisions{});
  EXPECT_EQ(h.s.free(0, 0), U(4));
  EXPECT_EQ(h.s.free(1, 0), U(4));
}

// Waiting work is started when its node comes back online: an action with affinity to an
// offline node waits (it is not rejected) and starts there as soon as the node is back;
// an action whose shape fits only the offline node's capacity waits too, and even when it
// starves it holds nothing back on the online nodes.
TEST(NodeMembership, WaitersForAnOfflineNodeStartWhenItReturnsAndHoldNothingBack) {
  Inventory inv = cpu_inventory(2, 2);
  inv.nodes[1].capacity = {U(8)};
  PolicyConfig p = policy_of(PolicyKind::kTangram);
  p.starvation_seconds = 10;
  Harness h(inv, p);
  EXPECT_EQ(h.online(1, false, 0), Decisions{});
  ActionSpec pinned = action(1, {U(1)});
  pinned.affinity_node = 1;
  EXPECT_EQ(h.submit({pinned, action(2, {U(6)}, 5)}, 0), Decisions{});
  EXPECT_EQ(h.s.state(1), ActionState::kWaiting);
  EXPECT_EQ(h.s.state(2), ActionState::kWaiting);
  // Long past starvation: small actions still run on node 0.
  EXPECT_EQ(h.submit({action(3, {U(1)}), action(4, {U(1)})}, 100),
            (Decisions{start(3).on(0).at(100), start(4).on(0).at(100)}));
  // Back: both start there, in policy order (1 s before 5 s).
  EXPECT_EQ(h.online(1, true, 101), (Decisions{start(1).on(1).at(101), start(2).on(1).at(101)}));
  EXPECT_EQ(h.s.free(1, 0), U(1));
}

// add_node adds capacity: waiting work starts on the new node; a shape that fitted no node
// (rejected before) is feasible once a node that holds it joins; indices of existing nodes
// are unchanged; duplicate or malformed nodes are refused with nothing applied.
TEST(NodeMembership, AddedNodeReceivesWorkAndMakesBigShapesFeasible) {
  Harness h(cpu_mem_inventory(1, 2, 1024), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h.submit({action(1, {U(1), 0}), action(2, {U(1), 0}), action(3, {U(1), 0}), action(4, {U(1), 0})}, 0),
            (Decisions{start(1).on(0).at(0), start(2).on(0).at(0)}));
  EXPECT_EQ(h.submit({action(5, {U(6), 0})}, 1), (Decisions{reject(5, 0).at(1)}));
  EXPECT_EQ(h.s.message(0), "action 5 can never run: demand does not fit on any node: cpu needs 6, largest is 2");
  expect_error([&] { h.s.add_node(NodeSpec{"node0", {U(8), U(1024)}, {}}, S(2), h.out); }, ErrorCode::kInvalidArgument,
               "node.name");
  expect_error([&] { h.s.add_node(NodeSpec{"big", {U(8)}, {}}, S(2), h.out); }, ErrorCode::kInvalidArgument,
               "node.capacity");
  expect_error([&] { h.s.add_node(NodeSpec{"big", {U(8), U(1024)}, {{0}}}, S(2), h.out); },
               ErrorCode::kInvalidArgument, "node.gpus[0].memory");
  expect_error([&] { h.s.set_node_online(7, false, S(2), h.out); }, ErrorCode::kUnknownName, "node");
  EXPECT_EQ(h.s.inventory().nodes.size(), 1u);
  EXPECT_EQ(h.add(NodeSpec{"big", {U(8), U(1024)}, {}}, 2), 1);
  EXPECT_EQ(h.out, (Decisions{start(3).on(1).at(2), start(4).on(1).at(2)}));
  EXPECT_EQ(h.submit({action(6, {U(6), 0})}, 3), (Decisions{start(6).on(1).at(3)})) << "the shape fits the new node";
  EXPECT_EQ(h.complete({1, 2, 3, 4, 6}, 4), Decisions{});
  EXPECT_EQ(h.s.free(0, 0), U(2));
  EXPECT_EQ(h.s.free(1, 0), U(8));
  EXPECT_EQ(h.s.free(1, 1), U(1024));
}

// A GPU service resident on a node that goes offline: its waiting actions do not start
// beside it there; once its running action there has ended it is evicted and restored on
// an online node, where they run. A GPU node added to an inventory without GPUs gains the
// GPU dimension: gpu_memory actions placed there get a device on it.
TEST(NodeMembership, ServicesLeaveAnOfflineNodeAndGpuNodesCanJoin) {
  Inventory inv = cpu_inventory(2, 4);
  inv.nodes[0].gpus = {{U(10000)}};
  inv.nodes[1].gpus = {{U(10000)}};
  inv.services = {{"rm", U(6000), 1.0, 1}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec a = action(1, {U(1)});
  a.service = 0;
  // Two equally good GPUs: the first.
  EXPECT_EQ(h.submit({a}, 0), (Decisions{restore(0).on(0, 0).at(1)}));
  EXPECT_EQ(h.tick(1), (Decisions{start(1).on(0, 0).service(0).at(1)}));
  ActionSpec b = action(2, {U(1)});
  b.service = 0;
  EXPECT_EQ(h.submit({b}, 1.5), Decisions{});  // batch of one is full
  EXPECT_EQ(h.online(0, false, 2), Decisions{});  // still running there: not evicted
  EXPECT_EQ(h.s.service_location(0), std::make_pair(0, 0));
  EXPECT_EQ(h.s.explain(2), "waiting for service 'rm': its node is offline; it moves once its actions there have ended");
  EXPECT_EQ(h.complete({1}, 3), (Decisions{discard(0).on(0, 0).at(3), restore(0).on(1, 0).at(4)}))
      << "started beside a service on an offline node";
  EXPECT_EQ(h.tick(4), (Decisions{start(2).on(1, 0).service(0).at(4)}));
  h.complete({2}, 5);

  Harness g(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(g.submit({action(1, {U(1)})}, 0), (Decisions{start(1).on(0).at(0)}));
  EXPECT_EQ(g.add(NodeSpec{"gpu", {U(4)}, {{U(8000)}}}, 1), 1);
  EXPECT_EQ(g.out, Decisions{});
  ActionSpec d = action(2, {U(1)});
  d.gpu_memory = U(3000);
  EXPECT_EQ(g.submit({d}, 2), (Decisions{start(2).on(1, 0).at(2)}));
  EXPECT_EQ(g.s.gpu_free(1, 0), U(5000));
  g.complete({1, 2}, 3);
  EXPECT_EQ(g.s.gpu_free(1, 0), U(8000));
}

class NodeChurn : public ::testing::TestWithParam<PolicyKind> {};

// Random workloads while nodes go offline, come back and join, under every policy:
// capacity is never exceeded (check_invariants after every event: free + used == capacity,
// offline bins hidden from placement); no start decision ever names an offline node; every
// action ends exactly once; after everything ends with all nodes online, every pool is
// exactly full.
TEST_P(NodeChurn, NothingPlacedOfflineAndPoolsExactAfterReturn) {
  RandomRun run(GetParam(), 31);
  Harness& h = run.h;
  std::vector<std::uint8_t> online(4, 1);
  std::int32_t nodes = 4, toggles = 0, on_joined = 0;
  auto check_starts = [&] {
    for (const Decision& d : h.out)
      if (d.kind == DecisionKind::kStart) {
        ASSERT_TRUE(online[d.node]) << "start on offline node " << d.node;
        on_joined += d.node >= 4 ? 1 : 0;
      }
  };
  for (int i = 0; i < 400; ++i) {
    if (run.pick(8) == 0) {
      run.now += 1;
      if (nodes < 6 && run.pick(6) == 0) {
        NodeSpec spec{"joined" + std::to_string(nodes), {U(8), U(16384)}, {}};
        h.s.add_node(std::move(spec), S(run.now), h.out);
        h.s.check_invariants();
        online.push_back(1);
        ++nodes;
        run.inv.nodes.push_back(h.s.inventory().nodes.back());
      } else {
        std::int32_t n = static_cast<std::int32_t>(run.pick(static_cast<std::uint32_t>(nodes)));
        online[n] = !online[n];
        ++toggles;
        h.s.set_node_online(n, online[n], S(run.now), h.out);
        h.s.check_invariants();
      }
      run.ledger.apply(h.out);
      run.after();
    } else {
      run.step();
    }
    check_starts();
    if (HasFatalFailure()) return;
  }
  // The workload's reach (not decisions): nodes went and came back, joined, and got work.
  // Under kTrajectory equal empty slots tie and the first free one wins, so the 12
  // trajectories rarely reach the slots of joined nodes, the last ones.
  EXPECT_GE(toggles, 20);
  EXPECT_GT(nodes, 4) << "no node joined";
  if (GetParam() != PolicyKind::kTrajectory) {
    EXPECT_GT(on_joined, 0) << "joined nodes got no work";
  }
  for (std::int32_t n = 0; n < nodes; ++n) {
    if (online[n]) continue;
    h.s.set_node_online(n, true, S(run.now), h.out);
    h.s.check_invariants();
    online[n] = 1;
    run.ledger.apply(h.out);
    run.after();
  }
  run.drain();
  if (HasFatalFailure()) return;
  run.ledger.expect_each_ended_once(run.next_id - 1);
  for (std::int32_t n = 0; n < nodes; ++n)
    for (std::int32_t k = 0; k < 2; ++k) EXPECT_EQ(h.s.free(n, k), h.s.inventory().nodes[n].capacity[k]);
}

INSTANTIATE_TEST_SUITE_P(Policies, NodeChurn,
                         ::testing::Values(PolicyKind::kTangram, PolicyKind::kFifo, PolicyKind::kTrajectory,
                                           PolicyKind::kIsolated, PolicyKind::kOptimus),
                         policy_param_name);

}  // namespace
}  // namespace tangram_test
