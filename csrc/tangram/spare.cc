// Spare elastic units, after the walk (SpareRule), and a start's top-up to a whole unit
// during it (ResizeRule::kMalleable).
//
// Reads: the actions started in this pass, under ResizeRule::kMalleable the running
// actions on bins a completion freed room on, their elasticity models and remaining work,
// which bins are contended.
// Changes: those actions' grants (the kStart decisions already emitted; a kResize for each
// running action that grew), bins' free room and reclaimable units.
// Guarantees: a grant only grows, a step (to the next whole unit) at a time, to the
// largest marginal cut in run time (while the GainRule passes it), never past elastic_max or
// the bin's free room;
// under SpareRule::kUncontended never into the room of a kind that an action waiting for
// the bin asks for (bin_reserve); a running action grows at most once per pass, and not
// in a pass that shrank it.
#include "tangram/scheduler_impl.h"

#include <algorithm>
#include <limits>
#include <map>
#include <vector>

namespace tangram {

// The most of each kind any class parked on `node` (or across partition `part` when
// kNone) asks for while it still waits for room in this pass, maxed into `reserve`: what a
// try at its turn would have found. A parked class fails for room at its turn, unless its
// quota refused an earlier head in this pass: then it waits for the quota (try_head looks
// at that first), which holds no room back.
void Scheduler::Impl::parked_need(std::int32_t part, std::int32_t node, Quantity* reserve) const {
  const std::int64_t count = node == kNone ? classes.partition_parking[part].count : classes.node_parked_count[node];
  if (count == 0) return;
  auto take = [&](std::int32_t c) {
    const Class& k = classes[c];
    if (!k.parked || k.park_node != node || (node == kNone && k.partition != part)) return;  // stale entry
    if (this_pass.quota_refused && !this_pass.waits_for_room(k)) return;
    for (std::int32_t x = 0; x < K; ++x) reserve[x] = std::max(reserve[x], k.demand[x]);
  };
  if (node != kNone) {
    for (std::int32_t c : classes.node_parked[node]) take(c);
    return;
  }
  for (const std::vector<ClassHead>* list : {&classes.partition_parking[part].parked, &classes.partition_parking[part].parked_new})
    for (const ClassHead& entry : *list) take(entry.cls);
}

// What spare units leave free on a bin (kUncontended), once per bin and pass. The parked
// classes are looked at only when the classes that failed in this pass leave room to spare
// in an elastic kind (a full bin, the usual case under load, costs no scan), those across
// the partition once per pass.
const Quantity* Scheduler::Impl::bin_reserve(std::int32_t bin) {
  const std::size_t at = static_cast<std::size_t>(bin) * K;
  if (spare.reserve_pass[bin] == this_pass.epoch) return &spare.reserve_rows[at];
  spare.reserve_pass[bin] = this_pass.epoch;
  Quantity* reserve = &spare.reserve_rows[at];
  std::fill(reserve, reserve + K, 0);
  if (row.rules.spare != SpareRule::kUncontended) return reserve;
  const std::int32_t node = bins.bin_node[bin];
  const std::int32_t part = bins.bin_partition[bin];
  for (std::int32_t k = 0; k < K; ++k) {
    if (spare.partition_contended[part] == this_pass.epoch)
      reserve[k] = std::max(reserve[k], spare.partition_need[static_cast<std::size_t>(part) * K + k]);
    if (spare.node_contended[node] == this_pass.epoch) reserve[k] = std::max(reserve[k], spare.node_need[static_cast<std::size_t>(node) * K + k]);
  }
  const Quantity* free = bins.free_of(bin);
  bool room = false;
  for (std::int32_t k = 0; k < K && !room; ++k) room = spare.elastic_kind_seen[k] && free[k] > reserve[k];
  if (!room) return reserve;
  if (spare.parked_need_pass[part] != this_pass.epoch) {
    spare.parked_need_pass[part] = this_pass.epoch;
    Quantity* across = &spare.parked_need_rows[static_cast<std::size_t>(part) * K];
    std::fill(across, across + K, 0);
    parked_need(part, kNone, across);
  }
  for (std::int32_t k = 0; k < K; ++k)
    reserve[k] = std::max(reserve[k], spare.parked_need_rows[static_cast<std::size_t>(part) * K + k]);
  parked_need(part, node, reserve);
  return reserve;
}

// A start topped up to a whole unit (ResizeRule::kMalleable, a SpareRule other than
// kNone): an elastic action whose minimum is a fraction of a unit takes the step to the
// next whole one (at most its maximum) when its bin's free room `f` holds it and the step
// passes the GainRule (the spare rule's test, with all its work left; it is not yet among
// the bin's running actions). A fraction of a CPU runs a process no faster under a
// guarantee, it only lets more of them share the CPU; the heads after it see what is left.
void Scheduler::Impl::top_up_start(std::int32_t slot, std::int32_t bin, Quantity* f) {
  ActionRec& a = actions.slots[slot];
  if (a.grant % kElasticStep == 0) return;
  if (!(step_cut(slot, bin, f, 1.0, static_cast<std::int64_t>(elastic.bin_run[bin].running.size())) > 0)) return;
  const Quantity step = grow_step(a, a.grant);
  a.grant += step;
  f[a.elastic_kind] -= step;
}

// The cut in remaining run time (work left x (t(g) - t(g + step))) of the action's next
// grow step, when the free room `f` holds the step, the cut is positive and it passes the
// GainRule; else 0. kRelative: the cut is at least min_relative_gain of the remaining time
// (work left x t(g)). kWait: the cut is more than the wait the step causes the `others`
// running on its bin. The step adds work left x ((g + step) t(g + step) - g t(g))
// unit-seconds to the bin; while the bin is full that is a wait of that over its capacity
// for each action there, and the share of the bin in use (before the step) is how likely it
// is full. So at low load a step is worth any gain (nobody else is there to wait), under load
// only a step that saves more than it costs the others; no constant trades one against the
// other.
double Scheduler::Impl::step_cut(std::int32_t slot, std::int32_t bin, const Quantity* f, double work,
                                 std::int64_t others, const Quantity* reserve) const {
  const ActionRec& a = actions.slots[slot];
  const Quantity step = grow_step(a, a.grant);
  const std::int32_t k = a.elastic_kind;
  if (step <= 0 || f[k] < step || (reserve != nullptr && f[k] - step < reserve[k])) return 0.0;
  const double now_s = seconds(slot, a.grant);
  const double next_s = seconds(slot, a.grant + step);
  const double remaining = work * now_s;
  const double cut = work * (now_s - next_s);
  if (!(remaining > 0) || !(cut > 0)) return 0.0;
  if (row.rules.gain == GainRule::kRelative) return cut >= policy.min_relative_gain * remaining ? cut : 0.0;
  const double capacity = static_cast<double>(bins.cap_of(bin)[k]);
  const double in_use = static_cast<double>(bins.cap_of(bin)[k] - f[k]) / capacity;
  const double added = work * (static_cast<double>(a.grant + step) * next_s - static_cast<double>(a.grant) * now_s);
  const double wait = static_cast<double>(others) * in_use * added / capacity;
  return cut > wait ? cut : 0.0;
}

// Spare elastic units go, one step at a time, to the action with the largest marginal cut
// in run time: under SpareRule::kUncontended only on bins nobody waits for, under kEveryBin
// on every bin. The candidates are the actions started in this pass and, under
// ResizeRule::kMalleable, the running actions on (online) bins a completion freed room on
// since the last pass, not resized in this pass. A running action's cut is its work left
// x (t(g) - t(g + step)), a start's all of it, and the GainRule judges it (step_cut). Each
// running action that grew gets one kResize.
void Scheduler::Impl::grant_spare(std::vector<Decision>& out) {
  // Candidates by bin (ordered: deterministic): this pass's starts in start order, then
  // running actions by id.
  std::map<std::int32_t, std::vector<SpareMember>> by_bin;
  for (std::size_t i = 0; i < this_pass.started.size(); ++i) {
    const ActionRec& a = actions.slots[this_pass.started[i]];
    if (a.elastic_kind == kNone || a.grant >= a.elastic_max) continue;
    if (bins.free_of(a.bin)[a.elastic_kind] <= bin_reserve(a.bin)[a.elastic_kind]) continue;  // no unit to spare
    by_bin[a.bin].push_back(SpareMember{this_pass.started[i], this_pass.started_decision[i], 1.0, a.grant});
  }
  for (std::int32_t bin : elastic.freed_bins) {
    if (!bins.node_online[bins.bin_node[bin]]) continue;
    // Room to spare, beyond what waiters ask for, in a kind some action is elastic in.
    const Quantity* free = bins.free_of(bin);
    const Quantity* reserve = bin_reserve(bin);
    bool room = false;
    for (std::int32_t k = 0; k < K && !room; ++k) room = spare.elastic_kind_seen[k] && free[k] > reserve[k];
    if (!room) continue;
    std::vector<SpareMember>& running = spare.spare_running;
    running.clear();
    for (std::int32_t s : elastic.bin_run[bin].running) {
      const ActionRec& a = actions.slots[s];
      if (a.elastic_kind == kNone || a.grant >= a.elastic_max || elastic.started_in(s, a.bin, this_pass.epoch) ||
          elastic.resized_in(s, now, this_pass.epoch))
        continue;
      running.push_back(SpareMember{s, SIZE_MAX, work_now(s), a.grant});
    }
    if (running.empty()) continue;
    std::sort(running.begin(), running.end(),
              [&](const SpareMember& x, const SpareMember& y) { return actions.slots[x.slot].id < actions.slots[y.slot].id; });
    std::vector<SpareMember>& members = by_bin[bin];
    members.insert(members.end(), running.begin(), running.end());
  }
  for (auto& [bin, members] : by_bin) {
    Quantity* f = bins.free_of(bin);
    const Quantity* reserve = bin_reserve(bin);
    // Every member is among the bin's running actions (kWait counts the others; the rows
    // with kRelative keep no such list).
    const std::int64_t others = malleable ? static_cast<std::int64_t>(elastic.bin_run[bin].running.size()) - 1 : 0;
    for (;;) {
      std::size_t best = SIZE_MAX;
      double best_cut = 0;
      for (std::size_t i = 0; i < members.size(); ++i) {
        const double cut = step_cut(members[i].slot, bin, f, members[i].work, others, reserve);
        if (!(cut > 0)) continue;
        if (best == SIZE_MAX || cut > best_cut) {
          best = i;
          best_cut = cut;
        }
      }
      if (best == SIZE_MAX) break;
      const SpareMember& m = members[best];
      ActionRec& a = actions.slots[m.slot];
      Quantity step = grow_step(a, a.grant);
      a.grant += step;
      f[a.elastic_kind] -= step;
      if (m.decision != SIZE_MAX) out[m.decision].grant = a.grant;
    }
    bins.refresh_leaf(bin);
    if (!malleable) continue;
    for (const SpareMember& m : members) {
      const ActionRec& a = actions.slots[m.slot];
      if (a.grant == m.was) continue;
      add_reclaim(bin, a.elastic_kind, a.grant - m.was);
      running_changed(bin);
      if (m.decision == SIZE_MAX) record_resize(m.slot, m.was, m.work, out);
    }
  }
}

// ---- SpareReserve

void SpareReserve::contend(std::int32_t part, std::int32_t node, const Quantity* demand, std::uint64_t pass) {
  std::uint64_t& stamp = node == kNone ? partition_contended[part] : node_contended[node];
  Quantity* need = node == kNone ? &partition_need[static_cast<std::size_t>(part) * K]
                                 : &node_need[static_cast<std::size_t>(node) * K];
  if (stamp != pass) {
    stamp = pass;
    std::fill(need, need + K, 0);
  }
  if (demand == nullptr) {
    std::fill(need, need + K, std::numeric_limits<Quantity>::max());
    return;
  }
  for (std::int32_t k = 0; k < K; ++k) need[k] = std::max(need[k], demand[k]);
}

}  // namespace tangram
