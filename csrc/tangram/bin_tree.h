// A segment tree over bins that answers "the first bins, in index order, whose free
// vector covers a demand" in about O(log n) per hit, pruning any subtree whose per-kind
// maximum falls short. A leaf value of -1 marks a bin as never matching.
#pragma once

#include <cstdint>
#include <vector>

#include "tangram/types.h"

namespace tangram {

class BinTree {
 public:
  BinTree() = default;
  BinTree(std::int32_t leaves, std::int32_t dims);

  std::int32_t leaves() const { return leaves_; }
  std::int32_t dims() const { return dims_; }
  const Quantity* leaf(std::int32_t i) const { return &max_[static_cast<std::size_t>(size_ + i) * dims_]; }
  // Sets leaf i to `values` (dims() entries) and refreshes its ancestors.
  void set(std::int32_t i, const Quantity* values);
  // Appends to `out` up to `limit` leaves in [lo, hi) that cover `demand`, in index order,
  // skipping leaves for which skip(leaf) is true.
  template <class Skip>
  void find(std::int32_t lo, std::int32_t hi, const Quantity* demand, std::int32_t limit,
            Skip&& skip, std::vector<std::int32_t>& out) const {
    if (lo >= hi || limit <= 0) return;
    std::size_t start = out.size();
    find_rec(1, 0, size_, lo, hi, demand, start + limit, skip, out);
  }

 private:
  bool covers(std::int32_t node, const Quantity* demand) const {
    const Quantity* v = &max_[static_cast<std::size_t>(node) * dims_];
    for (std::int32_t d = 0; d < dims_; ++d)
      if (v[d] < demand[d]) return false;
    return true;
  }
  template <class Skip>
  void find_rec(std::int32_t node, std::int32_t nlo, std::int32_t nhi, std::int32_t lo,
                std::int32_t hi, const Quantity* demand, std::size_t stop, Skip& skip,
                std::vector<std::int32_t>& out) const {
    if (out.size() >= stop || nhi <= lo || hi <= nlo || !covers(node, demand)) return;
    if (nhi - nlo == 1) {
      if (!skip(nlo)) out.push_back(nlo);
      return;
    }
    std::int32_t mid = nlo + (nhi - nlo) / 2;
    find_rec(2 * node, nlo, mid, lo, hi, demand, stop, skip, out);
    find_rec(2 * node + 1, mid, nhi, lo, hi, demand, stop, skip, out);
  }

  std::int32_t leaves_ = 0;
  std::int32_t dims_ = 0;
  std::int32_t size_ = 1;
  std::vector<Quantity> max_;  // (2 * size_) x dims_, node 1 is the root
};

}  // namespace tangram
