// IdMap: the flat hash map behind the scheduler's per-action indexes.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <unordered_map>

#include "tangram/id_map.h"

namespace tangram {
namespace {

// Invariant: after any sequence of inserts and erases, the map holds exactly the pairs a
// std::unordered_map given the same operations holds (backward-shift erase keeps every key
// reachable, including across the table's wrap-around and its growth).
TEST(IdMap, MatchesUnorderedMapUnderRandomOperations) {
  std::mt19937_64 rng(7);
  IdMap map;
  std::unordered_map<std::uint64_t, std::int32_t> want;
  for (int step = 0; step < 200000; ++step) {
    // A small key space forces long probe runs, repeats and erases of present keys.
    const std::uint64_t key = rng() % 512 + (rng() % 4 == 0 ? (std::uint64_t{1} << 63) : 0);
    const int op = static_cast<int>(rng() % 3);
    if (op == 0) {
      const auto value = static_cast<std::int32_t>(step);
      auto [ref, inserted] = map.insert(key, value);
      auto [it, want_inserted] = want.emplace(key, value);
      ASSERT_EQ(inserted, want_inserted);
      ASSERT_EQ(*ref, it->second);
    } else if (op == 1) {
      ASSERT_EQ(map.erase(key), want.erase(key) == 1);
    } else {
      const std::int32_t* got = map.find(key);
      auto it = want.find(key);
      ASSERT_EQ(got != nullptr, it != want.end());
      if (got != nullptr) {
        ASSERT_EQ(*got, it->second);
      }
    }
    ASSERT_EQ(map.size(), want.size());
  }
  std::size_t seen = 0;
  map.for_each([&](std::uint64_t key, std::int32_t value) {
    ++seen;
    ASSERT_EQ(want.at(key), value);
  });
  EXPECT_EQ(seen, want.size());
}

// Invariant: a value changed through find's pointer is what later lookups see.
TEST(IdMap, UpdatesThroughFind) {
  IdMap map;
  for (std::uint64_t k = 0; k < 1000; ++k) map.insert(k * 7919, -2);
  for (std::uint64_t k = 0; k < 1000; ++k) *map.find(k * 7919) = static_cast<std::int32_t>(k);
  for (std::uint64_t k = 0; k < 1000; ++k) EXPECT_EQ(*map.find(k * 7919), static_cast<std::int32_t>(k));
  EXPECT_EQ(map.find(1), nullptr);
  EXPECT_FALSE(map.erase(1));
}

}  // namespace
}  // namespace tangram
