// The waiting actions of one class in policy order: a 4-ary min-heap in one array. The
// head (what the class offers next) is O(1); inserting, taking the head and removing any
// action are O(log n), with no allocation per action (an ordered tree allocated a node for
// each, scattered over the heap). Four children per node halve the levels a sift walks
// against a binary heap, and siblings share cache lines: most of a sift's cost is misses.
// Every action's position is kept in `pos[key.slot]`, an array shared by all queues (slots
// are unique), so removal by slot needs no search.
//
// The queue is 48 bytes: a copy of the head plus a pointer and two 32-bit counts, so that
// the class holding it keeps its queue's head and its other hot fields in one cache line.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "tangram/types.h"

namespace tangram {

template <class Key>  // ordered by operator<, with an int32 `slot` unique per live action
class WaitQueue {
 public:
  using Positions = std::vector<std::int32_t>;

  bool empty() const { return size_ == 0; }
  std::size_t size() const { return size_; }
  // A copy kept beside the queue: whoever holds the queue reads its head without a trip
  // to the heap's storage. Valid while the queue is not empty.
  const Key& head() const { return head_; }

  void push(const Key& key, Positions& pos) {
    if (size_ == capacity_) grow();
    keys_[size_++] = key;
    sift_up(size_ - 1, pos);
    head_ = keys_[0];
  }
  void pop(Positions& pos) { erase_at(0, pos); }
  // Starts fetching what pop() reads first: the root's children and the last key.
  void prefetch_pop() const {
    const std::size_t n = std::min<std::size_t>(size_, kArity + 1);
    for (std::size_t i = 0; i < n; i += 2) tangram::prefetch(&keys_[i]);  // 2 keys a line
    if (size_ > 0) tangram::prefetch(&keys_[size_ - 1]);
  }
  void erase(std::int32_t slot, Positions& pos) { erase_at(static_cast<std::size_t>(pos[slot]), pos); }
  bool contains(const Key& key, const Positions& pos) const {
    const std::int32_t at = key.slot < static_cast<std::int32_t>(pos.size()) ? pos[key.slot] : -1;
    return at >= 0 && static_cast<std::size_t>(at) < size_ && keys_[at].slot == key.slot &&
           !(keys_[at] < key) && !(key < keys_[at]);
  }
  // The key at heap position i (i < size()): the root is the head, and the children of
  // position i lie at arity() * i + 1 on. For reading the first keys in order without a sort.
  const Key& at(std::size_t i) const { return keys_[i]; }
  static constexpr std::size_t arity() { return kArity; }
  // Every key, in heap order (not policy order).
  template <class Visit>
  void for_each(Visit&& visit) const {
    for (std::uint32_t i = 0; i < size_; ++i) visit(keys_[i]);
  }
  // Changes every key through `change(Key&)` (slots unchanged), then restores the heap: O(n).
  template <class Change>
  void rekey(Change&& change, Positions& pos) {
    for (std::uint32_t i = 0; i < size_; ++i) change(keys_[i]);
    for (std::size_t i = size_; i-- > 0;) sift_down(i, pos);
    if (size_ > 0) head_ = keys_[0];
  }
  // The keys in order (for explanations; O(n log n)).
  std::vector<Key> sorted() const {
    std::vector<Key> keys(keys_.get(), keys_.get() + size_);
    std::sort(keys.begin(), keys.end());
    return keys;
  }

 private:
  static constexpr std::size_t kArity = 4;

  void grow() {
    const std::size_t capacity = capacity_ == 0 ? 4 : 2 * static_cast<std::size_t>(capacity_);
    if (capacity > UINT32_MAX) throw std::length_error("a class holds over 2^32 waiting actions");
    std::unique_ptr<Key[]> keys(new Key[capacity]);
    std::copy(keys_.get(), keys_.get() + size_, keys.get());
    keys_ = std::move(keys);
    capacity_ = static_cast<std::uint32_t>(capacity);
  }
  void place(std::size_t i, const Key& key, Positions& pos) {
    keys_[i] = key;
    pos[key.slot] = static_cast<std::int32_t>(i);
  }
  void sift_up(std::size_t i, Positions& pos) {
    const Key key = keys_[i];
    while (i > 0) {
      const std::size_t parent = (i - 1) / kArity;
      if (!(key < keys_[parent])) break;
      place(i, keys_[parent], pos);
      i = parent;
    }
    place(i, key, pos);
  }
  void sift_down(std::size_t i, Positions& pos) {
    const Key key = keys_[i];
    const std::size_t n = size_;
    for (;;) {
      const std::size_t first = kArity * i + 1;
      if (first >= n) break;
      std::size_t child = first;
      const std::size_t last = std::min(first + kArity, n);
      for (std::size_t c = first + 1; c < last; ++c)
        if (keys_[c] < keys_[child]) child = c;
      if (!(keys_[child] < key)) break;
      place(i, keys_[child], pos);
      i = child;
    }
    place(i, key, pos);
  }
  void erase_at(std::size_t i, Positions& pos) {
    pos[(i == 0 ? head_ : keys_[i]).slot] = -1;
    const Key last = keys_[--size_];
    if (i < size_) {
      keys_[i] = last;
      // The moved key may belong above or below its new place.
      if (i > 0 && last < keys_[(i - 1) / kArity]) sift_up(i, pos);
      else sift_down(i, pos);
    }
    if (size_ > 0) head_ = keys_[0];
  }

  Key head_{};
  std::unique_ptr<Key[]> keys_;
  std::uint32_t size_ = 0;
  std::uint32_t capacity_ = 0;
};

}  // namespace tangram
