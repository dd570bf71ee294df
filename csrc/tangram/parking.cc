// Parking and wakes: classes that failed on resources alone wait off the active heap.
//
// Reads: bins' free vectors, released nodes since the last pass.
// Changes: Class::parked and its lists (per node, per partition), the pending wakes of a
// pass, the active heap (unpark).
// Guarantees: parking only skips tries that would fail: a parked class is woken (or listed
// as a pending wake) as soon as room it could use is released (under kMalleable: room,
// or room with what a shrink could take back there), and when its head starts starving; a
// wake never reorders the walk (a head behind the pass's cursor waits for the next pass,
// as a failed head would).
#include "tangram/scheduler_impl.h"

#include <algorithm>
#include <iterator>
#include <vector>

namespace tangram {

// Wakes the parked classes of `list` that `fits` says may fit now; the rest stay parked.
template <class Entry, class Fits>
void Scheduler::Impl::wake(std::vector<Entry>& list, std::int32_t scope, Fits&& fits) {
  std::size_t kept = 0;
  for (const Entry& entry : list) {
    const std::int32_t c = class_of(entry);
    Class& cl = classes[c];
    if (!cl.parked || cl.park_node != scope) continue;  // stale entry
    if (fits(cl)) unpark(c);
    else list[kept++] = entry;
  }
  list.resize(kept);
}

// Resources came back on `node` (in `partition`, or every partition when kNone). Only bins
// on that node changed, so a parked class that fits none of them still fits nowhere. Outside
// a pass the node is noted and its parked classes are looked at once per event, at the next
// pass (flush_releases); during a pass (an eviction) they are woken at once.
void Scheduler::Impl::release_on_node(std::int32_t node, std::int32_t partition) {
  ++elastic.shrink_room_version;  // room came back: known_no_shrink_room's demands may fit now
  if (!bins.node_online[node]) return;  // nothing starts there; set_node_online(true) wakes
  bool noted = classes.node_parked_count[node] > 0;
  if (this_pass.walking) wake(classes.node_parked[node], node, [&](const Class& cl) { return fits_or_shrinks_on_node(cl, node); });
  for (std::size_t p = 0; p < bins.partitions.size(); ++p) {
    if (partition != kNone && static_cast<std::int32_t>(p) != partition) continue;
    if (classes.partition_parking[p].count == 0) continue;
    if (this_pass.walking) {
      auto fits = [&](const Class& cl) { return fits_or_shrinks_on_node(cl, node); };
      wake(classes.partition_parking[p].parked, kNone, fits);
      wake(classes.partition_parking[p].parked_new, kNone, fits);
    }
    noted = true;
  }
  if (!this_pass.walking && noted) released.note(node);
}

// Lists as `wakes`, in policy order, the parked classes that fit a bin of one of the nodes
// released since the last pass: those parked on such a node, and the partition-wide ones.
// Checking exactly costs a few comparisons per class and node, far less than a retry that
// fails.
void Scheduler::Impl::flush_releases(std::vector<ClassHead>& wakes) {
  if (released.nodes.empty()) return;
  std::sort(released.nodes.begin(), released.nodes.end());  // leaves lie in node order
  for (std::int32_t n : released.nodes) {
    if (classes.node_parked_count[n] == 0) {  // whatever is listed is stale
      classes.node_parked[n].clear();
      continue;
    }
    std::vector<std::int32_t>& list = classes.node_parked[n];
    std::size_t kept = 0;
    for (std::int32_t c : list) {
      Class& cl = classes[c];
      // Stale entries go; so do repeats (a class parked again after a wake elsewhere).
      if (!cl.parked || cl.park_node != n || cl.seen_flush == released.epoch) continue;
      cl.seen_flush = released.epoch;
      list[kept++] = c;
      if (!fits_or_shrinks_on_node(cl, n)) continue;
      cl.pending_pass = this_pass.epoch;
      wakes.emplace_back(cl.waiting.head(), c);
    }
    list.resize(kept);
  }
  std::sort(wakes.begin(), wakes.end());  // the few node-parked ones
  for (std::size_t p = 0; p < bins.partitions.size(); ++p) {
    const Partition& part = bins.partitions[p];
    PartitionParking& parking = classes.partition_parking[p];
    if (parking.count == 0) {  // whatever is listed is stale
      parking.parked.clear();
      parking.parked_new.clear();
      continue;
    }
    // The per-kind maximum over the released leaves rules most classes out in K comparisons.
    const std::vector<Quantity>& most = released.list_leaves(p, bins, this_pass.epoch);
    const std::vector<std::int32_t>& leaves = released.leaves[p];
    // kMalleable: released leaves where a shrink could take units back. A class that fits
    // none of the released leaves' free room may fit one of these with those units: it is
    // tried in full at its turn (no released-leaf shortcut).
    elastic.shrink_bins.clear();
    if (malleable && !elastic.reclaim_bins[p].empty())
      for (std::int32_t leaf : leaves)
        if (elastic.bin_run[part.bins[leaf]].reclaim_sum > 0) elastic.shrink_bins.push_back(part.bins[leaf]);
    // Lazy wakes: with no shrink to judge here, a class the per-kind maxima admit is listed
    // without the scan for its first fitting leaf (fit_from kUnsettledFit). At its turn the
    // scan on the room left decides, and room only shrinks within a pass, so a leaf that
    // fits then fitted now; most pending wakes lose their room to earlier heads and are
    // ruled out then by the first kind alone. Where the answer could depend on what the
    // flush saw (a try for another reason before its turn), settle_fit scans this snapshot.
    const bool lazy = elastic.shrink_bins.empty();
    released.no_reclaim_pass[p] = lazy ? this_pass.epoch : 0;
    if (lazy) released.snapshot_for_flush(p);
    // The list in policy order: the few parked since the last flush sorted, then merged in
    // as the list is filtered (one walk, into heads_scratch, swapped in after).
    std::sort(parking.parked_new.begin(), parking.parked_new.end());
    const std::size_t node_wakes = wakes.size();
    classes.heads_scratch.resize(parking.parked.size() + parking.parked_new.size());
    std::size_t kept = 0;
    auto next_old = parking.parked.cbegin(), next_new = parking.parked_new.cbegin();
    const auto old_end = parking.parked.cend(), new_end = parking.parked_new.cend();
    for (;;) {
      ClassHead entry;  // the next in policy order, ties to the older list (as std::merge)
      if (next_new != new_end && (next_old == old_end || *next_new < *next_old)) {
        entry = *next_new++;
      } else if (next_old != old_end) {
        entry = *next_old++;
      } else {
        break;
      }
      Class& cl = classes[entry.cls];
      // Stale entries go; so do repeats (parked again under the same head since).
      if (!cl.parked || cl.park_node != kNone || cl.waiting.head().seq != entry.seq ||
          cl.seen_flush == released.epoch)
        continue;
      cl.seen_flush = released.epoch;
      classes.heads_scratch[kept++] = entry;
      bool may_fit = true;
      for (std::int32_t k = 0; k < K && may_fit; ++k) may_fit = cl.demand[k] <= most[k];
      if (lazy) {
        if (!may_fit) continue;
        cl.fit_pass = this_pass.epoch;
        cl.fit_from = kUnsettledFit;
        cl.pending_pass = this_pass.epoch;
        wakes.push_back(entry);
        continue;
      }
      const std::int32_t at = may_fit ? released.first_fit(p, 0, cl.demand) : -1;
      if (at >= 0) {
        cl.fit_pass = this_pass.epoch;  // flush runs at the start of the pass
        cl.fit_from = at;
      } else if (!std::any_of(elastic.shrink_bins.begin(), elastic.shrink_bins.end(),
                              [&](std::int32_t b) { return reclaim_covers(cl, b) && bins.may_use(b, cl.in_trajectory_slot, cl.trajectory); })) {
        continue;
      }
      cl.pending_pass = this_pass.epoch;
      wakes.push_back(entry);  // in policy order, like the list
    }
    classes.heads_scratch.resize(kept);
    parking.parked.swap(classes.heads_scratch);
    parking.parked_new.clear();
    // Merge this partition's wakes (in order) into those before them (in order).
    if (node_wakes > 0 && node_wakes < wakes.size()) {
      classes.heads_scratch.clear();
      std::merge(wakes.begin(), wakes.begin() + static_cast<std::ptrdiff_t>(node_wakes),
                 wakes.begin() + static_cast<std::ptrdiff_t>(node_wakes), wakes.end(),
                 std::back_inserter(classes.heads_scratch));
      wakes.swap(classes.heads_scratch);
    }
  }
  released.nodes.clear();
  ++released.epoch;
}

// A lazy wake of this pass (fit_from kUnsettledFit) learns what the flush would have found:
// the first released leaf that held it then, or, when none did, that it is no wake at all
// (false; its fit and pending marks are taken back).
bool Scheduler::Impl::settle_fit(Class& cl) {
  return cl.fit_from != kUnsettledFit || cl.fit_pass != this_pass.fit_epoch || listed_at_flush(cl);
}

// The scan settle_fit makes, whatever the class's fit_from says now.
bool Scheduler::Impl::listed_at_flush(Class& cl) {
  const std::int32_t at = released.first_fit_at_flush(cl.partition, 0, cl.demand);
  if (at < 0) {
    cl.fit_pass = 0;
    cl.pending_pass = 0;
    cl.fit_from = 0;
    return false;
  }
  cl.fit_from = at;
  return true;
}

void Scheduler::Impl::unpark(std::int32_t c) {
  Class& cl = classes[c];
  settle_fit(cl);  // out of the park before its turn: tried as the flush found it
  classes.leave_park(cl);
  classes.activate(c);
  // Woken mid-pass behind the cursor: this pass has passed it by, as it would have passed
  // by a failed head, so it still waits there (for room, or for its refused quota).
  if (this_pass.cursor != nullptr && cl.waiting.head() < *this_pass.cursor && this_pass.waits_for_room(cl)) {
    spare.contend(cl.partition, cl.park_node, cl.demand, this_pass.epoch);
  }
}

// ---- Classes

void Classes::park(std::int32_t c, std::int32_t node, TimeNs starvation_ns) {
  Class& cl = all[c];
  deactivate(c);
  cl.parked = true;
  cl.park_node = node;
  cl.fit_pass = 0;
  cl.pending_pass = 0;
  cl.park_deadline = cl.waiting.head().submit_ns + starvation_ns;
  if (cl.deadline_listed != cl.park_deadline) {
    cl.deadline_listed = cl.park_deadline;
    park_deadlines.push_back(ParkDeadline{cl.park_deadline, c});
    std::push_heap(park_deadlines.begin(), park_deadlines.end(), std::greater<>());
  }
  if (node == kNone) {
    partition_parking[cl.partition].parked_new.emplace_back(cl.waiting.head(), c);
    ++partition_parking[cl.partition].count;
  } else {
    node_parked[node].push_back(c);
    ++node_parked_count[node];
  }
}

// ---- Releases

const std::vector<Quantity>& Releases::list_leaves(std::size_t p, const Bins& bins, std::uint64_t pass) {
  const Partition& part = bins.partitions[p];
  std::vector<std::int32_t>& list = leaves[p];
  list.clear();
  for (std::int32_t n : nodes)
    for (std::int32_t leaf = part.node_lo[n]; leaf >= 0 && leaf < part.node_hi[n]; ++leaf) {
      bin_pos[part.bins[leaf]] = static_cast<std::int32_t>(list.size());
      bin_pass[part.bins[leaf]] = pass;
      list.push_back(leaf);
    }
  // Their free vectors as columns, and the per-kind maximum over them.
  const std::size_t n_leaves = list.size();
  std::vector<Quantity>& cols = free_cols[p];
  cols.resize(n_leaves * static_cast<std::size_t>(K));
  most.assign(K, -1);
  for (std::size_t i = 0; i < n_leaves; ++i) {
    const Quantity* f = bins.free_of(part.bins[list[i]]);
    for (std::int32_t k = 0; k < K; ++k) {
      cols[static_cast<std::size_t>(k) * n_leaves + i] = f[k];
      most[k] = std::max(most[k], f[k]);
    }
  }
  first_max[p] = most[0];
  return most;
}

}  // namespace tangram
