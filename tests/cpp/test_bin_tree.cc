// BinTree: "the first leaves, in index order, whose vector covers a demand".
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "tangram/bin_tree.h"

namespace tangram {
namespace {

// The answer by brute force: the first `limit` leaves in [lo, hi) covering `demand`.
std::vector<std::int32_t> first_covering(const std::vector<std::vector<Quantity>>& leaves, std::int32_t lo,
                                         std::int32_t hi, const std::vector<Quantity>& demand, std::int32_t limit) {
  std::vector<std::int32_t> out;
  for (std::int32_t i = lo; i < hi && static_cast<std::int32_t>(out.size()) < limit; ++i) {
    bool covers = true;
    for (std::size_t d = 0; d < demand.size(); ++d) covers = covers && leaves[i][d] >= demand[d];
    if (covers) out.push_back(i);
  }
  return out;
}

// Invariant: whatever mix of leaf writes (growing, shrinking, hiding with -1) and searches
// (whole tree, long and short ranges), every search returns what a scan of the leaves
// returns: the ancestors, brought up to date lazily, never prune a leaf that covers.
TEST(BinTree, SearchesMatchABruteForceScanUnderRandomWrites) {
  for (std::int32_t n : {1, 5, 64, 300}) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(n));
    const std::int32_t dims = 3;
    BinTree tree(n, dims);
    std::vector<std::vector<Quantity>> leaves(n, std::vector<Quantity>(dims, -1));
    auto random_vector = [&] {
      std::vector<Quantity> v(dims);
      for (Quantity& q : v) q = static_cast<Quantity>(rng() % 9) - 1;  // -1 (hidden) .. 7
      return v;
    };
    for (int step = 0; step < 20000; ++step) {
      if (rng() % 3 != 0) {
        const std::int32_t i = static_cast<std::int32_t>(rng() % n);
        leaves[i] = random_vector();
        tree.set(i, leaves[i].data());
        EXPECT_EQ(std::vector<Quantity>(tree.leaf(i), tree.leaf(i) + dims), leaves[i]);
        continue;
      }
      std::int32_t lo = static_cast<std::int32_t>(rng() % n), hi = static_cast<std::int32_t>(rng() % (n + 1));
      if (rng() % 2 == 0) lo = 0, hi = n;
      if (lo > hi) std::swap(lo, hi);
      std::vector<Quantity> demand = random_vector();
      for (Quantity& q : demand) q = std::max<Quantity>(q, 0);
      const std::int32_t limit = 1 + static_cast<std::int32_t>(rng() % 4);
      std::vector<std::int32_t> got;
      tree.find(lo, hi, demand.data(), limit, [](std::int32_t) { return false; }, got);
      ASSERT_EQ(got, first_covering(leaves, lo, hi, demand, limit)) << "n=" << n << " step " << step;
    }
  }
}

// Skipped leaves are passed over and the search goes on to the next covering ones.
TEST(BinTree, SkippedLeavesAreLeftOut) {
  BinTree tree(16, 1);
  for (std::int32_t i = 0; i < 16; ++i) {
    const Quantity v = 4;
    tree.set(i, &v);
  }
  const Quantity demand = 2;
  std::vector<std::int32_t> got;
  tree.find(0, 16, &demand, 3, [](std::int32_t leaf) { return leaf % 2 == 0; }, got);
  EXPECT_EQ(got, (std::vector<std::int32_t>{1, 3, 5}));
}

}  // namespace
}  // namespace tangram
