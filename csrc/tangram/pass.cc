// The scheduling pass: the heads of the classes in policy order, each tried once.
//
// Reads: everything; the policy's row through its rules (OrderRule via the keys,
// BinLayout via classes and partitions, RestoreRule, SpareRule).
// Changes: starts actions (bins, devices, quotas, services), parks classes, marks bins
// contended or held back for spare units and starving actions; emits kStart decisions (and
// the kRestore/kEvict decisions services.cc makes on the way, and the kResize decisions of
// a shrink that lets a head start, resize.cc).
// Guarantees: heads are tried in (-priority, key, seq) order; a class whose head cannot
// start starts nothing else in the pass; a starving head holds back every later head from
// the bins it could use; capacity, device memory and quotas are never exceeded.
#include "tangram/scheduler_impl.h"

#include <algorithm>
#include <vector>

namespace tangram {

// fits_released_leaf past its first test: the scan of the released leaves.
bool Scheduler::Impl::released_leaf_scan(Class& cl) {
  const Partition& part = bins.partitions[cl.partition];
  const std::vector<std::int32_t>& leaves = released.leaves[cl.partition];
  const Quantity* demand = cl.demand;
  const std::int32_t from = cl.fit_from == kUnsettledFit ? 0 : cl.fit_from;  // a fit now fitted at the flush
  for (std::int32_t i = released.first_fit(cl.partition, from, demand); i >= 0;
       i = released.first_fit(cl.partition, i + 1, demand)) {
    const std::int32_t bin = part.bins[leaves[i]];
    if ((bins.bin_bound[bin] && !bins.lends_to(cl.in_trajectory_slot, cl.trajectory, bin)) || !bins.node_online[bins.bin_node[bin]]) continue;
    if (bins.has_gpus && bins.node_max_dev_free[bins.bin_node[bin]] < cl.gpu_memory) continue;
    if (bins.bin_bound[bin]) return true;  // lent: found by lend_slot_room, not from fit_from
    cl.fit_from = i;
    return true;
  }
  cl.fit_from = static_cast<std::int32_t>(leaves.size());
  return false;
}

// The leaves of the class's partition it may use: [lo, hi), or one fixed leaf (a bound
// trajectory slot, hidden from the free tree). False when it has nowhere to go right now.
bool Scheduler::Impl::eligible_range(const Class& c, std::int32_t& lo, std::int32_t& hi,
                                     std::int32_t& fixed_leaf) const {
  const Partition& part = bins.partitions[c.partition];
  fixed_leaf = kNone;
  std::int32_t node = c.affinity_node;
  if (c.service != kNone) node = gpus.dev_node[gpus.services[c.service].device];
  if (c.in_trajectory_slot) {
    auto it = bins.trajectory_bin.find(c.trajectory);
    if (it != bins.trajectory_bin.end()) {
      fixed_leaf = bins.bin_leaf[it->second];
      lo = fixed_leaf;
      hi = fixed_leaf + 1;
      return true;
    }
  }
  if (node == kNone) {
    lo = 0;
    hi = part.free_tree.leaves();
    return true;
  }
  lo = part.node_lo[node];
  hi = part.node_hi[node];
  return lo >= 0;
}

// The one node a class is confined to (affinity, its service's device, its trajectory's
// slot), or kNone when it may use any bin of its partition.
std::int32_t Scheduler::Impl::scope_node(const Class& c) const {
  if (c.in_trajectory_slot) {
    auto it = bins.trajectory_bin.find(c.trajectory);
    if (it != bins.trajectory_bin.end()) return bins.bin_node[it->second];
  }
  if (c.service != kNone) {
    std::int32_t d = gpus.services[c.service].device;
    return d == kNone ? kNone : gpus.dev_node[d];
  }
  return c.affinity_node;
}

// Tries to start the head of class `c`, in steps: its quota and service gates, the bins it
// may use (find_room), GPU memory made by eviction, a shrink of running actions that pays
// (kMalleable, resize.cc), the starvation rule when nothing fits (no_room), quota
// admission, best fit, and the start (start_head).
Scheduler::Impl::Try Scheduler::Impl::try_head(std::int32_t c, std::vector<Decision>& out) {
  Class& cl = classes[c];
  const std::int32_t slot = cl.waiting.head().slot;
  // A start commits to the head's record and takes the head off the queue, most likely
  // cache misses: fetch them while the placement search runs.
  prefetch(&actions.slots[slot]);
  cl.waiting.prefetch_pop();
  if (cl.quota != kNone && this_pass.quota_blocked[cl.quota]) {  // refused earlier in this pass
    note_quota_block(cl, quotas[cl.quota]);
    return Try::kWaits;
  }
  std::int32_t device = kNone;  // the service's device, for a service action
  if (cl.service != kNone && !service_admits(cl, device, out)) return Try::kWaits;
  if (cl.in_trajectory_slot) {
    // A slot that can never hold the head (another node's shape) is given up once nothing of
    // its trajectory runs there; the trajectory then takes a slot as one without would.
    auto it = bins.trajectory_bin.find(cl.trajectory);
    if (it != bins.trajectory_bin.end() && bins.bin_holder_running[it->second] == 0 && bins.never_holds(it->second, cl.demand, cl.gpu_memory))
      unbind_slot(c, it->second);
  }
  std::vector<std::int32_t>& cand = this_pass.cand;
  const Room room = find_room(cl, device, cand);
  // GPU memory held by resident services is reclaimed for an action that needs it, when its
  // quota admits it now (as a restore is made only then): else the memory would sit unused
  // while the services evicted for it came back, pass after pass.
  if (cand.empty() && cl.gpu_memory > 0 && room.has_range && !room.masked) {
    if (cl.quota != kNone && quota_refuses(cl)) return Try::kWaits;
    if (make_gpu_room(cl, room.lo, room.hi, room.fixed_leaf, device, out)) return try_head(c, out);
  }
  if (cand.empty()) {
    if (may_reclaim(cl) && plan_shrink(cl, room, device, elastic.shrink_plan)) {
      if (cl.quota != kNone && !quota_admits(cl)) return Try::kWaits;
      start_by_shrinking(c, room, device, elastic.shrink_plan, out);
      return Try::kStarted;
    }
    return no_room(cl, room, device);
  }
  if (cl.quota != kNone && !quota_admits(cl)) return Try::kWaits;
  start_head(c, bins.best_fit(cand, cl.partition, cl.demand), room.fixed_leaf, device, out, room.borrowed);
  return Try::kStarted;
}

// The bins the class may use now, as `cand`: up to `candidates` leaves of its partition
// whose free room covers its demand (and GPU memory), first in leaf order, skipping bins
// held back by a starving action. Empty when none fits, when it has nowhere to go, or when
// its whole partition is held back.
inline Scheduler::Impl::Room Scheduler::Impl::find_room(Class& cl, std::int32_t device, std::vector<std::int32_t>& cand) {
  Room room;
  room.has_range = eligible_range(cl, room.lo, room.hi, room.fixed_leaf);
  room.scope = scope_node(cl);
  // A trajectory's own slot is nobody else's: a starving action elsewhere cannot claim it.
  room.own_slot = room.fixed_leaf != kNone;
  room.masked = !room.own_slot && this_pass.partition_masked[cl.partition] == this_pass.epoch;
  cand.clear();
  // Trajectory slots: a service action runs in its own trajectory's held slot when that is
  // on its service's node, else in a free slot there, else in another held one
  // (held_slot_room). A starving head holds back free slots only, never held ones.
  const bool service_in_slots = cl.service != kNone && row.rules.bins == BinLayout::kTrajectorySlots;
  // A service action's GPU memory, if any, must fit its service's device.
  auto gpu_fits = [&] {
    if (!cand.empty() && device != kNone && gpus.dev_free[device] < cl.gpu_memory) cand.clear();
    return room;
  };
  if (service_in_slots && room.has_range && held_slot_room(cl, room, true, cand)) return gpu_fits();
  if (!room.has_range || room.masked) {
    if (service_in_slots && room.has_range) held_slot_room(cl, room, false, cand);
    return gpu_fits();
  }
  const Partition& part = bins.partitions[cl.partition];
  const std::int32_t lo = room.lo, hi = room.hi;
  if (room.fixed_leaf != kNone) {
    std::int32_t b = part.bins[room.fixed_leaf];
    const Quantity* f = bins.free_of(b);
    bool fits = true;
    for (std::int32_t k = 0; k < K && fits; ++k) fits = f[k] >= cl.demand[k];
    if (fits && cl.gpu_memory > 0 && device == kNone) fits = bins.node_max_dev_free[bins.bin_node[b]] >= cl.gpu_memory;
    if (fits) fits = bins.node_online[bins.bin_node[b]] != 0;
    if (fits) cand.push_back(room.fixed_leaf);
  } else {
    std::copy(cl.demand, cl.demand + K, this_pass.query.begin());
    if (bins.has_gpus) this_pass.query[K] = device == kNone ? cl.gpu_memory : 0;
    auto skip = [&](std::int32_t leaf) { return this_pass.any_mask && this_pass.node_masked[bins.bin_node[part.bins[leaf]]] == this_pass.epoch; };
    if (cl.fit_pass == this_pass.fit_epoch && lo == 0 && hi == part.free_tree.leaves()) {
      // Woken by this pass's releases: only released leaves can hold it (see Class).
      const std::vector<std::int32_t>& leaves = released.leaves[cl.partition];
      const std::int32_t first = released.first_fit(cl.partition, cl.fit_from, cl.demand);
      // Leaves before `first` do not fit now, and room only shrinks in a pass: later
      // heads of this class start their scan there.
      cl.fit_from = first < 0 ? static_cast<std::int32_t>(leaves.size()) : first;
      for (std::int32_t i = first; i >= 0; i = released.first_fit(cl.partition, i + 1, cl.demand)) {
        const std::int32_t leaf = leaves[i];
        if (bins.bin_bound[part.bins[leaf]] || !bins.node_online[bins.bin_node[part.bins[leaf]]] || skip(leaf)) continue;
        if (bins.has_gpus && bins.node_max_dev_free[bins.bin_node[part.bins[leaf]]] < this_pass.query[K]) continue;
        cand.push_back(leaf);
        if (static_cast<std::int32_t>(cand.size()) == policy.candidates) break;
      }
    } else if (lo == 0 && hi == part.free_tree.leaves()) {
      // Its heads are tried again and again in one pass: each search starts where the
      // last one found its first fit, past the leaves filled up since the pass began.
      const std::int32_t from = cl.tree_epoch == bins.search_epoch ? cl.tree_from : 0;
      FailedDemands& no_fit = bins.partitions[cl.partition].no_fit;
      const FailedDemands::Stamp epoch{bins.search_epoch, 0};
      const bool whole = from == 0 && !this_pass.any_mask;  // every leaf, none skipped
      if (!whole || !no_fit.covers(this_pass.query.data(), bins.D, epoch)) {
        part.free_tree.find(from, hi, this_pass.query.data(), policy.candidates, skip, cand);
        if (whole && cand.empty()) no_fit.note(this_pass.query.data(), bins.D, epoch);
      }
      cl.tree_epoch = bins.search_epoch;
      cl.tree_from = cand.empty() ? hi : cand[0];
    } else {
      part.free_tree.find(lo, hi, this_pass.query.data(), policy.candidates, skip, cand);
    }
  }
  if (cand.empty() && service_in_slots) held_slot_room(cl, room, false, cand);
  if (cand.empty() && cl.in_trajectory_slot && room.fixed_leaf == kNone) room.borrowed = lend_slot_room(cl, room, cand);
  return gpu_fits();
}

// Trajectory slots: held slots of the service's node with room for a service action, as
// `cand`: with `own`, its own trajectory's slot alone; else every other (up to
// `candidates`). Every slot of a node can be held by trajectories that each wait for a
// reward of that node's service (one machine, or services on sandbox nodes' GPUs); kept to
// free slots those rewards would wait for ever. A reward is its service's work, which no
// sandbox owns. True when it found one.
bool Scheduler::Impl::held_slot_room(const Class& cl, const Room& room, bool own, std::vector<std::int32_t>& cand) {
  const Partition& part = bins.partitions[cl.partition];
  auto fits = [&](std::int32_t leaf) {
    const std::int32_t b = part.bins[leaf];
    if (!bins.bin_bound[b] || !bins.node_online[bins.bin_node[b]]) return false;
    const Quantity* f = bins.free_of(b);
    for (std::int32_t k = 0; k < K; ++k)
      if (f[k] < cl.demand[k]) return false;
    return true;
  };
  const std::int32_t own_bin = bins.held_slot(actions.slots[cl.waiting.head().slot].trajectory);
  const std::int32_t own_leaf = own_bin == kNone ? kNone : bins.bin_leaf[own_bin];
  if (own) {
    if (own_leaf == kNone || own_leaf < room.lo || own_leaf >= room.hi || !fits(own_leaf)) return false;
    cand.push_back(own_leaf);
    return true;
  }
  for (std::int32_t leaf = room.lo; leaf < room.hi; ++leaf) {
    if (leaf == own_leaf || !fits(leaf)) continue;
    cand.push_back(leaf);
    if (static_cast<std::int32_t>(cand.size()) == policy.candidates) break;
  }
  return !cand.empty();
}

// Trajectory slots: held slots lent to the head of a trajectory that holds none and found no
// free slot, as `cand` (up to `candidates`): on online nodes, not held back, where every
// held slot's trajectory has nothing live (node_busy_holders == 0), with room for the head.
// There, no work in progress could ever free a slot for it (only trajectory ends do, which
// the caller may never send), so it runs in one, binding nothing. True when it found one.
bool Scheduler::Impl::lend_slot_room(const Class& cl, const Room& room, std::vector<std::int32_t>& cand) {
  const Partition& part = bins.partitions[cl.partition];
  for (std::int32_t leaf = room.lo; leaf < room.hi;) {
    const std::int32_t b = part.bins[leaf];
    const std::int32_t n = bins.bin_node[b];
    if (bins.node_busy_holders[n] > 0 || !bins.node_online[n] || (this_pass.any_mask && this_pass.node_masked[n] == this_pass.epoch)) {
      leaf = part.node_hi[n];  // a node's bins are contiguous leaves
      continue;
    }
    ++leaf;
    if (!bins.bin_bound[b] || (bins.has_gpus && bins.node_max_dev_free[n] < cl.gpu_memory)) continue;
    const Quantity* f = bins.free_of(b);
    bool fits = true;
    for (std::int32_t k = 0; k < K && fits; ++k) fits = f[k] >= cl.demand[k];
    if (!fits) continue;
    cand.push_back(leaf - 1);
    if (static_cast<std::int32_t>(cand.size()) == policy.candidates) break;
  }
  return !cand.empty();
}

// The trajectory of class c gives its slot `bin` up (it has a live action, the head): the
// slot is free again (or taken over, free_slot), its node may now lend its held slots, and
// the trajectory's other classes, parked on that slot's node, are looked at again.
void Scheduler::Impl::unbind_slot(std::int32_t c, std::int32_t bin) {
  const TrajectoryId t = classes[c].trajectory;
  bins.trajectory_bin.erase(t);
  --bins.node_busy_holders[bins.bin_node[bin]];
  free_slot(bin);
  for (std::int32_t other : classes.trajectory_classes[t])
    if (other != c && classes[other].parked) unpark(other);
}

// Its holder ended: the slot is free, unless an action runs there in it as a lent slot;
// then that action's trajectory (the lowest action id's, among those holding no slot) takes
// the slot over, as its own from now on, so a slot with work of a trajectory in it is
// always held.
void Scheduler::Impl::free_slot(std::int32_t bin) {
  std::int32_t heir = kNone;
  if (bins.bin_lent_running[bin] > 0)
    for (std::int32_t s = 0; s < static_cast<std::int32_t>(actions.slots.size()); ++s) {
      const ActionRec& a = actions.slots[s];
      if (a.state != ActionState::kRunning || a.bin != bin || a.own_slot || !classes[a.cls].in_trajectory_slot) continue;
      if (bins.trajectory_bin.count(a.trajectory)) continue;
      if (heir == kNone || a.id < actions.slots[heir].id) heir = s;
    }
  if (heir == kNone) {
    bins.clear_slot(bin);
    release_on_node(bins.bin_node[bin], bins.bin_partition[bin]);
    return;
  }
  ActionRec& a = actions.slots[heir];
  a.own_slot = true;
  --bins.bin_lent_running[bin];
  ++bins.bin_holder_running[bin];
  bins.bind_slot(bin, a.trajectory);  // it has a live action: this one
  for (std::int32_t other : classes.trajectory_classes[a.trajectory])
    if (classes[other].parked) unpark(other);
}

// A trajectory's live actions went from none to some (+1) or back (-1): when it holds a
// slot, its node counts it busy or not; a node whose holders all went idle lends its held
// slots, so classes parked for room there are looked at again.
void Scheduler::Impl::holder_live(TrajectoryId trajectory, std::int32_t delta) {
  if (row.rules.bins != BinLayout::kTrajectorySlots) return;
  auto it = bins.trajectory_bin.find(trajectory);
  if (it == bins.trajectory_bin.end()) return;
  const std::int32_t n = bins.bin_node[it->second];
  bins.node_busy_holders[n] += delta;
  if (bins.node_busy_holders[n] == 0) release_on_node(n, bins.bin_partition[it->second]);
}

// Nothing fits the head now. A starving head (waited starvation_seconds) holds back every
// later head from the bins it could use; any other parks until room is released where it
// could run (GPU classes are looked at every pass instead, since memory also frees when a
// cached service turns idle; so is a class a shrink could make room for, since whether a
// shrink pays changes with time).
Scheduler::Impl::Try Scheduler::Impl::no_room(Class& cl, const Room& room, std::int32_t device) {
  const bool held = room.masked || (!room.own_slot && room.scope != kNone && this_pass.node_masked[room.scope] == this_pass.epoch) ||
                    fits_a_held_back_node(cl, room);
  cl.block = held ? Block::kHeldBack : Block::kResources;
  // While a node is offline, an action that fits no online node's capacity holds nothing
  // back (it waits for the node, or for a new one, parked like any other).
  if (!room.own_slot && now - cl.waiting.head().submit_ns >= starvation_ns &&
      (bins.n_offline == 0 || (room.has_range && bins.fits_online_capacity(cl.partition, cl.demand, cl.gpu_memory, room.lo, room.hi, device)))) {
    // With trajectory slots, the bins held back are the free slots only, so the pass goes
    // on for bound ones; and only on the nodes whose slots could ever hold it: a free slot
    // it can never use, held back, could keep the holder of the slot it waits for from
    // ever finishing (its action needing that very slot, on its service's node).
    if (room.scope == kNone && row.rules.bins == BinLayout::kTrajectorySlots && room.has_range) {
      const Partition& part = bins.partitions[cl.partition];
      for (std::int32_t leaf = room.lo; leaf < room.hi; ++leaf)
        if (!bins.never_holds(part.bins[leaf], cl.demand, cl.gpu_memory)) this_pass.node_masked[bins.bin_node[part.bins[leaf]]] = this_pass.epoch;
    } else if (room.scope == kNone) {
      this_pass.partition_masked[cl.partition] = this_pass.epoch;
      if (starving_head_halts) return Try::kHalt;
    } else {
      this_pass.node_masked[room.scope] = this_pass.epoch;
    }
    this_pass.any_mask = true;
    return Try::kBlocked;
  }
  if (!this_pass.any_mask && cl.service == kNone && cl.gpu_memory == 0 && !could_shrink_into(cl))
    return Try::kParked;
  return Try::kBlocked;
}

// For explain(): whether a class that may use any node found no room only because the nodes
// where its demand fits are held back by a starving action (node masks: the search skipped
// them). A search of its range without the masks, on this failure path only.
bool Scheduler::Impl::fits_a_held_back_node(const Class& cl, const Room& room) {
  if (!this_pass.any_mask || room.own_slot || room.scope != kNone || !room.has_range || room.masked) return false;
  std::copy(cl.demand, cl.demand + K, this_pass.query.begin());
  if (bins.has_gpus) this_pass.query[K] = 0;
  std::vector<std::int32_t> found;
  const Partition& part = bins.partitions[cl.partition];
  part.free_tree.find(room.lo, room.hi, this_pass.query.data(), 1, [](std::int32_t) { return false; }, found);
  return !found.empty() && this_pass.node_masked[bins.bin_node[part.bins[found[0]]]] == this_pass.epoch;
}

void Scheduler::Impl::note_quota_block(Class& cl, const QuotaState& q) {
  cl.block = q.last_block == QuotaState::Blocked::kRate     ? Block::kQuotaRate
             : q.last_block == QuotaState::Blocked::kTokens ? Block::kQuotaTokens
                                                            : Block::kQuotaConcurrency;
  cl.block_until = q.last_until;
}

// Takes the head's request from its quota, or blocks the quota for the rest of the pass
// (later heads of the quota wait without asking).
bool Scheduler::Impl::quota_admits(Class& cl) {
  if (quota_refuses(cl)) return false;
  quotas[cl.quota].take(now, cl.tokens);
  return true;
}

// Whether the head's quota would refuse it now; if so, the quota is blocked for the rest of
// the pass, as quota_admits would leave it.
bool Scheduler::Impl::quota_refuses(Class& cl) {
  QuotaState& q = quotas[cl.quota];
  if (q.admits(now, cl.tokens)) return false;
  this_pass.quota_blocked[cl.quota] = 1;
  this_pass.quota_blocked_at[cl.quota] = cl.waiting.head();
  this_pass.quota_refused = true;
  note_quota_block(cl, q);
  if (q.last_until != kNever) wakeup = std::min(wakeup, q.last_until);
  return true;
}

// Starts the head of class `c` on `leaf` of its partition: takes its resources (and a GPU
// device by best fit, when it needs one and has no service), binds a trajectory slot on its
// first start, takes the head off its class, and emits the kStart decision. The class's
// next head parks at once if it surely cannot start in the rest of the pass.
inline void Scheduler::Impl::start_head(std::int32_t c, std::int32_t leaf, std::int32_t fixed_leaf, std::int32_t device,
                                 std::vector<Decision>& out, bool borrowed) {
  Class& cl = classes[c];
  Partition& part = bins.partitions[cl.partition];
  const std::int32_t slot = cl.waiting.head().slot;
  ActionRec& a = actions.slots[slot];
  if (count_progress) {
    std::int32_t& started_before = *actions.trajectory_progress.insert(a.trajectory, 0).first;
    started_before = std::min(started_before + 1, kProgressCap);
  }
  const std::int32_t bin = part.bins[leaf];
  const std::int32_t node = bins.bin_node[bin];
  if (device == kNone && cl.gpu_memory > 0) {
    Quantity best_left = INT64_MAX;
    for (std::int32_t d = gpus.node_first_dev[node]; d < gpus.node_first_dev[node + 1]; ++d)
      if (gpus.dev_free[d] >= cl.gpu_memory && gpus.dev_free[d] - cl.gpu_memory < best_left) {
        best_left = gpus.dev_free[d] - cl.gpu_memory;
        device = d;
      }
  }
  Quantity* f = bins.free_of(bin);
  for (std::int32_t k = 0; k < K; ++k) f[k] -= cl.demand[k];
  a.grant = a.elastic_kind == kNone ? 0 : cl.demand[a.elastic_kind];
  if (a.elastic_kind != kNone && cl.in_trajectory_slot) {
    // The trajectory's slot is all its own: the action gets all of it, up to its bound.
    Quantity extra = std::min(f[a.elastic_kind], a.elastic_max - a.grant);
    a.grant += extra;
    f[a.elastic_kind] -= extra;
  } else if (a.elastic_kind != kNone && malleable && row.rules.spare != SpareRule::kNone) {
    top_up_start(slot, bin, f);
  }
  if (released.bin_pass[bin] == this_pass.epoch) released.took(bin, bins.bin_partition[bin], f);  // the columns stay exact
  if (cl.gpu_memory > 0) {
    gpus.dev_free[device] -= cl.gpu_memory;
    refresh_node_devices(node);
  }
  a.bin = bin;
  a.own_slot = cl.in_trajectory_slot && !borrowed;
  if (a.own_slot) ++bins.bin_holder_running[bin];
  if (borrowed) ++bins.bin_lent_running[bin];
  // Listed before the next head's look below: units it holds above its minimum are ones a
  // shrink could take back later.
  if (malleable) note_running(slot);
  if (cl.in_trajectory_slot && fixed_leaf == kNone && !borrowed) {
    bins.bind_slot(bin, cl.trajectory);  // it has a live action: this one
    // The trajectory's other classes now wait for this slot alone, not where they were
    // parked (their affinity node, or any free slot): they are looked at again.
    for (std::int32_t other : classes.trajectory_classes[cl.trajectory])
      if (other != c && classes[other].parked) unpark(other);
  } else if (!bins.bin_bound[bin]) {
    bins.refresh_leaf(bin);
  }
  if (cl.service != kNone) {
    ServiceRec& svc = gpus.services[cl.service];
    if (svc.draining_pass == this_pass.epoch) --svc.drain_starts;  // service_admits: above 0
    svc.running += 1;
    svc.running_ns += actions.details[slot].est_ns;
    svc.waiting -= 1;
    svc.queued_ns -= actions.details[slot].est_ns;
  }
  classes.deactivate(c);
  cl.waiting.pop(actions.queue_pos);
  ++cl.running;
  // The class's next head would be tried later in this pass, where room only shrinks: if
  // it surely cannot start now, it parks now, as that try would park it.
  if (!cl.waiting.empty() && surely_parks(cl)) {
    cl.block = Block::kResources;
    const std::int32_t next_scope = scope_node(cl);  // its trajectory's slot may be bound now
    classes.park(c, next_scope, starvation_ns);
  } else {
    classes.activate(c);
  }
  a.state = ActionState::kRunning;
  a.device = device;
  a.start_ns = now;
  --actions.n_waiting;
  ++actions.n_running;
  Decision d;
  d.kind = DecisionKind::kStart;
  d.action = a.id;
  d.node = node;
  d.device = device == kNone ? kNone : gpus.dev_local[device];
  d.service = cl.service;
  d.elastic_kind = a.elastic_kind;
  d.grant = a.grant;
  d.time = now;
  this_pass.started.push_back(slot);
  this_pass.started_decision.push_back(out.size());
  out.push_back(d);
}

void Scheduler::Impl::pass(std::vector<Decision>& out) {
  ++this_pass.epoch;
  ++bins.search_epoch;
  this_pass.fit_epoch = this_pass.epoch;
  this_pass.any_mask = false;
  wakeup = kNever;
  this_pass.spared_fresh = false;
  std::fill(this_pass.quota_blocked.begin(), this_pass.quota_blocked.end(), 0);
  this_pass.quota_refused = false;
  this_pass.started.clear();
  this_pass.started_decision.clear();
  if (service_tails_ordered && !gpus.services.empty()) order_service_tails();
  if (gpus.any_replicated) rebind_replicas();
  std::vector<ClassHead>& wakes = this_pass.pending_wakes;
  wakes.clear();
  flush_releases(wakes);
  for (std::int32_t c = classes.next_starving(now); c != kNone; c = classes.next_starving(now)) unpark(c);
  this_pass.walking = true;
  if ((bins.n_offline > 0 || gpus.n_offline_devices > 0) && !gpus.services.empty()) evict_offline_services(out);
  if (row.rules.restore == RestoreRule::kQueuesFirst && !gpus.services.empty()) restore_queues(out);
  // Walk the heads in policy order. A head pushed behind the cursor (a class woken by an
  // eviction) waits for the next pass, like any head this pass has already passed by.
  classes.active_deferred.clear();
  bool have_cursor = false;
  OrderKey cursor{};
  std::size_t next_wake = 0;
  for (;;) {
    while (!classes.active.empty() && !classes.live(classes.active.front())) {
      std::pop_heap(classes.active.begin(), classes.active.end(), std::greater<>());
      classes.active.pop_back();
    }
    Classes::ActiveEntry e{};  // the head tried next
    bool woken = false;
    // A pending wake still parked (not woken since, nor parked again) whose head comes
    // before the heap's: at its turn it is tried if it may still fit, or else stays parked,
    // exactly where a failed try would park it.
    if (next_wake < wakes.size()) {
      const ClassHead& w = wakes[next_wake];
      Class& wc = classes[w.cls];
      if (!wc.parked || wc.pending_pass != this_pass.epoch) {
        ++next_wake;
        continue;
      }
      if (classes.active.empty() || policy_before(w, classes.active.front().key)) {
        ++next_wake;
        const bool unsettled = wc.fit_from == kUnsettledFit;
        if (!may_start_now(wc)) {
          wc.fit_pass = 0;
          wc.pending_pass = 0;
          // It stays parked, so spare units leave its demand free through bin_reserve's
          // parked_need (its quota, if any, was not refused before its turn); no contend.
          wc.block = Block::kResources;
          continue;
        }
        // A lazy wake that fits a released leaf now (fits_released_leaf found it) fitted it
        // at the flush; one sent to a full try otherwise (a mask, a refused quota, a shrink
        // that might help) is tried only if the flush would have listed it.
        const bool fits_released = wc.fit_from >= 0 && wc.fit_from < static_cast<std::int32_t>(released.leaves[wc.partition].size());
        if (unsettled && !fits_released && !listed_at_flush(wc)) continue;
        // Woken: its head comes before every head in the heap, so it is tried now (what
        // a trip into the heap and straight out again would come to).
        e = classes.unpark_for_try(w.cls);
        woken = true;
      }
    }
    if (!woken) {
      if (classes.active.empty()) break;
      e = classes.active.front();
      std::pop_heap(classes.active.begin(), classes.active.end(), std::greater<>());
      classes.active.pop_back();
      if (!classes.live(e)) continue;
    }
    if (have_cursor && e.key < cursor) {
      classes.active_deferred.push_back(e);
      continue;
    }
    cursor = e.key;
    have_cursor = true;
    const std::int32_t c = e.cls;
    // A class woken by this pass's releases whose head surely cannot start now (the room it
    // fitted went to heads before it) parks at once, as the full try would park it.
    if (!woken && parks_at_turn(classes[c])) {
      Class& cl = classes[c];
      cl.block = Block::kResources;
      classes.park(c, scope_node(cl), starvation_ns);
      continue;
    }
    // The heads tried after this one start by committing to their action's record, most
    // likely a cache miss: fetch them while this one is tried.
    if (!classes.active.empty()) prefetch(&actions.slots[classes.active.front().key.slot]);
    if (next_wake < wakes.size()) {
      const WaitQueue<OrderKey>& next = classes[wakes[next_wake].cls].waiting;
      if (!next.empty()) prefetch(&actions.slots[next.head().slot]);
    }
    this_pass.cursor = &cursor;
    Try r = try_head(c, out);
    this_pass.cursor = nullptr;
    if (r == Try::kHalt) {
      // A starving action that may use any bin stops the pass: the whole partition is its.
      // Pending wakes not reached join the heap, held back like every head behind it.
      for (; next_wake < wakes.size(); ++next_wake) {
        const Class& wc = classes[wakes[next_wake].cls];
        if (wc.parked && wc.pending_pass == this_pass.epoch) unpark(wakes[next_wake].cls);
      }
      spare.contend(classes[c].partition, kNone, nullptr, this_pass.epoch);  // every head behind it is held back
      classes.active_deferred.push_back(e);
      for (const Classes::ActiveEntry& rest : classes.active)
        if (classes.live(rest)) classes[rest.cls].block = Block::kHeldBack;
      break;
    }
    if (r == Try::kStarted) continue;  // try_head pushed the class's next head, if any
    // Whoever still waits for resources has a claim on the bins it could use: no spare
    // units there. (Waiting for a quota or a service is waiting for something else.) A
    // parked class's claim is bin_reserve's parked_need; a blocked one's is noted here.
    std::int32_t node = scope_node(classes[c]);
    if (r == Try::kBlocked) spare.contend(classes[c].partition, node, classes[c].demand, this_pass.epoch);
    if (r == Try::kParked) classes.park(c, node, starvation_ns);
    else classes.active_deferred.push_back(e);
  }
  for (const Classes::ActiveEntry& e : classes.active_deferred)
    if (classes.live(e)) classes.push_active(e);
  this_pass.walking = false;
  // Spare units for this pass's starts, and (kMalleable) for the running actions on bins a
  // completion freed room on since the last pass.
  if (row.rules.spare != SpareRule::kNone && (!this_pass.started.empty() || !elastic.freed_bins.empty())) grant_spare(out);
  elastic.clear_freed();
  for (std::size_t q = 0; q < quotas.size(); ++q)
    if (this_pass.quota_blocked[q] && quotas[q].last_until != kNever) wakeup = std::min(wakeup, quotas[q].last_until);
  for (const ServiceRec& s : gpus.services)
    if (s.device != kNone && s.ready_ns > now) wakeup = std::min(wakeup, s.ready_ns);
  // A plan fell short sparing a service ready only since the last pass (its waiting actions
  // had this pass to start): the next pass may evict it, so one comes even when no event
  // does; else what waits for its memory would wait for good.
  if (this_pass.spared_fresh && actions.n_waiting > 0) wakeup = std::min(wakeup, now + 1);
  this_pass.spared_fresh = false;
  prev_pass_now = now;
}

}  // namespace tangram
