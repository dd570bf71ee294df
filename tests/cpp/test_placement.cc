// Placement: best fit among the first `candidates` bins that fit (index order), the score
// summed over kinds, node affinity, and the best-fitting GPU on the chosen node.
#include <string>
#include <utility>
#include <vector>

#include "harness.h"

namespace tangram_test {
namespace {

Inventory nodes_of_cores(std::vector<std::int64_t> cores) {
  Inventory inv;
  inv.kinds = {"cpu"};
  for (std::size_t n = 0; n < cores.size(); ++n)
    inv.nodes.push_back(NodeSpec{"node" + std::to_string(n), {U(cores[n])}, {}});
  return inv;
}

// Best fit looks only at the first `candidates` bins that fit, in index order. Nodes of 8,
// 4 and 3 cores leave a 2-core action room scored 768, 512 and 341 (of 1024): the third
// wins among all three, the second among the first two, the first when it is the only one.
TEST(Placement, BestFitAmongTheFirstCandidates) {
  for (auto [candidates, node] : {std::pair{4, 2}, std::pair{3, 2}, std::pair{2, 1}, std::pair{1, 0}}) {
    SCOPED_TRACE("candidates " + std::to_string(candidates));
    PolicyConfig p = policy_of(PolicyKind::kFifo);
    p.candidates = candidates;
    Harness h(nodes_of_cores({8, 4, 3}), p);
    EXPECT_EQ(h.submit({action(1, {U(2)})}, 0), (Decisions{start(1).on(node).at(0)}));
  }
}

// The score adds the normalised room left over every kind, so the fuller node by cpu is
// not always the better fit: {2 cores, 100 MiB} leaves node 0 (4 cores, 1000 MiB) 512 +
// 921 and node 1 (8 cores, 200 MiB) 768 + 512: node 1, the tighter fit overall.
TEST(Placement, ScoreSumsTheRoomLeftOverEveryKind) {
  Inventory inv;
  inv.kinds = {"cpu", "memory"};
  inv.nodes = {NodeSpec{"small", {U(4), U(1000)}, {}}, NodeSpec{"wide", {U(8), U(200)}, {}}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h.submit({action(1, {U(2), U(100)})}, 0), (Decisions{start(1).on(1).at(0)}));
}

// Affinity confines an action to its node: it goes there even when another node fits
// better, and waits when its node is full although another has room.
TEST(Placement, AffinityConfinesToItsNode) {
  Harness h(nodes_of_cores({2, 8}), policy_of(PolicyKind::kTangram));
  ActionSpec pinned = action(1, {U(2)});
  pinned.affinity_node = 1;
  EXPECT_EQ(h.submit({pinned}, 0), (Decisions{start(1).on(1).at(0)}));  // node 0 would fit exactly
  ActionSpec big = action(2, {U(7)});
  big.affinity_node = 1;
  EXPECT_EQ(h.submit({big}, 1), Decisions{});
  EXPECT_EQ(h.s.explain(2), "waiting for resources: needs cpu=7 on node 1; most free on one bin it may use: cpu=6");
  EXPECT_EQ(h.complete({1}, 2), (Decisions{start(2).on(1).at(2)}));
}

// A plain GPU action takes the best-fitting GPU of the node placement chose: the one left
// with the least free memory after it.
TEST(Placement, BestFitGpuOnTheNode) {
  Inventory inv = cpu_inventory(1, 8);
  inv.nodes[0].gpus = {{U(8000)}, {U(4000)}, {U(3500)}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec a = action(1, {U(1)});
  a.gpu_memory = U(3000);
  EXPECT_EQ(h.submit({a}, 0), (Decisions{start(1).on(0, 2).at(0)}));  // 500 left, not 1000 or 5000
  ActionSpec b = action(2, {U(1)});
  b.gpu_memory = U(3600);
  EXPECT_EQ(h.submit({b}, 1), (Decisions{start(2).on(0, 1).at(1)}));  // 400 left on GPU 1; GPU 2 has 500 free
  EXPECT_EQ(h.s.gpu_free(0, 0), U(8000));
  EXPECT_EQ(h.s.gpu_free(0, 1), U(400));
  EXPECT_EQ(h.s.gpu_free(0, 2), U(500));
}

}  // namespace
}  // namespace tangram_test
