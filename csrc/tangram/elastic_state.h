// Running and elastic state under ResizeRule::kMalleable: each bin's running actions, the
// units above their minimum that running elastic actions hold (what a shrink could take
// back), and what the pass remembers of where shrinks cannot pay. A part of
// Scheduler::Impl (scheduler_impl.h); resize.cc holds the out-of-line methods and the
// coordinators that read action records and models.
//
// Owns: per bin its running actions, reclaimable units (per kind and summed), its place in
// its partition's list of bins with some, its earliest estimated finish and shrink
// futility; per running action (by slot) its resize state; the bins a completion freed
// room on since the last pass; per partition the bound on free plus reclaimable room, the
// demands that found no shrink room in this pass and the bins still worth a shrink plan.
// Guarantees (Scheduler::Impl::check_running(), in introspection.cc: they need the actions):
//   - each running action is listed once, on its bin, at run_state's running_pos;
//   - bin_reclaim holds, per bin and kind, the sum over the bin's running elastic actions
//     of their grant above their minimum, reclaim_sum its total, and a bin is in its
//     partition's reclaim_bins (at reclaim_pos) exactly when that total is positive;
//   - a bin is in freed_bins exactly when BinRun::freed (cleared by each pass's end);
//   - shrink_room_version moves on whenever free plus reclaimable room may have grown (a
//     release, units added, a bin's futility lost), so a memo taken under it holds.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "tangram/failed_demands.h"
#include "tangram/model.h"

namespace tangram {

// A running action under ResizeRule::kMalleable, by slot, set at its start: its place in
// its bin's list of running actions, and its last grant change, if any. Half a cache line.
struct alignas(32) RunState {
  TimeNs resized_ns = -1;          // when its grant last changed; -1: not since its start
  double work_left = 1.0;          // the share of its work left then (unused while -1)
  Quantity grant_before = 0;       // its grant before that change
  std::uint32_t resized_pass = 0;  // the pass that made it, low bits (with resized_ns: the pass)
  std::int32_t running_pos = -1;   // its position in its bin's running list
};
static_assert(sizeof(RunState) == 32, "a running action's resize state is half a cache line");

// A bin's running actions under ResizeRule::kMalleable, in one cache line: a start or an
// end touches this and the action's RunState.
struct alignas(64) BinRun {
  std::vector<std::int32_t> running;  // its running actions (slots)
  std::uint64_t started_pass = 0;     // the last pass that started something here
  std::int32_t started_from = 0;      // entries from here on started in that pass
  std::int32_t reclaim_pos = -1;      // its position in its partition's reclaim_bins, or -1
  Quantity reclaim_sum = 0;           // its reclaimable units over all kinds
  double finish_min = 0;              // earliest estimated finish there, while finish_ok
  bool finish_ok = false;             // cleared whenever its running actions or grants change
  bool freed = false;                 // listed in freed_bins
  bool shrink_futile = false;         // no shrink plan here can pay until it changes (shrink_futile)
  std::int32_t partition = 0;         // the bin's (Bins::bin_partition), for its reclaim list
};
static_assert(sizeof(BinRun) == 64, "a bin's running state is one cache line");

// A shrink of running actions that lets a head start (plan_shrink).
struct ShrinkPlan {
  std::int32_t leaf = kNone;
  std::vector<std::pair<std::int32_t, Quantity>> grants;  // (slot, new grant), by action id
  std::vector<double> work;  // each one's work left now, at its old grant
};

// An action a shrink may take units from (plan_shrink_on).
struct ShrinkDonor {
  std::int32_t slot;
  Quantity grant;  // as planned
  double work;     // its work left now
};

struct Elastic {
  std::int32_t K = 0;  // kinds
  std::vector<BinRun> bin_run;      // by bin
  // shrink_futile's floor per bin, and the pass it was computed in.
  std::vector<double> bin_shrink_floor;
  std::vector<std::uint64_t> bin_shrink_floor_pass;
  std::vector<RunState> run_state;  // by slot
  std::vector<Quantity> bin_reclaim;  // per bin and kind (K a bin): units above minimum
  std::vector<std::vector<std::int32_t>> reclaim_bins;  // per partition: bins with a reclaim sum > 0
  // Bins where a complete or cancel freed room since the last pass: their running actions
  // are candidates for spare units.
  std::vector<std::int32_t> freed_bins;
  // Per partition and kind, the most free room plus reclaimable units on one of its bins
  // with any, as of the pass it was taken in (reclaim_bound_pass): room only shrinks in a
  // pass, so a class asking more of some kind fits none of them. Reset when units are added.
  std::vector<Quantity> reclaim_bound;
  std::vector<std::uint64_t> reclaim_bound_pass;
  // Per partition, the demands of plain classes (no trajectory slot, the whole partition
  // in range) that found no shrink room in this pass. In a pass a bin's free room plus
  // reclaimable units only shrink and a futile bin stays futile, until a release, units
  // added or a bin's futility lost bump shrink_room_version: till then a plain class asking
  // at least as much of every kind finds none either, without the walk over the
  // partition's reclaim bins.
  std::vector<FailedDemands> no_shrink_room;
  std::uint64_t shrink_room_version = 0;
  // Per partition, the bins of reclaim_bins not futile when the pass first asked, in list
  // order; recomputed in each pass, and when a bin joins the list.
  std::vector<std::vector<std::int32_t>> shrink_candidates;
  std::vector<std::uint64_t> shrink_candidates_pass;
  ShrinkPlan shrink_plan;  // scratch of try_head
  std::vector<std::int32_t> shrink_bins;  // scratch of plan_shrink and flush_releases
  std::vector<ShrinkDonor> shrink_donors;  // scratch of plan_shrink_on
  std::vector<Quantity> shrink_short_by;  // scratch of plan_shrink_on

  // ---- resize.cc
  void resize(std::int32_t kinds, std::size_t n_partitions);  // at construction
  void append_bin(std::int32_t partition);  // a new bin of `partition`, with nothing running
  // `units` more (or fewer, when negative) reclaimable units of `kind` on `bin`.
  void add_reclaim(std::int32_t bin, std::int32_t kind, Quantity units);
  // Whether a plain class of `partition` asking `demand` is known, in pass `pass`, to find
  // no shrink room (a demand at least as large found none); note_no_shrink_room records one.
  bool known_no_shrink_room(std::int32_t partition, const Quantity* demand, std::uint64_t pass) const {
    return no_shrink_room[partition].covers(demand, K, {pass, shrink_room_version});
  }
  void note_no_shrink_room(std::int32_t partition, const Quantity* demand, std::uint64_t pass) {
    no_shrink_room[partition].note(demand, K, {pass, shrink_room_version});
  }

  // Room was freed on `bin`: its running actions are candidates for spare units.
  void mark_freed(std::int32_t bin) {
    BinRun& run = bin_run[bin];
    if (run.freed) return;
    run.freed = true;
    freed_bins.push_back(bin);
  }
  void clear_freed() {
    for (std::int32_t b : freed_bins) bin_run[b].freed = false;
    freed_bins.clear();
  }
  // Whether the action in `slot`, running on `bin`, started in pass `pass`.
  bool started_in(std::int32_t slot, std::int32_t bin, std::uint64_t pass) const {
    const BinRun& run = bin_run[bin];
    return run.started_pass == pass && run_state[slot].running_pos >= run.started_from;
  }
  // Whether its grant changed in pass `pass`, at `now`. A resize is at the pass's time, so
  // the pass's low bits and its time name the pass (it would take 2^32 passes at one
  // instant to mistake another).
  bool resized_in(std::int32_t slot, TimeNs now, std::uint64_t pass) const {
    const RunState& r = run_state[slot];
    return r.resized_ns == now && r.resized_pass == static_cast<std::uint32_t>(pass);
  }
};

}  // namespace tangram
