// A segment tree over bins that answers "the first bins, in index order, whose free
// vector covers a demand" in about O(log n) per hit, pruning any subtree whose per-kind
// maximum falls short. A leaf value of -1 marks a bin as never matching.
//
// Leaves are written at once; the maxima above them are brought up to date only when a
// search needs them (settle), for all leaves written since in one sweep. Most starts and
// completions touch a few bins and no search follows before many more do: each ancestor
// is then recomputed once per sweep rather than once per write. A search is const but
// sweeps: a tree shared between threads must be settled before they search it.
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
  // Sets leaf i to `values` (dims() entries); its ancestors follow at the next settle().
  void set(std::int32_t i, const Quantity* values);
  // Brings every maximum above the leaves written since the last sweep up to date.
  void settle() const {
    if (!dirty_.empty()) sweep();
  }
  // Appends to `out` up to `limit` leaves in [lo, hi) that cover `demand`, in index order,
  // skipping leaves for which skip(leaf) is true.
  template <class Skip>
  void find(std::int32_t lo, std::int32_t hi, const Quantity* demand, std::int32_t limit,
            Skip&& skip, std::vector<std::int32_t>& out) const {
    if (lo >= hi || limit <= 0) return;
    const std::size_t stop = out.size() + static_cast<std::size_t>(limit);
    if (hi - lo <= kScanLeaves) {
      // A short range (one node's bins): its leaves directly, in the same order and with the
      // same answer as the descent from the root, without the descent.
      for (std::int32_t leaf = lo; leaf < hi; ++leaf)
        if (covers(size_ + leaf, demand) && !skip(leaf)) {
          out.push_back(leaf);
          if (out.size() >= stop) return;
        }
      return;
    }
    settle();
    // Depth-first, left child first: the walk goes down the left child at once, and the
    // right one waits on an explicit stack (at most one pending right sibling per level).
    struct Span {
      std::int32_t node, nlo, nhi;
    };
    Span stack[2 * kMaxDepth];
    std::int32_t top = 0;
    stack[top++] = Span{1, 0, size_};
    while (top > 0) {
      Span s = stack[--top];
      while (s.nlo < hi && lo < s.nhi && covers(s.node, demand)) {
        if (s.nhi - s.nlo == 1) {
          if (!skip(s.nlo)) {
            out.push_back(s.nlo);
            if (out.size() >= stop) return;
          }
          break;
        }
        const std::int32_t mid = s.nlo + (s.nhi - s.nlo) / 2;
        stack[top++] = Span{2 * s.node + 1, mid, s.nhi};
        s = Span{2 * s.node, s.nlo, mid};
      }
    }
  }

 private:
  static constexpr std::int32_t kMaxDepth = 32;  // leaves < 2^31
  static constexpr std::int32_t kScanLeaves = 8;  // ranges this short are scanned, not searched
  bool covers(std::int32_t node, const Quantity* demand) const {
    const Quantity* v = &max_[static_cast<std::size_t>(node) * dims_];
    for (std::int32_t d = 0; d < dims_; ++d)
      if (v[d] < demand[d]) return false;
    return true;
  }

  void sweep() const;

  std::int32_t leaves_ = 0;
  std::int32_t dims_ = 0;
  std::int32_t size_ = 1;
  // (2 * size_) x dims_, node 1 is the root. The maxima above the leaves are a cache the
  // const searches bring up to date, hence mutable.
  mutable std::vector<Quantity> max_;
  mutable std::vector<std::int32_t> dirty_;  // nodes written since the last sweep
  mutable std::vector<std::uint8_t> is_dirty_;  // per node: listed in dirty_
};

}  // namespace tangram
