// A hash map from 64-bit ids to int32 values for the scheduler's indexes (action id -> slot,
// trajectory -> live actions, class key hash -> class). Every submit inserts and every
// completion erases, so a node-based map spends more on its allocator than on hashing; this one is a
// flat table: linear probing, at most half full, erase by backward shift (no tombstones).
// Pointers from find/insert stay valid until the next insert or erase.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "tangram/types.h"

namespace tangram {

class IdMap {
 public:
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  std::int32_t* find(std::uint64_t key) { return const_cast<std::int32_t*>(std::as_const(*this).find(key)); }
  const std::int32_t* find(std::uint64_t key) const {
    if (size_ == 0) return nullptr;
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      const Entry& e = table_[i];
      if (!e.used) return nullptr;
      if (e.key == key) return &e.value;
    }
  }
  bool contains(std::uint64_t key) const { return find(key) != nullptr; }
  // Starts fetching the cache line where a probe for key begins (batches of random ids
  // overlap their misses this way instead of taking them one after another).
  void prefetch(std::uint64_t key) const {
    if (!table_.empty()) tangram::prefetch(&table_[home(key)]);
  }

  // Inserts (key, value) unless key is present; returns the entry's value and whether it
  // was inserted.
  std::pair<std::int32_t*, bool> insert(std::uint64_t key, std::int32_t value) {
    if (2 * (size_ + 1) > table_.size()) grow();
    std::size_t i = home(key);
    for (; table_[i].used; i = (i + 1) & mask_)
      if (table_[i].key == key) return {&table_[i].value, false};
    table_[i] = Entry{key, value, true};
    ++size_;
    return {&table_[i].value, true};
  }

  // Removes key if present; returns whether it was.
  bool erase(std::uint64_t key) {
    if (size_ == 0) return false;
    std::size_t hole = home(key);
    for (;; hole = (hole + 1) & mask_) {
      if (!table_[hole].used) return false;
      if (table_[hole].key == key) break;
    }
    // Backward shift: move up every later entry of the run whose home does not lie
    // cyclically in (hole, j], so each stays reachable from its home.
    for (std::size_t j = (hole + 1) & mask_; table_[j].used; j = (j + 1) & mask_) {
      const std::size_t h = home(table_[j].key);
      const bool stays = hole < j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (stays) continue;
      table_[hole] = table_[j];
      hole = j;
    }
    table_[hole].used = false;
    --size_;
    return true;
  }

  // Makes room for n entries in all, so that the inserts up to there do not rehash.
  void reserve(std::size_t n) {
    std::size_t size = table_.empty() ? 16 : table_.size();
    while (2 * n > size) size *= 2;
    if (size > table_.size()) rehash(size);
  }

  template <class F>
  void for_each(F&& f) const {
    for (const Entry& e : table_)
      if (e.used) f(e.key, e.value);
  }

 private:
  struct Entry {
    std::uint64_t key = 0;
    std::int32_t value = 0;
    bool used = false;
  };

  std::size_t home(std::uint64_t key) const {
    // The murmur3 finaliser: sequential ids spread over the whole table.
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return static_cast<std::size_t>(key) & mask_;
  }

  void grow() { rehash(table_.empty() ? 16 : 2 * table_.size()); }
  void rehash(std::size_t size) {  // size: a power of two
    std::vector<Entry> old(size);
    old.swap(table_);
    mask_ = table_.size() - 1;
    size_ = 0;
    for (const Entry& e : old)
      if (e.used) insert(e.key, e.value);
  }

  std::vector<Entry> table_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

}  // namespace tangram
