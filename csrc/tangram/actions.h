// Live actions: their records by slot, the id and trajectory indexes, and the counts. A part
// of Scheduler::Impl (scheduler_impl.h).
//
// Owns: each live action's hot record (ActionRec) and the rest of it (ActionDetail), by
// slot; the free slots; live ids -> slots; per trajectory its live actions and (OrderRule::
// kProgress) the actions it has started; the waiting and running counts; the submit
// sequence; the batch mark of validate_ids.
// Guarantees (Scheduler::Impl::check(), in introspection.cc, with the classes they wait in):
//   - by_id maps exactly the live (waiting or running) actions' ids to their slots, outside
//     a submit's validation (which marks the batch's ids kBatchSlot and takes them out again
//     on an error); a free slot's record is kUnknown;
//   - details and queue_pos have an entry per slot;
//   - trajectory_live counts each trajectory's live actions and has no entry for one with
//     none; n_waiting and n_running count the live actions in each state;
//   - next_seq only grows: no two actions share an order key.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tangram/id_map.h"
#include "tangram/model.h"

namespace tangram {

inline constexpr std::int32_t kBatchSlot = -2;  // by_id: an id of the batch being validated

// Policy order: (neg_priority, key, seq). Fields laid out so the struct packs into 32 bytes
// (two to a cache line): heaps and sorts move many of these. `slot` and `submit_ns` ride
// along so that a class's next head can be judged (starving or not) without a trip to its
// action record, a likely cache miss.
template <class A, class B>
bool policy_before(const A& x, const B& y) {
  if (x.neg_priority != y.neg_priority) return x.neg_priority < y.neg_priority;
  if (x.key != y.key) return x.key < y.key;
  return x.seq < y.seq;
}

struct OrderKey {
  std::int64_t key;
  std::uint64_t seq;
  TimeNs submit_ns;   // when the action was submitted; not part of the order
  std::int32_t neg_priority;
  std::int32_t slot;  // the action's slot; not part of the order
  bool operator<(const OrderKey& o) const { return policy_before(*this, o); }
};

// What an event touches of a live action, in one cache line: completions look up ids at
// random, and a start commits to the head's record, so each costs one line, not three.
struct alignas(64) ActionRec {
  ActionId id = 0;
  TrajectoryId trajectory = 0;
  Quantity elastic_max = 0;
  Quantity grant = 0;  // elastic grant while running
  TimeNs start_ns = 0;
  std::int32_t cls = kNone;
  std::int32_t elastic_kind = kNone;
  std::int32_t bin = kNone;
  std::int32_t device = kNone;  // global device index
  std::uint32_t mark = 0;  // validate_ids: the batch mark when its id was last seen
  ActionState state = ActionState::kUnknown;
  bool own_slot = false;  // running in its trajectory's own slot (BinLayout::kTrajectorySlots)
};
static_assert(sizeof(ActionRec) == 64, "an action's hot record is one cache line");

// The rest of a live action's record: read at submit, for spare units and for queries.
struct ActionDetail {
  ElasticityModel model;
  TimeNs est_ns = 0;
  Quantity submitted_max = 0;  // elastic_max as submitted (Scheduler::limit may lower it)
  bool any_replica = false;  // submitted to any copy of a replicated service (rebind_replicas may move it)
  OrderKey order{};  // with its submit time
};

struct Actions {
  std::vector<ActionRec> slots;
  std::vector<ActionDetail> details;  // by slot, like `slots`
  std::vector<std::int32_t> free_slots;
  IdMap by_id;  // live action id -> slot
  std::vector<std::int32_t> queue_pos;  // per slot: position in its class's WaitQueue while waiting
  IdMap trajectory_live;  // trajectory -> its live actions
  // OrderRule::kProgress: per trajectory, the actions it has started, from its first start
  // until end_trajectories names it (a trajectory never ended keeps its entry).
  IdMap trajectory_progress;
  std::uint64_t next_seq = 0;
  std::size_t n_waiting = 0, n_running = 0;
  TimeNs last_submit_ns = -1;  // the latest accepted action's submit (-1: none yet)
  TimeNs mean_gap_ns = -1;     // between accepted actions' submits, a moving average (-1: fewer than two)
  std::uint32_t mark = 0;  // validate_ids: the current batch's mark (ActionRec::mark)

  // A live action of the trajectory more: true when it is its first.
  bool trajectory_gains(TrajectoryId trajectory) { return ++*trajectory_live.insert(trajectory, 0).first == 1; }
  // A live action of the trajectory fewer: true when it was its last.
  bool trajectory_loses(TrajectoryId trajectory) {
    if (--*trajectory_live.find(trajectory) != 0) return false;
    trajectory_live.erase(trajectory);
    return true;
  }
  // The action in `slot` (its record `r`) has ended, run or waited: its id and slot are free.
  void release(ActionRec& r, std::int32_t slot) {
    by_id.erase(r.id);
    r.state = ActionState::kUnknown;
    free_slots.push_back(slot);
  }

  // Every id is live and passes state_ok(slot, position); then no id repeats (reported at
  // its later position). Repeats are found by marking slots, so the check is one probe per
  // id. Throws Error naming the first bad id.
  template <class F>
  void validate_ids(const ActionId* ids, std::size_t n, F&& state_ok) {
    if (++mark == 0) {  // wrapped round: old marks could pass for this batch's
      for (ActionRec& r : slots) r.mark = 0;
      mark = 1;
    }
    std::size_t repeat = SIZE_MAX;
    constexpr std::size_t kAhead = 8;  // ids whose index lines are fetched ahead of their probe
    for (std::size_t i = 0; i < std::min(n, kAhead); ++i) by_id.prefetch(ids[i]);
    for (std::size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) by_id.prefetch(ids[i + kAhead]);
      const std::int32_t* slot = by_id.find(ids[i]);
      if (slot == nullptr)
        throw Error(ErrorCode::kUnknownAction, "ids[" + std::to_string(i) + "]",
                    "action " + std::to_string(ids[i]) + " is not live (never submitted, or already ended)");
      state_ok(*slot, i);
      ActionRec& r = slots[*slot];
      if (r.mark == mark) repeat = std::min(repeat, i);
      r.mark = mark;
    }
    if (repeat != SIZE_MAX)
      throw Error(ErrorCode::kDuplicateId, "ids[" + std::to_string(repeat) + "]",
                  "action " + std::to_string(ids[repeat]) + " appears twice in the batch");
  }
};

}  // namespace tangram
