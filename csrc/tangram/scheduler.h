// The action-level scheduler: events in, decisions out.
//
// Every event call validates its whole batch first (throwing tangram::Error and applying
// nothing if any item is bad), applies it, then runs one scheduling pass at `now` and
// appends that pass's decisions to `out` (which it clears first). Time must never go
// backwards. The same events always give the same decisions.
//
// Terminal states: an action ends exactly once, by complete() (done or failed: the caller
// knows which), cancel(), or a kReject decision at submit (it can never fit).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tangram/model.h"

namespace tangram {

class Scheduler {
 public:
  Scheduler(Inventory inventory, PolicyConfig policy);
  ~Scheduler();
  Scheduler(Scheduler&&) noexcept;
  Scheduler& operator=(Scheduler&&) noexcept;
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Registers a (units, seconds) table for ModelKind::kTable; returns its id.
  std::int32_t add_table(std::vector<std::pair<double, double>> points);

  // ---- events
  void submit(const ActionSpec* actions, std::size_t count, TimeNs now,
              std::vector<Decision>& out);
  // The actions finished (successfully or not); their resources (an elastic action's
  // current grant) return to the pools.
  void complete(const ActionId* ids, std::size_t count, TimeNs now,
                std::vector<Decision>& out);
  // Waiting actions leave the queue; running ones are taken as stopped by the caller (their
  // resources return to the pools, as for complete).
  void cancel(const ActionId* ids, std::size_t count, TimeNs now,
              std::vector<Decision>& out);
  // The trajectories are over (trajectory slots are freed). They must have no live
  // actions left.
  void end_trajectories(const TrajectoryId* ids, std::size_t count, TimeNs now,
                        std::vector<Decision>& out);
  // Time passed: restores finish, quotas refill.
  void tick(TimeNs now, std::vector<Decision>& out);
  // The runtime finished restoring `service` on (node, device) sooner than planned: it is
  // ready now, and the device's operations end now when that restore was the last one, so
  // its waiting actions start without waiting out the estimate. A report that matches no
  // restore in progress (the service is elsewhere, offloaded, or already ready) changes
  // nothing; the runtime still holds each action until the restore it waits for is done.
  // Runs a pass.
  void service_restored(std::int32_t service, std::int32_t node, std::int32_t device, TimeNs now,
                        std::vector<Decision>& out);
  // New estimates of `service`'s restore and offload times, in seconds (what the runtime
  // measured), for the restores and evictions decided from now on. Throws Error for an
  // unknown service or a time outside [0, 1e9].
  void set_service_times(std::int32_t service, double restore_seconds, double offload_seconds);
  // The API behind `quota` answered "too many requests" (HTTP 429, with a Retry-After): the
  // quota admits nothing new before `until` (a later backoff extends the pause, an earlier
  // one changes nothing; requests in flight are not touched), its waiting requests held as
  // by its rate. Runs no pass: a backoff can only hold actions back. Throws Error for an
  // unknown quota or an `until` outside [0, 1e9] seconds.
  void back_off_quota(std::int32_t quota, TimeNs until);
  // What `quota` would admit at `now` (QuotaState::snapshot; a live view: nothing changes,
  // `now` is not checked against the clock). Throws Error for an unknown quota or a `now`
  // outside [0, 1e9] seconds.
  QuotaSnapshot quota_snapshot(std::int32_t quota, TimeNs now) const;
  // Running elastic actions say how many units of their elastic kind they can use from now
  // on (a worker pool with fewer tasks left than its grant, or more again when it gets
  // more): each one's maximum becomes limits[i] milli-units, within [its minimum, the
  // maximum it was submitted with]. A grant above its new maximum drops to it at once (a
  // kResize decision, under any ResizeRule; the units return to the pools for the pass
  // that follows); under ResizeRule::kMalleable a grant below it may grow to it as units
  // free up. An action limited here is not resized again by this event's pass.
  void limit(const ActionId* ids, const Quantity* limits, std::size_t count, TimeNs now,
             std::vector<Decision>& out);

  // ---- node membership (a cluster whose nodes come and go)
  // Takes a node out of placement (online=false) or brings it back. An offline node gets
  // no new placements: its bins are hidden from placement, services resident there are
  // evicted once none of their actions runs there, and restores skip its GPUs. Actions
  // already running there keep their resources until the caller ends each through
  // complete() or cancel() (the core never ends an action on its own). When the node
  // comes back, its pools are exactly what those calls left: capacity minus whatever still
  // runs there. Capacity of an offline node still counts for feasibility: an action that
  // fits only there waits (it is not rejected) and, even when starving, holds no online
  // bins back. Idempotent; runs a pass like every event.
  void set_node_online(std::int32_t node, bool online, TimeNs now, std::vector<Decision>& out);
  // Appends a node (online) with its capacity per kind (the inventory's kinds; a new kind
  // cannot be added) and GPUs; returns its index. Bins are made as the policy makes them
  // at construction (trajectory slots, task pool shares). Indices of existing nodes, bins
  // and devices do not change. Throws Error for a bad or duplicate node; runs a pass.
  std::int32_t add_node(NodeSpec node, TimeNs now, std::vector<Decision>& out);
  // Takes one GPU out of placement (online=false: it needs a reset, e.g. after a fatal Xid
  // error) or brings it back. Its memory is fenced off: nothing new is placed or restored
  // there; services resident on it are evicted once none of their actions runs there;
  // actions running there keep their memory until the caller ends them, and it is fenced
  // off as they end. Back online, the fenced memory is free again. Idempotent; runs a pass.
  void set_device_online(std::int32_t node, std::int32_t device, bool online, TimeNs now, std::vector<Decision>& out);
  bool device_online(std::int32_t node, std::int32_t device) const;
  bool node_online(std::int32_t node) const;

  // ---- queries
  // The earliest future time at which a tick could start something (a restore finishing,
  // a quota refilling), or kNever.
  TimeNs next_wakeup() const;
  TimeNs now() const;
  // The text of a kReject decision's `reason` from the last event call.
  const std::string& message(std::int32_t reason) const;
  std::size_t message_count() const;  // messages of the last event call
  // Why a waiting action waits, in words; or, for a running one, where it runs and its
  // grant (and, when a kResize changed it, from what and when).
  std::string explain(ActionId id) const;
  ActionState state(ActionId id) const;
  // For a running action: where it runs and its current elastic grant (what its last
  // kStart or kResize decision gave); `time` is its start.
  Decision placement(ActionId id) const;

  const Inventory& inventory() const;
  const PolicyConfig& policy() const;
  std::size_t waiting_count() const;
  std::size_t running_count() const;
  // Classes in use (action shapes with distinct constraints; with trajectory slots, per live
  // trajectory: an ended trajectory's classes are freed for reuse).
  std::size_t class_count() const;
  // Free amount of `kind` on `node` (summed over the node's bins), milli-units.
  Quantity free(std::int32_t node, std::int32_t kind) const;
  Quantity gpu_free(std::int32_t node, std::int32_t device) const;
  // The service's device as (node, device), or (kNone, kNone) when offloaded.
  std::pair<std::int32_t, std::int32_t> service_location(std::int32_t service) const;
  bool service_ready(std::int32_t service) const;
  // BinLayout::kTrajectorySlots: the node of the slot the trajectory holds, or kNone (it
  // holds none: not started yet, ended, or running only in slots lent to it).
  std::int32_t trajectory_slot_node(TrajectoryId trajectory) const;
  // Run time in seconds the action's model gives for `units` milli-units of its elastic
  // kind (its minimum when not elastic). The action must be live.
  double runtime(ActionId id, Quantity units) const;

  // Check every internal invariant (capacity never exceeded, accounting consistent);
  // throws std::logic_error naming the first violation. For tests and the fuzzer.
  void check_invariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tangram
