// Classes and parking: waiting actions grouped by identical admission constraints, the
// heap of the heads that may start, and the classes parked off it. A part of
// Scheduler::Impl (scheduler_impl.h); the out-of-line methods are in actions.cc (making
// and freeing classes) and parking.cc.
//
// Owns: the classes (their keys, waiting queues, and what the last pass found of them),
// their demand rows, the index by key, each trajectory's classes (trajectory slots), the
// free class ids; the active heap; the parked lists per node and per partition and the
// starvation deadlines of parked classes.
// Guarantees (check(), in introspection.cc):
//   - a class with waiting actions is either active (in_active, exactly one live heap
//     entry, whose key is its head's) or parked, never both; an empty class is neither;
//     active_count counts the active ones;
//   - a parked class is listed where it parks (its node's list, or its partition's, with
//     its head), and node_parked_count / PartitionParking::count count them; lists may
//     hold stale entries, which whoever walks them drops;
//   - every parked class has a live deadline entry at its head's starvation time;
//   - a class in use is found by its key through index (chains of equal hashes); a freed
//     one is in free_classes only, and its id and demand row are reused by the next class
//     made; heap and deadline entries left for a freed id stay stale (generations go on);
//   - a class in use has waiting or running actions, or is a trajectory's (freed when the
//     trajectory ends): the others are freed as their last action ends or is rejected, so a
//     long run holds classes for its live actions, not for every key it has seen.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tangram/actions.h"
#include "tangram/id_map.h"
#include "tangram/model.h"
#include "tangram/wait_queue.h"

namespace tangram {

// Why a class could not start its head in the last pass that looked at it.
enum class Block : std::uint8_t {
  kNotConsidered,
  kResources,
  kHeldBack,  // an older starving action holds the bins
  kQuotaRate,
  kQuotaConcurrency,
  kQuotaTokens,
  kServiceRestoring,
  kServiceNoRoom,
  kServiceOffline,  // resident on a node taken offline: moves once its actions there end
  kServiceBatchFull,
  kServiceDraining,  // resident, but drained for a starving service (restore())
};

// A class with its head's order fields (24 bytes, cheap to sort and merge): the entries of
// the partition-parked lists and of a pass's pending wakes.
struct ClassHead {
  ClassHead() = default;
  ClassHead(const OrderKey& head, std::int32_t c)
      : key(head.key), seq(head.seq), neg_priority(head.neg_priority), cls(c) {}
  std::int64_t key = 0;
  std::uint64_t seq = 0;
  std::int32_t neg_priority = 0;
  std::int32_t cls = kNone;
  bool operator<(const ClassHead& o) const { return policy_before(*this, o); }
};

// Class::fit_from of a lazy wake whose first fitting leaf at the flush is not known yet.
inline constexpr std::int32_t kUnsettledFit = -1;

struct alignas(64) Class {
  // Laid out by use. The first cache line holds what a flush, a pass and a completion look
  // at for every class they meet; the second its queue (head inline), affinity and GPU
  // memory (what a try reads besides); the class key's other fields and the rest follow.
  bool parked = false;
  bool in_active = false;
  // Trajectory slots, non-service actions: the class runs in its trajectory's own slot. Service
  // actions run beside their service: in their own trajectory's slot when it is on that
  // node, else in a free slot there, else in another held one (held_slot_room); they bind
  // nothing.
  bool in_trajectory_slot = false;
  Block block = Block::kNotConsidered;
  std::int32_t park_node = kNone;  // while parked: the node it waits on, or kNone (partition)
  std::uint64_t seen_flush = 0;    // release epoch of the last flush that listed it
  std::uint64_t pending_pass = 0;  // a pending wake of this pass (partition-wide or node)
  // A pending wake of pass `fit_pass` (flush_releases): it fitted nowhere when parked and
  // only released bins have grown since, so in that pass its only possible bins are the
  // partition's released leaves from position `fit_from` on (the first it fitted). Free
  // room only shrinks within a pass, so placement needs to look at nothing else. A lazy
  // wake's fit_from is kUnsettledFit until its turn or settle_fit (parking.cc), only while
  // it is parked.
  std::uint64_t fit_pass = 0;
  std::int32_t fit_from = 0;
  std::int32_t partition = 0;
  const Quantity* demand = nullptr;  // K kinds: a row of Classes::demand_rows, never moved
  std::int32_t quota = kNone;
  std::int32_t service = kNone;
  std::uint64_t active_gen = 0;  // counts activations; older heap entries are stale

  WaitQueue<OrderKey> waiting;  // its waiting actions, head first
  std::int32_t affinity_node = kNone;
  std::int32_t running = 0;  // its running actions (a start and an end count it beside `waiting`)
  Quantity gpu_memory = 0;

  // the rest of the class key (with demand, partition, affinity, service, quota, gpu memory)
  std::int64_t tokens = 0;
  TrajectoryId trajectory = 0;
  // state
  // A search hint for its placements across all bins (try_head): while `tree_epoch` is
  // Bins::search_epoch, no leaf before `tree_from` holds its demand (free room only
  // shrinks until the epoch moves on: at each pass, and when an eviction frees GPU memory).
  std::uint64_t tree_epoch = 0;
  std::int32_t tree_from = 0;
  TimeNs park_deadline = 0;  // when its head starts starving
  // The deadline of its latest entry in Classes::park_deadlines not yet popped (kNoDeadline:
  // none): parked again with that deadline, it needs no new entry.
  TimeNs deadline_listed = kNoDeadline;
  TimeNs block_until = 0;
  std::int32_t next_same_hash = kNone;
  std::string infeasible;  // why no action of this class can ever run; empty if one can
  std::uint64_t key_hash = 0;  // its entry in Classes::index
};
static_assert(offsetof(Class, waiting) == 64 && offsetof(Class, running) < 128 && offsetof(Class, tokens) == 128,
              "a class's hot fields fill its first two cache lines");


// Classes parked on any bin of a partition, with their heads: `parked` in policy order as
// of the last flush, `parked_new` added since (unsorted). A flush sorts the few new ones
// and merges, instead of sorting them all. Entries of classes since unparked, parked
// elsewhere or with another head are stale and dropped at the next flush.
struct PartitionParking {
  std::vector<ClassHead> parked, parked_new;
  std::int64_t count = 0;  // classes parked here now
};

// The class an entry of a parked list names.
inline std::int32_t class_of(std::int32_t c) { return c; }
inline std::int32_t class_of(const ClassHead& entry) { return entry.cls; }

struct Classes {
  std::int32_t K = 0;  // kinds: the length of a demand row
  std::vector<Class> all;  // by class id
  Class& operator[](std::int32_t c) { return all[c]; }
  const Class& operator[](std::int32_t c) const { return all[c]; }
  std::size_t size() const { return all.size(); }
  std::vector<Class>::const_iterator begin() const { return all.begin(); }
  std::vector<Class>::const_iterator end() const { return all.end(); }
  std::vector<Class>::iterator begin() { return all.begin(); }
  std::vector<Class>::iterator end() { return all.end(); }
  std::size_t in_use() const { return all.size() - free_classes.size(); }

  // Class demand vectors, K per row, in chunks that never move (Class::demand points
  // here): classes made one after another lie side by side, unlike one vector each.
  static constexpr std::size_t kDemandRowsPerChunk = 256;
  std::vector<std::unique_ptr<Quantity[]>> demand_rows;
  std::size_t demand_rows_used = kDemandRowsPerChunk;  // in the last chunk
  // Classes by hash of their constraints; equal hashes chain through Class::next_same_hash.
  IdMap index;
  // With trajectory slots a class is keyed by its trajectory: an ended trajectory's classes (all empty)
  // are freed and their slots reused, so a long run does not grow by one class per
  // trajectory. Other classes are freed as soon as no action of theirs waits or runs
  // (free_if_unused).
  std::unordered_map<TrajectoryId, std::vector<std::int32_t>> trajectory_classes;
  std::vector<std::int32_t> free_classes;

  // The head of every class that may start, as a min-heap in policy order. Deactivating
  // only clears Class::in_active: entries whose generation is not the class's current one
  // are stale and dropped when they surface (each pass drains the heap).
  struct ActiveEntry {
    OrderKey key;
    std::int32_t cls;
    std::uint64_t gen;
    bool operator>(const ActiveEntry& o) const { return o.key < key; }
  };
  std::vector<ActiveEntry> active;
  std::vector<ActiveEntry> active_deferred;  // popped in a pass, still active: pushed back after it
  std::size_t active_count = 0;

  std::vector<std::vector<std::int32_t>> node_parked;  // classes parked on one node's bins (may hold stale ids)
  static constexpr std::size_t kNodeParkedReserve = 8;  // each node list's room from the start
  std::vector<std::int64_t> node_parked_count;
  std::vector<PartitionParking> partition_parking;  // by partition
  std::vector<ClassHead> heads_scratch;  // a flush's merges (flush_releases)
  // Parked classes by the time their head starts starving: then they must be looked at
  // again, since the starvation guard changes what a failure means.
  // A min-heap of (deadline, class). An entry is live while its class is parked with that
  // deadline; any other is stale and dropped when it comes up (a class parked again with
  // its listed deadline reuses the entry, so a burst that parks and wakes classes pass
  // after pass does not grow the heap).
  struct ParkDeadline {
    TimeNs at;
    std::int32_t cls;
    bool operator>(const ParkDeadline& o) const { return std::tie(at, cls) > std::tie(o.at, o.cls); }
  };
  std::vector<ParkDeadline> park_deadlines;

  // The class of actions like `s` in `partition` (`in_slot`: in its trajectory's slot);
  // made(Class&) is called on it when it is made just now.
  template <class Made>
  std::int32_t find_or_add(const ActionSpec& s, std::int32_t partition, bool in_slot, Made&& made);
  void free_class(std::int32_t c);  // an empty class (neither active nor parked); actions.cc
  // Frees class c once it has no waiting or running action, unless a trajectory's slot keys
  // it (those go when the trajectory ends). Its id and demand row serve the next class made.
  void free_if_unused(std::int32_t c) {
    const Class& cl = all[c];
    if (cl.running == 0 && cl.waiting.empty() && !cl.in_trajectory_slot) free_class(c);
  }

  // ---- the active heap
  bool live(const ActiveEntry& e) const { return all[e.cls].in_active && all[e.cls].active_gen == e.gen; }
  void push_active(const ActiveEntry& e) {
    active.push_back(e);
    std::push_heap(active.begin(), active.end(), std::greater<>());
  }
  ActiveEntry make_active(std::int32_t c) {  // marks the class active; its entry for the heap
    Class& cl = all[c];
    cl.in_active = true;
    ++active_count;
    return ActiveEntry{cl.waiting.head(), c, ++cl.active_gen};
  }
  void activate(std::int32_t c) {
    const Class& cl = all[c];
    if (cl.in_active || cl.parked || cl.waiting.empty()) return;
    push_active(make_active(c));
  }
  void deactivate(std::int32_t c) {
    Class& cl = all[c];
    if (!cl.in_active) return;
    cl.in_active = false;  // its heap entry is now stale
    --active_count;
  }

  // ---- parking.cc
  // Parks class c on `node` (kNone: across its partition) until its head starves, at its
  // submit + `starvation_ns`.
  void park(std::int32_t c, std::int32_t node, TimeNs starvation_ns);
  void leave_park(Class& cl) {  // the park's bookkeeping, nothing else
    cl.parked = false;
    if (cl.park_node == kNone) --partition_parking[cl.partition].count;
    else --node_parked_count[cl.park_node];
  }
  // Out of the park for a try at once: the class's active entry, as if popped from the heap.
  ActiveEntry unpark_for_try(std::int32_t c) {
    leave_park(all[c]);
    return make_active(c);
  }
  void check(std::size_t n_partitions) const;  // its guarantees (introspection.cc)
  // A parked class whose head starves by `now` (its deadline taken off), or kNone.
  std::int32_t next_starving(TimeNs now) {
    while (!park_deadlines.empty() && park_deadlines.front().at <= now) {
      const ParkDeadline due = park_deadlines.front();
      std::pop_heap(park_deadlines.begin(), park_deadlines.end(), std::greater<>());
      park_deadlines.pop_back();
      Class& cl = all[due.cls];
      if (cl.deadline_listed == due.at) cl.deadline_listed = kNoDeadline;
      if (cl.parked && cl.park_deadline == due.at) return due.cls;
    }
    return kNone;
  }

  const Quantity* store_demand(const std::vector<Quantity>& demand) {
    if (demand_rows_used == kDemandRowsPerChunk) {
      demand_rows.emplace_back(new Quantity[kDemandRowsPerChunk * static_cast<std::size_t>(K)]);
      demand_rows_used = 0;
    }
    Quantity* row = demand_rows.back().get() + demand_rows_used++ * static_cast<std::size_t>(K);
    std::copy(demand.begin(), demand.end(), row);
    return row;
  }
};

template <class Made>
std::int32_t Classes::find_or_add(const ActionSpec& s, std::int32_t partition, bool in_slot, Made&& made) {
  TrajectoryId traj = in_slot ? s.trajectory : 0;
  std::uint64_t h = 1469598103934665603ull;
  // FNV-1a over whole words: index (an IdMap) mixes the result again.
  auto mix = [&h](std::int64_t x) { h = (h ^ static_cast<std::uint64_t>(x)) * 0x100000001b3ull; };
  for (Quantity q : s.demand) mix(q);
  mix(s.gpu_memory);
  mix(partition);
  mix(s.affinity_node);
  mix(s.service);
  mix(s.quota);
  mix(s.tokens);
  mix(static_cast<std::int64_t>(traj));
  mix(in_slot ? 1 : 0);
  const std::int32_t* found = index.find(h);
  const std::int32_t chain = found == nullptr ? kNone : *found;
  for (std::int32_t c = chain; c != kNone; c = all[c].next_same_hash) {
    const Class& o = all[c];
    if (std::equal(s.demand.begin(), s.demand.end(), o.demand) && o.gpu_memory == s.gpu_memory && o.partition == partition &&
        o.affinity_node == s.affinity_node && o.service == s.service && o.quota == s.quota &&
        o.tokens == s.tokens && o.trajectory == traj && o.in_trajectory_slot == in_slot)
      return c;
  }
  Class c;
  c.next_same_hash = chain;
  c.key_hash = h;
  std::int32_t id;
  if (free_classes.empty()) {
    id = static_cast<std::int32_t>(all.size());
    c.demand = store_demand(s.demand);
  } else {
    id = free_classes.back();
    free_classes.pop_back();
    const Class& old = all[id];
    // Stale heap and deadline entries may still name this slot: its active generation goes
    // on from where it was, so those heap entries stay stale; a deadline entry wakes it
    // only when parked with that very deadline (due then anyway), and stays listed. Its
    // demand row is reused.
    c.active_gen = old.active_gen;
    c.deadline_listed = old.deadline_listed;
    c.waiting = std::move(all[id].waiting);  // empty: its storage serves the new class
    Quantity* row = const_cast<Quantity*>(old.demand);  // a row of demand_rows, owned here
    std::copy(s.demand.begin(), s.demand.end(), row);
    c.demand = row;
  }
  c.gpu_memory = s.gpu_memory;
  c.partition = partition;
  c.affinity_node = s.affinity_node;
  c.service = s.service;
  c.quota = s.quota;
  c.tokens = s.tokens;
  c.trajectory = traj;
  c.in_trajectory_slot = in_slot;
  if (id == static_cast<std::int32_t>(all.size())) {
    all.push_back(std::move(c));
    // Room to free every class without a reallocation in the middle of a completion.
    if (free_classes.capacity() < all.capacity()) free_classes.reserve(all.capacity());
  } else {
    all[id] = std::move(c);
  }
  *index.insert(h, id).first = id;  // the chain's new head
  if (in_slot) trajectory_classes[traj].push_back(id);
  made(all[id]);
  return id;
}

}  // namespace tangram
