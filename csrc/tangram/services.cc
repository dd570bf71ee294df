// GPU services: restores, greedy eviction, and room made for GPU actions.
//
// Reads: services (residency, waiting and queued work), device memory, the partitions'
// capacity and free trees.
// Changes: which device each service is resident on, device free memory; emits kRestore
// and kEvict decisions.
// Guarantees: a service with running actions, still restoring, or ready only since the
// last pass is never evicted, and no plan takes the GPU memory its restore was made for
// beside it (promised_on); device memory is never over-committed; under
// ServiceDevices::kHome a service lives only on its home device; a service that has waited
// starvation_seconds for a device drains one (drain()) once the services in its way have
// been ready there for starvation_seconds, so no stream of requests to them keeps it
// offloaded for good, and no two services drain each other back and forth.
#include "tangram/scheduler_impl.h"

#include <algorithm>
#include <tuple>
#include <vector>

namespace tangram {

// A service resident on an offline node or device is evicted once none of its actions
// runs there (the caller ends those); until then its actions wait (try_head). Its state
// there is gone: a discard.
void Scheduler::Impl::evict_offline_services(std::vector<Decision>& out) {
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(gpus.services.size()); ++s) {
    const ServiceRec& svc = gpus.services[s];
    if (svc.device == kNone || svc.running > 0 || device_online(svc.device)) continue;
    const std::int32_t node = gpus.dev_node[svc.device];
    evict(s, out, /*discard=*/true);
    refresh_node_devices(node);
  }
}

// Replicated services. An action of a replicated service waits at one copy of it, the copy
// that would start it soonest (soonest_copy), chosen at submit (route_replica) and again at
// every pass while it is among the service's next to start (rebind_replicas): so a copy
// restored later takes over the batches queued at the others, as a surplus copy is brought
// in once the queue ahead at the others outlasts its restore.

// Index, in its replica group (first copy `first`), of the copy at which an action would
// start soonest: the least wait, the whole batches ahead of it there (live(i): the actions
// there, over max_batch) times their mean estimate (work(i): their summed est_ns, over
// live(i)), plus, for a surplus copy, how long until it can start anything (0 when resident,
// what is left of its restore when restoring, its restore time when offloaded); among equal
// waits the copy with the fewest live actions, then the lower copy. Only copies `reachable`
// are candidates (copy_reachable). The mean of what is ahead, not the action's own time:
// under shortest first a queue's last actions are its shortest, and would never see the
// long batches ahead of them.
template <class Reachable, class Live, class Work>
std::size_t Scheduler::Impl::soonest_copy(std::int32_t first, Reachable&& reachable, Live&& live, Work&& work) const {
  const std::vector<std::int32_t>& group = gpus.replica_group[first];
  std::size_t best = 0;
  __int128 best_wait = -1;
  std::int64_t best_live = 0;
  for (std::size_t i = 0; i < group.size(); ++i) {
    const std::int32_t copy = group[i];
    const ServiceRec& r = gpus.services[copy];
    if (!reachable(i)) continue;
    const TimeNs until = !inv.services[copy].surplus ? 0
                         : r.device == kNone     ? r.restore_ns
                                                 : std::max<TimeNs>(r.ready_ns - now, 0);
    const std::int64_t n = live(i);
    const __int128 batches = n / inv.services[copy].max_batch;
    const __int128 wait = static_cast<__int128>(until) + (n == 0 ? 0 : batches * work(i) / n);
    if (best_wait < 0 || wait < best_wait || (wait == best_wait && n < best_live)) {
      best = i;
      best_wait = wait;
      best_live = n;
    }
  }
  return best;
}

// Index in group `first` of the copy a new action would join: soonest_copy counting each
// copy's live actions (running and waiting) and their work.
template <class Reachable>
std::size_t Scheduler::Impl::soonest_for_new(std::int32_t first, Reachable&& reachable) const {
  const std::vector<std::int32_t>& group = gpus.replica_group[first];
  return soonest_copy(
      first, reachable,
      [&](std::size_t i) { return static_cast<std::int64_t>(gpus.services[group[i]].running) + gpus.services[group[i]].waiting; },
      [&](std::size_t i) { return static_cast<__int128>(gpus.services[group[i]].running_ns) + gpus.services[group[i]].queued_ns; });
}

// The copy a submitted action of a replicated service joins: its live actions include the
// batch's earlier ones. The service's minimum copies share its calls evenly (each restored
// when it is first given one).
std::int32_t Scheduler::Impl::route_replica(const ActionSpec& s) const {
  const std::vector<std::int32_t>& group = gpus.replica_group[s.service];
  return group[soonest_for_new(s.service, [&](std::size_t i) { return copy_reachable(group[i]); })];
}

// Whether a copy may be routed to: a minimum copy always (it is restored when first given
// an action), a surplus one when resident or restoring, or while surplus_has_room.
bool Scheduler::Impl::copy_reachable(std::int32_t copy) const {
  return !inv.services[copy].surplus || gpus.services[copy].device != kNone || surplus_has_room(copy);
}

// Every pass, before anything starts: a replicated service's first waiting actions in
// policy order (the next two batches of every copy: kRebindBatches), go to the copy that
// would start each soonest, counting the copy's running actions and the waiting ones placed
// there before it. A copy restored since, or one whose batch ended, thus takes over actions
// queued at a busier one. An action that named its copy stays there (and counts there), as
// does one whose class at the chosen copy could never run. Actions further back keep their
// copy until they come that far forward (an action's place only matters once it is among
// the next to start), except that
// - those queued at an offloaded surplus copy that has lost its room go back to the others
//   (placed after the first ones, in order), and
// - an offloaded surplus copy with nothing queued, that a new action would be routed to
//   (route_replica), takes the last waiting action in policy order: its restore begins as if
//   that action had just arrived.
// So a pass costs O(B log B) for B batch slots of the group, not O(W log W) for W waiting:
// a burst of ten thousand rewards is not sorted again at every event.
void Scheduler::Impl::rebind_replicas() {
  std::vector<OrderKey>& keys = this_pass.rebinding;
  std::vector<std::int64_t>& live = this_pass.rebind_live;
  std::vector<TimeNs>& work = this_pass.rebind_work;
  std::vector<std::uint8_t>& reachable = this_pass.rebind_reachable;
  std::vector<std::int32_t>& queued = this_pass.rebind_classes;  // the group's classes with waiting actions
  for (std::int32_t first = 0; first < static_cast<std::int32_t>(gpus.replica_group.size()); ++first) {
    const std::vector<std::int32_t>& group = gpus.replica_group[first];
    if (group.size() < 2) continue;
    std::int64_t waiting = 0, window = 0;
    for (std::int32_t copy : group) {
      waiting += gpus.services[copy].waiting;
      window += kRebindBatches * inv.services[copy].max_batch;
    }
    if (waiting == 0) continue;
    auto index_of = [&](std::int32_t copy) {
      return static_cast<std::size_t>(std::find(group.begin(), group.end(), copy) - group.begin());
    };
    // Moving actions within the group changes no copy's reach (surplus_has_room looks at
    // other services and at devices without another copy of the group): settled once.
    reachable.assign(group.size(), 0);
    for (std::size_t i = 0; i < group.size(); ++i) reachable[i] = copy_reachable(group[i]) ? 1 : 0;
    // The group's classes with waiting actions. Under home devices the group holds only the
    // deployed copies: actions naming an undeployed surplus copy are not the group's.
    queued.clear();
    for (std::int32_t c = 0; c < static_cast<std::int32_t>(classes.size()); ++c)
      if (classes[c].service != kNone && !classes[c].waiting.empty() && index_of(classes[c].service) < group.size())
        queued.push_back(c);
    keys.clear();
    const bool whole = waiting <= window;
    if (whole) {
      for (std::int32_t c : queued) classes[c].waiting.for_each([&](const OrderKey& k) { keys.push_back(k); });
      std::sort(keys.begin(), keys.end());
    } else {
      first_waiting(queued, static_cast<std::size_t>(window), keys);
      const std::size_t front = keys.size();
      for (std::int32_t c : queued)
        if (!reachable[index_of(classes[c].service)])
          classes[c].waiting.for_each([&](const OrderKey& k) {
            if (keys[front - 1] < k) keys.push_back(k);  // the first ones are listed already
          });
      std::sort(keys.begin() + static_cast<std::ptrdiff_t>(front), keys.end());
    }
    live.assign(group.size(), 0);
    work.assign(group.size(), 0);
    for (std::size_t i = 0; i < group.size(); ++i) {
      live[i] = gpus.services[group[i]].running;
      work[i] = gpus.services[group[i]].running_ns;
    }
    for (const OrderKey& k : keys) {  // each counts where it ends up
      const ActionRec& r = actions.slots[k.slot];
      if (!actions.details[k.slot].any_replica) {  // it named its copy
        const std::size_t at = index_of(classes[r.cls].service);
        ++live[at];
        work[at] += actions.details[k.slot].est_ns;
        continue;
      }
      const std::size_t best = soonest_copy(
          first, [&](std::size_t i) { return reachable[i] != 0; }, [&](std::size_t i) { return live[i]; },
          [&](std::size_t i) { return static_cast<__int128>(work[i]); });
      std::size_t at = best;
      if (group[best] != classes[r.cls].service && !move_to_copy(k.slot, group[best])) at = index_of(classes[r.cls].service);
      ++live[at];
      work[at] += actions.details[k.slot].est_ns;
    }
    if (!whole) call_in_surplus(first, reachable);
  }
}

// The first `n` waiting actions in policy order of the classes `queued` into `keys`, by a
// walk down their heaps (each position's children come after it): O(n log n).
void Scheduler::Impl::first_waiting(const std::vector<std::int32_t>& queued, std::size_t n,
                                    std::vector<OrderKey>& keys) const {
  struct Next {
    OrderKey key;
    std::int32_t cls;
    std::uint32_t at;
    bool operator>(const Next& o) const { return o.key < key; }
  };
  std::vector<Next> next;
  for (std::int32_t c : queued) next.push_back(Next{classes[c].waiting.at(0), c, 0});
  std::make_heap(next.begin(), next.end(), std::greater<>());
  constexpr std::size_t arity = WaitQueue<OrderKey>::arity();
  while (!next.empty() && keys.size() < n) {
    std::pop_heap(next.begin(), next.end(), std::greater<>());
    const Next taken = next.back();
    next.pop_back();
    keys.push_back(taken.key);
    const WaitQueue<OrderKey>& q = classes[taken.cls].waiting;
    for (std::size_t child = arity * taken.at + 1; child < q.size() && child <= arity * taken.at + arity; ++child) {
      next.push_back(Next{q.at(child), taken.cls, static_cast<std::uint32_t>(child)});
      std::push_heap(next.begin(), next.end(), std::greater<>());
    }
  }
}

// An offloaded surplus copy of group `first` with nothing queued, that route_replica would
// send a new action to, takes the group's last waiting action in policy order (that did not
// name its copy): the queue beyond the rebound ones would otherwise never call it in.
void Scheduler::Impl::call_in_surplus(std::int32_t first, const std::vector<std::uint8_t>& reachable) {
  const std::vector<std::int32_t>& group = gpus.replica_group[first];
  for (std::size_t i = 0; i < group.size(); ++i) {
    const ServiceRec& copy = gpus.services[group[i]];
    if (!inv.services[group[i]].surplus || copy.device != kNone || copy.waiting > 0 || !reachable[i]) continue;
    if (soonest_for_new(first, [&](std::size_t j) { return reachable[j] != 0; }) != i) continue;
    bool found = false;
    OrderKey last{};
    for (const Class& cl : classes)
      if (cl.service != kNone && cl.service != group[i] && inv.services[cl.service].first_copy(cl.service) == first)
        cl.waiting.for_each([&](const OrderKey& k) {
          if (actions.details[k.slot].any_replica && (!found || last < k)) last = k, found = true;
        });
    if (found) move_to_copy(last.slot, group[i]);
  }
}

// Waiting action `slot` moves to the class like its own at service `copy`; false (and it
// stays) when that class could never run.
bool Scheduler::Impl::move_to_copy(std::int32_t slot, std::int32_t copy) {
  ActionRec& r = actions.slots[slot];
  const std::int32_t from = r.cls;
  ActionSpec like;
  like.demand.assign(classes[from].demand, classes[from].demand + K);
  like.gpu_memory = classes[from].gpu_memory;
  like.affinity_node = classes[from].affinity_node;
  like.service = copy;
  like.quota = classes[from].quota;
  like.tokens = classes[from].tokens;
  const std::int32_t to = classes.find_or_add(like, classes[from].partition, /*in_slot=*/false,
                                              [&](Class& made) { made.infeasible = infeasible_reason(made); });
  if (!classes[to].infeasible.empty()) {
    classes.free_if_unused(to);
    return false;
  }
  leave_class_queue(slot);
  r.cls = to;
  join_class_queue(to, actions.details[slot]);
  return true;
}

// Whether another copy of `copy`'s replica group is resident (or restoring) on device d.
bool Scheduler::Impl::sibling_on(std::int32_t copy, std::int32_t d) const {
  for (std::int32_t o : gpus.replica_group[inv.services[copy].first_copy(copy)])
    if (o != copy && gpus.services[o].device == d) return true;
  return false;
}

// Whether offloaded surplus copy `copy` could be restored without taking memory another
// service needs: no other service's minimum copy waits offloaded (its restore comes first),
// and an online device that holds no other copy of its group (two copies on one device
// share its compute) has its memory free now, or free once the quiet services there give
// theirs back: idle (nothing running or waiting, ready before the last pass: those plan_room
// evicts first) and not asked for lately (fewer than two requests, or none for kTailGaps of
// its mean gaps, as order_service_tails tells a stopped queue). A popular service between
// two requests is not quiet: evicting it would cost a restore at its next one. A surplus
// copy is for memory that would otherwise serve nothing, not for pushing out another service
// (whose only copy that may be); if that memory is taken by the time its restore is
// planned, the restore makes room as any does.
bool Scheduler::Impl::surplus_has_room(std::int32_t copy) const {
  const std::int32_t first = inv.services[copy].first_copy(copy);
  for (std::int32_t o = 0; o < static_cast<std::int32_t>(gpus.services.size()); ++o)
    if (!inv.services[o].surplus && inv.services[o].first_copy(o) != first && gpus.services[o].device == kNone &&
        gpus.services[o].waiting > 0)
      return false;
  const Quantity memory = inv.services[copy].memory;
  for (std::int32_t d = 0; d < static_cast<std::int32_t>(gpus.dev_free.size()); ++d) {
    if (!device_online(d) || sibling_on(copy, d)) continue;
    Quantity room = gpus.dev_free[d];
    for (std::int32_t o = 0; o < static_cast<std::int32_t>(gpus.services.size()) && room < memory; ++o) {
      const ServiceRec& r = gpus.services[o];
      if (r.device == d && r.running == 0 && r.waiting == 0 && r.ready_ns <= prev_pass_now &&
          (r.mean_gap_ns < 0 || (now - r.last_request_ns) / kTailGaps > r.mean_gap_ns))
        room += evict_frees(inv.services[o]);
    }
    if (room >= memory) return true;
  }
  return false;
}

// Greedy eviction plan for `need` milli-MiB on device d: never a service with running
// actions, still restoring or ready only since the last pass (nor `keep`); idle ones
// (nothing waiting) first, those surplus replicas first, then by the restore time their
// eviction will likely cost (least restore time per expected gap until their next
// request); then the least queued work per unit of restore cost, then service order. The
// plan's `likely` sums that cost over its idle victims, so the choice of device weighs
// popularity too.
// A victim whose offloaded state would not fit the node's offload memory (beside the
// earlier victims') is discarded instead: its state is given up, freeing all its memory.
// When that is still short, the plan's unmovable victims (in plan order) are discarded
// rather than offloaded, and then idle unmovable services asleep on d (in service order)
// are discarded too: their processes, and the memory they keep there, are given up; for a
// `starving` action also those with waiting actions (which restore afresh later: else the
// starving action, holding back what they need to start, and they would wait on each other).
Scheduler::Impl::RoomPlan Scheduler::Impl::plan_room(std::int32_t d, Quantity need, std::int32_t keep,
                                                     bool starving) const {
  RoomPlan plan;
  Quantity room = gpus.dev_free[d] - promised_on(d, keep);
  if (room >= need) {
    plan.ok = true;
    return plan;
  }
  std::vector<std::int32_t> cands;
  bool spared = false;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(gpus.services.size()); ++s) {
    const ServiceRec& o = gpus.services[s];
    // A service that became ready since the last pass gets that pass for its waiting
    // actions before it may be evicted: otherwise a restore can be undone unused.
    if (s != keep && o.device == d && o.running == 0) {
      if (o.ready_ns <= prev_pass_now) cands.push_back(s);
      else if (o.ready_ns <= now) spared = true;  // ready since the last pass (not still restoring)
    }
  }
  // How long until a service is asked for again: its usual gap between requests, or the
  // time since its last one when longer; -1 when it was never asked for.
  auto expected_gap = [&](const ServiceRec& r) -> TimeNs {
    if (r.last_request_ns < 0) return -1;
    const TimeNs since = now - r.last_request_ns;
    return std::max<TimeNs>(std::max<TimeNs>(r.mean_gap_ns, since), 1);
  };
  std::sort(cands.begin(), cands.end(), [&](std::int32_t x, std::int32_t y) {
    const ServiceRec& a = gpus.services[x];
    const ServiceRec& b = gpus.services[y];
    bool ia = a.waiting == 0, ib = b.waiting == 0;
    if (ia != ib) return ia;
    if (ia && inv.services[x].surplus != inv.services[y].surplus) return inv.services[x].surplus;  // surplus copies first
    if (ia) {
      // Idle: the one whose eviction costs least in restores it will likely need first:
      // restore time over the expected gap until it is asked for again; never asked: no cost.
      const TimeNs ga = expected_gap(a), gb = expected_gap(b);
      if ((ga < 0) != (gb < 0)) return ga < 0;
      if (ga >= 0) {
        __int128 ca = static_cast<__int128>(a.restore_ns) * gb;
        __int128 cb = static_cast<__int128>(b.restore_ns) * ga;
        if (ca != cb) return ca < cb;
      }
    }
    __int128 lhs = static_cast<__int128>(a.queued_ns) * std::max<TimeNs>(b.restore_ns, 1);
    __int128 rhs = static_cast<__int128>(b.queued_ns) * std::max<TimeNs>(a.restore_ns, 1);
    if (lhs != rhs) return lhs < rhs;
    return x < y;
  });
  // The victims' host memory must fit the node's offload memory, less what `keep` gives
  // back there when this plan is for its restore.
  const ServiceRec* kept = keep != kNone ? &gpus.services[keep] : nullptr;
  Quantity host = kept != nullptr && kept->device == kNone && kept->host_node == gpus.dev_node[d]
                      ? -inv.services[keep].host_memory
                      : 0;
  for (std::size_t i = 0; i < cands.size() && room < need; ++i) {
    const ServiceRec& o = gpus.services[cands[i]];
    const bool kept_state = gpus.offload_fits(gpus.dev_node[d], host + inv.services[cands[i]].host_memory);
    if (kept_state) host += inv.services[cands[i]].host_memory;
    room += kept_state ? evict_frees(inv.services[cands[i]]) : inv.services[cands[i]].memory;
    plan.discard.push_back(kept_state ? 0 : 1);
    plan.busy += o.waiting > 0 ? 1 : 0;
    plan.queued += o.queued_ns;
    const TimeNs gap = expected_gap(o);
    if (o.waiting == 0 && gap > 0) plan.likely += static_cast<double>(o.restore_ns) / static_cast<double>(gap);
    plan.victims.push_back(cands[i]);
  }
  // Still short: unmovable victims give their processes up rather than keep their asleep
  // memory there (else a device an unmovable service sleeps on could never hold the rest).
  for (std::size_t i = 0; i < plan.victims.size() && room < need; ++i) {
    const std::int32_t v = plan.victims[i];
    if (plan.discard[i] || inv.services[v].asleep_memory == 0) continue;
    room += inv.services[v].asleep_memory;
    plan.discard[i] = 1;
  }
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(gpus.services.size()) && room < need; ++s) {
    const ServiceRec& o = gpus.services[s];
    if (s == keep || o.device != kNone || o.pinned_device != d || (o.waiting > 0 && !starving)) continue;
    if (inv.services[s].asleep_memory == 0) continue;
    room += inv.services[s].asleep_memory;
    plan.victims.push_back(s);
    plan.discard.push_back(1);
  }
  plan.ok = room >= need;
  plan.spared_fresh = !plan.ok && spared;
  return plan;
}

// GPU memory on device d promised to the heads of services restored there and not used yet
// (restoring, or ready only since the last pass, with nothing running): the GPU memory of
// each one's first waiting action in policy order (but `keep`'s). Plans (restores and the
// evictions made for GPU actions) leave it free: else a second restore, or another action's
// plan, takes the room a restore was made for, its head finds no room beside its service,
// and the service, evicted unused once it may be, is restored again, pass after pass. Starts
// may use it: what they take comes back when they end.
Quantity Scheduler::Impl::promised_on(std::int32_t d, std::int32_t keep) const {
  Quantity promised = 0;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(gpus.services.size()); ++s) {
    const ServiceRec& o = gpus.services[s];
    if (s == keep || o.device != d || o.ready_ns <= prev_pass_now || o.running > 0 || o.waiting == 0) continue;
    const Class* first = nullptr;
    for (const Class& cl : classes)
      if (cl.service == s && !cl.waiting.empty() && (first == nullptr || cl.waiting.head() < first->waiting.head()))
        first = &cl;
    if (first != nullptr) promised += first->gpu_memory;
  }
  return promised;
}

void Scheduler::Impl::evict_plan(const RoomPlan& plan, std::vector<Decision>& out) {
  for (std::size_t i = 0; i < plan.victims.size(); ++i) {
    const std::int32_t v = plan.victims[i];
    if (gpus.services[v].device == kNone) discard_asleep(v, out);
    else evict(v, out, plan.discard[i] != 0);
  }
}

// An unmovable service asleep on its pinned device gives its process up: the memory it
// keeps there (and its host memory) is free again, and its next restore is a fresh load.
// Emits a kEvict with reason kDiscard for the device its process was on.
void Scheduler::Impl::discard_asleep(std::int32_t v, std::vector<Decision>& out) {
  ServiceRec& svc = gpus.services[v];
  const std::int32_t d = svc.pinned_device;
  gpus.give_back(d, inv.services[v].asleep_memory);
  svc.pinned_device = kNone;
  gpus.release_offloaded_state(v, inv.services[v].host_memory);
  gpus.dev_ops_end[d] = std::max(now, gpus.dev_ops_end[d]);
  refresh_node_devices(gpus.dev_node[d]);
  emit_evict(v, d, true, out);
}

void Scheduler::Impl::emit_evict(std::int32_t v, std::int32_t d, bool discard, std::vector<Decision>& out) const {
  Decision e;
  e.kind = DecisionKind::kEvict;
  e.service = v;
  e.node = gpus.dev_node[d];
  e.device = gpus.dev_local[d];
  e.time = now;
  if (discard) e.reason = kDiscard;
  out.push_back(e);
}

// Evicts resident service v: offloaded, its state kept in host memory (the memory it keeps
// asleep stays on the device), or with `discard` its state given up (all of its memory
// free; an unmovable one's process too, so it is no longer pinned).
void Scheduler::Impl::evict(std::int32_t v, std::vector<Decision>& out, bool discard) {
  ServiceRec& svc = gpus.services[v];
  const ServiceSpec& spec = inv.services[v];
  const std::int32_t d = svc.device;
  svc.device = kNone;
  if (discard) {
    gpus.give_back(d, spec.memory);
    svc.pinned_device = kNone;
  } else {
    gpus.give_back(d, evict_frees(spec));
    if (spec.host_memory > 0) {
      gpus.node_offload_used[gpus.dev_node[d]] += spec.host_memory;
      svc.host_node = gpus.dev_node[d];
    }
  }
  gpus.dev_ops_end[d] = std::max(now, gpus.dev_ops_end[d]) + svc.offload_ns;
  emit_evict(v, d, discard, out);
}

// Whether device d could ever serve the head of class `cl` (a service action): big enough
// for the service beside the action's GPU memory, on a node with a bin of the class's
// partition whose capacity covers its demand. By capacity alone: what runs there now ends.
bool Scheduler::Impl::could_serve(const Class& cl, std::int32_t d) const {
  if (gpus.dev_total[d] < inv.services[cl.service].memory + cl.gpu_memory) return false;
  const Partition& part = bins.partitions[cl.partition];
  const std::int32_t n = gpus.dev_node[d];
  if (part.node_lo[n] < 0) return false;
  std::vector<Quantity> demand(cl.demand, cl.demand + K);
  if (bins.has_gpus) demand.push_back(0);
  std::vector<std::int32_t> found;
  part.cap_tree.find(part.node_lo[n], part.node_hi[n], demand.data(), 1, [](std::int32_t) { return false; }, found);
  return !found.empty();
}

// Whether a waiting action of `cl`'s service in another class could run on device d.
bool Scheduler::Impl::serves_another(const Class& cl, std::int32_t d) const {
  for (const Class& other : classes)
    if (&other != &cl && other.service == cl.service && !other.waiting.empty() && could_serve(other, d)) return true;
  return false;
}

// Makes `svc_id` resident (or restoring) somewhere, evicting greedily (plan_room).
// Emits the evict and restore decisions; false when no device can make room now.
bool Scheduler::Impl::restore(std::int32_t svc_id, const Class& head, std::vector<Decision>& out) {
  ServiceRec& svc = gpus.services[svc_id];
  const ServiceSpec& spec = inv.services[svc_id];
  // Its whole memory must fit the device; restored where it is pinned (an unmovable one
  // asleep there) it takes only what it does not keep asleep.
  const Quantity full = spec.memory;
  auto need_on = [&](std::int32_t d) { return full - (d == svc.pinned_device ? spec.asleep_memory : 0); };
  // Room is made for the head beside the service, not the service alone: else the head
  // would evict (make_gpu_room) the very services the next restore needs, and restores
  // made for actions that never fit beside them would evict each other pass after pass.
  auto room_on = [&](std::int32_t d) { return need_on(d) + head.gpu_memory; };
  const Partition& part = bins.partitions[head.partition];
  std::int32_t dlo = svc.home_device != kNone ? svc.home_device : 0;
  std::int32_t dhi = svc.home_device != kNone ? svc.home_device + 1 : static_cast<std::int32_t>(gpus.dev_node.size());
  std::vector<std::int32_t> found;
  auto no_skip = [](std::int32_t) { return false; };
  std::vector<Quantity> demand(head.demand, head.demand + K);
  if (bins.has_gpus) demand.push_back(0);
  // A surplus copy goes beside another copy of its group (they would share the device's
  // compute; its calls were routed to it for room elsewhere) only where no other device in
  // its range could ever serve its head.
  bool sibling_free_device = false;
  for (std::int32_t d = dlo; d < dhi && spec.surplus && !sibling_free_device; ++d)
    sibling_free_device = device_online(d) && could_serve(head, d) && !sibling_on(svc_id, d);
  auto usable = [&](std::int32_t d) {
    return device_online(d) && could_serve(head, d) && !(sibling_free_device && sibling_on(svc_id, d));
  };
  // Prefer devices whose node has room for the waiting action right now.
  auto busy_node = [&](std::int32_t d) -> std::int64_t {
    std::int32_t n = gpus.dev_node[d];
    found.clear();
    part.free_tree.find(part.node_lo[n], part.node_hi[n], demand.data(), 1, no_skip, found);
    return found.empty() ? 1 : 0;
  };
  // When a restore on d could begin: after d's earlier restores and offloads.
  auto begins = [&](std::int32_t d) { return std::max(now, gpus.dev_ops_end[d]); };
  // An unmovable service restores where it is pinned while its head could ever run there;
  // else (an offline node, a head whose demand that node or device can never hold) its
  // process there is given up, and it loads afresh on a device of its own range.
  if (svc.pinned_device != kNone && usable(svc.pinned_device)) dlo = svc.pinned_device, dhi = dlo + 1;
  // Actions running or waiting at the services resident on d: they share d's compute with
  // whatever is restored beside them (reward models' batches are compute-bound), so a
  // restore goes where the fewest would share it. Counting actions, not busy services,
  // keeps a restore off the device of one heavily used service.
  auto actions_on = [&](std::int32_t d) {
    std::int64_t n = 0;
    for (const ServiceRec& o : gpus.services) n += o.device == d ? o.running + o.waiting : 0;
    return n;
  };
  // 1. A device with room already: the fewest actions there, the soonest free, then best
  // fit. 2. Else the cheapest eviction plan.
  std::int32_t target = kNone;
  std::tuple<std::int64_t, std::int64_t, TimeNs, Quantity> best_fit{2, 0, 0, 0};
  for (std::int32_t d = dlo; d < dhi; ++d)
    if (gpus.dev_free[d] - promised_on(d, svc_id) >= room_on(d) && usable(d)) {
      std::tuple<std::int64_t, std::int64_t, TimeNs, Quantity> fit{busy_node(d), actions_on(d), begins(d),
                                                                    gpus.dev_free[d] - room_on(d)};
      if (fit < best_fit) {
        best_fit = fit;
        target = d;
      }
    }
  RoomPlan chosen;
  if (target == kNone) {
    std::tuple<std::int64_t, std::int64_t, std::int64_t, TimeNs, double, std::size_t, std::int32_t> best{
        INT64_MAX, 0, 0, 0, 0, 0, 0};
    for (std::int32_t d = dlo; d < dhi; ++d) {
      if (!usable(d)) continue;
      RoomPlan plan = plan_room(d, room_on(d), svc_id);
      this_pass.spared_fresh |= plan.spared_fresh;
      if (!plan.ok) continue;
      TimeNs ready = begins(d);  // after the victims' offloads
      for (std::int32_t v : plan.victims) ready += gpus.services[v].offload_ns;
      auto cost = std::make_tuple(busy_node(d), plan.busy, plan.queued, ready, plan.likely, plan.victims.size(), d);
      if (cost < best) {
        best = cost;
        target = d;
        chosen = std::move(plan);
      }
    }
    if (target == kNone) {
      if (now - head.waiting.head().submit_ns >= starvation_ns) drain(svc_id, dlo, dhi, room_on, usable);
      return false;
    }
    evict_plan(chosen, out);
  }
  gpus.dev_free[target] -= need_on(target);
  if (svc.pinned_device != kNone && svc.pinned_device != target) discard_asleep(svc_id, out);  // its old process
  gpus.release_offloaded_state(svc_id, spec.host_memory);  // its offloaded state goes back to the device
  if (!spec.movable) svc.pinned_device = target;
  svc.device = target;
  svc.ready_ns = begins(target) + svc.restore_ns;
  gpus.dev_ops_end[target] = svc.ready_ns;
  refresh_node_devices(gpus.dev_node[target]);
  if (!chosen.victims.empty()) release_on_node(gpus.dev_node[target], kNone);
  Decision d;
  d.kind = DecisionKind::kRestore;
  d.service = svc_id;
  d.node = gpus.dev_node[target];
  d.device = gpus.dev_local[target];
  d.time = svc.ready_ns;
  out.push_back(d);
  if (svc.ready_ns > now) wakeup = std::min(wakeup, svc.ready_ns);
  return true;
}

// A service that has waited starvation_seconds finds no device that can make room: the
// services in its way all have running actions, which plan_room never evicts, and a steady
// stream of requests would keep them busy for as long as it lasts. So it drains the device
// (in [dlo, dhi), usable) where the fewest running actions are in its way: the services
// there that would have to go (fewest running actions first) serve the queue they had when
// their drain began (the first of an unbroken run of passes that drain them): as many starts
// as actions waited then, in their order, and nothing more, in this pass, and the pass after,
// while it still waits, and so on. A finite queue, served rather than stranded by their
// eviction (each stranded action would wait for a restore of its own), while what arrives
// later waits. Once their running actions have ended, plan_room evicts them for it.
// Services still restoring, or ready only since the last pass, are not in the way
// (plan_room spares them too).
template <class NeedOn, class Usable>
void Scheduler::Impl::drain(std::int32_t svc_id, std::int32_t dlo, std::int32_t dhi, NeedOn&& room_on,
                            Usable&& usable) {
  std::int64_t least = INT64_MAX;
  std::vector<std::int32_t> in_way, victims;
  for (std::int32_t d = dlo; d < dhi; ++d) {
    if (!usable(d)) continue;
    in_way.clear();
    for (std::int32_t o = 0; o < static_cast<std::int32_t>(gpus.services.size()); ++o) {
      if (o == svc_id || gpus.services[o].device != d || gpus.services[o].ready_ns > prev_pass_now) continue;
      // A service keeps its device against drains for starvation_seconds after it became
      // ready: else, with a burst queued at both, two services drain each other in turn,
      // each restored to serve a share of its queue (bench/sim_grid.py, rewardburst). A pass
      // comes when that residency ends.
      const TimeNs kept_until = gpus.services[o].ready_ns + starvation_ns;
      if (kept_until > now) {
        wakeup = std::min(wakeup, kept_until);
        continue;
      }
      in_way.push_back(o);
    }
    std::sort(in_way.begin(), in_way.end(), [&](std::int32_t x, std::int32_t y) {
      return std::make_pair(gpus.services[x].running, x) < std::make_pair(gpus.services[y].running, y);
    });
    Quantity room = gpus.dev_free[d];
    std::int64_t running = 0;
    std::size_t k = 0;
    for (; k < in_way.size() && room < room_on(d); ++k) {
      room += evict_frees(inv.services[in_way[k]]);
      running += gpus.services[in_way[k]].running;
    }
    if (room < room_on(d) || running >= least) continue;
    least = running;
    victims.assign(in_way.begin(), in_way.begin() + static_cast<std::ptrdiff_t>(k));
  }
  for (std::int32_t v : victims) {
    ServiceRec& victim = gpus.services[v];
    const bool run_goes_on = victim.draining_pass == this_pass.epoch || victim.draining_pass + 1 == this_pass.epoch;
    if (!run_goes_on) victim.drain_starts = victim.waiting;
    victim.draining_pass = this_pass.epoch;
    victim.draining_for = svc_id;
  }
}

// OrderRule::kEstimate serves the step, and a GPU service queue whose arrivals have stopped
// is work the step waits for. Shortest first minimises its mean ACT but leaves its longest
// actions to the end, each then alone on a batch slot; so in its tail the queue keeps
// shortest first except for the actions that would end past the drain: each action may
// start no later than the drain's end (its queued work over max_batch) less its own run
// time, and one that shortest first starts later goes where that latest start falls.
// Arrivals have stopped once the time since the service's last request exceeds kTailGaps
// of its mean gap between requests, and the time since the last submit of any action
// kTailGaps of the mean gap between submits: while other actions still come, trajectories
// still run and the step is not at its end, so a lull of one service keeps shortest first.
// The next request ends the tail, and the queue goes back to shortest first at the pass
// after it.
void Scheduler::Impl::order_service_tails() {
  const bool all_stopped = actions.mean_gap_ns >= 0 && (now - actions.last_submit_ns) / kTailGaps > actions.mean_gap_ns;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(gpus.services.size()); ++s) {
    ServiceRec& svc = gpus.services[s];
    if (svc.waiting == 0) {
      svc.tail_ordered = false;  // no key to change
      continue;
    }
    const bool tail = all_stopped && svc.mean_gap_ns >= 0 && (now - svc.last_request_ns) / kTailGaps > svc.mean_gap_ns;
    if (tail != svc.tail_ordered) reorder_service_queue(s, tail);
  }
}

// Re-keys the service's waiting actions and puts their classes back in the active heap
// under their new heads (a service's classes never park: they are looked at every pass).
// In its tail, with the queue in shortest-first order (its keys from order_key), W its work
// and B its max_batch: the action at position j is late when the work before it exceeds
// W - B x its run time (shortest first would start it after the drain's end less its run
// time), and then takes the key of the first position whose work before it reaches that.
void Scheduler::Impl::reorder_service_queue(std::int32_t svc_id, bool tail) {
  gpus.services[svc_id].tail_ordered = tail;
  std::vector<OrderKey> queue;  // shortest-first keys
  for (std::int32_t c = 0; c < static_cast<std::int32_t>(classes.size()); ++c) {
    Class& cl = classes[c];
    if (cl.service != svc_id || cl.quota != kNone) continue;
    cl.waiting.for_each([&](const OrderKey& k) {
      OrderKey normal = k;
      normal.key = order_key(cl, actions.details[k.slot].est_ns, aging_term(k.submit_ns));
      queue.push_back(normal);
    });
  }
  std::sort(queue.begin(), queue.end());
  std::vector<__int128> before(queue.size() + 1, 0);  // work before each position
  for (std::size_t j = 0; j < queue.size(); ++j) before[j + 1] = before[j] + actions.details[queue[j].slot].est_ns;
  const __int128 work = before.back();
  const std::int64_t batch = inv.services[svc_id].max_batch;
  std::vector<std::int64_t>& key = tail_keys;  // by slot
  if (key.size() < actions.slots.size()) key.resize(actions.slots.size());
  for (std::size_t j = 0; j < queue.size(); ++j) {
    key[queue[j].slot] = queue[j].key;
    if (!tail) continue;
    const __int128 latest = work - static_cast<__int128>(batch) * actions.details[queue[j].slot].est_ns;
    if (before[j] <= latest) continue;
    const std::size_t at = static_cast<std::size_t>(std::lower_bound(before.begin(), before.begin() + j, latest) - before.begin());
    key[queue[j].slot] = queue[at].key;
  }
  for (std::int32_t c = 0; c < static_cast<std::int32_t>(classes.size()); ++c) {
    Class& cl = classes[c];
    if (cl.service != svc_id || cl.quota != kNone || cl.waiting.empty()) continue;
    classes.deactivate(c);
    cl.waiting.rekey([&](OrderKey& k) { k.key = actions.details[k.slot].order.key = key[k.slot]; }, actions.queue_pos);
    classes.activate(c);
  }
}

// RestoreRule::kQueuesFirst: a restore serves a service's whole queue, so offloaded services with waiting
// actions are restored before the walk, in queue order rather than action order: starving
// ones first (the first of their waiting actions in policy order has waited
// starvation_seconds), then minimum copies before surplus ones, surplus ones by their
// service's work (waiting and running at all its copies) per batch slot, the most first (a
// copy shortens its service's drain, and the step waits for the longest); then the most
// waiting actions per second the restore and the queue occupy the GPU memory (Smith's rule:
// waiting / (restore + queued work / max_batch), cross multiplied in integers), then service
// order. Each is restored by restore() (the usual device choice and greedy eviction) with
// its first waiting action in policy order as the head; one that finds no room now is left
// to the walk. While a GPU action with no service starves, none is restored ahead of the
// walk.
void Scheduler::Impl::restore_queues(std::vector<Decision>& out) {
  std::vector<std::int32_t> order;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(gpus.services.size()); ++s)
    if (gpus.services[s].device == kNone && gpus.services[s].waiting > 0) order.push_back(s);
  if (order.empty()) return;
  std::vector<std::int32_t> head(gpus.services.size(), kNone);  // class holding the service's first waiting action
  for (std::int32_t c = 0; c < static_cast<std::int32_t>(classes.size()); ++c) {
    const Class& cl = classes[c];
    // A starving GPU action (no service) gets its memory in the walk, in policy order: restores
    // ahead of the walk would take the device it waits for, pass after pass.
    if (cl.service == kNone && cl.gpu_memory > 0 && !cl.waiting.empty() &&
        now - cl.waiting.head().submit_ns >= starvation_ns)
      return;
    if (cl.service == kNone || cl.waiting.empty() || gpus.services[cl.service].device != kNone) continue;
    std::int32_t& h = head[cl.service];
    if (h == kNone || cl.waiting.head() < classes[h].waiting.head()) h = c;
  }
  auto starving = [&](std::int32_t s) { return now - classes[head[s]].waiting.head().submit_ns >= starvation_ns; };
  auto span = [&](std::int32_t s) {
    return gpus.services[s].restore_ns + gpus.services[s].queued_ns / inv.services[s].max_batch;
  };
  // A replicated service's work, waiting and running at all its copies, per batch slot.
  auto group_work = [&](std::int32_t s) {
    __int128 w = 0;
    for (std::int32_t o : gpus.replica_group[inv.services[s].first_copy(s)])
      w += gpus.services[o].queued_ns + gpus.services[o].running_ns;
    return w / inv.services[s].max_batch;
  };
  std::sort(order.begin(), order.end(), [&](std::int32_t x, std::int32_t y) {
    bool sx = starving(x), sy = starving(y);
    if (sx != sy) return sx;
    const bool px = inv.services[x].surplus, py = inv.services[y].surplus;
    if (px != py) return py;  // minimum copies first
    if (px) {
      const __int128 wx = group_work(x), wy = group_work(y);
      if (wx != wy) return wx > wy;
    }
    __int128 lhs = static_cast<__int128>(gpus.services[x].waiting) * span(y);
    __int128 rhs = static_cast<__int128>(gpus.services[y].waiting) * span(x);
    if (lhs != rhs) return lhs > rhs;
    return x < y;
  });
  for (std::int32_t s : order) {
    const Class& cl = classes[head[s]];
    if (cl.quota != kNone && !quotas[cl.quota].admits(now, cl.tokens)) continue;  // the walk will say why
    if (gpus.services[s].device == kNone) restore(s, cl, out);
  }
}

// An action needs GPU memory that resident services hold: evict by the same greedy plan,
// on its service's device, or else on the device with the cheapest plan among the nodes
// (in its range) where the rest of its demand fits now. False when no plan exists.
bool Scheduler::Impl::make_gpu_room(const Class& c, std::int32_t lo, std::int32_t hi, std::int32_t fixed_leaf,
                                    std::int32_t device, std::vector<Decision>& out) {
  std::int32_t target = kNone;
  RoomPlan chosen;
  if (device != kNone) {
    if (gpus.dev_free[device] >= c.gpu_memory) return false;  // it waits for something else
    // Its service's node must hold the rest of its demand now, else the memory freed would go
    // unused (and the victims be restored and evicted again, pass after pass). Under
    // trajectory slots its trajectory's own held slot there is nobody else's: a starving
    // action does not hold it back (else the starving action, waiting for a slot this
    // trajectory's end or idleness would lend it, and this action, would wait on each other).
    const Partition& part = bins.partitions[c.partition];
    const std::int32_t own_slot = bins.held_slot(actions.slots[c.waiting.head().slot].trajectory);
    bool rest_fits = false;
    for (std::int32_t leaf = lo; leaf < hi && !rest_fits; ++leaf) {
      const std::int32_t b = part.bins[leaf];
      if (!bins.node_online[bins.bin_node[b]] ||
          (b != own_slot && this_pass.any_mask && this_pass.node_masked[bins.bin_node[b]] == this_pass.epoch))
        continue;
      const Quantity* f = bins.free_of(b);
      rest_fits = true;
      for (std::int32_t k = 0; k < K && rest_fits; ++k) rest_fits = f[k] >= c.demand[k];
    }
    if (!rest_fits) return false;
    chosen = plan_room(device, c.gpu_memory, c.service, now - c.waiting.head().submit_ns >= starvation_ns);
    this_pass.spared_fresh |= chosen.spared_fresh;
    if (!chosen.ok) return false;
    target = device;
  } else {
    const Partition& part = bins.partitions[c.partition];
    std::tuple<std::int64_t, std::int64_t, double, std::size_t, std::int32_t> best{INT64_MAX, 0, 0, 0, 0};
    if (fixed_leaf != kNone) lo = fixed_leaf, hi = fixed_leaf + 1;
    for (std::int32_t leaf = lo; leaf < hi; ++leaf) {
      const std::int32_t b = part.bins[leaf];
      const std::int32_t n = bins.bin_node[b];
      if (fixed_leaf == kNone && bins.bin_bound[b] && !bins.lends_to(c.in_trajectory_slot, c.trajectory, b)) continue;
      if (!bins.node_online[n]) continue;
      // A trajectory's own slot is nobody else's: no starving action holds it back (else a
      // starving action waiting for that slot, and the slot's own action waiting for GPU
      // memory there, would wait on each other for good).
      if (fixed_leaf == kNone && this_pass.any_mask && this_pass.node_masked[n] == this_pass.epoch) continue;
      const Quantity* f = bins.free_of(b);
      bool fits = true;
      for (std::int32_t k = 0; k < K && fits; ++k) fits = f[k] >= c.demand[k];
      if (!fits) continue;
      for (std::int32_t d = gpus.node_first_dev[n]; d < gpus.node_first_dev[n + 1]; ++d) {
        if (gpus.dev_total[d] < c.gpu_memory || gpus.dev_offline[d]) continue;
        RoomPlan plan = plan_room(d, c.gpu_memory, kNone, now - c.waiting.head().submit_ns >= starvation_ns);
        this_pass.spared_fresh |= plan.spared_fresh;
        if (!plan.ok || plan.victims.empty()) continue;
        auto cost = std::make_tuple(plan.busy, plan.queued, plan.likely, plan.victims.size(), d);
        if (cost < best) {
          best = cost;
          target = d;
          chosen = std::move(plan);
        }
      }
    }
    if (target == kNone) return false;
  }
  evict_plan(chosen, out);
  refresh_node_devices(gpus.dev_node[target]);
  release_on_node(gpus.dev_node[target], kNone);
  return true;
}

// The service gate of a service action's try: its service must be resident and ready on
// an online node whose device can hold the action beside it, with room in its batch. Moves
// a service whose device is too small (once its batch is done) and restores an offloaded
// one. True with `device` set to the service's device; false when the action waits (its
// class's Block says for what).
bool Scheduler::Impl::service_admits(Class& cl, std::int32_t& device, std::vector<Decision>& out) {
  ServiceRec& svc = gpus.services[cl.service];
  if (svc.device != kNone && !device_online(svc.device)) {
    // Resident on an offline node or device: evicted once its running actions there have ended.
    cl.block = Block::kServiceOffline;
    return false;
  }
  if (svc.device != kNone && svc.ready_ns <= now && !could_serve(cl, svc.device)) {
    // Its device (or the device's node) can never hold this action beside the service:
    // move the service once its running batch is done and no other waiting action of it
    // could run where it is, for an action its quota admits now. Left there, an idle
    // service would keep the action waiting for good, since nothing else evicts it; moved
    // any sooner, an unmovable one would come back to its device for those others, and
    // go again, pass after pass.
    if (svc.running > 0 || serves_another(cl, svc.device)) {
      cl.block = Block::kServiceNoRoom;
      return false;
    }
    if (cl.quota != kNone && quota_refuses(cl)) return false;
    const std::int32_t node = gpus.dev_node[svc.device];
    evict(cl.service, out, !gpus.offload_fits(node, inv.services[cl.service].host_memory));
    refresh_node_devices(node);
    release_on_node(node, kNone);
  }
  // A restore is made for an action that its quota would admit now: else the memory would
  // sit unused, or two services kept out of each other's way by their quotas would swap
  // places pass after pass.
  if (svc.device == kNone && cl.quota != kNone && quota_refuses(cl)) return false;
  if (svc.device == kNone && !restore(cl.service, cl, out)) {
    cl.block = Block::kServiceNoRoom;
    return false;
  }
  if (svc.ready_ns > now) {
    cl.block = Block::kServiceRestoring;
    cl.block_until = svc.ready_ns;
    wakeup = std::min(wakeup, svc.ready_ns);
    return false;
  }
  if (svc.draining_pass == this_pass.epoch && svc.drain_starts == 0) {
    cl.block = Block::kServiceDraining;
    return false;
  }
  if (svc.running >= inv.services[cl.service].max_batch) {
    cl.block = Block::kServiceBatchFull;
    return false;
  }
  device = svc.device;
  return true;
}

}  // namespace tangram
