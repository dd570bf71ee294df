// What the core is told: the inventory, the policy (policy.h), the actions; and what it answers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tangram/policy.h"
#include "tangram/types.h"

namespace tangram {

// ---------------------------------------------------------------- inventory

struct GpuSpec {
  Quantity memory = 0;  // milli-MiB
};

struct NodeSpec {
  std::string name;
  std::vector<Quantity> capacity;  // one entry per Inventory::kinds, milli-units
  std::vector<GpuSpec> gpus;
  // Host RAM for the state of services offloaded from its GPUs (a sleeping server's weights
  // backed up in pinned memory), milli-MiB; -1: not limited.
  Quantity offload_memory = -1;
};

// A named API quota. Zero disables a limit.
struct QuotaSpec {
  std::string name;
  double rate = 0;                   // requests per second (GCRA emission interval 1/rate)
  std::int64_t burst = 1;            // requests admitted back to back before the rate applies
  std::int64_t max_concurrency = 0;  // requests in flight at once
  std::int64_t tokens_per_minute = 0;  // token bucket: capacity and refill per minute
};

// What a quota would admit at a moment, for a live view (Scheduler::quota_snapshot).
struct QuotaSnapshot {
  std::int64_t requests = -1;  // requests its rate lets start back to back (-1: no rate limit)
  std::int64_t tokens = -1;    // whole tokens of its budget (-1: no budget)
  TimeNs paused_until = 0;     // the end of a backoff (0: none)
};

inline constexpr std::int32_t kNone = -1;

// A GPU service (a reward model): resident on one device or offloaded to host memory.
struct ServiceSpec {
  std::string name;
  Quantity memory = 0;         // device memory while resident, milli-MiB
  double restore_seconds = 0;  // its restore's own time, host -> device
  std::int32_t max_batch = 1;  // actions it runs at once while resident
  double offload_seconds = 0;  // its offload's time when evicted, device -> host
  // Device memory it keeps while offloaded, milli-MiB (an inference server asleep keeps
  // its CUDA context and allocator pool); at most `memory`. Non-zero only when not movable.
  Quantity asleep_memory = 0;
  // Whether a restore may go to another device than its last one. A server process cannot
  // move its CUDA context: false pins it to the device it was restored on (its
  // asleep_memory stays there) while the action it is restored for could run there; else
  // (an offline node, a demand that device's node can never hold) the process is given
  // up and the restore is a fresh load on another device.
  bool movable = true;
  // Host RAM its offloaded state takes on the node it was evicted from, milli-MiB: an
  // eviction needs that much of the node's offload_memory, which its next restore frees.
  Quantity host_memory = 0;
  // Replicas: identical copies of one model, each its own service here (its own residency).
  // `replica_of` is the index of the group's first copy (kNone: not a replica of another;
  // the first copy of a group is kNone too, and is named by the group's actions). A copy
  // beyond the service's minimum count is `surplus`: when GPU memory is needed, idle surplus
  // copies are evicted first.
  std::int32_t replica_of = kNone;
  // The index of its replica group's first copy (`self` when it is that copy or unreplicated).
  std::int32_t first_copy(std::int32_t self) const { return replica_of == kNone ? self : replica_of; }
  bool surplus = false;
};
// A device's restores and offloads run one after another, in decision order (the runtime
// carries them out so: an offload must free the memory a restore goes into): a restore is
// ready restore_seconds after the device's earlier operations end, and an eviction keeps
// the device busy for offload_seconds. The memory an eviction frees is free for the core at
// once; an action placed there starts when the offload ends (the runtime waits for it).

struct Inventory {
  std::vector<std::string> kinds;  // resource kinds, e.g. {"cpu", "memory"}; names unique
  std::vector<NodeSpec> nodes;
  std::vector<QuotaSpec> quotas;
  std::vector<ServiceSpec> services;
};

// ---------------------------------------------------------------- actions

enum class ModelKind : std::uint8_t {
  kConstant = 0,  // run time does not depend on the grant
  kAmdahl = 1,    // t(u) = seconds * ((1 - p) + p * min / u)
  kTable = 2,     // piecewise linear through (units, seconds) points, flat outside
  kCallback = 3,  // t(u) = callback(u), a native function (numba cfunc from Python)
};

using RuntimeCallback = double (*)(double units);

struct ElasticityModel {
  ModelKind kind = ModelKind::kConstant;
  double seconds = 0;            // kConstant, kAmdahl: run time at the minimum grant
  double parallel_fraction = 0;  // kAmdahl, in [0, 1]
  std::int32_t table = -1;       // kTable: id from Scheduler::add_table
  RuntimeCallback callback = nullptr;  // kCallback
};

struct ActionSpec {
  ActionId id = 0;
  TrajectoryId trajectory = 0;
  std::uint32_t task = 0;      // task pool (BinLayout::kTaskPools); a label otherwise
  std::int32_t priority = 0;   // higher classes go first
  std::vector<Quantity> demand;  // minimum demand per kind, milli-units
  Quantity gpu_memory = 0;     // device memory on one GPU (or on its service's GPU)
  std::int32_t elastic_kind = kNone;  // the one elastic dimension, or kNone
  Quantity elastic_max = 0;    // upper bound of the elastic grant, milli-units
  ElasticityModel model;
  std::int32_t affinity_node = kNone;  // where its trajectory's sandbox lives
  std::int32_t service = kNone;        // GPU service it must run on
  // `service` is the first copy of a replicated service and any copy will do: the core
  // routes the action at submit to the copy that would serve it soonest (Scheduler::submit).
  bool any_replica = false;
  std::int32_t quota = kNone;          // API quota it draws from
  std::int64_t tokens = 0;             // tokens it takes from the quota's budget
};

// ---------------------------------------------------------------- decisions

enum class DecisionKind : std::uint8_t {
  kStart = 0,    // run `action` on `node` (and `device`), elastic kind granted `grant`
  kRestore = 1,  // make `service` resident on `node`/`device`; ready at `time`
  kEvict = 2,    // offload `service` from `node`/`device` to host memory
  kReject = 3,   // `action` can never run: terminal; Scheduler::message(reason) says why
  kResize = 4,   // running `action` on `node` now holds `grant` of `elastic_kind` (its new
                 // total grant; ResizeRule::kMalleable, or Scheduler::limit); `time`: now
};

struct Decision {
  DecisionKind kind = DecisionKind::kStart;
  ActionId action = 0;
  std::int32_t node = kNone;
  std::int32_t device = kNone;  // GPU index within the node
  std::int32_t service = kNone;
  std::int32_t elastic_kind = kNone;
  Quantity grant = 0;  // granted units of the elastic kind; 0 when the action is not elastic
  TimeNs time = 0;     // kStart, kResize: when; kRestore: when the service is ready
  std::int32_t reason = kNone;  // kReject: index into the last call's messages; kEvict: kDiscard or kNone
};
// A kEvict whose service's state is given up rather than offloaded (its process closed;
// its next restore is a fresh load): an offline node or device, no room for its state in
// the node's offload memory, or an unmovable service's process asleep on a device that
// needs the memory, or left for another device.
inline constexpr std::int32_t kDiscard = 1;

// Where an action stands.
enum class ActionState : std::uint8_t { kUnknown = 0, kWaiting = 1, kRunning = 2 };

}  // namespace tangram
