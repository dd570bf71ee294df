// The last few demands that found nothing while a stamp held, for a search that may skip
// itself. While the stamp holds room only shrinks, so a demand at least as large in every
// dimension finds nothing either. Two users: a partition's whole-tree searches of the free
// tree (stamp: Bins::search_epoch) and shrink_room_somewhere (stamp: the pass and
// Elastic::shrink_room_version).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tangram/model.h"

namespace tangram {

struct FailedDemands {
  static constexpr std::int32_t kRows = 4;  // the last kRows failures are kept
  struct Stamp {
    std::uint64_t a = UINT64_MAX, b = UINT64_MAX;
    bool operator==(const Stamp& o) const { return a == o.a && b == o.b; }
  };
  Stamp stamp;
  std::int32_t count = 0, next = 0;
  std::vector<Quantity> rows;  // kRows rows of `dims`

  // Whether `demand` (dims amounts) is at least a failure noted under `now`.
  bool covers(const Quantity* demand, std::int32_t dims, Stamp now) const {
    if (!(stamp == now)) return false;
    for (std::int32_t m = 0; m < count; ++m) {
      const Quantity* failed = &rows[static_cast<std::size_t>(m) * dims];
      // All dimensions compared, without a branch each: which one fails first is a coin toss
      // for the branch predictor, and the rows are a few words long.
      bool at_least = true;
      for (std::int32_t d = 0; d < dims; ++d) at_least &= demand[d] >= failed[d];
      if (at_least) return true;
    }
    return false;
  }
  // `demand` found nothing under `now`; failures under an older stamp are forgotten.
  void note(const Quantity* demand, std::int32_t dims, Stamp now) {
    if (!(stamp == now)) {
      stamp = now;
      count = next = 0;
      rows.resize(static_cast<std::size_t>(kRows) * dims);
    }
    const std::int32_t row = count < kRows ? count++ : next;
    next = (row + 1) % kRows;
    std::copy(demand, demand + dims, &rows[static_cast<std::size_t>(row) * dims]);
  }
};

}  // namespace tangram
