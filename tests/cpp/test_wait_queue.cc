// WaitQueue: the per-class queue of waiting actions in policy order.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "tangram/wait_queue.h"

namespace tangram {
namespace {

struct Key {
  std::int64_t order;
  std::int32_t slot;
  bool operator<(const Key& o) const { return order != o.order ? order < o.order : slot < o.slot; }
};

// Invariant: under any mix of inserts, head removals and removals by slot, the head is the
// smallest key an ordered set given the same operations holds, every live slot's position
// points at its key, and the sorted view equals the set.
TEST(WaitQueue, MatchesAnOrderedSetUnderRandomOperations) {
  std::mt19937_64 rng(11);
  WaitQueue<Key> queue;
  std::vector<std::int32_t> pos(4096, -1);
  std::set<Key> want;
  std::vector<std::int32_t> free_slots;
  for (std::int32_t s = 4095; s >= 0; --s) free_slots.push_back(s);
  for (int step = 0; step < 100000; ++step) {
    const int op = static_cast<int>(rng() % 4);
    if ((op <= 1 || want.empty()) && !free_slots.empty()) {
      const Key key{static_cast<std::int64_t>(rng() % 64), free_slots.back()};  // many equal orders
      free_slots.pop_back();
      queue.push(key, pos);
      want.insert(key);
    } else if (op == 2 && !want.empty()) {
      ASSERT_EQ(queue.head().slot, want.begin()->slot);
      free_slots.push_back(want.begin()->slot);
      want.erase(want.begin());
      queue.pop(pos);
    } else if (!want.empty()) {
      auto it = want.begin();
      std::advance(it, static_cast<long>(rng() % want.size()));
      free_slots.push_back(it->slot);
      queue.erase(it->slot, pos);
      ASSERT_EQ(pos[it->slot], -1);
      want.erase(it);
    }
    ASSERT_EQ(queue.size(), want.size());
    if (!want.empty()) {
      ASSERT_EQ(queue.head().slot, want.begin()->slot);
    }
  }
  for (const Key& k : want) EXPECT_TRUE(queue.contains(k, pos));
  const std::vector<Key> sorted = queue.sorted();
  ASSERT_EQ(sorted.size(), want.size());
  std::size_t i = 0;
  for (const Key& k : want) EXPECT_EQ(sorted[i++].slot, k.slot);
}

}  // namespace
}  // namespace tangram
