// Construction, bins and node membership: Impl's constructor and add_node (the bins the
// policy's BinLayout makes of a node, and every part's entries for them), and the Bins
// part's methods (bins.h).
//
// Reads: the inventory and the policy's row (BinLayout, ServiceDevices).
// Changes: bins (capacity, free room; under kMalleable each bin's running-action state),
// the partitions' BinTrees, devices, node membership.
// Guarantees: every bin's free vector is mirrored in its partition's free tree (hidden, all
// -1, while its trajectory slot is bound or its node offline); a node's bins under each
// layout sum exactly to its capacity; indices of nodes, bins and devices never change.
#include "tangram/scheduler_impl.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace tangram {

Scheduler::Impl::Impl(Inventory inventory, PolicyConfig cfg)
    : inv(std::move(inventory)), policy(std::move(cfg)), row(resolve_policy(policy)) {
  K = static_cast<std::int32_t>(inv.kinds.size());
  if (K == 0) throw Error(ErrorCode::kInvalidArgument, "inventory.kinds", "at least one resource kind is needed");
  for (std::int32_t k = 0; k < K; ++k) {
    if (inv.kinds[k].empty()) throw Error(ErrorCode::kInvalidArgument, "inventory.kinds[" + std::to_string(k) + "]", "a kind needs a name");
    for (std::int32_t j = 0; j < k; ++j)
      if (inv.kinds[j] == inv.kinds[k])
        throw Error(ErrorCode::kInvalidArgument, "inventory.kinds[" + std::to_string(k) + "]", "duplicate kind '" + inv.kinds[k] + "'");
  }
  if (inv.nodes.empty()) throw Error(ErrorCode::kInvalidArgument, "inventory.nodes", "at least one node is needed");
  const std::int32_t N = static_cast<std::int32_t>(inv.nodes.size());
  for (std::int32_t n = 0; n < N; ++n) {
    const auto& node = inv.nodes[n];
    std::string f = "inventory.nodes[" + std::to_string(n) + "]";
    if (static_cast<std::int32_t>(node.capacity.size()) != K)
      throw Error(ErrorCode::kInvalidArgument, f + ".capacity", "has " + std::to_string(node.capacity.size()) + " entries for " + std::to_string(K) + " kinds");
    for (std::int32_t k = 0; k < K; ++k)
      if (node.capacity[k] < 0 || node.capacity[k] > kMaxMilli)
        throw Error(ErrorCode::kInvalidArgument, f + ".capacity." + inv.kinds[k], "must be in [0, 1e12] units");
    for (std::size_t g = 0; g < node.gpus.size(); ++g)
      if (node.gpus[g].memory <= 0 || node.gpus[g].memory > kMaxMilli)
        throw Error(ErrorCode::kInvalidArgument, f + ".gpus[" + std::to_string(g) + "].memory", "must be in (0, 1e12] MiB");
    if (node.offload_memory < -1 || node.offload_memory > kMaxMilli)
      throw Error(ErrorCode::kInvalidArgument, f + ".offload_memory", "must be in [0, 1e12] MiB, or unlimited");
  }
  for (const NodeSpec& node : inv.nodes) bins.add_node(gpus.add_node(node));
  bins.set_dims(K, gpus.any());

  // quotas and services
  for (std::size_t q = 0; q < inv.quotas.size(); ++q) {
    quotas.emplace_back(inv.quotas[q], "inventory.quotas[" + std::to_string(q) + "]");
    for (std::size_t j = 0; j < q; ++j)
      if (inv.quotas[j].name == inv.quotas[q].name)
        throw Error(ErrorCode::kInvalidArgument, "inventory.quotas[" + std::to_string(q) + "].name", "duplicate quota '" + inv.quotas[q].name + "'");
  }
  this_pass.quota_blocked.assign(quotas.size(), 0);
  this_pass.quota_blocked_at.assign(quotas.size(), OrderKey{});
  for (std::size_t s = 0; s < inv.services.size(); ++s) {
    const auto& spec = inv.services[s];
    std::string f = "inventory.services[" + std::to_string(s) + "]";
    for (std::size_t j = 0; j < s; ++j)
      if (inv.services[j].name == spec.name) throw Error(ErrorCode::kInvalidArgument, f + ".name", "duplicate service '" + spec.name + "'");
    if (spec.memory < 0 || spec.memory > kMaxMilli) throw Error(ErrorCode::kInvalidArgument, f + ".memory", "must be in [0, 1e12] MiB");
    if (!std::isfinite(spec.restore_seconds) || spec.restore_seconds < 0 || spec.restore_seconds > kMaxSeconds)
      throw Error(ErrorCode::kInvalidArgument, f + ".restore_seconds", "must be a finite number in [0, 1e9]");
    if (!std::isfinite(spec.offload_seconds) || spec.offload_seconds < 0 || spec.offload_seconds > kMaxSeconds)
      throw Error(ErrorCode::kInvalidArgument, f + ".offload_seconds", "must be a finite number in [0, 1e9]");
    if (spec.max_batch < 1) throw Error(ErrorCode::kInvalidArgument, f + ".max_batch", "must be at least 1");
    if (spec.host_memory < 0 || spec.host_memory > kMaxMilli)
      throw Error(ErrorCode::kInvalidArgument, f + ".host_memory", "must be in [0, 1e12] MiB");
    if (spec.asleep_memory < 0 || spec.asleep_memory > spec.memory)
      throw Error(ErrorCode::kInvalidArgument, f + ".asleep_memory", "must be in [0, memory]");
    if (spec.asleep_memory > 0 && spec.movable)
      throw Error(ErrorCode::kInvalidArgument, f + ".asleep_memory",
                  "memory kept while offloaded stays on its device: the service must not be movable");
    if (!bins.has_gpus) throw Error(ErrorCode::kInvalidArgument, f, "a GPU service needs at least one GPU in the inventory");
    if (spec.replica_of != kNone) {
      const std::int32_t first = spec.replica_of;
      if (first < 0 || first >= static_cast<std::int32_t>(s) || inv.services[first].replica_of != kNone)
        throw Error(ErrorCode::kInvalidArgument, f + ".replica_of",
                    "must be the index of an earlier service that is not itself a replica");
      const ServiceSpec& f0 = inv.services[first];
      if (spec.memory != f0.memory || spec.max_batch != f0.max_batch || spec.asleep_memory != f0.asleep_memory ||
          spec.movable != f0.movable)
        throw Error(ErrorCode::kInvalidArgument, f + ".replica_of",
                    "a replica must have its first copy's memory, max_batch, asleep_memory and movable");
    } else if (spec.surplus) {
      throw Error(ErrorCode::kInvalidArgument, f + ".surplus", "only a replica (replica_of set) can be surplus");
    }
    ServiceRec rec;
    rec.restore_ns = to_ns(spec.restore_seconds);
    rec.offload_ns = to_ns(spec.offload_seconds);
    gpus.services.push_back(rec);
    gpus.replica_group.emplace_back();
    gpus.replica_group[spec.replica_of == kNone ? s : spec.replica_of].push_back(static_cast<std::int32_t>(s));
  }

  // policy
  std::string pf = "policy(" + row.name + ")";
  validate_rules(row, pf);
  if (!std::isfinite(policy.aging) || policy.aging < 0 || policy.aging > 4)
    throw Error(ErrorCode::kInvalidArgument, pf + ".aging", "must be a finite number in [0, 4]");
  const bool by_estimate = row.rules.order == OrderRule::kEstimate || row.rules.order == OrderRule::kProgress;
  count_progress = row.rules.order == OrderRule::kProgress;
  service_tails_ordered = row.rules.order == OrderRule::kEstimate;
  estimate_weight = by_estimate ? 1 : 0;
  aging_permille = by_estimate ? to_milli(policy.aging) : 0;
  if (policy.candidates < 1 || policy.candidates > 1024)
    throw Error(ErrorCode::kInvalidArgument, pf + ".candidates", "must be in [1, 1024]");
  if (!std::isfinite(policy.min_relative_gain) || policy.min_relative_gain < 0 || policy.min_relative_gain > 1)
    throw Error(ErrorCode::kInvalidArgument, pf + ".min_relative_gain", "must be a finite number in [0, 1]");
  if (!std::isfinite(policy.starvation_seconds) || policy.starvation_seconds <= 0 || policy.starvation_seconds > kMaxSeconds)
    throw Error(ErrorCode::kInvalidArgument, pf + ".starvation_seconds", "must be a finite number in (0, 1e9]");
  starvation_ns = to_ns(policy.starvation_seconds);

  malleable = row.rules.resize == ResizeRule::kMalleable;

  // Validate the policy's bin options; then every node's bins, partition by partition.
  switch (row.rules.bins) {
    case BinLayout::kNodes:
      bins.partitions.resize(1);
      break;
    case BinLayout::kTrajectorySlots: {
      bool has_cpu = false;
      for (std::int32_t k = 0; k < K; ++k) has_cpu = has_cpu || inv.kinds[k] == "cpu";
      if (!has_cpu) throw Error(ErrorCode::kUnknownName, pf, "trajectory slots need a 'cpu' kind");
      if (!std::isfinite(policy.trajectory_slot_cpu) || policy.trajectory_slot_cpu <= 0 ||
          policy.trajectory_slot_cpu > kMaxBaseUnits)
        throw Error(ErrorCode::kInvalidArgument, pf + ".trajectory_slot_cpu", "must be a finite number in (0, 1e12]");
      if (to_milli(policy.trajectory_slot_cpu) < 1)
        throw Error(ErrorCode::kInvalidArgument, pf + ".trajectory_slot_cpu", "must be at least 0.0005 cores (one milli-core)");
      bins.partitions.resize(1);
      break;
    }
    case BinLayout::kTaskPools: {
      if (policy.pools.empty()) throw Error(ErrorCode::kInvalidArgument, pf + ".pools", "task pools need at least one pool");
      for (std::size_t p = 0; p < policy.pools.size(); ++p) {
        double w = policy.pools[p].second;
        if (!std::isfinite(w) || w <= 0 || w > 1e6)
          throw Error(ErrorCode::kInvalidArgument, pf + ".pools[" + std::to_string(p) + "].weight", "must be a finite number in (0, 1e6]");
        if (bins.pool_partition.count(policy.pools[p].first))
          throw Error(ErrorCode::kInvalidArgument, pf + ".pools[" + std::to_string(p) + "].task", "duplicate task pool " + std::to_string(policy.pools[p].first));
        bins.pool_partition[policy.pools[p].first] = static_cast<std::int32_t>(p);
      }
      bins.partitions.resize(policy.pools.size());
      break;
    }
  }
  elastic.resize(K, bins.partitions.size());
  spare.resize(K, N, bins.partitions.size());
  std::vector<NodeBins> splits(static_cast<std::size_t>(N));
  for (std::int32_t n = 0; n < N; ++n) splits[n] = node_bins(inv.nodes[n].capacity);
  for (std::size_t p = 0; p < bins.partitions.size(); ++p)
    for (std::int32_t n = 0; n < N; ++n)
      for (const std::vector<Quantity>& cap : splits[n][p]) append_bin(n, static_cast<std::int32_t>(p), cap);
  starving_head_halts = bins.partitions.size() == 1 && row.rules.bins != BinLayout::kTrajectorySlots;
  if (row.rules.bins == BinLayout::kTrajectorySlots && bins.partitions[0].bins.empty())
    throw Error(ErrorCode::kInvalidArgument, pf + ".trajectory_slot_cpu", "larger than every node's cpu: no slot fits");
  if (uses_service_home()) {
    // A dedicated deployment: each service runs its minimum copies only (its surplus copies
    // are never routed to, so never restored), and each of those is given a home device up
    // front, round robin over all devices in service order, as a dedicated reward pool would be.
    for (std::vector<std::int32_t>& group : gpus.replica_group)
      group.erase(std::remove_if(group.begin(), group.end(),
                                 [&](std::int32_t copy) { return inv.services[copy].surplus; }),
                  group.end());
    std::size_t deployed = 0;
    for (std::size_t s = 0; bins.has_gpus && s < gpus.services.size(); ++s)
      if (!inv.services[s].surplus) gpus.services[s].home_device = static_cast<std::int32_t>(deployed++ % gpus.dev_node.size());
  }
  for (const std::vector<std::int32_t>& group : gpus.replica_group) gpus.any_replicated |= group.size() > 1;
  bins.build_trees();
  classes.K = K;
  classes.node_parked.resize(N);
  // Room for a few parked classes per node up front: the lists' first growths, one per node
  // in a burst of pinned actions, would otherwise cost a reallocation each in the pass.
  for (std::vector<std::int32_t>& list : classes.node_parked) list.reserve(Classes::kNodeParkedReserve);
  classes.node_parked_count.assign(N, 0);
  classes.partition_parking.resize(bins.partitions.size());
  released.resize(K, N, bins.partitions.size(), bins.bin_node.size());
  this_pass.node_masked.assign(N, 0);
  this_pass.partition_masked.assign(bins.partitions.size(), 0);
  this_pass.query.resize(bins.D);
}

// ---- Bins

void Bins::set_dims(std::int32_t kinds, bool gpus) {
  K = kinds;
  has_gpus = gpus;
  D = K + (has_gpus ? 1 : 0);
  leaf_row.assign(D, 0);
}

void Bins::add_node(Quantity max_dev) {
  node_max_dev_free.push_back(max_dev);
  node_max_dev_total.push_back(max_dev);
  node_online.push_back(1);
  node_busy_holders.push_back(0);
}

void Bins::append_bin(std::int32_t node, std::int32_t part, const std::vector<Quantity>& cap) {
  const std::int32_t b = static_cast<std::int32_t>(bin_node.size());
  bin_node.push_back(node);
  bin_partition.push_back(part);
  bin_leaf.push_back(static_cast<std::int32_t>(partitions[part].bins.size()));
  partitions[part].bins.push_back(b);
  bin_room.insert(bin_room.end(), cap.begin(), cap.end());  // free: all of it
  bin_room.insert(bin_room.end(), cap.begin(), cap.end());
  bin_bound.push_back(0);
  bin_holder.push_back(0);
  bin_holder_running.push_back(0);
  bin_lent_running.push_back(0);
}

void Bins::refresh_leaf(std::int32_t bin) {
  Partition& part = partitions[bin_partition[bin]];
  std::int32_t leaf = bin_leaf[bin];
  // A bound trajectory slot and an offline node's bins stay hidden: nothing else is placed
  // there (a bound slot's own trajectory finds it through trajectory_bin).
  if (bin_bound[bin] || !node_online[bin_node[bin]]) return hide_leaf(part, leaf);
  std::copy(free_of(bin), free_of(bin) + K, leaf_row.begin());
  if (has_gpus) leaf_row[K] = node_max_dev_free[bin_node[bin]];
  part.free_tree.set(leaf, leaf_row.data());
}

void Bins::set_node_dev_free(std::int32_t node, Quantity best) {
  if (best == node_max_dev_free[node]) return;
  if (best > node_max_dev_free[node]) ++search_epoch;  // room grew: search hints are void
  node_max_dev_free[node] = best;
  if (!node_online[node]) return;  // its leaves stay hidden
  for (auto& part : partitions) {
    if (part.node_lo[node] < 0) continue;
    for (std::int32_t leaf = part.node_lo[node]; leaf < part.node_hi[node]; ++leaf) {
      if (bin_bound[part.bins[leaf]]) continue;  // a bound trajectory slot stays hidden
      std::copy(part.free_tree.leaf(leaf), part.free_tree.leaf(leaf) + D, leaf_row.begin());
      leaf_row[K] = best;
      part.free_tree.set(leaf, leaf_row.data());
    }
  }
}

// (Re)builds every partition's trees and node ranges from the bins' current state: at
// construction, and when add_node appends bins (and maybe the GPU dimension).
void Bins::build_trees() {
  const std::int32_t N = nodes();
  std::vector<Quantity> v(D), hidden(D, -1);
  for (auto& part : partitions) {
    std::int32_t leaves = static_cast<std::int32_t>(part.bins.size());
    part.free_tree = BinTree(leaves, D);
    part.cap_tree = BinTree(leaves, D);
    part.node_lo.assign(N, -1);
    part.node_hi.assign(N, -1);
    for (std::int32_t leaf = 0; leaf < leaves; ++leaf) {
      std::int32_t b = part.bins[leaf];
      std::int32_t n = bin_node[b];
      if (part.node_lo[n] < 0) part.node_lo[n] = leaf;
      part.node_hi[n] = leaf + 1;
      std::copy(cap_of(b), cap_of(b) + K, v.begin());
      if (has_gpus) v[K] = node_max_dev_total[n];
      part.cap_tree.set(leaf, v.data());
      if (bin_bound[b] || !node_online[n]) {
        part.free_tree.set(leaf, hidden.data());
        continue;
      }
      std::copy(free_of(b), free_of(b) + K, v.begin());
      if (has_gpus) v[K] = node_max_dev_free[n];
      part.free_tree.set(leaf, v.data());
    }
    part.cap_tree.settle();  // capacities change only here: const searches never write
  }
}

void Bins::hide_leaf(Partition& part, std::int32_t leaf) {
  std::fill(leaf_row.begin(), leaf_row.end(), -1);
  part.free_tree.set(leaf, leaf_row.data());
}

// Offline: the node's leaves leave the free trees; nothing more is placed there. Online:
// its unbound leaves come back with their exact free vectors.
bool Bins::set_node_online(std::int32_t node, bool online) {
  if (static_cast<bool>(node_online[node]) == online) return false;
  node_online[node] = online ? 1 : 0;
  n_offline += online ? -1 : 1;
  for (auto& part : partitions) {
    if (part.node_lo[node] < 0) continue;
    for (std::int32_t leaf = part.node_lo[node]; leaf < part.node_hi[node]; ++leaf) {
      const std::int32_t b = part.bins[leaf];
      if (!online) hide_leaf(part, leaf);
      else if (!bin_bound[b]) refresh_leaf(b);
    }
  }
  return true;
}

void Bins::bind_slot(std::int32_t bin, TrajectoryId trajectory) {
  trajectory_bin[trajectory] = bin;
  bin_holder[bin] = trajectory;
  ++node_busy_holders[bin_node[bin]];  // it has a live action
  if (bin_bound[bin]) return;  // taken over: hidden already
  bin_bound[bin] = 1;
  hide_leaf(partitions[bin_partition[bin]], bin_leaf[bin]);
}

void Bins::clear_slot(std::int32_t bin) {
  bin_bound[bin] = 0;
  bin_holder[bin] = 0;
  refresh_leaf(bin);
}

bool Bins::fits_some_bin(std::int32_t partition, const Quantity* demand, std::int32_t node) const {
  const Partition& part = partitions[partition];
  for (std::int32_t leaf = part.node_lo[node]; leaf >= 0 && leaf < part.node_hi[node]; ++leaf) {
    const Quantity* f = free_of(part.bins[leaf]);
    bool fits = true;
    for (std::int32_t k = 0; k < K && fits; ++k) fits = f[k] >= demand[k];
    if (fits) return true;
  }
  return false;
}

// Only asked while a node is offline: a starving action that fits nowhere online must not
// hold the online bins back for a node that may never return.
bool Bins::fits_online_capacity(std::int32_t partition, const Quantity* demand, Quantity gpu_memory, std::int32_t lo,
                                std::int32_t hi, std::int32_t device) const {
  const Partition& part = partitions[partition];
  for (std::int32_t leaf = lo; leaf < hi; ++leaf) {
    const std::int32_t b = part.bins[leaf];
    const std::int32_t n = bin_node[b];
    if (!node_online[n]) continue;
    const Quantity* cap = cap_of(b);
    bool fits = true;
    for (std::int32_t k = 0; k < K && fits; ++k) fits = cap[k] >= demand[k];
    if (fits && device == kNone && gpu_memory > 0) fits = node_max_dev_total[n] >= gpu_memory;
    if (fits) return true;
  }
  return false;
}

bool Bins::never_holds(std::int32_t bin, const Quantity* demand, Quantity gpu_memory) const {
  const Quantity* cap = cap_of(bin);
  for (std::int32_t k = 0; k < K; ++k)
    if (cap[k] < demand[k]) return true;
  return has_gpus && gpu_memory > 0 && node_max_dev_total[bin_node[bin]] < gpu_memory;
}

void Scheduler::Impl::refresh_node_devices(std::int32_t node) { bins.set_node_dev_free(node, gpus.most_free_on(node)); }

// Offline: the node's leaves leave the free trees; nothing more is placed there. Online:
// its unbound leaves come back with their exact free vectors, and classes parked for room
// are woken as by a release on the node.
void Scheduler::Impl::set_node_online(std::int32_t node, bool online) {
  if (bins.set_node_online(node, online) && online) release_on_node(node, kNone);
}

// A device out of placement (online=false) fences its free memory off, and whatever
// returns to it later; back online, the fenced memory is free again.
void Scheduler::Impl::set_device_online(std::int32_t d, bool online) {
  if (!gpus.set_online(d, online)) return;
  refresh_node_devices(gpus.dev_node[d]);
  if (online) release_on_node(gpus.dev_node[d], kNone);
}

// A bin at the end of its partition's leaves, all of its capacity free, and its entries in
// the other parts.
void Scheduler::Impl::append_bin(std::int32_t node, std::int32_t part, const std::vector<Quantity>& cap) {
  bins.append_bin(node, part, cap);
  spare.append_bin();
  if (malleable) elastic.append_bin(part);
}

// The policy's bins for one node of `capacity` (the options already validated): per
// partition, each bin's capacity. tangram, fifo, optimus: the whole node. trajectory:
// whole slots of trajectory_slot_cpu cores, other kinds split evenly among them. isolated:
// each task pool's share, split exactly: the floor of each share in parts per million,
// then the milli-units left over spread evenly, the first pools taking one more, so the
// shares sum to the node.
Scheduler::Impl::NodeBins Scheduler::Impl::node_bins(const std::vector<Quantity>& capacity) const {
  NodeBins split(bins.partitions.size());
  switch (row.rules.bins) {
    case BinLayout::kNodes:
      split[0].push_back(capacity);
      break;
    case BinLayout::kTrajectorySlots: {
      std::int32_t cpu = kNone;
      for (std::int32_t k = 0; k < K; ++k)
        if (inv.kinds[k] == "cpu") cpu = k;
      const Quantity n_slots = trajectory_slots(capacity[cpu], policy.trajectory_slot_cpu);
      std::vector<Quantity> cap(K);
      for (std::int32_t k = 0; k < K; ++k)
        cap[k] = k == cpu ? to_milli(policy.trajectory_slot_cpu) : (n_slots > 0 ? capacity[k] / n_slots : 0);
      split[0].assign(static_cast<std::size_t>(n_slots), cap);
      break;
    }
    case BinLayout::kTaskPools: {
      double total = 0;
      for (const auto& pool : policy.pools) total += pool.second;
      const std::size_t P = policy.pools.size();
      for (std::size_t p = 0; p < P; ++p) split[p].assign(1, std::vector<Quantity>(K));
      for (std::int32_t k = 0; k < K; ++k) {
        Quantity given = 0;
        for (std::size_t p = 0; p < P; ++p) {
          const Quantity ppm = static_cast<Quantity>(std::floor(policy.pools[p].second / total * 1e6));
          const Quantity q = static_cast<Quantity>((static_cast<__int128>(capacity[k]) * ppm) / 1000000);
          split[p][0][k] = q;
          given += q;
        }
        const Quantity left = capacity[k] - given, each = left / static_cast<Quantity>(P);
        const std::size_t extra = static_cast<std::size_t>(left % static_cast<Quantity>(P));
        for (std::size_t p = 0; p < P; ++p) split[p][0][k] += each + (p < extra ? 1 : 0);
      }
      break;
    }
  }
  return split;
}

// Appends a node: its bins (as the constructor makes them for the policy), its GPUs, and
// every per-node index; then rebuilds the trees. Class feasibility is recomputed (new
// capacity can only make more classes feasible).
std::int32_t Scheduler::Impl::add_node(NodeSpec spec) {
  const std::int32_t n = static_cast<std::int32_t>(inv.nodes.size());
  const NodeBins split = node_bins(spec.capacity);
  for (std::size_t p = 0; p < split.size(); ++p)
    for (const std::vector<Quantity>& cap : split[p]) append_bin(n, static_cast<std::int32_t>(p), cap);
  // devices: appended after every existing one, so global device indices stay valid
  bins.add_node(gpus.add_node(spec));
  bins.set_dims(K, gpus.any());
  this_pass.query.assign(bins.D, 0);
  inv.nodes.push_back(std::move(spec));
  classes.node_parked.emplace_back().reserve(Classes::kNodeParkedReserve);
  classes.node_parked_count.push_back(0);
  spare.resize(K, bins.nodes(), bins.partitions.size());
  this_pass.node_masked.push_back(0);
  released.resize(K, bins.nodes(), bins.partitions.size(), bins.bin_node.size());  // leaf positions change below
  bins.build_trees();
  for (auto& cl : classes) cl.infeasible = infeasible_reason(cl);
  release_on_node(n, kNone);
  return n;
}

}  // namespace tangram
