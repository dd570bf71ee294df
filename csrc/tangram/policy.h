// Policies as data. A policy is a row of independent rules, resolved once when a scheduler
// is made; the scheduling pass reads the rules and never asks which policy runs. Adding a
// policy is adding a row (and a PolicyKind): kPolicyRows in policy.cc. A row that is not
// built in runs through PolicyConfig::row (the tests run a sixth policy this way).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tangram/types.h"

namespace tangram {

// The order waiting actions are tried in: (-priority, key, seq) with seq counting submits.
enum class OrderRule : std::uint8_t {
  kArrival = 0,   // key = 0: submission order within a priority
  kEstimate = 1,  // key = estimated run time + aging * submit time (shortest first, aged);
                  // an action under a quota: key = aging * submit time (every request
                  // costs its quota the same, so its queue keeps arrival order); a GPU
                  // service's queue whose arrivals have stopped is re-keyed for its drain
                  // (Impl::order_service_tails: the step's objective)
  kProgress = 2,  // as kEstimate (without service tails: mean ACT is its objective), but
                  // an action under a quota is keyed by its trajectory's
                  // progress first: key = aging * submit time - kProgressCreditNs x the
                  // actions its trajectory has started (at most kProgressCap counted), so
                  // the quota serves the trajectories nearest their end first. Lower mean
                  // ACT when a quota is saturated, a longer step and p99: the objective of
                  // an asynchronous trainer (docs/scheduling.md, Objectives).
};

// OrderRule::kProgress: the key one more started action is worth (100 s), and the most
// started actions counted (so the key cannot overflow: 2^20 x 100 s = 1.05e17 ns).
inline constexpr std::int64_t kProgressCreditNs = 100'000'000'000;
inline constexpr std::int32_t kProgressCap = 1 << 20;

// What placement packs into.
enum class BinLayout : std::uint8_t {
  kNodes = 0,            // one bin per node, one partition
  kTrajectorySlots = 1,  // each node cut into slots of trajectory_slot_cpu cores; a
                         // trajectory binds one slot from its first start until it ends,
                         // and an elastic action takes its slot's free units up to its max
  kTaskPools = 2,        // a partition per task pool, each node split by the pools' weights
};

// Where elastic units beyond the minimum grants go, after the walk: one step (to the next
// whole unit) at a time to the action started in the pass with the largest marginal cut in
// run time, while that cut passes the GainRule.
enum class SpareRule : std::uint8_t {
  kNone = 0,         // every action runs at its minimum (its slot, under kTrajectorySlots)
  kUncontended = 1,  // never into the room, of its kind, that an action waiting for the bin asks for
  kEveryBin = 2,     // on every bin, whether or not others wait
};

// When offloaded GPU services are restored.
enum class RestoreRule : std::uint8_t {
  kOnDemand = 0,     // when the walk reaches a waiting action of the service
  kQueuesFirst = 1,  // before the walk, whole queues by Smith's rule (see restore_queues)
};

// Which devices a GPU service may be resident on.
enum class ServiceDevices : std::uint8_t {
  kAny = 0,   // any device with room (or room made by eviction)
  kHome = 1,  // a dedicated pool: a service's minimum copies only (surplus ones are never
              // used), the i-th such copy in service order on device i % devices
};

// Whether a running action's elastic grant may change after its start.
enum class ResizeRule : std::uint8_t {
  kFixed = 0,      // the grant of its start decision until it ends
  kMalleable = 1,  // a fractional elastic minimum starts topped up to a whole unit (unless
                   // SpareRule::kNone), running actions grow into room a completion frees
                   // (by the SpareRule) and give units back for a waiting action when that
                   // pays (kResize decisions; docs/scheduling.md states the rule)
};

// Whether a spare step (SpareRule other than kNone) is worth granting. Its cut is the run
// time it saves the action: work left x (t(g) - t(g + step)).
enum class GainRule : std::uint8_t {
  kRelative = 0,  // the cut is at least min_relative_gain of the action's remaining run time
  kWait = 1,      // the cut is more than the wait the step causes others on its bin: the
                  // unit-seconds it adds (work left x ((g + step) t(g + step) - g t(g))) over
                  // the bin's capacity, times the other actions running there, weighted by
                  // the share of the bin in use. Needs ResizeRule::kMalleable (which keeps
                  // each bin's running actions). docs/scheduling.md derives it.
};

struct PolicyRules {
  OrderRule order = OrderRule::kEstimate;
  BinLayout bins = BinLayout::kNodes;
  SpareRule spare = SpareRule::kUncontended;
  RestoreRule restore = RestoreRule::kQueuesFirst;
  ServiceDevices service_devices = ServiceDevices::kAny;
  ResizeRule resize = ResizeRule::kFixed;
  GainRule gain = GainRule::kRelative;
};

struct PolicyRow {
  std::string name;
  PolicyRules rules;
};

// The built-in policies; their rows are kPolicyRows in policy.cc, in this order.
enum class PolicyKind : std::uint8_t {
  // Minimise average ACT, and serve the step: shortest estimate first with aging (a GPU
  // service queue whose requests have stopped ordered for its drain), fractional minimums
  // topped up to whole units, spare elastic units where nobody waits while they save more
  // than the wait they cause, running grants that grow and shrink, whole service queues
  // restored first by Smith's rule.
  kTangram = 0,
  // One shared pool, first-come first-served (with backfill), fixed minimum grants.
  kFifo = 1,
  // Each trajectory owns a fixed slot of cores from its first action until it ends; its
  // actions run in that slot with the whole slot as their grant. Services on home devices.
  kTrajectory = 2,
  // A dedicated share of every node per task pool; each service has a home device.
  kIsolated = 3,
  // Optimus/AFS-style greedy elasticity from the cluster-scheduling literature: arrival
  // order (with backfill) and minimum grants at admission, then every spare elastic unit
  // goes to the action started in the pass with the largest marginal cut in run time,
  // whether or not others still wait.
  kOptimus = 4,
};

struct PolicyConfig {
  PolicyKind kind = PolicyKind::kTangram;
  // A policy that is not built in: its name and rules, used instead of kind's row.
  std::optional<PolicyRow> row;
  // OrderRule::kEstimate: ordering key = estimated run time + aging * submit time. Larger
  // favours arrival order; smaller favours short actions. Waiting can never starve an
  // action in the order, because later arrivals get ever larger keys.
  double aging = 0.5;
  // Placement: best fit among the first `candidates` feasible bins in index order.
  std::int32_t candidates = 4;
  // GainRule::kRelative (optimus): an extra elastic unit is granted only if it cuts the run
  // time by at least this fraction of the current run time. Unused under GainRule::kWait.
  double min_relative_gain = 0.05;
  // Every policy: an action that has waited this long and still does not fit holds back
  // every later action from the bins it could use, so big actions are not starved by a
  // stream of small ones (under kTrajectorySlots only the free slots: a trajectory's own
  // slot is never held). Under RestoreRule::kQueuesFirst, also the wait after which a
  // service's restore goes first.
  double starvation_seconds = 60;
  // BinLayout::kTrajectorySlots: cores in each trajectory's slot (e.g. 2.0 / 17). Each node
  // holds as many slots as fit its cpu, counted from this value to a billionth of a core (so
  // cpu / n gives n slots), each of this many cores rounded to the milli-core as an
  // action's demand is (an action asking for its slot fits it); other kinds are divided
  // evenly among a node's slots (trajectory_slots()).
  double trajectory_slot_cpu = 0;
  // BinLayout::kTaskPools: (task pool id, weight). Every node is divided among the pools
  // in proportion to the weights. Actions name their pool in ActionSpec::task.
  std::vector<std::pair<std::uint32_t, double>> pools;
};

// How many slots of `slot_cpu` cores (PolicyConfig::trajectory_slot_cpu) a node of `cpu`
// milli-cores holds under BinLayout::kTrajectorySlots.
Quantity trajectory_slots(Quantity cpu, double slot_cpu);

// The built-in rows, in PolicyKind order: the one list of policy names.
const std::vector<PolicyRow>& builtin_policies();
const PolicyRow& policy_row(PolicyKind kind);
// The row a configuration runs: its own row if it has one, else its kind's.
const PolicyRow& resolve_policy(const PolicyConfig& config);
const char* policy_name(PolicyKind kind);
// Throws Error(kUnknownName) for a name that is not built in.
PolicyKind policy_from_name(const std::string& name);
// Throws Error(kInvalidArgument) naming `field` for a row without a name or with a rule
// out of its enum's range (a row made by casting).
void validate_rules(const PolicyRow& row, const std::string& field);

// The rules by name, as Python and docs/scheduling.md spell them: each field ("order",
// "bins", "spare", "restore", "service_devices", "resize", "gain") with its values' names
// in enum order.
using RuleNames = std::vector<std::pair<std::string, std::vector<std::string>>>;
const RuleNames& rule_names();
// (field, value name) for each field of `rules`, in rule_names() order.
std::vector<std::pair<std::string, std::string>> describe_rules(const PolicyRules& rules);
// The rules named by (field, value name) pairs; every field exactly once. Throws
// Error(kInvalidArgument) naming `where`.field for an unknown, missing or repeated field or
// an unknown value.
PolicyRules parse_rules(const std::vector<std::pair<std::string, std::string>>& fields, const std::string& where);

}  // namespace tangram
