// Running grants under ResizeRule::kMalleable: each bin's running actions, the units above
// their minimum that a shrink could take back, remaining work, and the shrink that lets a
// waiting head start (spare.cc grows running grants); and, under every rule, the limit an
// action sets on its own grant (Scheduler::limit).
//
// Reads: running actions' grants, models and remaining work; bins' free room; the head
// being tried and the bins it may use (pass.cc's Room).
// Changes: the per-bin lists of running actions and of reclaimable units; when a shrink
// pays, the shrunk actions' grants and remaining work and the bin's free room (kResize
// decisions, then the head's kStart).
// Guarantees: a grant never goes below its minimum nor above the action's limit; an action
// is resized at most once per pass and never in the pass that started it; a shrink happens only when its loss (the
// extra run time of the shrunk actions) is less than the wait it saves the head; free
// room is always capacity minus the current grants.
#include "tangram/scheduler_impl.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tangram {

namespace {
constexpr double kNoFinish = std::numeric_limits<double>::infinity();  // no running action
}  // namespace

// The fraction of its work a running action has left now: what it had at its last grant
// change, less the time since over its run time at that grant. An action whose model gives
// no positive run time has none left.
double Scheduler::Impl::work_now(std::int32_t slot) const {
  const RunState& run = elastic.run_state[slot];
  const TimeNs since = run.resized_ns >= 0 ? run.resized_ns : actions.slots[slot].start_ns;
  const double work = run.resized_ns >= 0 ? run.work_left : 1.0;
  if (since >= now) return work;
  const double t = seconds(slot, actions.slots[slot].grant);
  if (!(t > 0)) return 0.0;
  const double left = work - static_cast<double>(now - since) / 1e9 / t;
  return left > 0 ? left : 0.0;
}

// When it should finish at its current grant, in seconds: its last grant change (or start)
// plus its work left then x its run time (that alone when the model gives no positive run
// time).
double Scheduler::Impl::estimated_finish(std::int32_t slot) const {
  const RunState& run = elastic.run_state[slot];
  const double since = to_seconds(run.resized_ns >= 0 ? run.resized_ns : actions.slots[slot].start_ns);
  const double work = run.resized_ns >= 0 ? run.work_left : 1.0;
  const double t = seconds(slot, actions.slots[slot].grant);
  if (!(t > 0) || !(work > 0)) return since;
  return since + work * t;
}

// A head's gain from starting on `bin` now rather than waiting there: until the earliest
// estimated finish among the actions running there (0 once one is due).
double Scheduler::Impl::gain_on(std::int32_t bin) {
  BinRun& run = elastic.bin_run[bin];
  if (!run.finish_ok) {
    double earliest = kNoFinish;
    for (std::int32_t s : run.running) earliest = std::min(earliest, estimated_finish(s));
    run.finish_min = earliest;
    run.finish_ok = true;
  }
  const double gain = run.finish_min - to_seconds(now);
  return gain > 0 ? gain : 0.0;
}

void Scheduler::Impl::record_resize(std::int32_t slot, Quantity old_grant, double work, std::vector<Decision>& out) {
  record_resize(slot, old_grant, work, this_pass.epoch, out);
}

void Scheduler::Impl::record_resize(std::int32_t slot, Quantity old_grant, double work, std::uint64_t pass,
                                    std::vector<Decision>& out) {
  const ActionRec& a = actions.slots[slot];
  running_changed(a.bin);
  RunState& run = elastic.run_state[slot];
  run.work_left = work;
  run.resized_ns = now;
  run.grant_before = old_grant;
  run.resized_pass = static_cast<std::uint32_t>(pass);
  push_resize(a, out);
}

void Scheduler::Impl::push_resize(const ActionRec& a, std::vector<Decision>& out) const {
  Decision dec;
  dec.kind = DecisionKind::kResize;
  dec.action = a.id;
  dec.node = bins.bin_node[a.bin];
  dec.elastic_kind = a.elastic_kind;
  dec.grant = a.grant;
  dec.time = now;
  out.push_back(dec);
}

// The action can use at most `max` from now on. Its grant drops to that when above it, and
// the units go back to its bin (waking whatever waits for them there) before the event's
// pass, which counts the action as resized already. Under kMalleable its bin's running
// actions are candidates for spare units in that pass, as after a completion (so an
// action limited to more than its grant may grow back to it).
void Scheduler::Impl::limit_grant(std::int32_t slot, Quantity max, std::vector<Decision>& out) {
  ActionRec& a = actions.slots[slot];
  a.elastic_max = max;
  if (malleable) elastic.mark_freed(a.bin);
  if (a.grant <= max) return;
  const Quantity old_grant = a.grant;
  const double work = malleable ? work_now(slot) : 0.0;
  bins.free_of(a.bin)[a.elastic_kind] += old_grant - max;
  a.grant = max;
  if (malleable) {
    add_reclaim(a.bin, a.elastic_kind, max - old_grant);
    record_resize(slot, old_grant, work, this_pass.epoch + 1, out);
  } else {
    push_resize(a, out);
  }
  if (!bins.bin_bound[a.bin]) bins.refresh_leaf(a.bin);
  release_on_node(bins.bin_node[a.bin], bins.bin_partition[a.bin]);
}

void Scheduler::Impl::add_reclaim(std::int32_t bin, std::int32_t kind, Quantity units) {
  elastic.add_reclaim(bin, kind, units);
  if (units > 0 && this_pass.walking) released.reclaim_grew(bin, elastic.bin_run[bin].partition, this_pass.epoch);
}

// Free room plus what a shrink could take back there covers the class's demand.
bool Scheduler::Impl::reclaim_covers(const Class& cl, std::int32_t bin) const {
  if (elastic.bin_run[bin].reclaim_sum == 0) return false;
  const Quantity* f = bins.free_of(bin);
  const Quantity* back = &elastic.bin_reclaim[static_cast<std::size_t>(bin) * K];
  for (std::int32_t k = 0; k < K; ++k)
    if (f[k] + back[k] < cl.demand[k]) return false;
  return true;
}

bool Scheduler::Impl::reclaim_fits_node(const Class& cl, std::int32_t node) const {
  const Partition& part = bins.partitions[cl.partition];
  for (std::int32_t leaf = part.node_lo[node]; leaf >= 0 && leaf < part.node_hi[node]; ++leaf) {
    const std::int32_t b = part.bins[leaf];
    if (reclaim_covers(cl, b) && bins.may_use(b, cl.in_trajectory_slot, cl.trajectory)) return true;
  }
  return false;
}

// Whether a shrink might ever let the class's head start where it may go, now or later
// without a release: some bin it may use holds its demand in free room plus reclaimable
// units, and is not known to be futile until it changes (shrink_futile). A class for which
// this holds is not parked (whether a shrink pays changes with time); one for which it does
// not can only be helped by a release, or a change on a futile bin, both of which wake it
// (running_changed notes the bin's node as released).
bool Scheduler::Impl::shrink_room_somewhere(const Class& cl) {
  const std::vector<std::int32_t>& list = elastic.reclaim_bins[cl.partition];
  // A class that may use any bin of its partition (no slot, service or affinity: `plain`
  // below) asks the memo first: in a pass's run of failed wakes it answers most.
  const bool any_bin = may_use_any_bin(cl);
  if (this_pass.walking && any_bin && elastic.known_no_shrink_room(cl.partition, cl.demand, this_pass.epoch)) return false;
  if (!reclaim_bound_covers(cl)) return false;
  if (cl.service != kNone && gpus.services[cl.service].device == kNone) return false;
  std::int32_t lo = 0, hi = 0, fixed_leaf = kNone;
  if (!eligible_range(cl, lo, hi, fixed_leaf)) return false;
  const Partition& part = bins.partitions[cl.partition];
  if (fixed_leaf != kNone) {
    const std::int32_t b = part.bins[fixed_leaf];
    return bins.node_online[bins.bin_node[b]] && reclaim_covers(cl, b) && !elastic.bin_run[b].shrink_futile;
  }
  if (static_cast<std::size_t>(hi - lo) <= list.size()) {
    for (std::int32_t leaf = lo; leaf < hi; ++leaf)
      if (shrink_may_help(cl, part.bins[leaf])) return true;
    return false;
  }
  const bool plain = this_pass.walking && !cl.in_trajectory_slot && lo == 0 && hi == part.free_tree.leaves();
  if (plain && !any_bin && elastic.known_no_shrink_room(cl.partition, cl.demand, this_pass.epoch)) return false;
  for (std::int32_t b : list) {
    const std::int32_t leaf = bins.bin_leaf[b];
    if (leaf >= lo && leaf < hi && shrink_may_help(cl, b)) return true;
  }
  if (plain) elastic.note_no_shrink_room(cl.partition, cl.demand, this_pass.epoch);
  return false;
}

// Elastic::reclaim_bound of partition p, taken in this pass.
void Scheduler::Impl::refresh_reclaim_bound(std::int32_t p) {
  Quantity* bound = &elastic.reclaim_bound[static_cast<std::size_t>(p) * K];
  std::fill(bound, bound + K, 0);
  for (std::int32_t b : elastic.reclaim_bins[p]) {
    const Quantity* f = bins.free_of(b);
    const Quantity* back = &elastic.bin_reclaim[static_cast<std::size_t>(b) * K];
    for (std::int32_t k = 0; k < K; ++k) bound[k] = std::max(bound[k], f[k] + back[k]);
  }
  elastic.reclaim_bound_pass[p] = this_pass.epoch;
}

// may_start_now's test when the class's partition has units a shrink could take back: some
// bin it may use holds it, or would with those units (`node`: where it is confined, or kNone).
bool Scheduler::Impl::fits_or_shrinks(Class& cl, std::int32_t node) {
  if (node != kNone) return bins.fits_some_bin(cl.partition, cl.demand, node) || reclaim_fits_node(cl, node);
  if (cl.fit_pass != this_pass.fit_epoch || fits_released_leaf(cl)) return true;
  // Its scope is the whole partition (node kNone), so it has no affinity node (scope_node):
  // may_use_any_bin without a read of the class's second cache line.
  if (cl.in_trajectory_slot || cl.service != kNone) return shrink_room_somewhere(cl);
  // No released leaf has units to take back (most passes): no shrink there either.
  if (released.no_reclaim_pass[cl.partition] == this_pass.epoch) return false;
  // The memo of failed demands answers most pending wakes that fail here (a pass's wakes
  // mostly ask alike): asked before the call.
  if (this_pass.walking && elastic.known_no_shrink_room(cl.partition, cl.demand, this_pass.epoch)) return false;
  return released_shrink_room(cl);
}

// shrink_room_somewhere for a pending wake of this pass's releases (fit_pass), which may use
// any bin. It parked where no bin held it with the units a shrink could take back, except
// bins known futile. Since then a bin's free room plus those units grew only by a release
// (the released leaves) and a futile bin became worth a plan only by a change to its
// running actions (noted as a release before the pass; in the pass it ends the fit epoch);
// starts and spare grants only move units between the two or use them up. So the released
// leaves are all it needs to look at. A shrink in this pass ends the fit epoch too: then
// the full search runs. What it finds holds for its demand across the partition, so it
// shares the memo of failed demands (which fits_or_shrinks asks first).
bool Scheduler::Impl::released_shrink_room(const Class& cl) {
  if (!reclaim_bound_covers(cl)) return false;
  const std::vector<std::int32_t>& leaves = released.leaves[cl.partition];
  const Partition& part = bins.partitions[cl.partition];
  for (std::int32_t leaf : leaves)
    if (shrink_may_help(cl, part.bins[leaf])) return true;
  if (this_pass.walking) elastic.note_no_shrink_room(cl.partition, cl.demand, this_pass.epoch);  // the memo's stamp is the pass's
  return false;
}

// The first bin in leaf order, among those the head may use now (as placement would: not
// held back by a starving action, GPU memory on the node), where shrinking running actions
// lets the head start and pays. False when there is none.
bool Scheduler::Impl::plan_shrink(const Class& cl, const Room& room, std::int32_t device, ShrinkPlan& plan) {
  const std::vector<std::int32_t>& list = elastic.reclaim_bins[cl.partition];
  if (list.empty() || !room.has_range || room.masked || !reclaim_bound_covers(cl)) return false;
  if (device != kNone && gpus.dev_free[device] < cl.gpu_memory) return false;
  // The bins considered below are among those shrink_room_somewhere looks at: where it
  // knows of none, there is no plan.
  if (this_pass.walking && may_use_any_bin(cl) && elastic.known_no_shrink_room(cl.partition, cl.demand, this_pass.epoch))
    return false;
  const Partition& part = bins.partitions[cl.partition];
  elastic.shrink_bins.clear();
  auto consider = [&](std::int32_t leaf) {
    const std::int32_t b = part.bins[leaf];
    const std::int32_t node = bins.bin_node[b];
    // First whether any plan there could pay (once per pass and bin; mostly none can):
    // plan_shrink_on would fail there whatever the class.
    if (shrink_futile(b) || !reclaim_covers(cl, b)) return;
    if (room.own_slot) {
      if (!bins.node_online[node]) return;
    } else if (!bins.may_use(b, cl.in_trajectory_slot, cl.trajectory) || (this_pass.any_mask && this_pass.node_masked[node] == this_pass.epoch)) {
      return;
    }
    if (device == kNone && cl.gpu_memory > 0 && bins.node_max_dev_free[node] < cl.gpu_memory) return;
    elastic.shrink_bins.push_back(leaf);
  };
  if (room.fixed_leaf != kNone) {
    consider(room.fixed_leaf);
  } else {
    for (std::int32_t b : shrink_candidates_of(cl.partition))
      if (bins.bin_leaf[b] >= room.lo && bins.bin_leaf[b] < room.hi) consider(bins.bin_leaf[b]);
    std::sort(elastic.shrink_bins.begin(), elastic.shrink_bins.end());
  }
  for (std::int32_t leaf : elastic.shrink_bins) {
    if (plan_shrink_on(cl, part.bins[leaf], plan)) {
      plan.leaf = leaf;
      return true;
    }
  }
  return false;
}

// Whether no plan plan_shrink_on could make on `bin` now pays, for any head: it only spares
// plans that would fail, so the decisions are plan_shrink_on's.
//
// The floor: the cheapest first step (work left x (t(g - step) - t(g))) among the actions a
// shrink may take units from, whatever their kind. A plan's first step costs at least that,
// and its later steps cost nothing below zero while every such action's model is Amdahl or
// constant (run time never falls as units are taken, in floating point too; with any other
// model there is no floor). No plan pays when the floor is at least the gain (gain_on).
// Within a pass the floor holds once computed: those actions only drop out (started or
// resized in it; spare units come after the walk). Across passes the work left falls, one
// step's cut by (t(g - step) - t(g)) / t(g) per second, while the gain falls by one per
// second: when that rate is at most 1 for every such action and none was left out for
// having started or been resized in the pass, a futile bin stays futile until its running
// actions or grants change (which clears BinRun::shrink_futile), given a margin far above
// rounding.
bool Scheduler::Impl::shrink_futile(std::int32_t bin) {
  BinRun& run = elastic.bin_run[bin];
  if (run.shrink_futile) return true;
  const double gain = gain_on(bin);
  if (elastic.bin_shrink_floor_pass[bin] != this_pass.epoch) {
    double floor = kNoFinish;  // no action to take from: every plan fails
    bool lasting = true;
    for (std::int32_t s : run.running) {
      const ActionRec& a = actions.slots[s];
      if (a.elastic_kind == kNone || a.grant <= minimum(a)) continue;
      if (elastic.started_in(s, a.bin, this_pass.epoch) || elastic.resized_in(s, now, this_pass.epoch)) {
        lasting = false;
        continue;
      }
      const ModelKind model = actions.details[s].model.kind;
      if (model != ModelKind::kAmdahl && model != ModelKind::kConstant) {
        floor = -kNoFinish;
        break;
      }
      const double now_time = seconds(s, a.grant);
      const double step_time = seconds(s, a.grant - shrink_step(a, a.grant));
      const double cut = work_now(s) * (step_time - now_time);
      if (cut < floor) floor = cut;  // a NaN cut is skipped, as plan_shrink_on skips it
      lasting = lasting && step_time - now_time <= now_time;
    }
    elastic.bin_shrink_floor[bin] = floor;
    elastic.bin_shrink_floor_pass[bin] = this_pass.epoch;
    if (lasting && floor >= gain + 1e-9 * (1.0 + std::abs(gain))) run.shrink_futile = true;
  }
  return !(elastic.bin_shrink_floor[bin] < gain);
}

void Scheduler::Impl::shrink_futility_lost(std::int32_t bin) {
  elastic.bin_run[bin].shrink_futile = false;
  // Mid-pass, the pass's pending wakes may now find shrink room off the released leaves
  // (released_shrink_room): they search everywhere for the rest of the pass. Between
  // passes the release noted below covers it.
  this_pass.fit_epoch = PassState::kNoFitEpoch;
  ++elastic.shrink_room_version;
  const std::int32_t node = bins.bin_node[bin];
  if (bins.node_online[node]) released.note(node);
}

// Within a pass a futile bin becomes worth a plan again only by a shrink on it (the only
// change that can raise its gain), which needs it to be a candidate already; a bin that
// joins the reclaim list resets the candidates.
const std::vector<std::int32_t>& Scheduler::Impl::shrink_candidates_of(std::int32_t partition) {
  std::vector<std::int32_t>& candidates = elastic.shrink_candidates[partition];
  if (elastic.shrink_candidates_pass[partition] != this_pass.epoch) {
    candidates.clear();
    for (std::int32_t b : elastic.reclaim_bins[partition])
      if (!shrink_futile(b)) candidates.push_back(b);
    elastic.shrink_candidates_pass[partition] = this_pass.epoch;
  }
  return candidates;
}

// Units taken back on `bin`, one step at a time, each from the action that loses least by
// it (loss: work left x (t(g - step) - t(g)); ties by action id), from actions whose kind
// the head is short of, never below a minimum, until the head fits. It pays when the
// total loss is less than the head's gain: the wait it avoids, until the earliest
// estimated finish among the actions running there.
bool Scheduler::Impl::plan_shrink_on(const Class& cl, std::int32_t bin, ShrinkPlan& plan) {
  const Quantity* f = bins.free_of(bin);
  std::vector<Quantity>& short_by = elastic.shrink_short_by;
  short_by.assign(static_cast<std::size_t>(K), 0);
  for (std::int32_t k = 0; k < K; ++k) short_by[k] = std::max<Quantity>(0, cl.demand[k] - f[k]);
  std::vector<ShrinkDonor>& donors = elastic.shrink_donors;
  donors.clear();
  for (std::int32_t s : elastic.bin_run[bin].running) {
    const ActionRec& a = actions.slots[s];
    if (a.elastic_kind == kNone || short_by[a.elastic_kind] == 0 || a.grant <= minimum(a)) continue;
    if (elastic.started_in(s, a.bin, this_pass.epoch) || elastic.resized_in(s, now, this_pass.epoch)) continue;
    donors.push_back(ShrinkDonor{s, a.grant, work_now(s)});
  }
  if (donors.empty()) return false;
  const double gain = gain_on(bin);
  double loss = 0;
  for (;;) {
    bool short_any = false;
    for (std::int32_t k = 0; k < K; ++k) short_any = short_any || short_by[k] > 0;
    if (!short_any) break;
    std::size_t best = SIZE_MAX;
    double best_loss = 0;
    for (std::size_t i = 0; i < donors.size(); ++i) {
      const ShrinkDonor& d = donors[i];
      const ActionRec& a = actions.slots[d.slot];
      const Quantity lowest = minimum(a);
      if (short_by[a.elastic_kind] == 0 || d.grant <= lowest) continue;
      const Quantity step = shrink_step(a, d.grant);
      const double cut = d.work * (seconds(d.slot, d.grant - step) - seconds(d.slot, d.grant));
      if (cut != cut) continue;  // NaN: a model that gives no usable run time there
      if (best == SIZE_MAX || cut < best_loss || (cut == best_loss && a.id < actions.slots[donors[best].slot].id)) {
        best = i;
        best_loss = cut;
      }
    }
    if (best == SIZE_MAX) return false;
    ShrinkDonor& d = donors[best];
    const std::int32_t kind = actions.slots[d.slot].elastic_kind;
    const Quantity step = shrink_step(actions.slots[d.slot], d.grant);
    d.grant -= step;
    short_by[kind] = std::max<Quantity>(0, short_by[kind] - step);
    loss += best_loss;
  }
  if (!(loss < gain)) return false;
  plan.grants.clear();
  plan.work.clear();
  std::sort(donors.begin(), donors.end(),
            [&](const ShrinkDonor& x, const ShrinkDonor& y) { return actions.slots[x.slot].id < actions.slots[y.slot].id; });
  for (const ShrinkDonor& d : donors) {
    if (d.grant == actions.slots[d.slot].grant) continue;
    plan.grants.emplace_back(d.slot, d.grant);
    plan.work.push_back(d.work);
  }
  return true;
}

// Applies the plan (a kResize for each shrunk action, by action id) and starts the head on
// its bin. Room may now have grown on that bin (units come back a whole step at a time):
// search hints and the released-leaf shortcut no longer hold for this pass.
void Scheduler::Impl::start_by_shrinking(std::int32_t c, const Room& room, std::int32_t device,
                                         const ShrinkPlan& plan, std::vector<Decision>& out) {
  const std::int32_t bin = bins.partitions[classes[c].partition].bins[plan.leaf];
  Quantity* f = bins.free_of(bin);
  for (std::size_t i = 0; i < plan.grants.size(); ++i) {
    const auto [slot, grant] = plan.grants[i];
    ActionRec& a = actions.slots[slot];
    const Quantity old_grant = a.grant;
    f[a.elastic_kind] += old_grant - grant;
    a.grant = grant;
    add_reclaim(bin, a.elastic_kind, grant - old_grant);
    record_resize(slot, old_grant, plan.work[i], out);
  }
  ++bins.search_epoch;
  this_pass.fit_epoch = PassState::kNoFitEpoch;
  start_head(c, plan.leaf, room.fixed_leaf, device, out);
}

// ---- Elastic

void Elastic::resize(std::int32_t kinds, std::size_t n_partitions) {
  K = kinds;
  reclaim_bins.resize(n_partitions);
  reclaim_bound.assign(n_partitions * static_cast<std::size_t>(K), 0);
  reclaim_bound_pass.assign(n_partitions, 0);
  no_shrink_room.assign(n_partitions, FailedDemands{});
  shrink_candidates.resize(n_partitions);
  shrink_candidates_pass.assign(n_partitions, 0);
}

void Elastic::append_bin(std::int32_t partition) {
  bin_run.emplace_back();
  bin_run.back().partition = partition;
  bin_run.back().running.reserve(8);  // a node's actions, mostly: few regrowths as they come and go
  bin_reclaim.insert(bin_reclaim.end(), static_cast<std::size_t>(K), 0);
  bin_shrink_floor.push_back(0);
  bin_shrink_floor_pass.push_back(0);
}

void Elastic::add_reclaim(std::int32_t bin, std::int32_t kind, Quantity units) {
  BinRun& run = bin_run[bin];
  const std::int32_t partition = run.partition;
  if (units > 0) {  // the bound may have grown
    reclaim_bound_pass[partition] = 0;
    ++shrink_room_version;
  }
  bin_reclaim[static_cast<std::size_t>(bin) * K + kind] += units;
  const Quantity sum = run.reclaim_sum += units;
  std::vector<std::int32_t>& list = reclaim_bins[partition];
  if (sum > 0 && run.reclaim_pos < 0) {
    run.reclaim_pos = static_cast<std::int32_t>(list.size());
    list.push_back(bin);
    shrink_candidates_pass[partition] = 0;
  } else if (sum == 0 && run.reclaim_pos >= 0) {
    const std::int32_t last = list.back();
    list[run.reclaim_pos] = last;
    bin_run[last].reclaim_pos = run.reclaim_pos;
    list.pop_back();
    run.reclaim_pos = -1;
  }
}

}  // namespace tangram
