// Bins and their trees: what placement packs into, per the policy's BinLayout (a node, one
// trajectory slot, or a node's share for one task pool), node membership, and trajectory
// slots' bindings. A part of Scheduler::Impl (scheduler_impl.h); bins.cc makes the bins
// and holds the out-of-line methods. It knows nothing of classes: a demand is K amounts.
//
// Owns: per bin its free vector and capacity, node, partition and leaf; per partition
// (one, or one per task pool) its bins in leaf order, each node's leaf range and two
// BinTrees (free room, capacity); per node whether it is online and its largest free and
// total device memory (the trees' GPU dimension); trajectory slots' holders.
// Guarantees (check(), in introspection.cc; Impl::check() adds those that need the actions):
//   - each bin's free vector is mirrored in its partition's free tree, the node's largest
//     free device memory beside it when there are GPUs, except that the leaf of a bound
//     trajectory slot or of an offline node is hidden (all -1): nothing else is placed there;
//   - a partition's leaves are its bins in node order, node_lo/node_hi bound each node's;
//     the cap tree holds capacities and is settled (its const searches never write);
//   - a node's bins under each layout sum exactly to its capacity; indices of nodes, bins
//     and leaves never change (add_node appends);
//   - a slot is bound exactly when trajectory_bin maps its holder to it (bin_holder);
//   - search_epoch moves on at each pass and whenever free room grows during one (device
//     memory freed, units a shrink gave back): while it stays, room only shrinks, so a
//     search hint taken under it (Class::tree_from) holds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tangram/bin_tree.h"
#include "tangram/failed_demands.h"
#include "tangram/model.h"

namespace tangram {

struct Partition {
  std::vector<std::int32_t> bins;       // global bin ids, in leaf order
  std::vector<std::int32_t> node_lo;    // per node: first leaf of its bins (or -1)
  std::vector<std::int32_t> node_hi;
  BinTree free_tree;  // free vector (+ node's largest free device memory); -1 = unusable
  BinTree cap_tree;   // capacity vector (+ node's largest device) for feasibility

  // Queries of the free tree over all its leaves, none skipped, that found no leaf under
  // the current Bins::search_epoch: the heads of a pass that fit nowhere (new arrivals into
  // a full cluster) skip the search.
  FailedDemands no_fit;
};

struct Bins {
  std::int32_t K = 0;  // kinds
  std::int32_t D = 0;  // tree dims: K (+1 when there are GPUs)
  bool has_gpus = false;
  // Per bin: its free vector then its capacity (2K entries), side by side because the
  // best-fit score of a candidate reads both.
  std::vector<Quantity> bin_room;
  std::vector<std::int32_t> bin_node, bin_partition, bin_leaf;
  std::vector<Partition> partitions;
  std::unordered_map<std::uint32_t, std::int32_t> pool_partition;  // BinLayout::kTaskPools
  std::vector<Quantity> node_max_dev_free, node_max_dev_total;  // per node, over its devices
  // Node membership (set_node_online / add_node). An offline node's bins are hidden from
  // the free trees, so nothing is placed there; its running actions keep their resources
  // until the caller completes or cancels them.
  std::vector<std::uint8_t> node_online;  // per node
  std::int32_t n_offline = 0;
  std::uint64_t search_epoch = 0;

  // Trajectory slots (BinLayout::kTrajectorySlots).
  std::unordered_map<TrajectoryId, std::int32_t> trajectory_bin;  // a trajectory's bound slot
  std::vector<std::uint8_t> bin_bound;  // held by a trajectory (hidden from the free tree)
  // Per bin: its holder, and how many of the holder's own actions run there.
  std::vector<TrajectoryId> bin_holder;
  std::vector<std::int32_t> bin_holder_running;
  std::vector<std::int32_t> bin_lent_running;  // actions running there in it as a lent slot
  // Per node: its held slots whose holder has a live action. A node where that is 0 lends
  // its held slots (lend_slot_room): every slot there is held by a trajectory with nothing
  // to do, so no work in progress could free one for a trajectory without.
  std::vector<std::int32_t> node_busy_holders;

  std::vector<Quantity> leaf_row;  // scratch of the free trees' writes (D entries)

  Quantity* free_of(std::int32_t bin) { return &bin_room[static_cast<std::size_t>(bin) * 2 * K]; }
  const Quantity* free_of(std::int32_t bin) const { return &bin_room[static_cast<std::size_t>(bin) * 2 * K]; }
  const Quantity* cap_of(std::int32_t bin) const { return &bin_room[(static_cast<std::size_t>(bin) * 2 + 1) * K]; }
  std::int32_t nodes() const { return static_cast<std::int32_t>(node_online.size()); }
  // Argument check of the public calls: Error naming the field when out of range.
  void check_node(std::int32_t node) const {
    if (node < 0 || node >= nodes()) throw Error(ErrorCode::kUnknownName, "node", "no node with index " + std::to_string(node));
  }

  // ---- bins.cc
  // Sets the kinds and whether there are GPUs (the trees' dimensions); the trees are built
  // again by build_trees.
  void set_dims(std::int32_t kinds, bool gpus);
  // A node (online, no bins yet) whose largest device has `max_dev` memory (0: none).
  void add_node(Quantity max_dev);
  // A bin at the end of its partition's leaves, all of its capacity free.
  void append_bin(std::int32_t node, std::int32_t part, const std::vector<Quantity>& cap);
  void build_trees();  // every partition's trees and node ranges, from the bins' state
  void refresh_leaf(std::int32_t bin);  // after its free vector changed
  void hide_leaf(Partition& part, std::int32_t leaf);
  // The node's largest free device memory is now `best` (its leaves follow).
  void set_node_dev_free(std::int32_t node, Quantity best);
  bool set_node_online(std::int32_t node, bool online);  // false when it already was so
  // Trajectory slots: `bin` becomes `trajectory`'s (hidden, its node's holders busy), or
  // free again (shown).
  void bind_slot(std::int32_t bin, TrajectoryId trajectory);
  void clear_slot(std::int32_t bin);
  // Whether a bin of `node` in `partition` has free room for `demand`.
  bool fits_some_bin(std::int32_t partition, const Quantity* demand, std::int32_t node) const;
  // Whether some online bin in leaves [lo, hi) of `partition` could ever hold `demand`
  // (and `gpu_memory` on one device of its node unless `device` is set), by capacity.
  bool fits_online_capacity(std::int32_t partition, const Quantity* demand, Quantity gpu_memory, std::int32_t lo,
                            std::int32_t hi, std::int32_t device) const;
  // Whether `bin` can never hold `demand` with `gpu_memory` on one device: by capacity, or
  // GPU memory no device of its node has.
  bool never_holds(std::int32_t bin, const Quantity* demand, Quantity gpu_memory) const;

  void check() const;  // the trees, node membership and slot bindings (introspection.cc)

  // Best fit among candidate `leaves` of `partition` (at least one): least normalised room
  // left over by `demand`; the first on ties.
  std::int32_t best_fit(const std::vector<std::int32_t>& leaves, std::int32_t partition, const Quantity* demand) const {
    const Partition& part = partitions[partition];
    std::int32_t best_leaf = leaves[0];
    if (leaves.size() > 1) {
      std::int64_t best_score = INT64_MAX;
      for (std::int32_t leaf : leaves) {
        std::int32_t b = part.bins[leaf];
        const Quantity* f = free_of(b);
        const Quantity* cap = cap_of(b);
        std::int64_t score = 0;
        for (std::int32_t k = 0; k < K; ++k)
          if (cap[k] > 0) score += ((f[k] - demand[k]) * 1024) / cap[k];
        if (score < best_score) {
          best_score = score;
          best_leaf = leaf;
        }
      }
    }
    return best_leaf;
  }
  // A held slot `bin` is lent to a trajectory's class (`in_slot`): one holding no slot, on
  // a node where no holder has anything live.
  bool lends_to(bool in_slot, TrajectoryId trajectory, std::int32_t bin) const {
    return in_slot && node_busy_holders[bin_node[bin]] == 0 && !trajectory_bin.count(trajectory);
  }
  // Online, and not another trajectory's slot (a class in its trajectory's slot: `in_slot`).
  bool may_use(std::int32_t bin, bool in_slot, TrajectoryId trajectory) const {
    if (!node_online[bin_node[bin]]) return false;
    if (!bin_bound[bin]) return true;
    if (!in_slot) return false;
    auto it = trajectory_bin.find(trajectory);
    return it != trajectory_bin.end() && it->second == bin;
  }
  // The slot `trajectory` holds (trajectory slots), or kNone.
  std::int32_t held_slot(TrajectoryId trajectory) const {
    auto it = trajectory_bin.find(trajectory);
    return it == trajectory_bin.end() ? kNone : it->second;
  }
};

}  // namespace tangram
