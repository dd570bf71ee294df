// The waiting actions of one class in policy order: a 4-ary min-heap in one vector. The
// head (what the class offers next) is O(1); inserting, taking the head and removing any
// action are O(log n), with no allocation per action (an ordered tree allocated a node for
// each, scattered over the heap). Four children per node halve the levels a sift walks
// against a binary heap, and siblings share cache lines: most of a sift's cost is misses. Every action's position is kept in `pos[key.slot]`, an
// array shared by all queues (slots are unique), so removal by slot needs no search.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tangram/types.h"

namespace tangram {

template <class Key>  // ordered by operator<, with an int32 `slot` unique per live action
class WaitQueue {
 public:
  using Positions = std::vector<std::int32_t>;

  bool empty() const { return heap_.empty(); }
  std::size_t size() const { return heap_.size(); }
  // A copy kept beside the queue: whoever holds the queue reads its head without a trip
  // to the heap's storage. Valid while the queue is not empty.
  const Key& head() const { return head_; }

  void push(const Key& key, Positions& pos) {
    heap_.push_back(key);
    sift_up(heap_.size() - 1, pos);
    head_ = heap_.front();
  }
  void pop(Positions& pos) { erase_at(0, pos); }
  // Starts fetching what pop() reads first: the root's children and the last key.
  void prefetch_pop() const {
    const std::size_t n = std::min(heap_.size(), kArity + 1);
    for (std::size_t i = 0; i < n; i += 2) tangram::prefetch(heap_.data() + i);  // 2 keys a line
    if (!heap_.empty()) tangram::prefetch(&heap_.back());
  }
  void erase(std::int32_t slot, Positions& pos) { erase_at(static_cast<std::size_t>(pos[slot]), pos); }
  bool contains(const Key& key, const Positions& pos) const {
    const std::int32_t at = key.slot < static_cast<std::int32_t>(pos.size()) ? pos[key.slot] : -1;
    return at >= 0 && static_cast<std::size_t>(at) < heap_.size() && heap_[at].slot == key.slot &&
           !(heap_[at] < key) && !(key < heap_[at]);
  }
  // The keys in order (for explanations; O(n log n)).
  std::vector<Key> sorted() const {
    std::vector<Key> keys(heap_);
    std::sort(keys.begin(), keys.end());
    return keys;
  }

 private:
  void place(std::size_t i, const Key& key, Positions& pos) {
    heap_[i] = key;
    pos[key.slot] = static_cast<std::int32_t>(i);
  }
  static constexpr std::size_t kArity = 4;

  void sift_up(std::size_t i, Positions& pos) {
    const Key key = heap_[i];
    while (i > 0) {
      const std::size_t parent = (i - 1) / kArity;
      if (!(key < heap_[parent])) break;
      place(i, heap_[parent], pos);
      i = parent;
    }
    place(i, key, pos);
  }
  void sift_down(std::size_t i, Positions& pos) {
    const Key key = heap_[i];
    const std::size_t n = heap_.size();
    for (;;) {
      const std::size_t first = kArity * i + 1;
      if (first >= n) break;
      std::size_t child = first;
      const std::size_t last = std::min(first + kArity, n);
      for (std::size_t c = first + 1; c < last; ++c)
        if (heap_[c] < heap_[child]) child = c;
      if (!(heap_[child] < key)) break;
      place(i, heap_[child], pos);
      i = child;
    }
    place(i, key, pos);
  }
  void erase_at(std::size_t i, Positions& pos) {
    pos[(i == 0 ? head_ : heap_[i]).slot] = -1;
    const Key last = heap_.back();
    heap_.pop_back();
    if (i < heap_.size()) {
      heap_[i] = last;
      // The moved key may belong above or below its new place.
      if (i > 0 && last < heap_[(i - 1) / kArity]) sift_up(i, pos);
      else sift_down(i, pos);
    }
    if (!heap_.empty()) head_ = heap_.front();
  }

  Key head_{};
  std::vector<Key> heap_;
};

}  // namespace tangram
