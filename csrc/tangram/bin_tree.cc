#include "tangram/bin_tree.h"

#include <algorithm>

namespace tangram {

BinTree::BinTree(std::int32_t leaves, std::int32_t dims) : leaves_(leaves), dims_(dims) {
  while (size_ < leaves) size_ *= 2;
  max_.assign(static_cast<std::size_t>(2 * size_) * dims_, -1);
}

void BinTree::set(std::int32_t i, const Quantity* values) {
  std::int32_t node = size_ + i;
  std::copy(values, values + dims_, &max_[static_cast<std::size_t>(node) * dims_]);
  for (node /= 2; node >= 1; node /= 2) {
    Quantity* v = &max_[static_cast<std::size_t>(node) * dims_];
    const Quantity* l = &max_[static_cast<std::size_t>(2 * node) * dims_];
    const Quantity* r = &max_[static_cast<std::size_t>(2 * node + 1) * dims_];
    bool changed = false;
    for (std::int32_t d = 0; d < dims_; ++d) {
      Quantity m = std::max(l[d], r[d]);
      changed |= m != v[d];
      v[d] = m;
    }
    if (!changed) return;  // the maxima above depend only on this node's: unchanged too
  }
}

}  // namespace tangram
