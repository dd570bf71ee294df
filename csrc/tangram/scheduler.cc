// The public face: each event validates its whole batch, applies it, then runs one pass
// (scheduler.h). Queries read the state; none changes it.
#include "tangram/scheduler_impl.h"
#include "tangram/text.h"

#include <algorithm>
#include <string>
#include <vector>

namespace tangram {

Scheduler::Scheduler(Inventory inventory, PolicyConfig policy)
    : impl_(std::make_unique<Impl>(std::move(inventory), std::move(policy))) {}
Scheduler::~Scheduler() = default;
Scheduler::Scheduler(Scheduler&&) noexcept = default;
Scheduler& Scheduler::operator=(Scheduler&&) noexcept = default;

std::int32_t Scheduler::add_table(std::vector<std::pair<double, double>> points) {
  validate_table(points, "table");
  impl_->tables.push_back(std::move(points));
  return static_cast<std::int32_t>(impl_->tables.size() - 1);
}

void Scheduler::submit(const ActionSpec* actions, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  impl_->validate_now(now);
  impl_->submit(actions, count, now, out);
  impl_->pass(out);
}

void Scheduler::complete(const ActionId* ids, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  m.actions.validate_ids(ids, count, [&](std::int32_t slot, std::size_t i) {
    if (m.actions.slots[slot].state != ActionState::kRunning)
      throw Error(ErrorCode::kInvalidState, "ids[" + std::to_string(i) + "]",
                  "action " + std::to_string(m.actions.slots[slot].id) + " has not started");
    m.actions.trajectory_live.prefetch(m.actions.slots[slot].trajectory);  // finish() counts it down
  });
  m.messages.clear();
  m.now = now;
  for (std::size_t i = 0; i < count; ++i) m.finish(*m.actions.by_id.find(ids[i]));
  m.pass(out);
}

void Scheduler::cancel(const ActionId* ids, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  m.actions.validate_ids(ids, count, [](std::int32_t, std::size_t) {});
  m.messages.clear();
  m.now = now;
  for (std::size_t i = 0; i < count; ++i) {
    std::int32_t slot = *m.actions.by_id.find(ids[i]);
    if (m.actions.slots[slot].state == ActionState::kRunning) m.finish(slot);
    else m.unqueue(slot);
  }
  m.pass(out);
}

void Scheduler::limit(const ActionId* ids, const Quantity* limits, std::size_t count, TimeNs now,
                      std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  m.actions.validate_ids(ids, count, [&](std::int32_t slot, std::size_t i) {
    const ActionRec& a = m.actions.slots[slot];
    const std::string field = "ids[" + std::to_string(i) + "]";
    if (a.state != ActionState::kRunning)
      throw Error(ErrorCode::kInvalidState, field, "action " + std::to_string(a.id) + " has not started");
    if (a.elastic_kind == kNone)
      throw Error(ErrorCode::kInvalidArgument, field, "action " + std::to_string(a.id) + " is not elastic");
    const Quantity lo = m.minimum(a), hi = m.actions.details[slot].submitted_max;
    if (limits[i] < lo || limits[i] > hi) {
      Text why;
      why << "must be in [" << lo / 1000.0 << ", " << hi / 1000.0
          << "] units: the action's minimum and the maximum it was submitted with";
      throw Error(ErrorCode::kInvalidArgument, "limits[" + std::to_string(i) + "]", why.str());
    }
  });
  m.messages.clear();
  m.now = now;
  for (std::size_t i = 0; i < count; ++i) m.limit_grant(*m.actions.by_id.find(ids[i]), limits[i], out);
  m.pass(out);
}

void Scheduler::end_trajectories(const TrajectoryId* ids, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  for (std::size_t i = 0; i < count; ++i) {
    const std::int32_t* live = m.actions.trajectory_live.find(ids[i]);
    if (live != nullptr)
      throw Error(ErrorCode::kInvalidState, "trajectories[" + std::to_string(i) + "]",
                  "trajectory " + std::to_string(ids[i]) + " still has " + std::to_string(*live) + " live action(s)");
  }
  m.messages.clear();
  m.now = now;
  for (std::size_t i = 0; i < count; ++i) {
    // No live action: its classes are empty, neither active nor parked.
    auto classes_of = m.classes.trajectory_classes.find(ids[i]);
    if (classes_of != m.classes.trajectory_classes.end()) {
      for (std::int32_t c : classes_of->second) m.classes.free_class(c);
      m.classes.trajectory_classes.erase(classes_of);
    }
    if (m.count_progress) m.actions.trajectory_progress.erase(ids[i]);
    auto it = m.bins.trajectory_bin.find(ids[i]);
    if (it == m.bins.trajectory_bin.end()) continue;
    std::int32_t bin = it->second;
    m.bins.trajectory_bin.erase(it);
    m.free_slot(bin);
  }
  m.pass(out);
}

void Scheduler::tick(TimeNs now, std::vector<Decision>& out) {
  out.clear();
  impl_->validate_now(now);
  impl_->messages.clear();
  impl_->now = now;
  impl_->pass(out);
}

std::int32_t Scheduler::Impl::global_device(std::int32_t node, std::int32_t device) const {
  bins.check_node(node);
  const std::int32_t d = gpus.node_first_dev[node] + device;
  if (device < 0 || d >= gpus.node_first_dev[node + 1])
    throw Error(ErrorCode::kUnknownName, "device", "node " + std::to_string(node) + " has no GPU " + std::to_string(device));
  return d;
}

void Scheduler::service_restored(std::int32_t service, std::int32_t node, std::int32_t device, TimeNs now,
                                 std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  m.gpus.check_service(service);
  const std::int32_t d = m.global_device(node, device);
  m.messages.clear();
  m.now = now;
  ServiceRec& svc = m.gpus.services[service];
  if (svc.device == d && svc.ready_ns > now) {
    if (m.gpus.dev_ops_end[d] == svc.ready_ns) m.gpus.dev_ops_end[d] = now;
    svc.ready_ns = now;
  }
  m.pass(out);
}

void Scheduler::back_off_quota(std::int32_t quota, TimeNs until) {
  Impl& m = *impl_;
  if (quota < 0 || quota >= static_cast<std::int32_t>(m.quotas.size()))
    throw Error(ErrorCode::kUnknownName, "quota", "no quota with index " + std::to_string(quota));
  // A pause past the clock's range would make next_wakeup() a time tick() refuses.
  if (until < 0 || until > to_ns(kMaxSeconds)) throw Error(ErrorCode::kInvalidArgument, "until", "must be in [0, 1e9] seconds");
  m.quotas[quota].back_off(until);
}

QuotaSnapshot Scheduler::quota_snapshot(std::int32_t quota, TimeNs now) const {
  const Impl& m = *impl_;
  if (quota < 0 || quota >= static_cast<std::int32_t>(m.quotas.size()))
    throw Error(ErrorCode::kUnknownName, "quota", "no quota with index " + std::to_string(quota));
  if (now < 0 || now > to_ns(kMaxSeconds)) throw Error(ErrorCode::kInvalidArgument, "now", "must be in [0, 1e9] seconds");
  return m.quotas[quota].snapshot(now);
}

void Scheduler::set_service_times(std::int32_t service, double restore_seconds, double offload_seconds) {
  Impl& m = *impl_;
  m.gpus.check_service(service);
  if (!std::isfinite(restore_seconds) || restore_seconds < 0 || restore_seconds > kMaxSeconds)
    throw Error(ErrorCode::kInvalidArgument, "restore_seconds", "must be a finite number in [0, 1e9]");
  if (!std::isfinite(offload_seconds) || offload_seconds < 0 || offload_seconds > kMaxSeconds)
    throw Error(ErrorCode::kInvalidArgument, "offload_seconds", "must be a finite number in [0, 1e9]");
  m.gpus.services[service].restore_ns = to_ns(restore_seconds);
  m.gpus.services[service].offload_ns = to_ns(offload_seconds);
}

void Scheduler::set_node_online(std::int32_t node, bool online, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  m.bins.check_node(node);
  m.messages.clear();
  m.now = now;
  m.set_node_online(node, online);
  m.pass(out);
}

std::int32_t Scheduler::add_node(NodeSpec node, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  const std::string f = "node";
  if (node.name.empty()) throw Error(ErrorCode::kInvalidArgument, f + ".name", "a node needs a name");
  for (const NodeSpec& o : m.inv.nodes)
    if (o.name == node.name) throw Error(ErrorCode::kInvalidArgument, f + ".name", "duplicate node '" + node.name + "'");
  if (static_cast<std::int32_t>(node.capacity.size()) != m.K)
    throw Error(ErrorCode::kInvalidArgument, f + ".capacity", "has " + std::to_string(node.capacity.size()) + " entries for " + std::to_string(m.K) + " kinds");
  for (std::int32_t k = 0; k < m.K; ++k)
    if (node.capacity[k] < 0 || node.capacity[k] > kMaxMilli)
      throw Error(ErrorCode::kInvalidArgument, f + ".capacity." + m.inv.kinds[k], "must be in [0, 1e12] units");
  for (std::size_t g = 0; g < node.gpus.size(); ++g)
    if (node.gpus[g].memory <= 0 || node.gpus[g].memory > kMaxMilli)
      throw Error(ErrorCode::kInvalidArgument, f + ".gpus[" + std::to_string(g) + "].memory", "must be in (0, 1e12] MiB");
  if (node.offload_memory < -1 || node.offload_memory > kMaxMilli)
    throw Error(ErrorCode::kInvalidArgument, f + ".offload_memory", "must be in [0, 1e12] MiB, or unlimited");
  m.messages.clear();
  m.now = now;
  std::int32_t index = m.add_node(std::move(node));
  m.pass(out);
  return index;
}

void Scheduler::set_device_online(std::int32_t node, std::int32_t device, bool online, TimeNs now,
                                  std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  const std::int32_t d = m.global_device(node, device);
  m.messages.clear();
  m.now = now;
  m.set_device_online(d, online);
  m.pass(out);
}

bool Scheduler::device_online(std::int32_t node, std::int32_t device) const {
  return !impl_->gpus.dev_offline[impl_->global_device(node, device)];
}

bool Scheduler::node_online(std::int32_t node) const {
  const Impl& m = *impl_;
  m.bins.check_node(node);
  return m.bins.node_online[node] != 0;
}

TimeNs Scheduler::next_wakeup() const { return impl_->wakeup; }
TimeNs Scheduler::now() const { return impl_->now; }

const std::string& Scheduler::message(std::int32_t reason) const {
  if (reason < 0 || reason >= static_cast<std::int32_t>(impl_->messages.size()))
    throw Error(ErrorCode::kInvalidArgument, "reason", "no message with index " + std::to_string(reason) + " in the last call");
  return impl_->messages[reason];
}

std::size_t Scheduler::message_count() const { return impl_->messages.size(); }

std::string Scheduler::explain(ActionId id) const { return impl_->explain(id); }

ActionState Scheduler::state(ActionId id) const {
  const std::int32_t* slot = impl_->actions.by_id.find(id);
  return slot == nullptr ? ActionState::kUnknown : impl_->actions.slots[*slot].state;
}

Decision Scheduler::placement(ActionId id) const {
  const std::int32_t* slot = impl_->actions.by_id.find(id);
  if (slot == nullptr || impl_->actions.slots[*slot].state != ActionState::kRunning)
    throw Error(ErrorCode::kInvalidState, "id", "action " + std::to_string(id) + " is not running");
  const ActionRec& a = impl_->actions.slots[*slot];
  Decision d;
  d.kind = DecisionKind::kStart;
  d.action = id;
  d.node = impl_->bins.bin_node[a.bin];
  d.device = a.device == kNone ? kNone : impl_->gpus.dev_local[a.device];
  d.service = impl_->classes[a.cls].service;
  d.elastic_kind = a.elastic_kind;
  d.grant = a.grant;
  d.time = a.start_ns;
  return d;
}

const Inventory& Scheduler::inventory() const { return impl_->inv; }
const PolicyConfig& Scheduler::policy() const { return impl_->policy; }
std::size_t Scheduler::waiting_count() const { return impl_->actions.n_waiting; }
std::size_t Scheduler::running_count() const { return impl_->actions.n_running; }
std::size_t Scheduler::class_count() const { return impl_->classes.in_use(); }

Quantity Scheduler::free(std::int32_t node, std::int32_t kind) const {
  const Impl& m = *impl_;
  m.bins.check_node(node);
  if (kind < 0 || kind >= m.K) throw Error(ErrorCode::kUnknownName, "kind", "no kind with index " + std::to_string(kind));
  Quantity total = 0;
  for (std::size_t b = 0; b < m.bins.bin_node.size(); ++b)
    if (m.bins.bin_node[b] == node) total += m.bins.free_of(static_cast<std::int32_t>(b))[kind];
  return total;
}

Quantity Scheduler::gpu_free(std::int32_t node, std::int32_t device) const {
  return impl_->gpus.dev_free[impl_->global_device(node, device)];
}

std::int32_t Scheduler::trajectory_slot_node(TrajectoryId trajectory) const {
  auto it = impl_->bins.trajectory_bin.find(trajectory);
  return it == impl_->bins.trajectory_bin.end() ? kNone : impl_->bins.bin_node[it->second];
}

std::pair<std::int32_t, std::int32_t> Scheduler::service_location(std::int32_t service) const {
  const Impl& m = *impl_;
  m.gpus.check_service(service);
  std::int32_t d = m.gpus.services[service].device;
  if (d == kNone) return {kNone, kNone};
  return {m.gpus.dev_node[d], m.gpus.dev_local[d]};
}

bool Scheduler::service_ready(std::int32_t service) const {
  const Impl& m = *impl_;
  m.gpus.check_service(service);
  return m.gpus.services[service].ready(m.now);
}

double Scheduler::runtime(ActionId id, Quantity units) const {
  const std::int32_t* slot = impl_->actions.by_id.find(id);
  if (slot == nullptr) throw Error(ErrorCode::kUnknownAction, "id", "action " + std::to_string(id) + " is not live");
  const ActionRec& a = impl_->actions.slots[*slot];
  if (a.elastic_kind != kNone && units <= 0) throw Error(ErrorCode::kInvalidArgument, "units", "must be positive");
  return impl_->seconds(*slot, units);
}

void Scheduler::check_invariants() const { impl_->check(); }

}  // namespace tangram
