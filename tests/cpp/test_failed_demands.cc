// FailedDemands: the memo of demands that found nothing while a stamp held (the free tree's
// whole-tree searches, shrink_room_somewhere).
#include <gtest/gtest.h>

#include <vector>

#include "tangram/failed_demands.h"

namespace tangram {
namespace {

using Stamp = FailedDemands::Stamp;

// Invariant: it answers only for demands at least as large in every dimension as one noted
// under the same stamp (both words), keeps the last kRows notes, and forgets them all when
// the stamp moves on (room may have grown).
TEST(FailedDemands, AnswersForLargerDemandsUnderItsStamp) {
  FailedDemands memo;
  const std::vector<Quantity> small{2, 4}, large{3, 4}, other{1, 9};
  EXPECT_FALSE(memo.covers(small.data(), 2, Stamp{7, 0}));
  memo.note(small.data(), 2, Stamp{7, 0});
  EXPECT_TRUE(memo.covers(small.data(), 2, Stamp{7, 0}));
  EXPECT_TRUE(memo.covers(large.data(), 2, Stamp{7, 0}));
  EXPECT_FALSE(memo.covers(other.data(), 2, Stamp{7, 0}));  // smaller in the first dimension
  EXPECT_FALSE(memo.covers(large.data(), 2, Stamp{8, 0}));  // another first word
  EXPECT_FALSE(memo.covers(large.data(), 2, Stamp{7, 1}));  // another second word
  for (Quantity q = 10; q < 10 + FailedDemands::kRows; ++q) {
    const std::vector<Quantity> row{q, q};
    memo.note(row.data(), 2, Stamp{7, 0});
  }
  EXPECT_FALSE(memo.covers(small.data(), 2, Stamp{7, 0}));  // pushed out by the later notes
  EXPECT_TRUE(memo.covers(std::vector<Quantity>{10, 10}.data(), 2, Stamp{7, 0}));
  const std::vector<Quantity> later{5, 15};
  memo.note(later.data(), 2, Stamp{8, 0});
  EXPECT_FALSE(memo.covers(std::vector<Quantity>{10, 10}.data(), 2, Stamp{8, 0}));  // stamp 7's notes are gone
  EXPECT_TRUE(memo.covers(std::vector<Quantity>{5, 20}.data(), 2, Stamp{8, 0}));
}

}  // namespace
}  // namespace tangram
