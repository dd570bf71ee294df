// The scheduler core's private state and the map of its sources. docs/scheduling.md states
// the rules; tangram/bench/reference.py implements the same rules naively, and the differential
// tests hold the two to identical decisions. These headers are not installed.
//
// Scheduler::Impl is made of parts, each a struct in its own header that states what it
// owns and guarantees, with the methods that touch only its own state:
//   Bins (bins.h)          what placement packs into, per the policy's BinLayout: a node,
//                          one trajectory slot, or a node's share for one task pool. Each
//                          partition (one, or one per task pool) has a BinTree over its bins
//                          for fast "first bins that fit". Node membership; trajectory
//                          slots' holders.
//   Gpus (gpus.h)          devices and the GPU services resident on them or offloaded.
//   Actions (actions.h)    live actions by slot, the id and trajectory indexes.
//   Classes (classes.h)    waiting actions with identical admission constraints (demand,
//                          gpu memory, affinity, service, quota, tokens; the trajectory with
//                          trajectory slots): if the first of a class cannot start, none of
//                          the class can in that pass. A heap of the head of every class
//                          that may start, in policy order; a class that failed on resources
//                          alone is parked off it until resources are released where it
//                          could run (parking only skips work that would fail).
//   Releases (releases.h)  room released since the last pass: a class woken by it looks
//                          only at the released bins.
//   Elastic (elastic_state.h)  under ResizeRule::kMalleable: each bin's running actions,
//                          and per bin and kind the units above their minimum that running
//                          elastic actions hold (what a shrink could take back). A class
//                          parks only where free plus those units cannot hold it either:
//                          growing and shrinking move units between the two, so only a
//                          release can make such a class fit.
//   SpareReserve (spare.h) what spare elastic units must leave free in a pass.
//   PassState (below)      what holds for one pass only.
// Impl holds the parts, the policy's resolved rules, quotas, tables and the clock, and the
// methods that coordinate across parts: the events (submit, finish, ...), the pass and a
// head's try, services' restores and evictions, spare units and shrinks.
//
// Sources, one concern each (each file opens with what it reads, changes and guarantees):
//   policy.cc          the rows of rules, policy names
//   bins.cc            construction, bins, trees, node membership (and Bins' methods)
//   actions.cc         validation, classes, submit, the end of an action
//   parking.cc         parking and wakes (and Classes' park, Releases' leaves)
//   pass.cc            the pass and a head's try (placement, starvation, quota admission)
//   services.cc        GPU services: restores, greedy eviction
//   spare.cc           spare elastic units (to this pass's starts, and to running actions)
//   resize.cc          running grants: remaining work, shrinks for a waiting head (and
//                      Elastic's methods)
//   introspection.cc   explain, invariants
//   scheduler.cc       the public face: events in, decisions out
//   quota.cc, elasticity.cc, bin_tree.cc, id_map.h, wait_queue.h: the data structures.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tangram/actions.h"
#include "tangram/bin_tree.h"
#include "tangram/bins.h"
#include "tangram/classes.h"
#include "tangram/elastic_state.h"
#include "tangram/elasticity.h"
#include "tangram/gpus.h"
#include "tangram/id_map.h"
#include "tangram/quota.h"
#include "tangram/releases.h"
#include "tangram/scheduler.h"
#include "tangram/spare.h"
#include "tangram/wait_queue.h"

namespace tangram {

inline constexpr Quantity kMaxMilli = static_cast<Quantity>(kMaxBaseUnits) * kMilli;
inline constexpr Quantity kElasticStep = kMilli;  // elastic grants grow one base unit at a time

// The state of one pass (pass.cc): set up as it begins, valid until the next one begins.
// Guarantees: an entry stamped with a pass (the masks, Class::fit_pass, the spare reserve's
// rows, a service's draining_pass...) is this pass's exactly when it equals `epoch`, so
// nothing needs clearing between passes; while `walking`, a wake happens at once (a head
// behind `cursor` waits for the next pass, as a failed head would).
struct PassState {
  std::uint64_t epoch = 0;
  bool walking = false;  // the walk over the heads runs
  const OrderKey* cursor = nullptr;  // the head being looked at, while the walk runs
  // Bins held back by a starving head: its node's (== epoch) or its whole partition's.
  std::vector<std::uint64_t> node_masked, partition_masked;
  bool any_mask = false;
  std::vector<std::uint8_t> quota_blocked;  // by quota: it refused a head in this pass
  // The head each blocked quota refused: a parked class of that quota whose head comes
  // after it would, at its turn, wait for the quota and not for room (spare.cc).
  std::vector<OrderKey> quota_blocked_at;
  bool quota_refused = false;  // some quota refused a head in this pass
  std::vector<std::int32_t> started;  // action slots started in this pass
  // rebind_replicas' scratch: a replicated service's first waiting actions, its classes with
  // waiting actions, and per copy the live actions, their work, whether it may be routed to.
  std::vector<OrderKey> rebinding;
  std::vector<std::int32_t> rebind_classes;
  std::vector<std::int64_t> rebind_live;
  std::vector<TimeNs> rebind_work;
  std::vector<std::uint8_t> rebind_reachable;
  std::vector<std::size_t> started_decision;  // the index of each one's kStart in the event's decisions
  // Class::fit_pass marks a pending wake whose only possible bins are released leaves only
  // while it equals this (set at each pass). A shrink that leaves a bin with more free room
  // than before, or a futile bin becoming worth a plan, moves it off for the rest of the
  // pass, so such classes search everywhere.
  std::uint64_t fit_epoch = 0;
  static constexpr std::uint64_t kNoFitEpoch = UINT64_MAX;
  // A room plan fell short while sparing a service ready only since the last pass: the next
  // pass may evict it, so one is due even if no event comes.
  bool spared_fresh = false;
  // Parked classes that fit a bin released since the last pass (flush_releases), in policy
  // order of their heads. They stay parked until their turn in the pass: most lose
  // the room to an earlier head, and a look at the released leaves then is far cheaper
  // than a trip through the active heap and back into the park (see pass()).
  std::vector<ClassHead> pending_wakes;
  std::vector<std::int32_t> cand;  // scratch of try_head: find_room's candidate leaves
  std::vector<Quantity> query;     // scratch of placement searches: a demand and GPU memory (D entries)

  // A head that cannot fit, tried now in this pass: false when it would wait for its quota
  // (refused for an earlier head of this pass) rather than for room.
  bool waits_for_room(const Class& k) const {
    return k.quota == kNone || !quota_blocked[k.quota] || k.waiting.head() < quota_blocked_at[k.quota];
  }
};

struct Scheduler::Impl {
  // The inventory and policy, and the policy's rules resolved once.
  Inventory inv;
  PolicyConfig policy;
  PolicyRow row;  // the policy's rules (policy.h): nothing below asks its name
  std::int32_t K = 0;  // kinds
  // OrderRule as numbers, so the key needs no branch: key = est_ns * estimate_weight +
  // submit_ns * aging_permille / 1000 (both 0 under kArrival).
  std::int64_t estimate_weight = 0;
  std::int64_t aging_permille = 0;
  // OrderRule::kProgress: Actions::trajectory_progress counts each trajectory's starts.
  bool count_progress = false;
  // OrderRule::kEstimate: a GPU service queue whose arrivals have stopped is ordered for its
  // drain (order_service_tails).
  bool service_tails_ordered = false;
  std::vector<std::int64_t> tail_keys;  // scratch of reorder_service_queue: new keys by slot
  bool malleable = false;  // ResizeRule::kMalleable
  // A starving head that may use any bin stops the pass: the whole partition is its. Not
  // with several partitions (the others go on) nor with trajectory slots (bound slots are
  // their trajectories' own).
  bool starving_head_halts = false;
  TimeNs starvation_ns = 0;

  // The parts.
  Bins bins;
  Gpus gpus;
  Actions actions;
  Classes classes;
  Releases released;
  Elastic elastic;
  SpareReserve spare;
  PassState this_pass;
  std::vector<QuotaState> quotas;
  std::vector<RuntimeTable> tables;  // Scheduler::add_table's run-time tables

  // The clock and what the last event call hands back besides its decisions.
  TimeNs now = 0;
  TimeNs prev_pass_now = -1;  // when the previous pass ran
  TimeNs wakeup = kNever;
  std::vector<std::string> messages;

  // ---- bins.cc: construction, bins and node membership
  Impl(Inventory inventory, PolicyConfig cfg);
  // Per partition, the capacities of one node's bins under the policy's BinLayout.
  using NodeBins = std::vector<std::vector<std::vector<Quantity>>>;
  NodeBins node_bins(const std::vector<Quantity>& capacity) const;
  void append_bin(std::int32_t node, std::int32_t part, const std::vector<Quantity>& cap);
  void refresh_node_devices(std::int32_t node);  // after a device's free memory changed
  void set_node_online(std::int32_t node, bool online);
  std::int32_t add_node(NodeSpec spec);

  // ---- actions.cc: validation, classes, submit, the end of an action
  void validate_now(TimeNs t) const;
  template <class Field>
  void validate_spec(const ActionSpec& s, const Field& field) const;
  std::string infeasible_reason(const Class& c) const;
  void submit(const ActionSpec* a, std::size_t n, TimeNs t, std::vector<Decision>& out);
  void finish(std::int32_t slot);  // running -> gone, resources back
  void unqueue(std::int32_t slot);  // waiting -> gone
  // Waiting action `slot` joins its class's queue (and its service's waiting work); under a
  // new head the class goes back in the active heap, or, parked across the partition, is
  // listed again (the old entry is stale). `c` is its class, `detail` its details (the
  // caller has them at hand: inline on submit's path).
  void join_class_queue(std::int32_t c, const ActionDetail& detail) {
    Class& cl = classes[c];
    if (cl.service != kNone) {
      gpus.services[cl.service].waiting += 1;
      gpus.services[cl.service].queued_ns += detail.est_ns;
    }
    const bool new_head = cl.waiting.empty() || detail.order < cl.waiting.head();
    if (new_head) classes.deactivate(c);
    cl.waiting.push(detail.order, actions.queue_pos);
    if (new_head && !cl.parked) classes.activate(c);
    if (new_head && cl.parked && cl.park_node == kNone)
      classes.partition_parking[cl.partition].parked_new.emplace_back(cl.waiting.head(), c);
  }
  void leave_class_queue(std::int32_t slot);  // actions.cc
  // Run time at `units` of the elastic kind (the minimum when not elastic).
  double seconds(std::int32_t slot, Quantity units) const {
    const ActionRec& a = actions.slots[slot];
    const ElasticityModel& model = actions.details[slot].model;
    if (a.elastic_kind == kNone) return model_seconds(model, kMilli, kMilli, tables);
    return model_seconds(model, units, classes[a.cls].demand[a.elastic_kind], tables);
  }
  Quantity minimum(const ActionRec& a) const {
    return a.elastic_kind == kNone ? kMilli : classes[a.cls].demand[a.elastic_kind];
  }
  // Elastic grants move in whole base units: a step up from `grant` reaches the next whole
  // unit (a fractional minimum is topped up first), a step down the previous one, never
  // past the action's maximum or minimum.
  static Quantity grow_step(const ActionRec& a, Quantity grant) {
    return std::min(kElasticStep - grant % kElasticStep, a.elastic_max - grant);
  }
  Quantity shrink_step(const ActionRec& a, Quantity grant) const {
    const Quantity above_whole = grant % kElasticStep;
    return std::min(above_whole > 0 ? above_whole : kElasticStep, grant - minimum(a));
  }
  // The grant an action is ordered (and its service queue weighed) by: its minimum, under
  // ResizeRule::kMalleable rounded up to a whole unit for an elastic action (its start is
  // topped up to that whenever the room holds it).
  Quantity order_units(const ActionRec& a) const {
    const Quantity lowest = minimum(a);
    if (!malleable || a.elastic_kind == kNone || lowest % kElasticStep == 0) return lowest;
    return lowest + grow_step(a, lowest);
  }


  // ---- parking.cc: parking and wakes
  template <class Entry, class Fits>
  void wake(std::vector<Entry>& list, std::int32_t scope, Fits&& fits);
  void release_on_node(std::int32_t node, std::int32_t partition);
  void flush_releases(std::vector<ClassHead>& wakes);
  void unpark(std::int32_t c);

  // ---- pass.cc: the pass
  // kBlocked: short of resources; kWaits: for its quota or its GPU service, which do not
  // hold back spare elastic units.
  enum class Try { kStarted, kBlocked, kWaits, kParked, kHalt };
  void pass(std::vector<Decision>& out);
  Try try_head(std::int32_t c, std::vector<Decision>& out);
  // Where a head may go (find_room, which fills its candidate leaves in `cand`).
  struct Room {
    std::int32_t lo = 0, hi = 0;        // leaves of its partition it may use
    std::int32_t fixed_leaf = kNone;    // or its trajectory's bound slot
    std::int32_t scope = kNone;         // the one node it is confined to, or kNone
    bool has_range = false;             // it has somewhere to go now
    bool own_slot = false;              // it runs in its trajectory's own slot
    bool masked = false;                // its whole partition is held back
    bool borrowed = false;              // `cand` are held slots lent to it (lend_slot_room)
  };
  Room find_room(Class& cl, std::int32_t device, std::vector<std::int32_t>& cand);
  bool fits_a_held_back_node(const Class& cl, const Room& room);
  bool held_slot_room(const Class& cl, const Room& room, bool own, std::vector<std::int32_t>& cand);
  bool lend_slot_room(const Class& cl, const Room& room, std::vector<std::int32_t>& cand);
  void unbind_slot(std::int32_t c, std::int32_t bin);
  void holder_live(TrajectoryId trajectory, std::int32_t delta);
  void free_slot(std::int32_t bin);
  Try no_room(Class& cl, const Room& room, std::int32_t device);
  void note_quota_block(Class& cl, const QuotaState& q);
  bool quota_admits(Class& cl);
  bool quota_refuses(Class& cl);
  void start_head(std::int32_t c, std::int32_t leaf, std::int32_t fixed_leaf, std::int32_t device,
                  std::vector<Decision>& out, bool borrowed = false);
  std::int32_t scope_node(const Class& c) const;
  bool eligible_range(const Class& c, std::int32_t& lo, std::int32_t& hi, std::int32_t& fixed_leaf) const;
  // Whether try_head could start the head of a parkable class (no service, no GPU memory,
  // not starving) at this point of the pass; false only when it surely could not. With no
  // mask set, that is: some bin it may use covers its demand, or (kMalleable) would with
  // the units a shrink could take back there. Released leaves are all a class woken by this
  // pass's releases can use; a class confined to a node checks the node's bins. Under a
  // mask or a blocked quota the full try decides. Inline: a pass asks it of every pending
  // wake, and most are answered by fits_released_leaf's first test.
  bool may_start_now(Class& cl) {
    if (this_pass.any_mask || (cl.quota != kNone && this_pass.quota_blocked[cl.quota])) return true;
    const std::int32_t node = cl.parked ? cl.park_node : scope_node(cl);
    if (may_reclaim(cl)) return fits_or_shrinks(cl, node);  // kept apart: the common path stays lean
    if (node != kNone) return bins.fits_some_bin(cl.partition, cl.demand, node);
    return cl.fit_pass == this_pass.fit_epoch ? fits_released_leaf(cl) : true;
  }
  // A parkable head (no service, no GPU memory, not starving) that surely cannot start at
  // this point of the pass: a try would park it, so it parks without one.
  bool surely_parks(Class& cl) {
    return cl.service == kNone && cl.gpu_memory == 0 && now - cl.waiting.head().submit_ns < starvation_ns &&
           !may_start_now(cl);
  }
  // At its turn in the walk: a class woken by this pass's releases (whose released leaves
  // earlier heads may have filled since) that surely parks.
  bool parks_at_turn(Class& cl) { return cl.fit_pass == this_pass.fit_epoch && surely_parks(cl); }
  // Does a released leaf from the class's `fit_from` on still hold its head? The same test as
  // try_head's placement for a class woken by this pass's releases, with no masks set. Once
  // the pass's starts have used the released room up, the first kind alone says no.
  bool fits_released_leaf(Class& cl) {
    if (cl.demand[0] > released.first_max[cl.partition]) {
      cl.fit_from = static_cast<std::int32_t>(released.leaves[cl.partition].size());
      return false;
    }
    return released_leaf_scan(cl);
  }
  bool released_leaf_scan(Class& cl);
  bool settle_fit(Class& cl);
  bool listed_at_flush(Class& cl);
  // ---- services.cc: GPU services and eviction
  template <class Reachable, class Live, class Work>
  std::size_t soonest_copy(std::int32_t first, Reachable&& reachable, Live&& live, Work&& work) const;
  template <class Reachable>
  std::size_t soonest_for_new(std::int32_t first, Reachable&& reachable) const;
  bool copy_reachable(std::int32_t copy) const;
  std::int32_t route_replica(const ActionSpec& s) const;
  void rebind_replicas();
  void first_waiting(const std::vector<std::int32_t>& queued, std::size_t n, std::vector<OrderKey>& keys) const;
  void call_in_surplus(std::int32_t first, const std::vector<std::uint8_t>& reachable);
  // rebind_replicas routes again a replicated service's first waiting actions: this many
  // batches of each copy.
  static constexpr std::int64_t kRebindBatches = 2;
  bool move_to_copy(std::int32_t slot, std::int32_t copy);
  bool sibling_on(std::int32_t copy, std::int32_t d) const;
  bool surplus_has_room(std::int32_t copy) const;
  bool uses_service_home() const { return row.rules.service_devices == ServiceDevices::kHome; }
  bool service_admits(Class& cl, std::int32_t& device, std::vector<Decision>& out);
  bool restore(std::int32_t svc_id, const Class& head_class, std::vector<Decision>& out);
  template <class NeedOn, class Usable>
  void drain(std::int32_t svc_id, std::int32_t dlo, std::int32_t dhi, NeedOn&& room_on, Usable&& usable);
  void restore_queues(std::vector<Decision>& out);
  // order_service_tails: a queue's arrivals have stopped after this many mean gaps.
  static constexpr std::int64_t kTailGaps = 4;
  void order_service_tails();
  void reorder_service_queue(std::int32_t svc_id, bool tail);
  // An action's order key (OrderKey::key) from its class, estimate and aging term (of its
  // submit time): no run time under a quota (every request costs it the same, so shortest
  // first would not shorten its queue, only starve its long calls), else the estimate
  // (OrderRule), then aging.
  std::int64_t order_key(const Class& cl, TimeNs est_ns, std::int64_t aging) const {
    return (cl.quota == kNone ? est_ns * estimate_weight : 0) + aging;
  }
  std::int64_t aging_term(TimeNs submit_ns) const {
    return static_cast<std::int64_t>((static_cast<__int128>(submit_ns) * aging_permille) / 1000);
  }

  struct RoomPlan {
    bool ok = false;
    std::int64_t busy = 0;    // victims with waiting actions
    std::int64_t queued = 0;  // their queued work, ns
    // The restores its idle victims will likely need: each one's restore time over its
    // expected gap until its next request, summed in victim order (never asked for: 0).
    double likely = 0;
    std::vector<std::int32_t> victims;
    std::vector<std::uint8_t> discard;  // per victim: its state is given up (evict or discard_asleep)
    // Short of room while it spared a service ready only since the last pass, which the
    // next pass may evict (PassState::spared_fresh).
    bool spared_fresh = false;
  };
  RoomPlan plan_room(std::int32_t device, Quantity need, std::int32_t keep, bool starving = false) const;
  Quantity promised_on(std::int32_t device, std::int32_t keep) const;
  bool make_gpu_room(const Class& c, std::int32_t lo, std::int32_t hi, std::int32_t fixed_leaf,
                     std::int32_t device, std::vector<Decision>& out);
  void evict(std::int32_t svc_id, std::vector<Decision>& out, bool discard = false);
  void discard_asleep(std::int32_t svc_id, std::vector<Decision>& out);
  void emit_evict(std::int32_t svc_id, std::int32_t device, bool discard, std::vector<Decision>& out) const;
  void evict_plan(const RoomPlan& plan, std::vector<Decision>& out);
  void evict_offline_services(std::vector<Decision>& out);
  bool could_serve(const Class& cl, std::int32_t d) const;
  bool serves_another(const Class& cl, std::int32_t d) const;
  bool device_online(std::int32_t d) const { return bins.node_online[gpus.dev_node[d]] && !gpus.dev_offline[d]; }
  // Argument checks of the public calls: Error naming the field when out of range.
  std::int32_t global_device(std::int32_t node, std::int32_t device) const;  // node's GPU `device`
  void set_device_online(std::int32_t d, bool online);

  // ---- spare.cc: spare elastic units
  void grant_spare(std::vector<Decision>& out);
  void top_up_start(std::int32_t slot, std::int32_t bin, Quantity* f);  // a fractional minimum to a whole unit (kMalleable)
  // The spare rule's test on `bin` (whose free room is `f`): the step's cut, or 0 when the
  // step would leave less than `reserve` (per kind; nullptr: none) free or the GainRule
  // refuses it (`others`: the other actions running on the bin).
  double step_cut(std::int32_t slot, std::int32_t bin, const Quantity* f, double work, std::int64_t others,
                  const Quantity* reserve = nullptr) const;
  // SpareRule::kUncontended: what spare units must leave free on `bin` in this pass, per
  // kind: the most any class waiting for room there asks for. A waiter short of memory
  // keeps back its cores, not all of them, so idle cores still speed up the running
  // actions it waits on. Computed once per bin and pass.
  const Quantity* bin_reserve(std::int32_t bin);
  void parked_need(std::int32_t part, std::int32_t node, Quantity* reserve) const;

  // ---- resize.cc: running grants under ResizeRule::kMalleable
  // Its running actions or their grants changed: the earliest finish is stale, and a bin
  // where no shrink could pay (shrink_futile) may now have one that does: its node counts as
  // released for the next pass (flush_releases), which wakes the classes parked for want of
  // a shrink that pays there.
  void running_changed(std::int32_t bin) {
    BinRun& run = elastic.bin_run[bin];
    run.finish_ok = false;
    if (run.shrink_futile) [[unlikely]] shrink_futility_lost(bin);
  }
  void shrink_futility_lost(std::int32_t bin);  // out of line: the starts and ends stay inlined
  // Every change to what a shrink could take back on `bin` goes through here: where it grows
  // during the walk on a leaf released for this pass, the pass's pending wakes there may
  // start by a shrink. (Before the walk the flush sees it; after it no wake is left.)
  void add_reclaim(std::int32_t bin, std::int32_t kind, Quantity units);  // out of line: rare
  // A start (inline: on every start and end of a malleable row).
  void note_running(std::int32_t slot) {
    const ActionRec& a = actions.slots[slot];
    BinRun& bin = elastic.bin_run[a.bin];
    if (bin.started_pass != this_pass.epoch) {
      bin.started_pass = this_pass.epoch;
      bin.started_from = static_cast<std::int32_t>(bin.running.size());
    }
    RunState& run = elastic.run_state[slot];
    run.resized_ns = -1;
    run.running_pos = static_cast<std::int32_t>(bin.running.size());
    bin.running.push_back(slot);
    // An action that no shrink can take from leaves a futile bin futile: its finish can
    // only bring the gain down.
    bin.finish_ok = false;
    if (a.elastic_kind != kNone && a.grant > minimum(a)) {
      running_changed(a.bin);
      add_reclaim(a.bin, a.elastic_kind, a.grant - minimum(a));
    }
  }
  // An end, before its slot is freed: the bin where room was freed is noted.
  void forget_running(std::int32_t slot) {
    const ActionRec& a = actions.slots[slot];
    BinRun& bin = elastic.bin_run[a.bin];
    const std::int32_t pos = elastic.run_state[slot].running_pos;
    const std::int32_t last = bin.running.back();
    bin.running[pos] = last;
    elastic.run_state[last].running_pos = pos;
    bin.running.pop_back();
    running_changed(a.bin);
    if (a.elastic_kind != kNone && a.grant > minimum(a))
      add_reclaim(a.bin, a.elastic_kind, minimum(a) - a.grant);
    elastic.mark_freed(a.bin);
  }
  double work_now(std::int32_t slot) const;
  double estimated_finish(std::int32_t slot) const;  // seconds on the caller's clock
  double gain_on(std::int32_t bin);  // the wait a head avoids by starting on `bin` now
  // After a running action's grant changed in this pass (from `old_grant`; `work`: its
  // work left now at that grant): its remaining work from now, and its kResize decision.
  // `pass`: the pass it counts as resized in (the coming one for a limit before it).
  void record_resize(std::int32_t slot, Quantity old_grant, double work, std::vector<Decision>& out);
  void record_resize(std::int32_t slot, Quantity old_grant, double work, std::uint64_t pass,
                     std::vector<Decision>& out);
  // Scheduler::limit for one running elastic action (validated): its maximum becomes
  // `max`, a grant above it drops to it, before the event's pass.
  void limit_grant(std::int32_t slot, Quantity max, std::vector<Decision>& out);
  void push_resize(const ActionRec& a, std::vector<Decision>& out) const;  // its kResize decision
  bool reclaim_covers(const Class& cl, std::int32_t bin) const;
  bool reclaim_fits_node(const Class& cl, std::int32_t node) const;
  // Nothing to take back in the class's partition (the common case): one test, inline.
  bool may_reclaim(const Class& cl) const { return malleable && !elastic.reclaim_bins[cl.partition].empty(); }
  bool could_shrink_into(const Class& cl) { return may_reclaim(cl) && shrink_room_somewhere(cl); }
  bool shrink_room_somewhere(const Class& cl);
  // No trajectory slot, service or affinity confines the class: any bin of its partition.
  static bool may_use_any_bin(const Class& cl) {
    return !cl.in_trajectory_slot && cl.service == kNone && cl.affinity_node == kNone;
  }
  bool shrink_may_help(const Class& cl, std::int32_t bin) const {
    return !elastic.bin_run[bin].shrink_futile && reclaim_covers(cl, bin) && bins.may_use(bin, cl.in_trajectory_slot, cl.trajectory);
  }
  // Whether the most free plus reclaimable room of some bin of the class's partition
  // (Elastic::reclaim_bound, per pass) covers its demand.
  bool reclaim_bound_covers(const Class& cl) {
    const std::int32_t p = cl.partition;
    if (elastic.reclaim_bound_pass[p] != this_pass.epoch) refresh_reclaim_bound(p);
    const Quantity* bound = &elastic.reclaim_bound[static_cast<std::size_t>(p) * K];
    for (std::int32_t k = 0; k < K; ++k)
      if (cl.demand[k] > bound[k]) return false;
    return true;
  }
  void refresh_reclaim_bound(std::int32_t p);
  bool fits_or_shrinks(Class& cl, std::int32_t node);  // may_start_now with units to take back
  bool released_shrink_room(const Class& cl);
  bool fits_or_shrinks_on_node(const Class& cl, std::int32_t node) const {
    return bins.fits_some_bin(cl.partition, cl.demand, node) || (may_reclaim(cl) && reclaim_fits_node(cl, node));
  }
  bool plan_shrink(const Class& cl, const Room& room, std::int32_t device, ShrinkPlan& plan);
  bool plan_shrink_on(const Class& cl, std::int32_t bin, ShrinkPlan& plan);
  bool shrink_futile(std::int32_t bin);  // no shrink plan on `bin` can pay now
  // Per partition, the bins of reclaim_bins not futile when the pass first asked.
  const std::vector<std::int32_t>& shrink_candidates_of(std::int32_t partition);
  void start_by_shrinking(std::int32_t c, const Room& room, std::int32_t device, const ShrinkPlan& plan,
                          std::vector<Decision>& out);

  // ---- introspection.cc
  std::string explain(ActionId id) const;
  void check() const;
  void check_running() const;
};

}  // namespace tangram
