// Room released since the last pass, and the released leaves a pass's wakes may use. A part
// of Scheduler::Impl (scheduler_impl.h); list_leaves is in parking.cc.
//
// Owns: the nodes where room came back since the last flush (each listed once per epoch);
// per partition, the leaves of those nodes as of the pass's flush, their free vectors as
// columns, and the largest free amount of the first kind over them; per bin its position
// among them and the pass that listed it.
// Guarantees:
//   - a node is in `nodes` at most once, exactly while node_epoch[node] == epoch; a flush
//     empties the list and moves the epoch on;
//   - through the pass of a flush, the columns of a partition's released leaves equal those
//     leaves' free vectors and first_max their largest free amount of the first kind
//     (took() follows each start on one), so first_fit finds what the free vectors would.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tangram/bins.h"
#include "tangram/model.h"

namespace tangram {

struct Releases {
  std::int32_t K = 0;  // kinds
  std::uint64_t epoch = 1;
  // Nodes released since the last pass (partition-wide wakes are done once per event).
  std::vector<std::int32_t> nodes;
  std::vector<std::uint64_t> node_epoch;  // per node: == epoch when in `nodes`
  std::vector<std::vector<std::int32_t>> leaves;  // per partition, in leaf order
  // Per partition: the released leaves' free vectors by kind (K columns of the leaves'
  // count), kept exact through the pass's starts; bins map to their position.
  std::vector<std::vector<Quantity>> free_cols;
  // Per partition: the largest free amount of the first kind over its released leaves, now.
  // A class asking more fits none of them: most looks at a pass's pending wakes end here
  // once the pass's starts have used the room up.
  std::vector<Quantity> first_max;
  std::vector<std::int32_t> bin_pos;      // per bin: its position among its partition's leaves
  std::vector<std::uint64_t> bin_pass;    // per bin: == the pass that listed it
  std::vector<Quantity> most;             // per kind: the largest over the leaves list_leaves listed
  // Per partition, for the lazy wakes of a flush (flush_releases): the columns and first_max
  // as the flush saw them, before the pass's starts took room.
  std::vector<std::vector<Quantity>> flush_cols;
  std::vector<Quantity> flush_first_max;
  // Per partition: the pass through which none of its released leaves has units a shrink
  // could take back (kMalleable), set by the flush and taken back (0) when a start or grant
  // adds some there (reclaim_grew). Till then a pending wake that fits no released leaf
  // cannot start by a shrink either.
  std::vector<std::uint64_t> no_reclaim_pass;

  void resize(std::int32_t kinds, std::size_t n_nodes, std::size_t n_partitions, std::size_t n_bins) {
    K = kinds;
    node_epoch.resize(n_nodes, 0);
    leaves.resize(n_partitions);
    free_cols.resize(n_partitions);
    first_max.resize(n_partitions, -1);
    flush_cols.resize(n_partitions);
    flush_first_max.resize(n_partitions, -1);
    no_reclaim_pass.assign(n_partitions, 0);
    for (auto& list : leaves) list.clear();  // leaf positions may have changed
    bin_pos.assign(n_bins, 0);
    bin_pass.assign(n_bins, 0);
  }
  // Room came back on `node`: listed for the next flush.
  void note(std::int32_t node) {
    if (node_epoch[node] == epoch) return;
    node_epoch[node] = epoch;
    nodes.push_back(node);
  }
  // Partition p's leaves on the released nodes (sorted), with their columns, as of pass
  // `pass`; returns the largest free amount of each kind over them (`most`).
  const std::vector<Quantity>& list_leaves(std::size_t p, const Bins& bins, std::uint64_t pass);
  // The first released leaf of `partition` from position `from` on whose free vector covers
  // `demand`, or -1. The scan runs down the first kind's column, which rules most out (the
  // constructor makes sure there is at least one kind).
  std::int32_t first_fit(std::size_t partition, std::int32_t from, const Quantity* demand) const {
    return scan(free_cols[partition], first_max[partition], partition, from, demand);
  }
  // The same, on the free vectors as the last snapshot_for_flush saw them.
  std::int32_t first_fit_at_flush(std::size_t partition, std::int32_t from, const Quantity* demand) const {
    return scan(flush_cols[partition], flush_first_max[partition], partition, from, demand);
  }
  void snapshot_for_flush(std::size_t p) {
    flush_cols[p] = free_cols[p];
    flush_first_max[p] = first_max[p];
  }
  std::int32_t scan(const std::vector<Quantity>& cols, Quantity most_first, std::size_t partition, std::int32_t from,
                    const Quantity* demand) const {
    if (demand[0] > most_first) return -1;
    const std::int32_t n = static_cast<std::int32_t>(leaves[partition].size());
    const Quantity* first = cols.data();
    for (std::int32_t i = from; i < n; ++i) {
      if (first[i] < demand[0]) continue;
      bool fits = true;
      for (std::int32_t k = 1; k < K && fits; ++k) fits = cols[static_cast<std::size_t>(k) * n + i] >= demand[k];
      if (fits) return i;
    }
    return -1;
  }
  // Units a shrink could take back grew on `bin` (of partition p) in pass `pass`.
  void reclaim_grew(std::int32_t bin, std::int32_t p, std::uint64_t pass) {
    if (bin_pass[bin] == pass) no_reclaim_pass[p] = 0;
  }
  // A start took room on released `bin` of partition p: its free vector is now `f`.
  void took(std::int32_t bin, std::int32_t p, const Quantity* f) {
    std::vector<Quantity>& cols = free_cols[p];
    const std::size_t n_leaves = leaves[p].size();
    const Quantity was = cols[bin_pos[bin]];
    for (std::int32_t k = 0; k < K; ++k) cols[static_cast<std::size_t>(k) * n_leaves + bin_pos[bin]] = f[k];
    if (was == first_max[p] && f[0] < was)  // it held the maximum: find the new one
      first_max[p] = *std::max_element(cols.begin(), cols.begin() + static_cast<std::ptrdiff_t>(n_leaves));
  }
};

}  // namespace tangram
