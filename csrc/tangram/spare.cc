// Spare elastic units, after the walk (SpareRule).
//
// Reads: the actions started in this pass, their elasticity models, which bins are
// contended.
// Changes: those actions' grants (and the kStart decisions already emitted), bins' free
// room.
// Guarantees: a grant only grows, one unit at a time, to the largest marginal cut in run
// time (at least min_relative_gain of it), never past elastic_max or the bin's free room;
// under SpareRule::kUncontended never on a bin somebody waits for.
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

// Spare elastic units go to the actions started in this pass with the largest marginal cut
// in run time, one unit at a time: under SpareRule::kUncontended only on bins nobody waits
// for, under kEveryBin on every bin.
void Scheduler::Impl::grant_spare(std::vector<Decision>& out) {
  // Group this pass's elastic starts by bin, keeping start order.
  std::map<std::int32_t, std::vector<std::size_t>> by_bin;  // ordered: deterministic
  for (std::size_t i = 0; i < started.size(); ++i) {
    const ActionRec& a = slots[started[i]];
    if (a.elastic_kind == kNone || a.grant >= a.elastic_max) continue;
    std::int32_t node = bin_node[a.bin];
    std::int32_t part = bin_partition[a.bin];
    if (row.rules.spare == SpareRule::kUncontended &&
        (partition_contended[part] == pass_epoch || node_contended[node] == pass_epoch ||
         parked_waits_for_room(part, kNone) || parked_waits_for_room(part, node)))
      continue;
    by_bin[a.bin].push_back(i);
  }
  for (auto& [bin, members] : by_bin) {
    Quantity* f = free_of(bin);
    for (;;) {
      std::size_t best = SIZE_MAX;
      double best_gain = 0;
      for (std::size_t i : members) {
        ActionRec& a = slots[started[i]];
        Quantity step = std::min(kElasticStep, a.elastic_max - a.grant);
        if (step <= 0 || f[a.elastic_kind] < step) continue;
        double now_s = seconds(started[i], a.grant);
        double next_s = seconds(started[i], a.grant + step);
        double gain = now_s - next_s;
        if (!(now_s > 0) || !(gain >= policy.min_relative_gain * now_s) || !(gain > 0)) continue;
        if (best == SIZE_MAX || gain > best_gain) {
          best = i;
          best_gain = gain;
        }
      }
      if (best == SIZE_MAX) break;
      ActionRec& a = slots[started[best]];
      Quantity step = std::min(kElasticStep, a.elastic_max - a.grant);
      a.grant += step;
      f[a.elastic_kind] -= step;
      out[started_decision[best]].grant = a.grant;
    }
    refresh_leaf(bin);
  }
}

}  // namespace tangram
