// Spare elastic units, after the walk (SpareRule), and a start's top-up to a whole unit
// during it (ResizeRule::kMalleable).
//
// Reads: the actions started in this pass, under ResizeRule::kMalleable the running
// actions on bins a completion freed room on, their elasticity models and remaining work,
// which bins are contended.
// Changes: those actions' grants (the kStart decisions already emitted; a kResize for each
// running action that grew), bins' free room and reclaimable units.
// Guarantees: a grant only grows, a step (to the next whole unit) at a time, to the
// largest marginal cut in run time (at least min_relative_gain of it), never past
// elastic_max or the bin's free room;
// under SpareRule::kUncontended never on a bin somebody waits for; a running action grows
// at most once per pass, and not in a pass that shrank it.
#include "tangram/scheduler_impl.h"

#include <algorithm>
#include <map>
#include <vector>

namespace tangram {

// Whether a class parked on `node` (or across partition `part` when kNone) still waits for
// room in this pass: what a try at its turn would have found. A parked class fails for room
// at its turn, unless its quota refused an earlier head in this pass: then it waits for the
// quota (try_head looks at that first), which holds no room back.
bool Scheduler::Impl::parked_waits_for_room(std::int32_t part, std::int32_t node) const {
  const std::int64_t count = node == kNone ? partitions[part].parked_count : node_parked_count[node];
  if (count == 0) return false;
  if (!quota_refused) return true;
  auto waits = [&](std::int32_t c) {
    const Class& k = classes[c];
    if (!k.parked || k.park_node != node || (node == kNone && k.partition != part)) return false;  // stale entry
    return waits_for_room(k);
  };
  if (node != kNone) return std::any_of(node_parked[node].begin(), node_parked[node].end(), waits);
  for (const std::vector<ClassHead>* list : {&partitions[part].parked, &partitions[part].parked_new})
    for (const ClassHead& entry : *list)
      if (waits(entry.cls)) return true;
  return false;
}

// A start topped up to a whole unit (ResizeRule::kMalleable, a SpareRule other than
// kNone): an elastic action whose minimum is a fraction of a unit takes the step to the
// next whole one (at most its maximum) when its bin's free room `f` holds it and the step
// cuts its run time by at least min_relative_gain (the spare rule's test, with all its work
// left). A fraction of a CPU runs a process no faster under a guarantee, it only lets more
// of them share the CPU; the heads after it see what is left.
void Scheduler::Impl::top_up_start(std::int32_t slot, Quantity* f) {
  ActionRec& a = slots[slot];
  if (a.grant % kElasticStep == 0 || !(step_cut(slot, f, 1.0) > 0)) return;
  const Quantity step = grow_step(a, a.grant);
  a.grant += step;
  f[a.elastic_kind] -= step;
}

// The cut in remaining run time (work left x (t(g) - t(g + step))) of the action's next
// grow step, when the free room `f` holds the step and the cut is positive and at least
// min_relative_gain of its remaining time (work left x t(g)); else 0.
double Scheduler::Impl::step_cut(std::int32_t slot, const Quantity* f, double work) const {
  const ActionRec& a = slots[slot];
  const Quantity step = grow_step(a, a.grant);
  if (step <= 0 || f[a.elastic_kind] < step) return 0.0;
  const double now_s = seconds(slot, a.grant);
  const double remaining = work * now_s;
  const double cut = work * (now_s - seconds(slot, a.grant + step));
  return remaining > 0 && cut >= policy.min_relative_gain * remaining && cut > 0 ? cut : 0.0;
}

// Spare elastic units go, one step at a time, to the action with the largest marginal cut
// in run time: under SpareRule::kUncontended only on bins nobody waits for, under kEveryBin
// on every bin. The candidates are the actions started in this pass and, under
// ResizeRule::kMalleable, the running actions on (online) bins a completion freed room on
// since the last pass, not resized in this pass. A running action's cut is its work left
// x (t(g) - t(g + step)), at least min_relative_gain of its remaining time (work left x
// t(g)); a start's work left is all of it. Each running action that grew gets one kResize.
void Scheduler::Impl::grant_spare(std::vector<Decision>& out) {
  // Candidates by bin (ordered: deterministic): this pass's starts in start order, then
  // running actions by id.
  std::map<std::int32_t, std::vector<SpareMember>> by_bin;
  for (std::size_t i = 0; i < started.size(); ++i) {
    const ActionRec& a = slots[started[i]];
    if (a.elastic_kind == kNone || a.grant >= a.elastic_max || !spare_allowed(a.bin)) continue;
    by_bin[a.bin].push_back(SpareMember{started[i], started_decision[i], 1.0, a.grant});
  }
  for (std::int32_t bin : freed_bins) {
    if (!node_online[bin_node[bin]] || !spare_allowed(bin)) continue;
    std::vector<SpareMember>& running = spare_running;
    running.clear();
    for (std::int32_t s : bin_run[bin].running) {
      const ActionRec& a = slots[s];
      if (a.elastic_kind == kNone || a.grant >= a.elastic_max || started_this_pass(s) ||
          resized_this_pass(s))
        continue;
      running.push_back(SpareMember{s, SIZE_MAX, work_now(s), a.grant});
    }
    if (running.empty()) continue;
    std::sort(running.begin(), running.end(),
              [&](const SpareMember& x, const SpareMember& y) { return slots[x.slot].id < slots[y.slot].id; });
    std::vector<SpareMember>& members = by_bin[bin];
    members.insert(members.end(), running.begin(), running.end());
  }
  for (auto& [bin, members] : by_bin) {
    Quantity* f = free_of(bin);
    for (;;) {
      std::size_t best = SIZE_MAX;
      double best_cut = 0;
      for (std::size_t i = 0; i < members.size(); ++i) {
        const double cut = step_cut(members[i].slot, f, members[i].work);
        if (!(cut > 0)) continue;
        if (best == SIZE_MAX || cut > best_cut) {
          best = i;
          best_cut = cut;
        }
      }
      if (best == SIZE_MAX) break;
      const SpareMember& m = members[best];
      ActionRec& a = slots[m.slot];
      Quantity step = grow_step(a, a.grant);
      a.grant += step;
      f[a.elastic_kind] -= step;
      if (m.decision != SIZE_MAX) out[m.decision].grant = a.grant;
    }
    refresh_leaf(bin);
    if (!malleable) continue;
    for (const SpareMember& m : members) {
      const ActionRec& a = slots[m.slot];
      if (a.grant == m.was) continue;
      add_reclaim(bin, a.elastic_kind, a.grant - m.was);
      bin_run[bin].finish_ok = false;
      if (m.decision == SIZE_MAX) record_resize(m.slot, m.was, m.work, out);
    }
  }
}

}  // namespace tangram
