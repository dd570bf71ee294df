// Actions in and out: validation, classes, submit, and the end of an action.
//
// Reads: the inventory, the policy's row (BinLayout: task pools, trajectory slots;
// OrderRule through estimate_weight and aging_permille).
// Changes: action records, classes (made, found by their constraints, freed), the id and
// trajectory indexes; returns resources (finish: the current grant) and emits kReject
// decisions.
// Guarantees: a batch is validated whole before anything is applied (a typed Error naming
// the field otherwise); an action that can never fit is rejected at submit, exactly once.
#include "tangram/scheduler_impl.h"
#include "tangram/text.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace tangram {

void Scheduler::Impl::validate_now(TimeNs t) const {
  if (t < 0 || t > to_ns(kMaxSeconds)) throw Error(ErrorCode::kInvalidArgument, "now", "must be in [0, 1e9] seconds");
  if (t < now)
    throw Error(ErrorCode::kInvalidArgument, "now", "time went backwards (" + std::to_string(to_seconds(t)) + " s < " + std::to_string(to_seconds(now)) + " s)");
}

// `field()` names the action ("actions[3]"); it is only called to build an error.
template <class Field>
void Scheduler::Impl::validate_spec(const ActionSpec& s, const Field& field) const {
  auto bad = [&](const std::string& name, const std::string& why) { throw Error(ErrorCode::kInvalidArgument, field() + "." + name, why); };
  if (static_cast<std::int32_t>(s.demand.size()) != K)
    bad("demand", "has " + std::to_string(s.demand.size()) + " entries for " + std::to_string(K) + " kinds");
  for (std::int32_t k = 0; k < K; ++k)
    if (s.demand[k] < 0 || s.demand[k] > kMaxMilli) bad("demand." + inv.kinds[k], "must be in [0, 1e12] units");
  if (s.gpu_memory < 0 || s.gpu_memory > kMaxMilli) bad("gpu_memory", "must be in [0, 1e12] MiB");
  if (s.gpu_memory > 0 && !bins.has_gpus && s.service == kNone) bad("gpu_memory", "the inventory has no GPU");
  if (s.elastic_kind != kNone) {
    if (s.elastic_kind < 0 || s.elastic_kind >= K) bad("elastic_kind", "no kind with index " + std::to_string(s.elastic_kind));
    Quantity lo = s.demand[s.elastic_kind];
    if (lo <= 0) bad("demand." + inv.kinds[s.elastic_kind], "the elastic kind needs a positive minimum");
    if (s.elastic_max < lo) bad("elastic_max", "the elastic upper bound is below the minimum demand");
    if (s.elastic_max > kMaxMilli) bad("elastic_max", "must be at most 1e12 units");
  }
  const ElasticityModel& m = s.model;
  switch (m.kind) {
    case ModelKind::kConstant:
    case ModelKind::kAmdahl:
      if (!std::isfinite(m.seconds) || m.seconds < 0 || m.seconds > kMaxSeconds) bad("model.seconds", "must be a finite number in [0, 1e9]");
      if (m.kind == ModelKind::kAmdahl && !(m.parallel_fraction >= 0 && m.parallel_fraction <= 1))
        bad("model.parallel_fraction", "must be in [0, 1]");
      break;
    case ModelKind::kTable:
      if (m.table < 0 || m.table >= static_cast<std::int32_t>(tables.size())) bad("model.table", "no table with id " + std::to_string(m.table));
      break;
    case ModelKind::kCallback:
      if (m.callback == nullptr) bad("model.callback", "is null");
      break;
    default:
      bad("model.kind", "unknown model kind");
  }
  if (s.affinity_node != kNone && (s.affinity_node < 0 || s.affinity_node >= static_cast<std::int32_t>(inv.nodes.size())))
    throw Error(ErrorCode::kUnknownName, field() + ".affinity_node", "no node with index " + std::to_string(s.affinity_node));
  if (s.service != kNone) {
    if (s.service < 0 || s.service >= static_cast<std::int32_t>(gpus.services.size()))
      throw Error(ErrorCode::kUnknownName, field() + ".service", "no service with index " + std::to_string(s.service));
    if (s.affinity_node != kNone) bad("affinity_node", "cannot be combined with a service: actions run where their service is resident");
    if (s.any_replica && inv.services[s.service].replica_of != kNone)
      bad("service", "with any_replica, must name the first copy of its replicated service");
  } else if (s.any_replica) {
    bad("any_replica", "needs a service");
  }
  if (s.quota != kNone && (s.quota < 0 || s.quota >= static_cast<std::int32_t>(quotas.size())))
    throw Error(ErrorCode::kUnknownName, field() + ".quota", "no quota with index " + std::to_string(s.quota));
  if (s.tokens < 0 || s.tokens > static_cast<std::int64_t>(kMaxBaseUnits)) bad("tokens", "must be in [0, 1e12]");
  if (s.tokens > 0 && s.quota == kNone) bad("tokens", "tokens need a quota to draw from");
  if (row.rules.bins == BinLayout::kTaskPools && !bins.pool_partition.count(s.task))
    throw Error(ErrorCode::kUnknownName, field() + ".task", "no task pool " + std::to_string(s.task) + " among the policy's task pools");
  // The model must give a usable run time at the minimum grant.
  Quantity lo = s.elastic_kind == kNone ? kMilli : s.demand[s.elastic_kind];
  double t = model_seconds(m, lo, lo, tables);
  if (!std::isfinite(t) || t < 0 || t > kMaxSeconds) bad("model", "run time at the minimum grant is not a finite number in [0, 1e9] s");
}

// ---- Classes

// An empty class (neither active nor parked) leaves its hash chain; its slot is reused.
void Classes::free_class(std::int32_t c) {
  Class& cl = all[c];
  std::int32_t* head = index.find(cl.key_hash);
  if (*head == c) {
    if (cl.next_same_hash == kNone) index.erase(cl.key_hash);
    else *head = cl.next_same_hash;
  } else {
    std::int32_t p = *head;
    while (all[p].next_same_hash != c) p = all[p].next_same_hash;
    all[p].next_same_hash = cl.next_same_hash;
  }
  cl.next_same_hash = kNone;
  cl.infeasible.clear();
  free_classes.push_back(c);
}

// Why no action of this class can ever run, or "" if one could.
std::string Scheduler::Impl::infeasible_reason(const Class& c) const {
  const Partition& part = bins.partitions[c.partition];
  if (c.service == kNone && c.quota == kNone && c.affinity_node != kNone && part.node_lo[c.affinity_node] >= 0) {
    // The common case, an action pinned to its trajectory's node: a new class per
    // trajectory, so look at the node's few bins directly (the search below gives the
    // same answer, and the words when none fits).
    for (std::int32_t leaf = part.node_lo[c.affinity_node]; leaf < part.node_hi[c.affinity_node]; ++leaf) {
      const Quantity* cap = part.cap_tree.leaf(leaf);
      bool fits = !bins.has_gpus || cap[K] >= c.gpu_memory;
      for (std::int32_t k = 0; k < K && fits; ++k) fits = cap[k] >= c.demand[k];
      if (fits) return "";
    }
  }
  std::vector<Quantity> need(c.demand, c.demand + K);
  if (bins.has_gpus) need.push_back(c.service == kNone ? c.gpu_memory : 0);
  auto describe_shortfall = [&](std::int32_t lo, std::int32_t hi, const char* where) {
    Text os;
    os << "demand does not fit " << where << ":";
    std::vector<Quantity> best(bins.D, 0);
    for (std::int32_t leaf = lo; leaf < hi; ++leaf)
      for (std::int32_t d = 0; d < bins.D; ++d) best[d] = std::max(best[d], part.cap_tree.leaf(leaf)[d]);
    for (std::int32_t d = 0; d < bins.D; ++d)
      if (need[d] > best[d])
        os << " " << (d < K ? inv.kinds[d] : std::string("gpu_memory")) << " needs " << need[d] / 1000.0 << ", largest is " << best[d] / 1000.0 << ";";
    std::string s = os.str();
    if (!s.empty() && s.back() == ';') s.pop_back();
    return s;
  };
  if (c.quota != kNone && !quotas[c.quota].tokens_fit(c.tokens))
    return "needs " + std::to_string(c.tokens) + " tokens, more than quota '" + inv.quotas[c.quota].name + "' grants per minute";
  std::vector<std::int32_t> found;
  auto no_skip = [](std::int32_t) { return false; };
  if (c.service != kNone) {
    const ServiceSpec& spec = inv.services[c.service];
    const ServiceRec& rec = gpus.services[c.service];
    std::int32_t dlo = rec.home_device != kNone ? rec.home_device : 0;
    std::int32_t dhi = rec.home_device != kNone ? rec.home_device + 1 : static_cast<std::int32_t>(gpus.dev_node.size());
    for (std::int32_t d = dlo; d < dhi; ++d) {
      if (gpus.dev_total[d] < spec.memory + c.gpu_memory) continue;
      std::int32_t n = gpus.dev_node[d];
      if (part.node_lo[n] < 0) continue;
      found.clear();
      part.cap_tree.find(part.node_lo[n], part.node_hi[n], need.data(), 1, no_skip, found);
      if (!found.empty()) return "";
    }
    Text os;
    os << "service '" << spec.name << "' needs " << (spec.memory + c.gpu_memory) / 1000.0
       << " MiB of GPU memory with the action's demand on the same node, and no "
       << (rec.home_device != kNone ? "home device" : "device") << " has that";
    return os.str();
  }
  std::int32_t lo = 0, hi = part.free_tree.leaves();
  const char* where = "on any node";
  if (c.affinity_node != kNone) {
    lo = part.node_lo[c.affinity_node];
    hi = part.node_hi[c.affinity_node];
    where = "on its affinity node";
    if (lo < 0) return "its affinity node has no bin in this policy";
  }
  found.clear();
  part.cap_tree.find(lo, hi, need.data(), 1, no_skip, found);
  if (!found.empty()) return "";
  return describe_shortfall(lo, hi, where);
}

void Scheduler::Impl::submit(const ActionSpec* a, std::size_t n, TimeNs t, std::vector<Decision>& out) {
  // Validate the whole batch before touching anything (the clock included). Each id goes
  // into the index as it is checked, marked kBatchSlot, so one probe finds both a live
  // duplicate and a repeat within the batch; on any error the batch's ids come out again.
  std::size_t repeat = SIZE_MAX;  // the first position whose id came earlier in the batch
  std::size_t i = 0;
  actions.by_id.reserve(actions.by_id.size() + n);  // one rehash for a burst, not one per doubling
  try {
    for (; i < n; ++i) {
      auto field = [i] { return "actions[" + std::to_string(i) + "]"; };
      auto [slot, inserted] = actions.by_id.insert(a[i].id, kBatchSlot);
      if (!inserted && *slot != kBatchSlot) {
        throw Error(ErrorCode::kDuplicateId, field() + ".id", "action " + std::to_string(a[i].id) + " is already live");
      }
      if (!inserted) repeat = std::min(repeat, i);
      validate_spec(a[i], field);
    }
    if (repeat != SIZE_MAX)
      throw Error(ErrorCode::kDuplicateId, "actions[" + std::to_string(repeat) + "].id",
                  "action " + std::to_string(a[repeat].id) + " appears twice in the batch");
  } catch (...) {
    // Positions before i hold batch ids only (a live duplicate throws at once); position
    // i's id is the batch's too unless it was the live duplicate.
    for (std::size_t j = 0; j <= i && j < n; ++j) {
      const std::int32_t* slot = actions.by_id.find(a[j].id);
      if (slot != nullptr && *slot == kBatchSlot) actions.by_id.erase(a[j].id);
    }
    throw;
  }
  messages.clear();
  now = t;
  if (actions.free_slots.size() < n) {
    // Grow once for a burst rather than once per doubling (and still geometrically, so a
    // stream of single submits does not reallocate each time).
    const std::size_t need = actions.slots.size() + (n - actions.free_slots.size());
    if (need > actions.slots.capacity()) actions.slots.reserve(std::max(need, 2 * actions.slots.capacity()));
    if (need > actions.details.capacity()) actions.details.reserve(actions.slots.capacity());
    if (need > actions.queue_pos.capacity()) actions.queue_pos.reserve(actions.slots.capacity());
    if (malleable && need > elastic.run_state.capacity()) elastic.run_state.reserve(actions.slots.capacity());
  }
  const std::int64_t aging = aging_term(now);  // the same for the whole batch
  ActionSpec routed;  // an action routed to another copy of its service than the one it names
  for (std::size_t i = 0; i < n; ++i) {
    const ActionSpec* spec = &a[i];
    if (a[i].any_replica && gpus.replica_group[a[i].service].size() > 1) {
      const std::int32_t copy = route_replica(a[i]);
      if (copy != a[i].service) {
        routed = a[i];
        routed.service = copy;
        spec = &routed;
      }
    }
    const ActionSpec& s = *spec;
    const std::int32_t partition = row.rules.bins == BinLayout::kTaskPools ? bins.pool_partition.at(s.task) : 0;
    const bool in_slot = row.rules.bins == BinLayout::kTrajectorySlots && s.service == kNone;
    // Feasibility depends only on capacities and the class: decided once, when it is made.
    const std::int32_t c =
        classes.find_or_add(s, partition, in_slot, [&](Class& made) { made.infeasible = infeasible_reason(made); });
    const std::string& why = classes[c].infeasible;
    if (!why.empty()) {
      actions.by_id.erase(s.id);
      Decision d;
      d.kind = DecisionKind::kReject;
      d.action = s.id;
      d.time = now;
      d.reason = static_cast<std::int32_t>(messages.size());
      messages.push_back("action " + std::to_string(s.id) + " can never run: " + why);
      out.push_back(d);
      classes.free_if_unused(c);
      continue;
    }
    std::int32_t slot;
    if (!actions.free_slots.empty()) {
      slot = actions.free_slots.back();
      actions.free_slots.pop_back();
    } else {
      slot = static_cast<std::int32_t>(actions.slots.size());
      actions.slots.emplace_back();
      actions.details.emplace_back();
      actions.queue_pos.push_back(-1);
      if (malleable) elastic.run_state.emplace_back();
    }
    ActionRec& r = actions.slots[slot];
    ActionDetail& detail = actions.details[slot];
    r = ActionRec{};
    r.id = s.id;
    r.trajectory = s.trajectory;
    r.cls = c;
    r.state = ActionState::kWaiting;
    r.elastic_kind = s.elastic_kind;
    r.elastic_max = s.elastic_max;
    if (s.elastic_kind != kNone) spare.elastic_kind_seen[s.elastic_kind] = 1;
    detail = ActionDetail{};
    detail.model = s.model;
    detail.submitted_max = s.elastic_max;
    detail.any_replica = s.any_replica;
    detail.est_ns = to_ns(seconds(slot, order_units(r)));
    // Under a quota, kProgress goes by the trajectory's progress first (OrderRule).
    std::int64_t key = order_key(classes[c], detail.est_ns, aging);
    if (count_progress && classes[c].quota != kNone) {
      const std::int32_t* started_before = actions.trajectory_progress.find(s.trajectory);
      if (started_before != nullptr) key -= kProgressCreditNs * *started_before;
    }
    detail.order = OrderKey{key, actions.next_seq++, now, -s.priority, slot};
    *actions.by_id.find(s.id) = slot;
    if (actions.trajectory_gains(s.trajectory)) holder_live(s.trajectory, +1);
    ++actions.n_waiting;
    if (actions.last_submit_ns >= 0) {
      const TimeNs gap = now - actions.last_submit_ns;
      actions.mean_gap_ns = actions.mean_gap_ns < 0 ? gap : (7 * actions.mean_gap_ns + gap) / 8;
    }
    actions.last_submit_ns = now;
    if (classes[c].service != kNone) {
      ServiceRec& svc = gpus.services[classes[c].service];
      if (svc.last_request_ns >= 0) {
        const TimeNs gap = now - svc.last_request_ns;
        svc.mean_gap_ns = svc.mean_gap_ns < 0 ? gap : (7 * svc.mean_gap_ns + gap) / 8;
      }
      svc.last_request_ns = now;
    }
    join_class_queue(c, detail);
  }
}

// Waiting action `slot` leaves its class's queue (and its service's waiting work); the class
// is freed once unused.
void Scheduler::Impl::leave_class_queue(std::int32_t slot) {
  const std::int32_t c = actions.slots[slot].cls;
  Class& cl = classes[c];
  const bool was_head = cl.waiting.head().slot == slot;
  if (was_head) classes.deactivate(c);
  cl.waiting.erase(slot, actions.queue_pos);
  if (was_head && cl.parked) unpark(c);  // its new head may starve sooner
  else if (was_head) classes.activate(c);
  if (cl.service != kNone) {
    gpus.services[cl.service].waiting -= 1;
    gpus.services[cl.service].queued_ns -= actions.details[slot].est_ns;
  }
  classes.free_if_unused(c);
}

void Scheduler::Impl::finish(std::int32_t slot) {
  ActionRec& r = actions.slots[slot];
  Class& cl = classes[r.cls];
  if (malleable) forget_running(slot);
  Quantity* f = bins.free_of(r.bin);
  for (std::int32_t k = 0; k < K; ++k) f[k] += cl.demand[k];
  if (r.elastic_kind != kNone) f[r.elastic_kind] += r.grant - cl.demand[r.elastic_kind];  // its current grant
  std::int32_t node = bins.bin_node[r.bin];
  const bool frees_gpu_memory = r.device != kNone && cl.gpu_memory > 0;
  if (frees_gpu_memory) {
    gpus.give_back(r.device, cl.gpu_memory);
    refresh_node_devices(node);
  }
  // A trajectory slot stays bound (hidden from the free tree) until its trajectory ends.
  if (!bins.bin_bound[r.bin]) bins.refresh_leaf(r.bin);
  if (cl.in_trajectory_slot && !r.own_slot) --bins.bin_lent_running[r.bin];
  if (r.own_slot && --bins.bin_holder_running[r.bin] == 0) {
    // Nothing of its trajectory runs in the slot now: a class of it that the slot can never
    // hold may give the slot up (try_head), so it is looked at again.
    auto list = classes.trajectory_classes.find(r.trajectory);
    for (std::int32_t other : list->second)
      if (classes[other].parked && bins.never_holds(r.bin, classes[other].demand, classes[other].gpu_memory)) unpark(other);
  }
  if (cl.quota != kNone) quotas[cl.quota].release();
  if (cl.service != kNone) {
    gpus.services[cl.service].running -= 1;
    gpus.services[cl.service].running_ns -= actions.details[slot].est_ns;
  }
  --cl.running;
  classes.free_if_unused(r.cls);
  --actions.n_running;
  if (actions.trajectory_loses(r.trajectory)) holder_live(r.trajectory, -1);
  actions.release(r, slot);
  // Freed GPU memory is shared by every partition on the node.
  release_on_node(node, frees_gpu_memory ? kNone : bins.bin_partition[r.bin]);
}

void Scheduler::Impl::unqueue(std::int32_t slot) {
  ActionRec& r = actions.slots[slot];
  leave_class_queue(slot);
  --actions.n_waiting;
  if (actions.trajectory_loses(r.trajectory)) holder_live(r.trajectory, -1);
  actions.release(r, slot);
}

}  // namespace tangram
