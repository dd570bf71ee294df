// Introspection: why an action waits (explain) and the invariants (check: those across
// parts here, each part's own in its check()).
//
// Reads everything; changes nothing.
#include "tangram/scheduler_impl.h"
#include "tangram/text.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace tangram {

namespace {
[[noreturn]] void fail(const std::string& what) { throw std::logic_error("invariant violated: " + what); }
}  // namespace

std::string Scheduler::Impl::explain(ActionId id) const {
  const std::int32_t* slot = actions.by_id.find(id);
  if (slot == nullptr) return "action " + std::to_string(id) + " is not live (never submitted, or already ended)";
  const ActionRec& a = actions.slots[*slot];
  Text os;
  if (a.state == ActionState::kRunning) {
    os << "running on node " << bins.bin_node[a.bin] << " (" << inv.nodes[bins.bin_node[a.bin]].name << ")";
    if (a.device != kNone) os << ", GPU " << gpus.dev_local[a.device];
    if (a.elastic_kind != kNone) {
      os << ", " << inv.kinds[a.elastic_kind] << " grant " << a.grant / 1000.0;
      const RunState* r = malleable ? &elastic.run_state[*slot] : nullptr;
      if (r != nullptr && r->resized_ns >= 0)
        os << " (from " << r->grant_before / 1000.0 << " at " << to_seconds(r->resized_ns) << " s)";
      if (a.elastic_max < actions.details[*slot].submitted_max)
        os << ", limited by the action to " << a.elastic_max / 1000.0 << " of " << actions.details[*slot].submitted_max / 1000.0;
    }
    return os.str();
  }
  const Class& cl = classes[a.cls];
  std::size_t ahead = 0;
  for (const OrderKey& k : cl.waiting.sorted()) {
    if (k.slot == *slot) break;
    ++ahead;
  }
  os << "waiting";
  if (ahead > 0) os << " behind " << ahead << " earlier action" << (ahead > 1 ? "s" : "") << " of the same shape;";
  auto when = [&](TimeNs t) { return std::to_string(to_seconds(t)) + " s"; };
  switch (cl.parked ? Block::kResources : cl.block) {
    case Block::kNotConsidered:
      os << " not yet considered by a scheduling pass";
      break;
    case Block::kResources: {
      os << " for resources: needs";
      for (std::int32_t k = 0; k < K; ++k)
        if (cl.demand[k] > 0) os << " " << inv.kinds[k] << "=" << cl.demand[k] / 1000.0;
      if (cl.gpu_memory > 0) os << " gpu_memory=" << cl.gpu_memory / 1000.0;
      if (cl.affinity_node != kNone) os << " on node " << cl.affinity_node;
      if (cl.service != kNone) os << " beside service '" << inv.services[cl.service].name << "'";
      // Over the bins it could be placed in: online, on its affinity node if it has one,
      // and not another trajectory's slot (a service action may use those: held_slot_room).
      const Partition& part = bins.partitions[cl.partition];
      auto own = bins.trajectory_bin.find(cl.trajectory);
      const std::int32_t own_bin = cl.in_trajectory_slot && own != bins.trajectory_bin.end() ? own->second : kNone;
      const bool any_slot = cl.service != kNone;
      std::vector<Quantity> best(K, 0);
      for (std::int32_t b : part.bins) {
        if (!bins.node_online[bins.bin_node[b]] || (bins.bin_bound[b] && b != own_bin && !any_slot)) continue;
        if (cl.affinity_node != kNone && bins.bin_node[b] != cl.affinity_node) continue;
        for (std::int32_t k = 0; k < K; ++k) best[k] = std::max(best[k], bins.free_of(b)[k]);
      }
      os << "; most free on one bin it may use:";
      for (std::int32_t k = 0; k < K; ++k) os << " " << inv.kinds[k] << "=" << best[k] / 1000.0;
      if (cl.in_trajectory_slot && !bins.trajectory_bin.count(cl.trajectory))
        os << " (no free trajectory slot, and every node's held slots are full or have work in progress)";
      break;
    }
    case Block::kHeldBack:
      os << " held back: an action that has waited over " << policy.starvation_seconds << " s has first claim on the resources it needs";
      break;
    case Block::kQuotaRate:
      os << " for quota '" << inv.quotas[cl.quota].name << "' rate limit; next admission at " << when(cl.block_until);
      break;
    case Block::kQuotaTokens:
      os << " for quota '" << inv.quotas[cl.quota].name << "' token budget; enough tokens at " << when(cl.block_until);
      break;
    case Block::kQuotaConcurrency:
      os << " for quota '" << inv.quotas[cl.quota].name << "' concurrency limit (" << inv.quotas[cl.quota].max_concurrency << " in flight)";
      break;
    case Block::kServiceRestoring:
      os << " for service '" << inv.services[cl.service].name << "' to finish restoring at " << when(cl.block_until);
      break;
    case Block::kServiceOffline:
      os << " for service '" << inv.services[cl.service].name << "': its node is offline; it moves once its actions there have ended";
      break;
    case Block::kServiceNoRoom:
      os << " for service '" << inv.services[cl.service].name << "': no GPU can make room for it now (resident services are busy)";
      break;
    case Block::kServiceDraining: {
      const ServiceRec& svc = gpus.services[cl.service];
      os << " for service '" << inv.services[cl.service].name << "': it starts nothing until it is evicted for service '"
         << inv.services[svc.draining_for].name << "', which has waited longer than starvation_seconds for GPU memory";
      break;
    }
    case Block::kServiceBatchFull:
      os << " for service '" << inv.services[cl.service].name << "': its batch is full (" << inv.services[cl.service].max_batch << " running)";
      break;
  }
  return os.str();
}

// ResizeRule::kMalleable: each running action listed once, on its bin; each bin's
// reclaimable units the sum of its running elastic actions' units above their minimum, and
// listed in its partition exactly when there are some; remaining work a fraction.
void Scheduler::Impl::check_running() const {
  const std::size_t B = bins.bin_node.size();
  std::vector<Quantity> reclaim(B * K, 0);
  std::size_t listed = 0;
  for (std::size_t b = 0; b < B; ++b) {
    const BinRun& run = elastic.bin_run[b];
    for (std::size_t i = 0; i < run.running.size(); ++i) {
      const std::int32_t s = run.running[i];
      const ActionRec& a = actions.slots[s];
      if (a.state != ActionState::kRunning || a.bin != static_cast<std::int32_t>(b) ||
          elastic.run_state[s].running_pos != static_cast<std::int32_t>(i))
        fail("running list of bin " + std::to_string(b) + " out of sync");
      if (a.elastic_kind != kNone) reclaim[b * K + a.elastic_kind] += a.grant - minimum(a);
      const double work = elastic.run_state[s].work_left;
      if (elastic.run_state[s].resized_ns >= 0 && !(work >= 0 && work <= 1))
        fail("work left outside [0, 1] for action " + std::to_string(a.id));
      ++listed;
    }
    Quantity sum = 0;
    for (std::int32_t k = 0; k < K; ++k) {
      if (reclaim[b * K + k] != elastic.bin_reclaim[b * K + k]) fail("reclaimable units of bin " + std::to_string(b));
      sum += reclaim[b * K + k];
    }
    if (sum != run.reclaim_sum) fail("reclaimable sum of bin " + std::to_string(b));
    const std::int32_t pos = run.reclaim_pos;
    const std::vector<std::int32_t>& list = elastic.reclaim_bins[bins.bin_partition[b]];
    if ((sum > 0) != (pos >= 0) || (pos >= 0 && (pos >= static_cast<std::int32_t>(list.size()) || list[pos] != static_cast<std::int32_t>(b))))
      fail("reclaim list of bin " + std::to_string(b));
  }
  std::size_t in_lists = 0;
  for (const std::vector<std::int32_t>& list : elastic.reclaim_bins) in_lists += list.size();
  std::size_t with_units = 0;
  for (std::size_t b = 0; b < B; ++b) with_units += elastic.bin_run[b].reclaim_sum > 0 ? 1 : 0;
  if (listed != actions.n_running || in_lists != with_units) fail("running or reclaim lists out of sync");
}

void Scheduler::Impl::check() const {
  const std::size_t B = bins.bin_node.size();
  std::vector<Quantity> used(B * K, 0);
  std::vector<Quantity> dev_used(gpus.dev_node.size(), 0);
  std::vector<std::int32_t> svc_running(gpus.services.size(), 0), quota_running(quotas.size(), 0);
  std::vector<std::int32_t> class_running(classes.size(), 0);
  std::vector<std::int64_t> svc_waiting(gpus.services.size(), 0);
  std::vector<TimeNs> svc_queued(gpus.services.size(), 0), svc_running_ns(gpus.services.size(), 0);
  std::size_t waiting = 0, running = 0;
  actions.by_id.for_each([&](ActionId id, std::int32_t slot) {
    const ActionRec& a = actions.slots[slot];
    if (a.id != id) fail("id index out of sync");
    const Class& cl = classes[a.cls];
    if (a.state == ActionState::kRunning) {
      ++running;
      ++class_running[a.cls];
      for (std::int32_t k = 0; k < K; ++k) used[a.bin * K + k] += cl.demand[k];
      if (a.elastic_kind != kNone) {
        if (a.grant < cl.demand[a.elastic_kind] || a.grant > std::max(a.elastic_max, cl.demand[a.elastic_kind]))
          fail("grant outside [minimum, elastic_max] for action " + std::to_string(id));
        if (a.elastic_max > actions.details[slot].submitted_max)
          fail("elastic_max above the maximum submitted for action " + std::to_string(id));
        used[a.bin * K + a.elastic_kind] += a.grant - cl.demand[a.elastic_kind];
      }
      if (cl.gpu_memory > 0) dev_used[a.device] += cl.gpu_memory;
      if (cl.service != kNone) {
        ++svc_running[cl.service];
        svc_running_ns[cl.service] += actions.details[slot].est_ns;
        if (a.device != gpus.services[cl.service].device) fail("service action off its service's device");
      }
      if (cl.quota != kNone) ++quota_running[cl.quota];
    } else if (a.state == ActionState::kWaiting) {
      ++waiting;
      if (!cl.waiting.contains(actions.details[slot].order, actions.queue_pos)) fail("waiting action missing from its class");
      if (cl.service != kNone) {
        ++svc_waiting[cl.service];
        svc_queued[cl.service] += actions.details[slot].est_ns;
      }
    } else {
      fail("live action in a terminal state");
    }
  });
  if (waiting != actions.n_waiting || running != actions.n_running) fail("waiting/running counts");
  if (malleable) check_running();
  for (std::size_t b = 0; b < B; ++b)
    for (std::int32_t k = 0; k < K; ++k) {
      Quantity cap = bins.cap_of(static_cast<std::int32_t>(b))[k], f = bins.free_of(static_cast<std::int32_t>(b))[k];
      if (f < 0) fail("capacity exceeded on bin " + std::to_string(b));
      if (f + used[b * K + k] != cap) fail("free + used != capacity on bin " + std::to_string(b));
    }
  for (std::size_t s = 0; s < gpus.services.size(); ++s)
    if (gpus.services[s].running != svc_running[s] || gpus.services[s].waiting != svc_waiting[s] ||
        gpus.services[s].queued_ns != svc_queued[s] || gpus.services[s].running_ns != svc_running_ns[s])
      fail("service running, waiting or queued counts");
  gpus.check(inv, dev_used);
  for (std::size_t q = 0; q < quotas.size(); ++q)
    if (quotas[q].running != quota_running[q]) fail("quota running count");
  for (std::size_t c = 0; c < classes.size(); ++c)
    if (classes[static_cast<std::int32_t>(c)].running != class_running[c]) fail("class running count");
  classes.check(bins.partitions.size());
  if (bins.nodes() != static_cast<std::int32_t>(inv.nodes.size())) fail("node count");
  bins.check();
  // Trajectory slots: holders, their running actions per slot, busy holders per node.
  std::vector<std::int32_t> holder_running(bins.bin_node.size(), 0), lent_running(bins.bin_node.size(), 0),
      busy(inv.nodes.size(), 0);
  for (const ActionRec& a : actions.slots) {
    if (a.state != ActionState::kRunning) continue;
    if (a.own_slot) {
      if (!bins.bin_bound[a.bin] || bins.bin_holder[a.bin] != a.trajectory) fail("an action in its own slot outside it");
      ++holder_running[a.bin];
    } else if (classes[a.cls].in_trajectory_slot) {
      // A lent slot may be free again: its holder let it go and no trajectory without a
      // slot of its own had an action running there to take it over (free_slot).
      ++lent_running[a.bin];
    }
  }
  for (std::size_t b = 0; b < bins.bin_node.size(); ++b) {
    if (holder_running[b] != bins.bin_holder_running[b]) fail("slot holder's running count out of sync");
    if (lent_running[b] != bins.bin_lent_running[b]) fail("lent slot's running count out of sync");
  }
  for (const auto& [traj, b] : bins.trajectory_bin)
    if (actions.trajectory_live.find(traj) != nullptr) ++busy[bins.bin_node[b]];
  for (std::size_t n = 0; n < busy.size(); ++n)
    if (busy[n] != bins.node_busy_holders[n]) fail("busy slot holders per node out of sync");
}

// ---- the parts' own invariants (their headers state them)

// `action_memory`: per device, the GPU memory of the actions running on it.
void Gpus::check(const Inventory& inv, const std::vector<Quantity>& action_memory) const {
  std::vector<Quantity> used = action_memory;
  for (std::size_t s = 0; s < services.size(); ++s) {
    if (services[s].device != kNone) used[services[s].device] += inv.services[s].memory;
    else if (services[s].running) fail("offloaded service with running actions");
    else if (services[s].pinned_device != kNone) used[services[s].pinned_device] += inv.services[s].asleep_memory;
    if (services[s].device != kNone && services[s].pinned_device != kNone && services[s].device != services[s].pinned_device)
      fail("unmovable service resident away from its process's device");
  }
  std::vector<Quantity> offload_used(node_offload_used.size(), 0);
  for (std::size_t s = 0; s < services.size(); ++s) {
    if (services[s].host_node == kNone) continue;
    if (services[s].device != kNone) fail("a resident service holds offloaded host memory");
    offload_used[services[s].host_node] += inv.services[s].host_memory;
  }
  for (std::size_t n = 0; n < offload_used.size(); ++n) {
    if (offload_used[n] != node_offload_used[n]) fail("offload memory accounting on node " + std::to_string(n));
    if (node_offload_cap[n] >= 0 && offload_used[n] > node_offload_cap[n])
      fail("offload memory exceeded on node " + std::to_string(n));
  }
  std::int32_t offline_devices = 0;
  for (std::size_t d = 0; d < dev_node.size(); ++d) {
    if (dev_free[d] < 0) fail("GPU memory exceeded on device " + std::to_string(d));
    if (dev_free[d] + used[d] + dev_fenced[d] != dev_total[d])
      fail("GPU free + used + fenced != total on device " + std::to_string(d));
    if (dev_offline[d] ? dev_free[d] != 0 : dev_fenced[d] != 0) fail("GPU fence out of sync on device " + std::to_string(d));
    offline_devices += dev_offline[d] ? 1 : 0;
  }
  if (offline_devices != n_offline_devices) fail("offline device count");
}

void Classes::check(std::size_t n_partitions) const {
  std::size_t heads = 0;
  for (std::size_t c = 0; c < all.size(); ++c) {
    const Class& cl = all[c];
    if (cl.in_active) {
      ++heads;
      std::size_t entries = 0;
      for (const ActiveEntry& e : active)
        if (live(e)) {
          if (e.cls == static_cast<std::int32_t>(c)) ++entries;
        }
      if (cl.waiting.empty() || entries != 1) fail("active class head missing or duplicated");
      for (const ActiveEntry& e : active)
        if (live(e) && e.cls == static_cast<std::int32_t>(c) && e.key.seq != cl.waiting.head().seq)
          fail("active entry is not the class head");
      if (cl.parked) fail("class both parked and active");
    } else if (!cl.waiting.empty() && !cl.parked) {
      fail("waiting class neither active nor parked");
    }
  }
  if (heads != active_count) fail("active count out of sync");
  std::vector<std::uint8_t> is_free(all.size(), 0);
  for (std::int32_t c : free_classes) {
    if (is_free[c]) fail("class freed twice");
    is_free[c] = 1;
    const Class& cl = all[c];
    if (!cl.waiting.empty() || cl.in_active || cl.parked || cl.running != 0) fail("freed class in use");
  }
  for (std::size_t c = 0; c < all.size(); ++c) {
    const Class& cl = all[c];
    if (!is_free[c] && cl.waiting.empty() && cl.running == 0 && !cl.in_trajectory_slot) fail("unused class not freed");
  }
  for (std::size_t c = 0; c < all.size(); ++c) {
    if (is_free[c]) continue;
    const std::int32_t* head = index.find(all[c].key_hash);
    std::int32_t p = head == nullptr ? kNone : *head;
    while (p != kNone && p != static_cast<std::int32_t>(c)) {
      if (is_free[p]) fail("freed class still indexed");
      p = all[p].next_same_hash;
    }
    if (p == kNone) fail("class missing from its hash chain");
  }
  for (const auto& [traj, list] : trajectory_classes)
    for (std::int32_t c : list)
      if (is_free[c] || all[c].trajectory != traj) fail("trajectory's class list out of sync");
  std::vector<std::int64_t> node_count(node_parked.size(), 0), part_count(n_partitions, 0);
  for (const Class& cl : all) {
    if (!cl.parked) continue;
    if (cl.waiting.empty()) fail("parked class without waiting actions");
    if (cl.park_node == kNone) ++part_count[cl.partition];
    else ++node_count[cl.park_node];
  }
  // Every parked class has a live entry, and every listed deadline is in the heap.
  std::vector<std::uint8_t> live(all.size(), 0), listed(all.size(), 0);
  for (const ParkDeadline& d : park_deadlines) {
    const Class& cl = all[d.cls];
    if (cl.parked && d.at == cl.park_deadline) live[d.cls] = 1;
    if (d.at == cl.deadline_listed) listed[d.cls] = 1;
  }
  for (std::size_t c = 0; c < all.size(); ++c) {
    if (all[c].parked && !live[c]) fail("parked class without a deadline");
    if (all[c].deadline_listed != kNoDeadline && !listed[c]) fail("listed deadline not in the heap");
  }
  for (std::size_t n = 0; n < node_count.size(); ++n)
    if (node_count[n] != node_parked_count[n]) fail("node parked count");
  for (std::size_t p = 0; p < part_count.size(); ++p)
    if (part_count[p] != partition_parking[p].count) fail("partition parked count");
}

void Bins::check() const {
  std::int32_t offline = 0;
  for (std::uint8_t on : node_online) offline += on ? 0 : 1;
  if (offline != n_offline) fail("offline node count");
  for (const Partition& part : partitions)
    for (std::size_t leaf = 0; leaf < part.bins.size(); ++leaf) {
      std::int32_t b = part.bins[leaf];
      const Quantity* v = part.free_tree.leaf(static_cast<std::int32_t>(leaf));
      if (bin_bound[b] || !node_online[bin_node[b]]) {
        for (std::int32_t d = 0; d < D; ++d)
          if (v[d] != -1) fail(bin_bound[b] ? "bound trajectory slot visible in the free tree" : "offline node's bin visible in the free tree");
        continue;
      }
      for (std::int32_t k = 0; k < K; ++k)
        if (v[k] != free_of(static_cast<std::int32_t>(b))[k]) fail("free tree out of sync");
      if (has_gpus && v[K] != node_max_dev_free[bin_node[b]]) fail("free tree GPU entry out of sync");
    }
  std::size_t bound = 0;
  for (std::size_t b = 0; b < bin_node.size(); ++b) {
    bound += bin_bound[b] ? 1 : 0;
    if (!bin_bound[b] && bin_holder[b] != 0) fail("free slot with a holder");
  }
  if (bound != trajectory_bin.size()) fail("bound slots and trajectory bindings differ");
  for (const auto& [traj, b] : trajectory_bin)
    if (!bin_bound[b] || bin_holder[b] != traj) fail("trajectory binding out of sync");
}

}  // namespace tangram
