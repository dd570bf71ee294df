#include "tangram/bin_tree.h"

#include <algorithm>

namespace tangram {

BinTree::BinTree(std::int32_t leaves, std::int32_t dims) : leaves_(leaves), dims_(dims) {
  while (size_ < leaves) size_ *= 2;
  max_.assign(static_cast<std::size_t>(2 * size_) * dims_, -1);
  is_dirty_.assign(static_cast<std::size_t>(2 * size_), 0);
}

void BinTree::set(std::int32_t i, const Quantity* values) {
  const std::int32_t node = size_ + i;
  std::copy(values, values + dims_, &max_[static_cast<std::size_t>(node) * dims_]);
  if (!is_dirty_[node]) {
    is_dirty_[node] = 1;
    dirty_.push_back(node);
  }
}

void BinTree::sweep() const {
  // Level by level, bottom up: the parents of this level's changed nodes are recomputed
  // once each; a parent whose maxima did not change takes its ancestors out of the sweep
  // (unless another changed child brings them back).
  std::vector<std::int32_t>& level = dirty_;
  std::sort(level.begin(), level.end());
  for (std::int32_t node : level) is_dirty_[node] = 0;
  while (!level.empty() && level.front() > 1) {
    std::size_t kept = 0;
    std::int32_t last_parent = 0;
    for (std::int32_t child : level) {
      const std::int32_t node = child / 2;
      if (node == last_parent) continue;  // siblings: one recomputation
      last_parent = node;
      Quantity* v = &max_[static_cast<std::size_t>(node) * dims_];
      const Quantity* l = &max_[static_cast<std::size_t>(2 * node) * dims_];
      const Quantity* r = &max_[static_cast<std::size_t>(2 * node + 1) * dims_];
      bool changed = false;
      for (std::int32_t d = 0; d < dims_; ++d) {
        const Quantity m = std::max(l[d], r[d]);
        changed |= m != v[d];
        v[d] = m;
      }
      if (changed) level[kept++] = node;  // parents of a sorted level come out sorted
    }
    level.resize(kept);
  }
  level.clear();
}

}  // namespace tangram
