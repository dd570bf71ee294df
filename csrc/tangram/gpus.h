// Services and devices: the GPUs (global device index, in node order) and the GPU services
// resident on them or offloaded from them. A part of Scheduler::Impl (scheduler_impl.h).
//
// Owns: each device's node, local index, total and free memory, the end of its last
// restore or offload, whether it is out of placement (and the memory fenced off while it
// is); each service's record (residency, readiness, queue, the device it is pinned to or
// drained for); replica groups; per node, the host memory offloaded services hold there.
// Changes only through its own methods and the services' coordinators in services.cc.
// Guarantees (check(), in introspection.cc):
//   - device d's free memory + the GPU memory of actions running on it + the memory of
//     services resident (or asleep, pinned) on it + fenced memory = its total; none
//     negative;
//   - an offline device has nothing free: what it had and what comes back is fenced, and
//     returns to free when it comes back online;
//   - node n's devices are [node_first_dev[n], node_first_dev[n + 1]); indices never change
//     (a new node's devices come after all others);
//   - a service holds host memory on `host_node` only while offloaded, and
//     node_offload_used sums that per node, never above the node's offload memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tangram/model.h"

namespace tangram {

struct ServiceRec {
  std::int32_t device = kNone;  // global device index while resident or restoring
  TimeNs ready_ns = 0;
  std::int32_t running = 0;
  std::int64_t waiting = 0;
  TimeNs queued_ns = 0;  // estimated work of waiting actions
  TimeNs running_ns = 0;  // estimated work of running actions (their est_ns)
  std::int32_t home_device = kNone;  // ServiceDevices::kHome
  std::int32_t pinned_device = kNone;  // an unmovable one: where its process runs (keeping asleep_memory)
  std::int32_t host_node = kNone;  // offloaded: the node whose offload_memory holds its host_memory
  TimeNs restore_ns = 0;
  TimeNs offload_ns = 0;
  TimeNs last_request_ns = -1;  // its latest action's submit (-1: never asked for)
  TimeNs mean_gap_ns = -1;      // between its actions' submits, a moving average (-1: fewer than two)
  // OrderRule::kEstimate: its arrivals have stopped and its queue is ordered for its drain
  // (Impl::order_service_tails).
  bool tail_ordered = false;
  // Drained for a starving service (drain()): while this equals the pass, it starts at most
  // drain_starts more actions (those that waited when its unbroken run of drains began).
  std::uint64_t draining_pass = 0;
  std::int64_t drain_starts = 0;
  std::int32_t draining_for = kNone;  // the starving service it was last drained for

  bool ready(TimeNs now) const { return device != kNone && ready_ns <= now; }
};

// Device memory an eviction of the service frees (what it keeps asleep stays).
inline Quantity evict_frees(const ServiceSpec& spec) { return spec.memory - spec.asleep_memory; }

struct Gpus {
  // Devices, by global index.
  std::vector<std::int32_t> dev_node, dev_local;
  std::vector<Quantity> dev_total, dev_free;
  // Per device: when its last restore or offload ends (ServiceSpec: they run in order).
  std::vector<TimeNs> dev_ops_end;
  // Per device: out of placement (a GPU that needs a reset); its memory is fenced off: what
  // was free, and whatever comes back to it, goes to dev_fenced instead of dev_free.
  std::vector<std::uint8_t> dev_offline;
  std::vector<Quantity> dev_fenced;
  std::int32_t n_offline_devices = 0;
  std::vector<std::int32_t> node_first_dev{0};  // node -> first global device; one more entry than nodes

  std::vector<ServiceRec> services;
  // Per service: the copies of its replica group, itself first, when it is a group's first
  // copy (a single copy for an unreplicated service); empty for the other copies.
  std::vector<std::vector<std::int32_t>> replica_group;
  bool any_replicated = false;  // some group has more than one copy (routed: rebind_replicas)
  // Per node: host memory of the services offloaded there, and its NodeSpec::offload_memory
  // (-1: unlimited).
  std::vector<Quantity> node_offload_used, node_offload_cap;

  bool any() const { return !dev_node.empty(); }
  // Argument check of the public calls: Error naming the field when out of range.
  void check_service(std::int32_t service) const {
    if (service < 0 || service >= static_cast<std::int32_t>(services.size()))
      throw Error(ErrorCode::kUnknownName, "service", "no service with index " + std::to_string(service));
  }
  // Appends a node's devices after every existing one; returns its largest device's memory.
  Quantity add_node(const NodeSpec& node) {
    const std::int32_t n = static_cast<std::int32_t>(node_first_dev.size()) - 1;
    Quantity most = 0;
    for (std::size_t g = 0; g < node.gpus.size(); ++g) {
      dev_node.push_back(n);
      dev_local.push_back(static_cast<std::int32_t>(g));
      dev_total.push_back(node.gpus[g].memory);
      dev_free.push_back(node.gpus[g].memory);
      dev_ops_end.push_back(0);
      dev_offline.push_back(0);
      dev_fenced.push_back(0);
      most = std::max(most, node.gpus[g].memory);
    }
    node_first_dev.push_back(static_cast<std::int32_t>(dev_node.size()));
    node_offload_used.push_back(0);
    node_offload_cap.push_back(node.offload_memory);
    return most;
  }
  // The most free memory on one of the node's devices (0 without any).
  Quantity most_free_on(std::int32_t node) const {
    Quantity best = 0;
    for (std::int32_t d = node_first_dev[node]; d < node_first_dev[node + 1]; ++d) best = std::max(best, dev_free[d]);
    return best;
  }
  // Memory back to device d: free, or fenced off while the device is offline.
  void give_back(std::int32_t d, Quantity amount) { (dev_offline[d] ? dev_fenced[d] : dev_free[d]) += amount; }
  // Takes device d out of placement or back; its free memory is fenced off or returned.
  // False when it already was so.
  bool set_online(std::int32_t d, bool online) {
    if (!dev_offline[d] == online) return false;
    dev_offline[d] = online ? 0 : 1;
    n_offline_devices += online ? -1 : 1;
    if (online) {
      dev_free[d] += dev_fenced[d];
      dev_fenced[d] = 0;
    } else {
      dev_fenced[d] += dev_free[d];
      dev_free[d] = 0;
    }
    return true;
  }
  // Whether `extra` more host memory of offloaded services fits the node's offload_memory.
  bool offload_fits(std::int32_t node, Quantity extra) const {
    const Quantity cap = node_offload_cap[node];
    return cap < 0 || node_offload_used[node] + extra <= cap;
  }
  // Its guarantees, given the GPU memory of the actions running on each device (introspection.cc).
  void check(const Inventory& inv, const std::vector<Quantity>& action_memory) const;
  // Service v's offloaded state (`host_memory` of it) leaves host memory: restored, or given up.
  void release_offloaded_state(std::int32_t v, Quantity host_memory) {
    ServiceRec& svc = services[v];
    if (svc.host_node == kNone) return;
    node_offload_used[svc.host_node] -= host_memory;
    svc.host_node = kNone;
  }
};

}  // namespace tangram
