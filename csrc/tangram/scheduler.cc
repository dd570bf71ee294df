// The scheduler core. docs/scheduling.md states the rules; tangram/reference.py implements
// the same rules naively, and the differential tests hold the two to identical decisions.
//
// Structure:
//   bins        what placement packs into: a node (kTangram, kFifo), a node's share for one
//               task pool (kIsolated) or one trajectory slot (kTrajectory). Each policy
//               partition has a BinTree over its bins for fast "first bins that fit".
//   classes     waiting actions with identical admission constraints (demand, gpu memory,
//               affinity, service, quota, tokens; the trajectory under kTrajectory). If the
//               first of a class cannot start, none of the class can in that pass.
//   active      a heap of the head of every class that may start, in policy order. A
//               class that failed on resources alone is parked off it until resources are
//               released where it could run; parking only skips work that would fail. A
//               class woken by released room looks only at the released bins.
#include "tangram/scheduler.h"

#include "tangram/id_map.h"
#include "tangram/wait_queue.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <iterator>
#include <tuple>
#include <map>
#include <sstream>
#include <unordered_map>

#include "tangram/bin_tree.h"
#include "tangram/elasticity.h"
#include "tangram/quota.h"

namespace tangram {

namespace {

constexpr Quantity kMaxMilli = static_cast<Quantity>(kMaxBaseUnits) * kMilli;
constexpr Quantity kElasticStep = kMilli;  // elastic grants grow one base unit at a time
constexpr std::int32_t kBatchSlot = -2;  // by_id: an id of the batch being validated

// Why a class could not start its head in the last pass that looked at it.
enum class Block : std::uint8_t {
  kNotConsidered,
  kResources,
  kHeldBack,  // an older starving action holds the bins
  kQuotaRate,
  kQuotaConcurrency,
  kQuotaTokens,
  kServiceRestoring,
  kServiceNoRoom,
  kServiceBatchFull,
};

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
};
static_assert(sizeof(ActionRec) == 64, "an action's hot record is one cache line");

// The rest of a live action's record: read at submit, for spare units and for queries.
struct ActionDetail {
  ElasticityModel model;
  TimeNs est_ns = 0;
  OrderKey order{};  // with its submit time
};

// A class with its head's order fields (24 bytes, cheap to sort and merge): the entries of
// the partition-parked lists and of a pass's pending wakes.
struct ClassHead {
  ClassHead() = default;
  ClassHead(const OrderKey& head, std::int32_t c)
      : key(head.key), seq(head.seq), neg_priority(head.neg_priority), cls(c) {}
  std::int64_t key = 0;
  std::uint64_t seq = 0;
  std::int32_t neg_priority = 0;
  std::int32_t cls = kNone;
  bool operator<(const ClassHead& o) const { return policy_before(*this, o); }
};

struct alignas(64) Class {
  // Laid out by use. The first cache line holds what a flush, a pass and a completion look
  // at for every class they meet; the second its queue (head inline), affinity and GPU
  // memory (what a try reads besides); the class key's other fields and the rest follow.
  bool parked = false;
  bool in_active = false;
  // kTrajectory, non-service actions: the class runs in its trajectory's own slot. Service
  // actions run beside their service, in any slot no trajectory holds, and bind nothing.
  bool in_trajectory_slot = false;
  Block block = Block::kNotConsidered;
  std::int32_t park_node = kNone;  // while parked: the node it waits on, or kNone (partition)
  std::uint64_t seen_flush = 0;    // release epoch of the last flush that listed it
  std::uint64_t pending_pass = 0;  // a pending wake of this pass (partition-wide or node)
  // A pending wake of pass `fit_pass` (flush_releases): it fitted nowhere when parked and
  // only released bins have grown since, so in that pass its only possible bins are the
  // partition's released leaves from position `fit_from` on (the first it fitted). Free
  // room only shrinks within a pass, so placement needs to look at nothing else.
  std::uint64_t fit_pass = 0;
  std::int32_t fit_from = 0;
  std::int32_t partition = 0;
  const Quantity* demand = nullptr;  // K kinds: a row of Impl::demand_rows, never moved
  std::int32_t quota = kNone;
  std::int32_t service = kNone;
  std::uint64_t active_gen = 0;  // counts activations; older heap entries are stale

  WaitQueue<OrderKey> waiting;  // its waiting actions, head first
  std::int32_t affinity_node = kNone;
  std::int32_t next_same_hash = kNone;
  Quantity gpu_memory = 0;

  // the rest of the class key (with demand, partition, affinity, service, quota, gpu memory)
  std::int64_t tokens = 0;
  TrajectoryId trajectory = 0;
  // state
  // A search hint for its placements across all bins (try_head): while `tree_epoch` is the
  // scheduler's search_epoch, no leaf before `tree_from` holds its demand (free room only
  // shrinks until the epoch moves on: at each pass, and when an eviction frees GPU memory).
  std::uint64_t tree_epoch = 0;
  std::int32_t tree_from = 0;
  TimeNs park_deadline = 0;        // when its head starts starving
  std::uint64_t park_generation = 0;  // counts parkings, to spot stale deadline entries
  TimeNs block_until = 0;
  std::string infeasible;  // why no action of this class can ever run; empty if one can
  std::uint64_t key_hash = 0;  // its entry in Impl::class_index
};
static_assert(offsetof(Class, waiting) == 64 && offsetof(Class, tokens) == 128,
              "a class's hot fields fill its first two cache lines");


struct Partition {
  std::vector<std::int32_t> bins;       // global bin ids, in leaf order
  std::vector<std::int32_t> node_lo;    // per node: first leaf of its bins (or -1)
  std::vector<std::int32_t> node_hi;
  BinTree free_tree;  // free vector (+ node's largest free device memory); -1 = unusable
  BinTree cap_tree;   // capacity vector (+ node's largest device) for feasibility
  // Classes parked on any bin of this partition, with their heads: `parked` in policy
  // order as of the last flush, `parked_new` added since (unsorted). A flush sorts the few
  // new ones and merges, instead of sorting them all. Entries of classes since unparked,
  // parked elsewhere or with another head are stale and dropped at the next flush.
  std::vector<ClassHead> parked, parked_new;
  std::int64_t parked_count = 0;     // classes parked here now
};

struct ServiceRec {
  std::int32_t device = kNone;  // global device index while resident or restoring
  TimeNs ready_ns = 0;
  std::int32_t running = 0;
  std::int64_t waiting = 0;
  TimeNs queued_ns = 0;  // estimated work of waiting actions
  std::int32_t home_device = kNone;  // kIsolated / kTrajectory
  TimeNs restore_ns = 0;
};

}  // namespace

struct Scheduler::Impl {
  Inventory inv;
  PolicyConfig policy;
  PolicyRow row;  // the policy's rules, resolved once (policy.h): nothing below asks its name
  // OrderRule as numbers, so the key needs no branch: key = est_ns * estimate_weight +
  // submit_ns * aging_permille / 1000 (both 0 under kArrival).
  std::int64_t estimate_weight = 0;
  // A starving head that may use any bin stops the pass: the whole partition is its. Not
  // with several partitions (the others go on) nor with trajectory slots (bound slots are
  // their trajectories' own).
  bool starving_head_halts = false;
  std::int32_t K = 0;  // kinds
  std::int32_t D = 0;  // tree dims: K (+1 when there are GPUs)
  bool has_gpus = false;
  std::int64_t aging_permille = 0;
  TimeNs starvation_ns = 0;

  // bins
  // Per bin: its free vector then its capacity (2K entries), side by side because the
  // best-fit score of a candidate reads both.
  std::vector<Quantity> bin_room;
  std::vector<std::int32_t> bin_node, bin_partition, bin_leaf;
  std::vector<Partition> partitions;
  std::unordered_map<std::uint32_t, std::int32_t> pool_partition;  // kIsolated

  // GPUs (global device index)
  std::vector<std::int32_t> dev_node, dev_local;
  std::vector<Quantity> dev_total, dev_free;
  std::vector<std::int32_t> node_first_dev;  // node -> first global device
  std::vector<Quantity> node_max_dev_free, node_max_dev_total;

  std::vector<ServiceRec> services;
  std::vector<QuotaState> quotas;
  std::vector<RuntimeTable> tables;

  // actions and classes
  std::vector<ActionRec> slots;
  std::vector<ActionDetail> details;  // by slot, like `slots`
  std::vector<std::int32_t> free_slots;
  IdMap by_id;  // live action id -> slot
  std::vector<std::int32_t> queue_pos;  // per slot: position in its class's WaitQueue while waiting
  std::vector<Class> classes;
  // Class demand vectors, K per row, in chunks that never move (Class::demand points
  // here): classes made one after another lie side by side, unlike one vector each.
  static constexpr std::size_t kDemandRowsPerChunk = 256;
  std::vector<std::unique_ptr<Quantity[]>> demand_rows;
  std::size_t demand_rows_used = kDemandRowsPerChunk;  // in the last chunk
  const Quantity* store_demand(const std::vector<Quantity>& demand) {
    if (demand_rows_used == kDemandRowsPerChunk) {
      demand_rows.emplace_back(new Quantity[kDemandRowsPerChunk * static_cast<std::size_t>(K)]);
      demand_rows_used = 0;
    }
    Quantity* row = demand_rows.back().get() + demand_rows_used++ * static_cast<std::size_t>(K);
    std::copy(demand.begin(), demand.end(), row);
    return row;
  }
  // Classes by hash of their constraints; equal hashes chain through Class::next_same_hash.
  IdMap class_index;
  // kTrajectory keys a class by its trajectory: an ended trajectory's classes (all empty)
  // are freed and their slots reused, so a long run does not grow by one class per
  // trajectory. Other policies' classes are bounded by their distinct constraints.
  std::unordered_map<TrajectoryId, std::vector<std::int32_t>> trajectory_classes;
  std::vector<std::int32_t> free_classes;
  void free_class(std::int32_t c);
  // Per partition, the capacities of one node's bins under the policy.
  using NodeBins = std::vector<std::vector<std::vector<Quantity>>>;
  NodeBins node_bins(const std::vector<Quantity>& capacity) const;
  void append_bin(std::int32_t node, std::int32_t part, const std::vector<Quantity>& cap);
  // The head of every class that may start, as a min-heap in policy order. Deactivating
  // only clears Class::in_active: entries whose generation is not the class's current one
  // are stale and dropped when they surface (each pass drains the heap).
  struct ActiveEntry {
    OrderKey key;
    std::int32_t cls;
    std::uint64_t gen;
    bool operator>(const ActiveEntry& o) const { return o.key < key; }
  };
  std::vector<ActiveEntry> active;
  std::vector<ActiveEntry> active_deferred;  // popped in a pass, still active: pushed back after it
  std::size_t active_count = 0;
  bool live(const ActiveEntry& e) const { return classes[e.cls].in_active && classes[e.cls].active_gen == e.gen; }
  void push_active(const ActiveEntry& e) {
    active.push_back(e);
    std::push_heap(active.begin(), active.end(), std::greater<>());
  }
  std::vector<std::vector<std::int32_t>> node_parked;  // classes parked on one node's bins (may hold stale ids)
  std::vector<std::int64_t> node_parked_count;
  // Parked classes by the time their head starts starving: then they must be looked at
  // again, since the starvation guard changes what a failure means.
  // A min-heap of (deadline, class, park generation); entries of classes since unparked
  // are stale and skipped when they surface.
  struct ParkDeadline {
    TimeNs at;
    std::int32_t cls;
    std::uint64_t generation;
    bool operator>(const ParkDeadline& o) const { return std::tie(at, cls) > std::tie(o.at, o.cls); }
  };
  std::vector<ParkDeadline> park_deadlines;
  IdMap trajectory_live;  // trajectory -> its live actions
  std::unordered_map<TrajectoryId, std::int32_t> trajectory_bin;  // kTrajectory bindings
  std::vector<std::uint8_t> bin_bound;  // kTrajectory: slot held by a trajectory (hidden from the free tree)
  std::uint64_t next_seq = 0;
  std::size_t n_waiting = 0, n_running = 0;
  TimeNs now = 0;
  TimeNs wakeup = kNever;
  TimeNs prev_pass_now = -1;  // when the previous pass ran
  std::vector<std::string> messages;

  // per-pass scratch
  std::uint64_t pass_epoch = 0;
  std::uint64_t search_epoch = 0;  // moves on at each pass and whenever room grows in one
  const OrderKey* pass_cursor = nullptr;  // the head being looked at, while a pass runs
  std::vector<std::uint64_t> node_contended, partition_contended;  // == pass_epoch when set
  std::vector<std::uint64_t> node_masked, partition_masked;
  bool any_mask = false;
  std::vector<std::uint8_t> quota_blocked;
  std::vector<std::int32_t> started;  // action slots started in this pass
  std::vector<std::size_t> started_decision;
  std::vector<std::int32_t> cand;
  std::vector<Quantity> scratch;
  std::uint32_t mark = 0;  // validate_ids: the current batch's mark (ActionRec::mark)
  // Nodes released since the last pass (partition-wide wakes are done once per event).
  std::vector<std::int32_t> released_nodes;
  std::vector<std::uint64_t> node_released;  // == release_epoch when in released_nodes
  std::vector<Quantity> most_released;
  std::vector<std::vector<std::int32_t>> released_leaves;  // per partition, in leaf order
  // Per partition: the released leaves' free vectors by kind (K columns of the leaves'
  // count), kept exact through the pass's starts; bins map to their position.
  std::vector<std::vector<Quantity>> released_free;
  // Per partition: the largest free amount of the first kind over its released leaves, now.
  // A class asking more fits none of them: most looks at a pass's pending wakes end here
  // once the pass's starts have used the room up.
  std::vector<Quantity> released_first_max;
  std::vector<std::int32_t> bin_released_at;
  std::vector<std::uint64_t> bin_released_pass;  // == pass_epoch when released this pass
  // Parked classes that fit a bin released since the last pass (flush_releases), in policy
  // order of their heads. They stay parked until their turn in the pass: most lose
  // the room to an earlier head, and a look at the released leaves then is far cheaper
  // than a trip through the active heap and back into the park (see pass()).
  std::vector<ClassHead> pending_wakes;
  std::vector<ClassHead> heads_scratch;  // flush_releases: merges
  std::uint64_t release_epoch = 1;
  bool in_pass = false;

  // Node membership (set_node_online / add_node). An offline node's bins are hidden from
  // the free trees (all -1, like a bound trajectory slot), so nothing is placed there; its
  // running actions keep their resources until the caller completes or cancels them.
  std::vector<std::uint8_t> node_online;  // per node
  std::int32_t n_offline = 0;

  Impl(Inventory inventory, PolicyConfig cfg);

  // ---- helpers
  Quantity* free_of(std::int32_t bin) { return &bin_room[static_cast<std::size_t>(bin) * 2 * K]; }
  const Quantity* free_of(std::int32_t bin) const { return &bin_room[static_cast<std::size_t>(bin) * 2 * K]; }
  const Quantity* cap_of(std::int32_t bin) const { return &bin_room[(static_cast<std::size_t>(bin) * 2 + 1) * K]; }
  bool service_is_ready(const ServiceRec& s) const { return s.device != kNone && s.ready_ns <= now; }
  bool uses_service_home() const { return row.rules.service_devices == ServiceDevices::kHome; }

  void refresh_leaf(std::int32_t bin);
  void refresh_node_devices(std::int32_t node);
  void build_trees();
  void hide_leaf(Partition& part, std::int32_t leaf);
  void set_node_online(std::int32_t node, bool online);
  std::int32_t add_node(NodeSpec spec);
  bool fits_online_capacity(const Class& cl, std::int32_t lo, std::int32_t hi, std::int32_t device) const;
  void evict_offline_services(std::vector<Decision>& out);
  void release_on_node(std::int32_t node, std::int32_t partition);
  bool fits_some_bin(const Class& cl, std::int32_t node) const;
  static std::int32_t class_of(std::int32_t c) { return c; }
  static std::int32_t class_of(const ClassHead& entry) { return entry.cls; }
  template <class Entry, class Fits>
  void wake(std::vector<Entry>& list, std::int32_t scope, Fits&& fits);
  void flush_releases();
  bool may_start_now(Class& cl);
  bool fits_released_leaf(Class& cl);
  // The first released leaf of `partition` from position `from` on whose free vector covers
  // `demand`, or -1. The scan runs down the first kind's column, which rules most out (the
  // constructor makes sure there is at least one kind).
  std::int32_t first_released_fit(std::size_t partition, std::int32_t from, const Quantity* demand) const {
    if (demand[0] > released_first_max[partition]) return -1;
    const std::vector<Quantity>& cols = released_free[partition];
    const std::int32_t n = static_cast<std::int32_t>(released_leaves[partition].size());
    const Quantity* first = cols.data();
    for (std::int32_t i = from; i < n; ++i) {
      if (first[i] < demand[0]) continue;
      bool fits = true;
      for (std::int32_t k = 1; k < K && fits; ++k) fits = cols[static_cast<std::size_t>(k) * n + i] >= demand[k];
      if (fits) return i;
    }
    return -1;
  }

  void park(std::int32_t c, std::int32_t node_or_none);
  void leave_park(Class& cl) {  // the park's bookkeeping, nothing else
    cl.parked = false;
    if (cl.park_node == kNone) --partitions[cl.partition].parked_count;
    else --node_parked_count[cl.park_node];
  }
  void unpark(std::int32_t c);
  ActiveEntry unpark_for_try(std::int32_t c);
  ActiveEntry make_active(std::int32_t c) {  // marks the class active; its entry for the heap
    Class& cl = classes[c];
    cl.in_active = true;
    ++active_count;
    return ActiveEntry{cl.waiting.head(), c, ++cl.active_gen};
  }
  void activate(std::int32_t c);
  void deactivate(std::int32_t c);
  double seconds(std::int32_t slot, Quantity units) const;
  Quantity minimum(const ActionRec& a) const;

  // ---- events
  std::int32_t class_for(const ActionSpec& s);
  std::string infeasible_reason(const Class& c) const;
  void validate_now(TimeNs t) const;
  template <class Field>
  void validate_spec(const ActionSpec& s, const Field& field) const;
  void submit(const ActionSpec* a, std::size_t n, TimeNs t, std::vector<Decision>& out);
  void finish(std::int32_t slot);  // running -> gone, resources back
  void unqueue(std::int32_t slot);  // waiting -> gone

  // ---- the pass
  // kBlocked: short of resources; kWaits: for its quota or its GPU service, which do not
  // hold back spare elastic units.
  enum class Try { kStarted, kBlocked, kWaits, kParked, kHalt };
  void pass(std::vector<Decision>& out);
  Try try_head(std::int32_t c, std::vector<Decision>& out);
  std::int32_t scope_node(const Class& c) const;
  bool eligible_range(const Class& c, std::int32_t& lo, std::int32_t& hi, std::int32_t& fixed_leaf) const;
  bool restore(std::int32_t svc_id, const Class& head_class, std::vector<Decision>& out);
  void restore_queues(std::vector<Decision>& out);
  struct RoomPlan {
    bool ok = false;
    std::int64_t busy = 0;    // victims with waiting actions
    std::int64_t queued = 0;  // their queued work, ns
    std::vector<std::int32_t> victims;
  };
  RoomPlan plan_room(std::int32_t device, Quantity need, std::int32_t keep) const;
  bool make_gpu_room(const Class& c, std::int32_t lo, std::int32_t hi, std::int32_t fixed_leaf,
                     std::int32_t device, std::vector<Decision>& out);
  void evict(std::int32_t svc_id, std::vector<Decision>& out);
  void grant_spare(std::vector<Decision>& out);
  std::string explain(ActionId id) const;
  void check() const;
};

// ============================================================ construction

Scheduler::Impl::Impl(Inventory inventory, PolicyConfig cfg)
    : inv(std::move(inventory)), policy(std::move(cfg)), row(resolve_policy(policy)) {
  K = static_cast<std::int32_t>(inv.kinds.size());
  if (K == 0) throw Error(ErrorCode::kInvalidArgument, "inventory.kinds", "at least one resource kind is needed");
  for (std::int32_t k = 0; k < K; ++k) {
    if (inv.kinds[k].empty()) throw Error(ErrorCode::kInvalidArgument, "inventory.kinds[" + std::to_string(k) + "]", "a kind needs a name");
    for (std::int32_t j = 0; j < k; ++j)
      if (inv.kinds[j] == inv.kinds[k])
        throw Error(ErrorCode::kInvalidArgument, "inventory.kinds[" + std::to_string(k) + "]", "duplicate kind '" + inv.kinds[k] + "'");
  }
  if (inv.nodes.empty()) throw Error(ErrorCode::kInvalidArgument, "inventory.nodes", "at least one node is needed");
  const std::int32_t N = static_cast<std::int32_t>(inv.nodes.size());
  for (std::int32_t n = 0; n < N; ++n) {
    const auto& node = inv.nodes[n];
    std::string f = "inventory.nodes[" + std::to_string(n) + "]";
    if (static_cast<std::int32_t>(node.capacity.size()) != K)
      throw Error(ErrorCode::kInvalidArgument, f + ".capacity", "has " + std::to_string(node.capacity.size()) + " entries for " + std::to_string(K) + " kinds");
    for (std::int32_t k = 0; k < K; ++k)
      if (node.capacity[k] < 0 || node.capacity[k] > kMaxMilli)
        throw Error(ErrorCode::kInvalidArgument, f + ".capacity." + inv.kinds[k], "must be in [0, 1e12] units");
    for (std::size_t g = 0; g < node.gpus.size(); ++g)
      if (node.gpus[g].memory <= 0 || node.gpus[g].memory > kMaxMilli)
        throw Error(ErrorCode::kInvalidArgument, f + ".gpus[" + std::to_string(g) + "].memory", "must be in (0, 1e12] MiB");
  }
  // devices
  node_first_dev.resize(N + 1);
  for (std::int32_t n = 0; n < N; ++n) {
    node_first_dev[n] = static_cast<std::int32_t>(dev_node.size());
    for (std::size_t g = 0; g < inv.nodes[n].gpus.size(); ++g) {
      dev_node.push_back(n);
      dev_local.push_back(static_cast<std::int32_t>(g));
      dev_total.push_back(inv.nodes[n].gpus[g].memory);
    }
  }
  node_first_dev[N] = static_cast<std::int32_t>(dev_node.size());
  dev_free = dev_total;
  has_gpus = !dev_node.empty();
  D = K + (has_gpus ? 1 : 0);
  node_max_dev_free.assign(N, 0);
  node_max_dev_total.assign(N, 0);
  for (std::int32_t n = 0; n < N; ++n)
    for (std::int32_t d = node_first_dev[n]; d < node_first_dev[n + 1]; ++d)
      node_max_dev_total[n] = std::max(node_max_dev_total[n], dev_total[d]);
  node_max_dev_free = node_max_dev_total;

  // quotas and services
  for (std::size_t q = 0; q < inv.quotas.size(); ++q) {
    quotas.emplace_back(inv.quotas[q], "inventory.quotas[" + std::to_string(q) + "]");
    for (std::size_t j = 0; j < q; ++j)
      if (inv.quotas[j].name == inv.quotas[q].name)
        throw Error(ErrorCode::kInvalidArgument, "inventory.quotas[" + std::to_string(q) + "].name", "duplicate quota '" + inv.quotas[q].name + "'");
  }
  quota_blocked.assign(quotas.size(), 0);
  for (std::size_t s = 0; s < inv.services.size(); ++s) {
    const auto& spec = inv.services[s];
    std::string f = "inventory.services[" + std::to_string(s) + "]";
    for (std::size_t j = 0; j < s; ++j)
      if (inv.services[j].name == spec.name) throw Error(ErrorCode::kInvalidArgument, f + ".name", "duplicate service '" + spec.name + "'");
    if (spec.memory < 0 || spec.memory > kMaxMilli) throw Error(ErrorCode::kInvalidArgument, f + ".memory", "must be in [0, 1e12] MiB");
    if (!std::isfinite(spec.restore_seconds) || spec.restore_seconds < 0 || spec.restore_seconds > kMaxSeconds)
      throw Error(ErrorCode::kInvalidArgument, f + ".restore_seconds", "must be a finite number in [0, 1e9]");
    if (spec.max_batch < 1) throw Error(ErrorCode::kInvalidArgument, f + ".max_batch", "must be at least 1");
    if (!has_gpus) throw Error(ErrorCode::kInvalidArgument, f, "a GPU service needs at least one GPU in the inventory");
    ServiceRec rec;
    rec.restore_ns = to_ns(spec.restore_seconds);
    services.push_back(rec);
  }

  // policy
  std::string pf = "policy(" + row.name + ")";
  validate_rules(row, pf);
  if (!std::isfinite(policy.aging) || policy.aging < 0 || policy.aging > 4)
    throw Error(ErrorCode::kInvalidArgument, pf + ".aging", "must be a finite number in [0, 4]");
  const bool by_estimate = row.rules.order == OrderRule::kEstimate;
  estimate_weight = by_estimate ? 1 : 0;
  aging_permille = by_estimate ? to_milli(policy.aging) : 0;
  if (policy.candidates < 1 || policy.candidates > 1024)
    throw Error(ErrorCode::kInvalidArgument, pf + ".candidates", "must be in [1, 1024]");
  if (!std::isfinite(policy.min_relative_gain) || policy.min_relative_gain < 0 || policy.min_relative_gain > 1)
    throw Error(ErrorCode::kInvalidArgument, pf + ".min_relative_gain", "must be a finite number in [0, 1]");
  if (!std::isfinite(policy.starvation_seconds) || policy.starvation_seconds <= 0 || policy.starvation_seconds > kMaxSeconds)
    throw Error(ErrorCode::kInvalidArgument, pf + ".starvation_seconds", "must be a finite number in (0, 1e9]");
  starvation_ns = to_ns(policy.starvation_seconds);

  // Validate the policy's bin options; then every node's bins, partition by partition.
  switch (row.rules.bins) {
    case BinLayout::kNodes:
      partitions.resize(1);
      break;
    case BinLayout::kTrajectorySlots: {
      bool has_cpu = false;
      for (std::int32_t k = 0; k < K; ++k) has_cpu = has_cpu || inv.kinds[k] == "cpu";
      if (!has_cpu) throw Error(ErrorCode::kUnknownName, pf, "the trajectory policy needs a 'cpu' kind");
      if (policy.trajectory_slot_cpu <= 0 || policy.trajectory_slot_cpu > kMaxMilli)
        throw Error(ErrorCode::kInvalidArgument, pf + ".trajectory_slot_cpu", "must be positive");
      partitions.resize(1);
      break;
    }
    case BinLayout::kTaskPools: {
      if (policy.pools.empty()) throw Error(ErrorCode::kInvalidArgument, pf + ".pools", "the isolated policy needs at least one task pool");
      for (std::size_t p = 0; p < policy.pools.size(); ++p) {
        double w = policy.pools[p].second;
        if (!std::isfinite(w) || w <= 0 || w > 1e6)
          throw Error(ErrorCode::kInvalidArgument, pf + ".pools[" + std::to_string(p) + "].weight", "must be a finite number in (0, 1e6]");
        if (pool_partition.count(policy.pools[p].first))
          throw Error(ErrorCode::kInvalidArgument, pf + ".pools[" + std::to_string(p) + "].task", "duplicate task pool " + std::to_string(policy.pools[p].first));
        pool_partition[policy.pools[p].first] = static_cast<std::int32_t>(p);
      }
      partitions.resize(policy.pools.size());
      break;
    }
  }
  std::vector<NodeBins> splits(static_cast<std::size_t>(N));
  for (std::int32_t n = 0; n < N; ++n) splits[n] = node_bins(inv.nodes[n].capacity);
  for (std::size_t p = 0; p < partitions.size(); ++p)
    for (std::int32_t n = 0; n < N; ++n)
      for (const std::vector<Quantity>& cap : splits[n][p]) append_bin(n, static_cast<std::int32_t>(p), cap);
  starving_head_halts = partitions.size() == 1 && row.rules.bins != BinLayout::kTrajectorySlots;
  if (row.rules.bins == BinLayout::kTrajectorySlots && partitions[0].bins.empty())
    throw Error(ErrorCode::kInvalidArgument, pf + ".trajectory_slot_cpu", "larger than every node's cpu: no slot fits");
  if (uses_service_home() && has_gpus) {
    // Each service is given a home device up front, round robin over all devices, as a
    // dedicated reward pool would be.
    for (std::size_t s = 0; s < services.size(); ++s)
      services[s].home_device = static_cast<std::int32_t>(s % dev_node.size());
  }
  node_online.assign(N, 1);
  for (auto& part : partitions) {
    part.node_lo.assign(N, -1);
    part.node_hi.assign(N, -1);
  }
  build_trees();
  node_parked.resize(N);
  node_parked_count.assign(N, 0);
  node_released.assign(N, 0);
  released_leaves.resize(partitions.size());
  released_free.resize(partitions.size());
  released_first_max.assign(partitions.size(), -1);
  bin_released_at.assign(bin_node.size(), 0);
  bin_released_pass.assign(bin_node.size(), 0);
  node_contended.assign(N, 0);
  node_masked.assign(N, 0);
  partition_contended.assign(partitions.size(), 0);
  partition_masked.assign(partitions.size(), 0);
  scratch.resize(D);
}

// ============================================================ helpers

void Scheduler::Impl::refresh_leaf(std::int32_t bin) {
  Partition& part = partitions[bin_partition[bin]];
  std::int32_t leaf = bin_leaf[bin];
  if (!node_online[bin_node[bin]]) return hide_leaf(part, leaf);
  std::copy(free_of(bin), free_of(bin) + K, scratch.begin());
  if (has_gpus) scratch[K] = node_max_dev_free[bin_node[bin]];
  part.free_tree.set(leaf, scratch.data());
}

void Scheduler::Impl::refresh_node_devices(std::int32_t node) {
  Quantity best = 0;
  for (std::int32_t d = node_first_dev[node]; d < node_first_dev[node + 1]; ++d) best = std::max(best, dev_free[d]);
  if (best == node_max_dev_free[node]) return;
  if (best > node_max_dev_free[node]) ++search_epoch;  // room grew: search hints are void
  node_max_dev_free[node] = best;
  if (!node_online[node]) return;  // its leaves stay hidden
  for (auto& part : partitions) {
    if (part.node_lo[node] < 0) continue;
    for (std::int32_t leaf = part.node_lo[node]; leaf < part.node_hi[node]; ++leaf) {
      if (bin_bound[part.bins[leaf]]) continue;  // a bound trajectory slot stays hidden
      std::copy(part.free_tree.leaf(leaf), part.free_tree.leaf(leaf) + D, scratch.begin());
      scratch[K] = best;
      part.free_tree.set(leaf, scratch.data());
    }
  }
}

// (Re)builds every partition's trees and node ranges from the bins' current state: at
// construction, and when add_node appends bins (and maybe the GPU dimension).
void Scheduler::Impl::build_trees() {
  const std::int32_t N = static_cast<std::int32_t>(inv.nodes.size());
  std::vector<Quantity> v(D), hidden(D, -1);
  for (auto& part : partitions) {
    std::int32_t leaves = static_cast<std::int32_t>(part.bins.size());
    part.free_tree = BinTree(leaves, D);
    part.cap_tree = BinTree(leaves, D);
    part.node_lo.assign(N, -1);
    part.node_hi.assign(N, -1);
    for (std::int32_t leaf = 0; leaf < leaves; ++leaf) {
      std::int32_t b = part.bins[leaf];
      std::int32_t n = bin_node[b];
      if (part.node_lo[n] < 0) part.node_lo[n] = leaf;
      part.node_hi[n] = leaf + 1;
      std::copy(cap_of(b), cap_of(b) + K, v.begin());
      if (has_gpus) v[K] = node_max_dev_total[n];
      part.cap_tree.set(leaf, v.data());
      if (bin_bound[b] || !node_online[n]) {
        part.free_tree.set(leaf, hidden.data());
        continue;
      }
      std::copy(free_of(b), free_of(b) + K, v.begin());
      if (has_gpus) v[K] = node_max_dev_free[n];
      part.free_tree.set(leaf, v.data());
    }
    part.cap_tree.settle();  // capacities change only here: const searches never write
  }
}

void Scheduler::Impl::hide_leaf(Partition& part, std::int32_t leaf) {
  std::fill(scratch.begin(), scratch.end(), -1);
  part.free_tree.set(leaf, scratch.data());
}

// Offline: the node's leaves leave the free trees; nothing more is placed there. Online:
// its unbound leaves come back with their exact free vectors, and classes parked for room
// are woken as by a release on the node.
void Scheduler::Impl::set_node_online(std::int32_t node, bool online) {
  if (static_cast<bool>(node_online[node]) == online) return;
  node_online[node] = online ? 1 : 0;
  n_offline += online ? -1 : 1;
  for (auto& part : partitions) {
    if (part.node_lo[node] < 0) continue;
    for (std::int32_t leaf = part.node_lo[node]; leaf < part.node_hi[node]; ++leaf) {
      const std::int32_t b = part.bins[leaf];
      if (!online) hide_leaf(part, leaf);
      else if (!bin_bound[b]) refresh_leaf(b);
    }
  }
  if (online) release_on_node(node, kNone);
}

// A bin at the end of its partition's leaves, all of its capacity free.
void Scheduler::Impl::append_bin(std::int32_t node, std::int32_t part, const std::vector<Quantity>& cap) {
  const std::int32_t b = static_cast<std::int32_t>(bin_node.size());
  bin_node.push_back(node);
  bin_partition.push_back(part);
  bin_leaf.push_back(static_cast<std::int32_t>(partitions[part].bins.size()));
  partitions[part].bins.push_back(b);
  bin_room.insert(bin_room.end(), cap.begin(), cap.end());  // free: all of it
  bin_room.insert(bin_room.end(), cap.begin(), cap.end());
  bin_bound.push_back(0);
}

// The policy's bins for one node of `capacity` (the options already validated): per
// partition, each bin's capacity. tangram, fifo, optimus: the whole node. trajectory:
// whole slots of trajectory_slot_cpu cores, other kinds split evenly among them. isolated:
// each task pool's share, split exactly: the floor of each share in parts per million,
// then the milli-units left over spread evenly, the first pools taking one more, so the
// shares sum to the node.
Scheduler::Impl::NodeBins Scheduler::Impl::node_bins(const std::vector<Quantity>& capacity) const {
  NodeBins bins(partitions.size());
  switch (row.rules.bins) {
    case BinLayout::kNodes:
      bins[0].push_back(capacity);
      break;
    case BinLayout::kTrajectorySlots: {
      std::int32_t cpu = kNone;
      for (std::int32_t k = 0; k < K; ++k)
        if (inv.kinds[k] == "cpu") cpu = k;
      const Quantity slots = capacity[cpu] / policy.trajectory_slot_cpu;
      std::vector<Quantity> cap(K);
      for (std::int32_t k = 0; k < K; ++k)
        cap[k] = k == cpu ? policy.trajectory_slot_cpu : (slots > 0 ? capacity[k] / slots : 0);
      bins[0].assign(static_cast<std::size_t>(slots), cap);
      break;
    }
    case BinLayout::kTaskPools: {
      double total = 0;
      for (const auto& pool : policy.pools) total += pool.second;
      const std::size_t P = policy.pools.size();
      for (std::size_t p = 0; p < P; ++p) bins[p].assign(1, std::vector<Quantity>(K));
      for (std::int32_t k = 0; k < K; ++k) {
        Quantity given = 0;
        for (std::size_t p = 0; p < P; ++p) {
          const Quantity ppm = static_cast<Quantity>(std::floor(policy.pools[p].second / total * 1e6));
          const Quantity q = static_cast<Quantity>((static_cast<__int128>(capacity[k]) * ppm) / 1000000);
          bins[p][0][k] = q;
          given += q;
        }
        const Quantity left = capacity[k] - given, each = left / static_cast<Quantity>(P);
        const std::size_t extra = static_cast<std::size_t>(left % static_cast<Quantity>(P));
        for (std::size_t p = 0; p < P; ++p) bins[p][0][k] += each + (p < extra ? 1 : 0);
      }
      break;
    }
  }
  return bins;
}

// Appends a node: its bins (as the constructor makes them for the policy), its GPUs, and
// every per-node index; then rebuilds the trees. Class feasibility is recomputed (new
// capacity can only make more classes feasible).
std::int32_t Scheduler::Impl::add_node(NodeSpec spec) {
  const std::int32_t n = static_cast<std::int32_t>(inv.nodes.size());
  const NodeBins split = node_bins(spec.capacity);
  for (std::size_t p = 0; p < split.size(); ++p)
    for (const std::vector<Quantity>& cap : split[p]) append_bin(n, static_cast<std::int32_t>(p), cap);
  // devices: appended after every existing one, so global device indices stay valid
  node_first_dev[n] = static_cast<std::int32_t>(dev_node.size());
  Quantity most = 0;
  for (std::size_t g = 0; g < spec.gpus.size(); ++g) {
    dev_node.push_back(n);
    dev_local.push_back(static_cast<std::int32_t>(g));
    dev_total.push_back(spec.gpus[g].memory);
    dev_free.push_back(spec.gpus[g].memory);
    most = std::max(most, spec.gpus[g].memory);
  }
  node_first_dev.push_back(static_cast<std::int32_t>(dev_node.size()));
  node_max_dev_free.push_back(most);
  node_max_dev_total.push_back(most);
  has_gpus = !dev_node.empty();
  D = K + (has_gpus ? 1 : 0);
  scratch.assign(D, 0);
  inv.nodes.push_back(std::move(spec));
  node_online.push_back(1);
  node_parked.emplace_back();
  node_parked_count.push_back(0);
  node_released.push_back(0);
  node_contended.push_back(0);
  node_masked.push_back(0);
  for (auto& leaves : released_leaves) leaves.clear();  // leaf positions change below
  bin_released_at.assign(bin_node.size(), 0);
  bin_released_pass.assign(bin_node.size(), 0);
  build_trees();
  for (auto& cl : classes) cl.infeasible = infeasible_reason(cl);
  release_on_node(n, kNone);
  return n;
}

// Whether some online bin in [lo, hi) could ever hold the class (by capacity). Only asked
// while a node is offline: a starving action that fits nowhere online must not hold the
// online bins back for a node that may never return.
bool Scheduler::Impl::fits_online_capacity(const Class& cl, std::int32_t lo, std::int32_t hi, std::int32_t device) const {
  const Partition& part = partitions[cl.partition];
  for (std::int32_t leaf = lo; leaf < hi; ++leaf) {
    const std::int32_t b = part.bins[leaf];
    const std::int32_t n = bin_node[b];
    if (!node_online[n]) continue;
    const Quantity* cap = cap_of(b);
    bool fits = true;
    for (std::int32_t k = 0; k < K && fits; ++k) fits = cap[k] >= cl.demand[k];
    if (fits && device == kNone && cl.gpu_memory > 0) fits = node_max_dev_total[n] >= cl.gpu_memory;
    if (fits) return true;
  }
  return false;
}

// A service resident on an offline node is offloaded once none of its actions runs there
// (the caller ends those); until then its actions wait (try_head).
void Scheduler::Impl::evict_offline_services(std::vector<Decision>& out) {
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(services.size()); ++s) {
    const ServiceRec& svc = services[s];
    if (svc.device == kNone || svc.running > 0 || node_online[dev_node[svc.device]]) continue;
    const std::int32_t node = dev_node[svc.device];
    evict(s, out);
    refresh_node_devices(node);
  }
}

// Resources came back on `node` (in `partition`, or every partition when kNone): classes
// parked there may fit now.
bool Scheduler::Impl::fits_some_bin(const Class& cl, std::int32_t node) const {
  const Partition& part = partitions[cl.partition];
  for (std::int32_t leaf = part.node_lo[node]; leaf >= 0 && leaf < part.node_hi[node]; ++leaf) {
    const Quantity* f = free_of(part.bins[leaf]);
    bool fits = true;
    for (std::int32_t k = 0; k < K && fits; ++k) fits = f[k] >= cl.demand[k];
    if (fits) return true;
  }
  return false;
}

// Wakes the parked classes of `list` that `fits` says may fit now; the rest stay parked.
template <class Entry, class Fits>
void Scheduler::Impl::wake(std::vector<Entry>& list, std::int32_t scope, Fits&& fits) {
  std::size_t kept = 0;
  for (const Entry& entry : list) {
    const std::int32_t c = class_of(entry);
    Class& cl = classes[c];
    if (!cl.parked || cl.park_node != scope) continue;  // stale entry
    if (fits(cl)) unpark(c);
    else list[kept++] = entry;
  }
  list.resize(kept);
}

// Resources came back on `node` (in `partition`, or every partition when kNone). Only bins
// on that node changed, so a parked class that fits none of them still fits nowhere. Outside
// a pass the node is noted and its parked classes are looked at once per event, at the next
// pass (flush_releases); during a pass (an eviction) they are woken at once.
void Scheduler::Impl::release_on_node(std::int32_t node, std::int32_t partition) {
  if (!node_online[node]) return;  // nothing starts there; set_node_online(true) wakes
  bool noted = node_parked_count[node] > 0;
  if (in_pass) wake(node_parked[node], node, [&](const Class& cl) { return fits_some_bin(cl, node); });
  for (std::size_t p = 0; p < partitions.size(); ++p) {
    if (partition != kNone && static_cast<std::int32_t>(p) != partition) continue;
    if (partitions[p].parked_count == 0) continue;
    if (in_pass) {
      auto fits = [&](const Class& cl) { return fits_some_bin(cl, node); };
      wake(partitions[p].parked, kNone, fits);
      wake(partitions[p].parked_new, kNone, fits);
    }
    noted = true;
  }
  if (!in_pass && noted && node_released[node] != release_epoch) {
    node_released[node] = release_epoch;
    released_nodes.push_back(node);
  }
}

// Lists as pending wakes the parked classes that fit a bin of one of the nodes released
// since the last pass: those parked on such a node, and the partition-wide ones. Checking
// exactly costs a few comparisons per class and node, far less than a retry that fails.
void Scheduler::Impl::flush_releases() {
  if (released_nodes.empty()) return;
  std::sort(released_nodes.begin(), released_nodes.end());  // leaves lie in node order
  for (std::int32_t n : released_nodes) {
    if (node_parked_count[n] == 0) {  // whatever is listed is stale
      node_parked[n].clear();
      continue;
    }
    std::vector<std::int32_t>& list = node_parked[n];
    std::size_t kept = 0;
    for (std::int32_t c : list) {
      Class& cl = classes[c];
      // Stale entries go; so do repeats (a class parked again after a wake elsewhere).
      if (!cl.parked || cl.park_node != n || cl.seen_flush == release_epoch) continue;
      cl.seen_flush = release_epoch;
      list[kept++] = c;
      if (!fits_some_bin(cl, n)) continue;
      cl.pending_pass = pass_epoch;
      pending_wakes.emplace_back(cl.waiting.head(), c);
    }
    list.resize(kept);
  }
  std::sort(pending_wakes.begin(), pending_wakes.end());  // the few node-parked ones
  for (std::size_t p = 0; p < partitions.size(); ++p) {
    Partition& part = partitions[p];
    if (part.parked_count == 0) {  // whatever is listed is stale
      part.parked.clear();
      part.parked_new.clear();
      continue;
    }
    std::vector<std::int32_t>& leaves = released_leaves[p];
    leaves.clear();
    for (std::int32_t n : released_nodes)
      for (std::int32_t leaf = part.node_lo[n]; leaf >= 0 && leaf < part.node_hi[n]; ++leaf) {
        bin_released_at[part.bins[leaf]] = static_cast<std::int32_t>(leaves.size());
        bin_released_pass[part.bins[leaf]] = pass_epoch;
        leaves.push_back(leaf);
      }
    // Their free vectors as columns, and the per-kind maximum over them, which rules most
    // classes out in K comparisons.
    const std::size_t n_leaves = leaves.size();
    std::vector<Quantity>& cols = released_free[p];
    cols.resize(n_leaves * static_cast<std::size_t>(K));
    most_released.assign(K, -1);
    for (std::size_t i = 0; i < n_leaves; ++i) {
      const Quantity* f = free_of(part.bins[leaves[i]]);
      for (std::int32_t k = 0; k < K; ++k) {
        cols[static_cast<std::size_t>(k) * n_leaves + i] = f[k];
        most_released[k] = std::max(most_released[k], f[k]);
      }
    }
    released_first_max[p] = most_released[0];
    // The list in policy order: the few parked since the last flush sorted, then merged.
    std::sort(part.parked_new.begin(), part.parked_new.end());
    heads_scratch.clear();
    std::merge(part.parked.begin(), part.parked.end(), part.parked_new.begin(), part.parked_new.end(),
               std::back_inserter(heads_scratch));
    part.parked_new.clear();
    part.parked.swap(heads_scratch);
    const std::size_t node_wakes = pending_wakes.size();
    std::size_t kept = 0;
    for (const ClassHead entry : part.parked) {
      Class& cl = classes[entry.cls];
      // Stale entries go; so do repeats (parked again under the same head since).
      if (!cl.parked || cl.park_node != kNone || cl.waiting.head().seq != entry.seq ||
          cl.seen_flush == release_epoch)
        continue;
      cl.seen_flush = release_epoch;
      part.parked[kept++] = entry;
      bool may_fit = true;
      for (std::int32_t k = 0; k < K && may_fit; ++k) may_fit = cl.demand[k] <= most_released[k];
      const std::int32_t at = may_fit ? first_released_fit(p, 0, cl.demand) : -1;
      if (at < 0) continue;
      cl.fit_pass = pass_epoch;  // flush runs at the start of the pass
      cl.fit_from = at;
      cl.pending_pass = pass_epoch;
      pending_wakes.push_back(entry);  // in policy order, like the list
    }
    part.parked.resize(kept);
    // Merge this partition's wakes (in order) into those before them (in order).
    if (node_wakes > 0 && node_wakes < pending_wakes.size()) {
      heads_scratch.clear();
      std::merge(pending_wakes.begin(), pending_wakes.begin() + static_cast<std::ptrdiff_t>(node_wakes),
                 pending_wakes.begin() + static_cast<std::ptrdiff_t>(node_wakes), pending_wakes.end(),
                 std::back_inserter(heads_scratch));
      pending_wakes.swap(heads_scratch);
    }
  }
  released_nodes.clear();
  ++release_epoch;
}

// Whether try_head could start the head of a parkable class (no service, no GPU memory,
// not starving) at this point of the pass; false only when it surely could not. With no
// mask set, that is: some bin it may use covers its demand. Released leaves are all a
// class woken by this pass's releases can use; a class confined to a node checks the
// node's bins. Under a mask or a blocked quota the full try decides.
bool Scheduler::Impl::may_start_now(Class& cl) {
  if (any_mask || (cl.quota != kNone && quota_blocked[cl.quota])) return true;
  const std::int32_t node = cl.parked ? cl.park_node : scope_node(cl);
  if (node != kNone) return fits_some_bin(cl, node);
  return cl.fit_pass == pass_epoch ? fits_released_leaf(cl) : true;
}

// Does a released leaf from the class's `fit_from` on still hold its head? The same test as
// try_head's placement for a class woken by this pass's releases, with no masks set.
bool Scheduler::Impl::fits_released_leaf(Class& cl) {
  const Partition& part = partitions[cl.partition];
  const std::vector<std::int32_t>& leaves = released_leaves[cl.partition];
  const Quantity* demand = cl.demand;
  for (std::int32_t i = first_released_fit(cl.partition, cl.fit_from, demand); i >= 0;
       i = first_released_fit(cl.partition, i + 1, demand)) {
    const std::int32_t bin = part.bins[leaves[i]];
    if (bin_bound[bin] || !node_online[bin_node[bin]]) continue;
    if (has_gpus && node_max_dev_free[bin_node[bin]] < cl.gpu_memory) continue;
    cl.fit_from = i;
    return true;
  }
  cl.fit_from = static_cast<std::int32_t>(leaves.size());
  return false;
}


void Scheduler::Impl::park(std::int32_t c, std::int32_t node) {
  Class& cl = classes[c];
  deactivate(c);
  cl.parked = true;
  cl.park_node = node;
  cl.fit_pass = 0;
  cl.pending_pass = 0;
  cl.park_deadline = cl.waiting.head().submit_ns + starvation_ns;
  park_deadlines.push_back(ParkDeadline{cl.park_deadline, c, ++cl.park_generation});
  std::push_heap(park_deadlines.begin(), park_deadlines.end(), std::greater<>());
  if (node == kNone) {
    partitions[cl.partition].parked_new.emplace_back(cl.waiting.head(), c);
    ++partitions[cl.partition].parked_count;
  } else {
    node_parked[node].push_back(c);
    ++node_parked_count[node];
  }
}

void Scheduler::Impl::unpark(std::int32_t c) {
  Class& cl = classes[c];
  leave_park(cl);
  activate(c);
  // Woken mid-pass behind the cursor: this pass has passed it by, as it would have passed
  // by a failed head, so it still waits there.
  if (pass_cursor != nullptr && cl.waiting.head() < *pass_cursor) {
    if (cl.park_node == kNone) partition_contended[cl.partition] = pass_epoch;
    else node_contended[cl.park_node] = pass_epoch;
  }
}

// unpark() for a class whose head is tried at once: its active entry is returned rather
// than pushed (the caller takes it as if popped from the heap).
Scheduler::Impl::ActiveEntry Scheduler::Impl::unpark_for_try(std::int32_t c) {
  leave_park(classes[c]);
  return make_active(c);
}

void Scheduler::Impl::activate(std::int32_t c) {
  const Class& cl = classes[c];
  if (cl.in_active || cl.parked || cl.waiting.empty()) return;
  push_active(make_active(c));
}

void Scheduler::Impl::deactivate(std::int32_t c) {
  Class& cl = classes[c];
  if (!cl.in_active) return;
  cl.in_active = false;  // its heap entry is now stale
  --active_count;
}

Quantity Scheduler::Impl::minimum(const ActionRec& a) const {
  return a.elastic_kind == kNone ? kMilli : classes[a.cls].demand[a.elastic_kind];
}

double Scheduler::Impl::seconds(std::int32_t slot, Quantity units) const {
  const ActionRec& a = slots[slot];
  const ElasticityModel& model = details[slot].model;
  if (a.elastic_kind == kNone) return model_seconds(model, kMilli, kMilli, tables);
  return model_seconds(model, units, classes[a.cls].demand[a.elastic_kind], tables);
}

// ============================================================ submit

void Scheduler::Impl::validate_now(TimeNs t) const {
  if (t < 0 || t > to_ns(kMaxSeconds)) throw Error(ErrorCode::kInvalidArgument, "now", "must be in [0, 1e9] seconds");
  if (t < now)
    throw Error(ErrorCode::kInvalidArgument, "now", "time went backwards (" + std::to_string(to_seconds(t)) + " s < " + std::to_string(to_seconds(now)) + " s)");
}

// `field()` names the action ("actions[3]"); it is only called to build an error.
template <class Field>
void Scheduler::Impl::validate_spec(const ActionSpec& s, const Field& field) const {
  auto bad = [&](const std::string& name, const std::string& why) { throw Error(ErrorCode::kInvalidArgument, field() + "." + name, why); };
  if (static_cast<std::int32_t>(s.demand.size()) != K)
    bad("demand", "has " + std::to_string(s.demand.size()) + " entries for " + std::to_string(K) + " kinds");
  for (std::int32_t k = 0; k < K; ++k)
    if (s.demand[k] < 0 || s.demand[k] > kMaxMilli) bad("demand." + inv.kinds[k], "must be in [0, 1e12] units");
  if (s.gpu_memory < 0 || s.gpu_memory > kMaxMilli) bad("gpu_memory", "must be in [0, 1e12] MiB");
  if (s.gpu_memory > 0 && !has_gpus && s.service == kNone) bad("gpu_memory", "the inventory has no GPU");
  if (s.elastic_kind != kNone) {
    if (s.elastic_kind < 0 || s.elastic_kind >= K) bad("elastic_kind", "no kind with index " + std::to_string(s.elastic_kind));
    Quantity lo = s.demand[s.elastic_kind];
    if (lo <= 0) bad("demand." + inv.kinds[s.elastic_kind], "the elastic kind needs a positive minimum");
    if (s.elastic_max < lo) bad("elastic_max", "the elastic upper bound is below the minimum demand");
    if (s.elastic_max > kMaxMilli) bad("elastic_max", "must be at most 1e12 units");
  }
  const ElasticityModel& m = s.model;
  switch (m.kind) {
    case ModelKind::kConstant:
    case ModelKind::kAmdahl:
      if (!std::isfinite(m.seconds) || m.seconds < 0 || m.seconds > kMaxSeconds) bad("model.seconds", "must be a finite number in [0, 1e9]");
      if (m.kind == ModelKind::kAmdahl && !(m.parallel_fraction >= 0 && m.parallel_fraction <= 1))
        bad("model.parallel_fraction", "must be in [0, 1]");
      break;
    case ModelKind::kTable:
      if (m.table < 0 || m.table >= static_cast<std::int32_t>(tables.size())) bad("model.table", "no table with id " + std::to_string(m.table));
      break;
    case ModelKind::kCallback:
      if (m.callback == nullptr) bad("model.callback", "is null");
      break;
    default:
      bad("model.kind", "unknown model kind");
  }
  if (s.affinity_node != kNone && (s.affinity_node < 0 || s.affinity_node >= static_cast<std::int32_t>(inv.nodes.size())))
    throw Error(ErrorCode::kUnknownName, field() + ".affinity_node", "no node with index " + std::to_string(s.affinity_node));
  if (s.service != kNone) {
    if (s.service < 0 || s.service >= static_cast<std::int32_t>(services.size()))
      throw Error(ErrorCode::kUnknownName, field() + ".service", "no service with index " + std::to_string(s.service));
    if (s.affinity_node != kNone) bad("affinity_node", "cannot be combined with a service: actions run where their service is resident");
  }
  if (s.quota != kNone && (s.quota < 0 || s.quota >= static_cast<std::int32_t>(quotas.size())))
    throw Error(ErrorCode::kUnknownName, field() + ".quota", "no quota with index " + std::to_string(s.quota));
  if (s.tokens < 0 || s.tokens > static_cast<std::int64_t>(kMaxBaseUnits)) bad("tokens", "must be in [0, 1e12]");
  if (s.tokens > 0 && s.quota == kNone) bad("tokens", "tokens need a quota to draw from");
  if (row.rules.bins == BinLayout::kTaskPools && !pool_partition.count(s.task))
    throw Error(ErrorCode::kUnknownName, field() + ".task", "no task pool " + std::to_string(s.task) + " in the isolated policy");
  // The model must give a usable run time at the minimum grant.
  Quantity lo = s.elastic_kind == kNone ? kMilli : s.demand[s.elastic_kind];
  double t = model_seconds(m, lo, lo, tables);
  if (!std::isfinite(t) || t < 0 || t > kMaxSeconds) bad("model", "run time at the minimum grant is not a finite number in [0, 1e9] s");
}

std::int32_t Scheduler::Impl::class_for(const ActionSpec& s) {
  std::int32_t partition = row.rules.bins == BinLayout::kTaskPools ? pool_partition.at(s.task) : 0;
  const bool in_slot = row.rules.bins == BinLayout::kTrajectorySlots && s.service == kNone;
  TrajectoryId traj = in_slot ? s.trajectory : 0;
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::int64_t x) { h ^= static_cast<std::uint64_t>(x) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
  for (Quantity q : s.demand) mix(q);
  mix(s.gpu_memory);
  mix(partition);
  mix(s.affinity_node);
  mix(s.service);
  mix(s.quota);
  mix(s.tokens);
  mix(static_cast<std::int64_t>(traj));
  mix(in_slot ? 1 : 0);
  const std::int32_t* found = class_index.find(h);
  const std::int32_t chain = found == nullptr ? kNone : *found;
  for (std::int32_t c = chain; c != kNone; c = classes[c].next_same_hash) {
    const Class& o = classes[c];
    if (std::equal(s.demand.begin(), s.demand.end(), o.demand) && o.gpu_memory == s.gpu_memory && o.partition == partition &&
        o.affinity_node == s.affinity_node && o.service == s.service && o.quota == s.quota &&
        o.tokens == s.tokens && o.trajectory == traj && o.in_trajectory_slot == in_slot)
      return c;
  }
  Class c;
  c.next_same_hash = chain;
  c.key_hash = h;
  std::int32_t id;
  if (free_classes.empty()) {
    id = static_cast<std::int32_t>(classes.size());
    c.demand = store_demand(s.demand);
  } else {
    id = free_classes.back();
    free_classes.pop_back();
    const Class& old = classes[id];
    // Stale heap and deadline entries may still name this slot: its generations go on
    // from where they were, so those entries stay stale. Its demand row is reused.
    c.active_gen = old.active_gen;
    c.park_generation = old.park_generation;
    Quantity* row = const_cast<Quantity*>(old.demand);  // a row of demand_rows, owned here
    std::copy(s.demand.begin(), s.demand.end(), row);
    c.demand = row;
  }
  c.gpu_memory = s.gpu_memory;
  c.partition = partition;
  c.affinity_node = s.affinity_node;
  c.service = s.service;
  c.quota = s.quota;
  c.tokens = s.tokens;
  c.trajectory = traj;
  c.in_trajectory_slot = in_slot;
  if (id == static_cast<std::int32_t>(classes.size())) classes.push_back(std::move(c));
  else classes[id] = std::move(c);
  *class_index.insert(h, id).first = id;  // the chain's new head
  if (in_slot) trajectory_classes[traj].push_back(id);
  // Feasibility depends only on capacities and the class: decided once, here.
  classes[id].infeasible = infeasible_reason(classes[id]);
  return id;
}

// An empty class (neither active nor parked) leaves its hash chain; its slot is reused.
void Scheduler::Impl::free_class(std::int32_t c) {
  Class& cl = classes[c];
  std::int32_t* head = class_index.find(cl.key_hash);
  if (*head == c) {
    if (cl.next_same_hash == kNone) class_index.erase(cl.key_hash);
    else *head = cl.next_same_hash;
  } else {
    std::int32_t p = *head;
    while (classes[p].next_same_hash != c) p = classes[p].next_same_hash;
    classes[p].next_same_hash = cl.next_same_hash;
  }
  cl.next_same_hash = kNone;
  cl.infeasible.clear();
  free_classes.push_back(c);
}

// Why no action of this class can ever run, or "" if one could.
std::string Scheduler::Impl::infeasible_reason(const Class& c) const {
  const Partition& part = partitions[c.partition];
  if (c.service == kNone && c.quota == kNone && c.affinity_node != kNone && part.node_lo[c.affinity_node] >= 0) {
    // The common case, an action pinned to its trajectory's node: a new class per
    // trajectory, so look at the node's few bins directly (the search below gives the
    // same answer, and the words when none fits).
    for (std::int32_t leaf = part.node_lo[c.affinity_node]; leaf < part.node_hi[c.affinity_node]; ++leaf) {
      const Quantity* cap = part.cap_tree.leaf(leaf);
      bool fits = !has_gpus || cap[K] >= c.gpu_memory;
      for (std::int32_t k = 0; k < K && fits; ++k) fits = cap[k] >= c.demand[k];
      if (fits) return "";
    }
  }
  std::vector<Quantity> need(c.demand, c.demand + K);
  if (has_gpus) need.push_back(c.service == kNone ? c.gpu_memory : 0);
  auto describe_shortfall = [&](std::int32_t lo, std::int32_t hi, const char* where) {
    std::ostringstream os;
    os << "demand does not fit " << where << ":";
    std::vector<Quantity> best(D, 0);
    for (std::int32_t leaf = lo; leaf < hi; ++leaf)
      for (std::int32_t d = 0; d < D; ++d) best[d] = std::max(best[d], part.cap_tree.leaf(leaf)[d]);
    for (std::int32_t d = 0; d < D; ++d)
      if (need[d] > best[d])
        os << " " << (d < K ? inv.kinds[d] : std::string("gpu_memory")) << " needs " << need[d] / 1000.0 << ", largest is " << best[d] / 1000.0 << ";";
    std::string s = os.str();
    if (!s.empty() && s.back() == ';') s.pop_back();
    return s;
  };
  if (c.quota != kNone && !quotas[c.quota].tokens_fit(c.tokens))
    return "needs " + std::to_string(c.tokens) + " tokens, more than quota '" + inv.quotas[c.quota].name + "' grants per minute";
  std::vector<std::int32_t> found;
  auto no_skip = [](std::int32_t) { return false; };
  if (c.service != kNone) {
    const ServiceSpec& spec = inv.services[c.service];
    const ServiceRec& rec = services[c.service];
    std::int32_t dlo = rec.home_device != kNone ? rec.home_device : 0;
    std::int32_t dhi = rec.home_device != kNone ? rec.home_device + 1 : static_cast<std::int32_t>(dev_node.size());
    for (std::int32_t d = dlo; d < dhi; ++d) {
      if (dev_total[d] < spec.memory + c.gpu_memory) continue;
      std::int32_t n = dev_node[d];
      if (part.node_lo[n] < 0) continue;
      found.clear();
      part.cap_tree.find(part.node_lo[n], part.node_hi[n], need.data(), 1, no_skip, found);
      if (!found.empty()) return "";
    }
    std::ostringstream os;
    os << "service '" << spec.name << "' needs " << (spec.memory + c.gpu_memory) / 1000.0
       << " MiB of GPU memory with the action's demand on the same node, and no "
       << (rec.home_device != kNone ? "home device" : "device") << " has that";
    return os.str();
  }
  std::int32_t lo = 0, hi = part.free_tree.leaves();
  const char* where = "on any node";
  if (c.affinity_node != kNone) {
    lo = part.node_lo[c.affinity_node];
    hi = part.node_hi[c.affinity_node];
    where = "on its affinity node";
    if (lo < 0) return "its affinity node has no bin in this policy";
  }
  found.clear();
  part.cap_tree.find(lo, hi, need.data(), 1, no_skip, found);
  if (!found.empty()) return "";
  return describe_shortfall(lo, hi, where);
}

void Scheduler::Impl::submit(const ActionSpec* a, std::size_t n, TimeNs t, std::vector<Decision>& out) {
  // Validate the whole batch before touching anything (the clock included). Each id goes
  // into the index as it is checked, marked kBatchSlot, so one probe finds both a live
  // duplicate and a repeat within the batch; on any error the batch's ids come out again.
  std::size_t repeat = SIZE_MAX;  // the first position whose id came earlier in the batch
  std::size_t i = 0;
  by_id.reserve(by_id.size() + n);  // one rehash for a burst, not one per doubling
  try {
    for (; i < n; ++i) {
      auto field = [i] { return "actions[" + std::to_string(i) + "]"; };
      auto [slot, inserted] = by_id.insert(a[i].id, kBatchSlot);
      if (!inserted && *slot != kBatchSlot) {
        throw Error(ErrorCode::kDuplicateId, field() + ".id", "action " + std::to_string(a[i].id) + " is already live");
      }
      if (!inserted) repeat = std::min(repeat, i);
      validate_spec(a[i], field);
    }
    if (repeat != SIZE_MAX)
      throw Error(ErrorCode::kDuplicateId, "actions[" + std::to_string(repeat) + "].id",
                  "action " + std::to_string(a[repeat].id) + " appears twice in the batch");
  } catch (...) {
    // Positions before i hold batch ids only (a live duplicate throws at once); position
    // i's id is the batch's too unless it was the live duplicate.
    for (std::size_t j = 0; j <= i && j < n; ++j) {
      const std::int32_t* slot = by_id.find(a[j].id);
      if (slot != nullptr && *slot == kBatchSlot) by_id.erase(a[j].id);
    }
    throw;
  }
  messages.clear();
  now = t;
  if (free_slots.size() < n) {
    // Grow once for a burst rather than once per doubling (and still geometrically, so a
    // stream of single submits does not reallocate each time).
    const std::size_t need = slots.size() + (n - free_slots.size());
    if (need > slots.capacity()) slots.reserve(std::max(need, 2 * slots.capacity()));
    if (need > details.capacity()) details.reserve(slots.capacity());
    if (need > queue_pos.capacity()) queue_pos.reserve(slots.capacity());
  }
  // The aging term of the order key is the same for the whole batch.
  const std::int64_t aging_offset = static_cast<std::int64_t>((static_cast<__int128>(now) * aging_permille) / 1000);
  for (std::size_t i = 0; i < n; ++i) {
    const ActionSpec& s = a[i];
    std::int32_t c = class_for(s);
    const std::string& why = classes[c].infeasible;
    if (!why.empty()) {
      by_id.erase(s.id);
      Decision d;
      d.kind = DecisionKind::kReject;
      d.action = s.id;
      d.time = now;
      d.reason = static_cast<std::int32_t>(messages.size());
      messages.push_back("action " + std::to_string(s.id) + " can never run: " + why);
      out.push_back(d);
      continue;
    }
    std::int32_t slot;
    if (!free_slots.empty()) {
      slot = free_slots.back();
      free_slots.pop_back();
    } else {
      slot = static_cast<std::int32_t>(slots.size());
      slots.emplace_back();
      details.emplace_back();
      queue_pos.push_back(-1);
    }
    ActionRec& r = slots[slot];
    ActionDetail& detail = details[slot];
    r = ActionRec{};
    r.id = s.id;
    r.trajectory = s.trajectory;
    r.cls = c;
    r.state = ActionState::kWaiting;
    r.elastic_kind = s.elastic_kind;
    r.elastic_max = s.elastic_max;
    detail = ActionDetail{};
    detail.model = s.model;
    detail.est_ns = to_ns(seconds(slot, minimum(r)));
    const std::int64_t key = detail.est_ns * estimate_weight + aging_offset;
    detail.order = OrderKey{key, next_seq++, now, -s.priority, slot};
    *by_id.find(s.id) = slot;
    ++*trajectory_live.insert(s.trajectory, 0).first;
    ++n_waiting;
    Class& cl = classes[c];
    if (cl.service != kNone) {
      services[cl.service].waiting += 1;
      services[cl.service].queued_ns += detail.est_ns;
    }
    bool new_head = cl.waiting.empty() || detail.order < cl.waiting.head();
    if (new_head) deactivate(c);
    cl.waiting.push(detail.order, queue_pos);
    if (new_head && !cl.parked) activate(c);
    // Parked across the partition: listed again under its new head (the old entry is stale).
    if (new_head && cl.parked && cl.park_node == kNone) partitions[cl.partition].parked_new.emplace_back(cl.waiting.head(), c);
  }
}

void Scheduler::Impl::finish(std::int32_t slot) {
  ActionRec& r = slots[slot];
  Class& cl = classes[r.cls];
  Quantity* f = free_of(r.bin);
  for (std::int32_t k = 0; k < K; ++k) f[k] += cl.demand[k];
  if (r.elastic_kind != kNone) f[r.elastic_kind] += r.grant - cl.demand[r.elastic_kind];
  std::int32_t node = bin_node[r.bin];
  const bool frees_gpu_memory = r.device != kNone && cl.gpu_memory > 0;
  if (frees_gpu_memory) {
    dev_free[r.device] += cl.gpu_memory;
    refresh_node_devices(node);
  }
  // A trajectory slot stays bound (hidden from the free tree) until its trajectory ends.
  if (!bin_bound[r.bin]) refresh_leaf(r.bin);
  if (cl.quota != kNone) quotas[cl.quota].release();
  if (cl.service != kNone) services[cl.service].running -= 1;
  --n_running;
  if (--*trajectory_live.find(r.trajectory) == 0) trajectory_live.erase(r.trajectory);
  by_id.erase(r.id);
  r.state = ActionState::kUnknown;
  free_slots.push_back(slot);
  // Freed GPU memory is shared by every partition on the node.
  release_on_node(node, frees_gpu_memory ? kNone : bin_partition[r.bin]);
}

void Scheduler::Impl::unqueue(std::int32_t slot) {
  ActionRec& r = slots[slot];
  Class& cl = classes[r.cls];
  bool was_head = cl.waiting.head().slot == slot;
  if (was_head) deactivate(r.cls);
  cl.waiting.erase(slot, queue_pos);
  if (was_head && cl.parked) unpark(r.cls);  // its new head may starve sooner
  else if (was_head) activate(r.cls);
  if (cl.service != kNone) {
    services[cl.service].waiting -= 1;
    services[cl.service].queued_ns -= details[slot].est_ns;
  }
  --n_waiting;
  if (--*trajectory_live.find(r.trajectory) == 0) trajectory_live.erase(r.trajectory);
  by_id.erase(r.id);
  r.state = ActionState::kUnknown;
  free_slots.push_back(slot);
}

// ============================================================ the pass

// The leaves of the class's partition it may use: [lo, hi), or one fixed leaf (a bound
// trajectory slot, hidden from the free tree). False when it has nowhere to go right now.
bool Scheduler::Impl::eligible_range(const Class& c, std::int32_t& lo, std::int32_t& hi,
                                     std::int32_t& fixed_leaf) const {
  const Partition& part = partitions[c.partition];
  fixed_leaf = kNone;
  std::int32_t node = c.affinity_node;
  if (c.service != kNone) node = dev_node[services[c.service].device];
  if (c.in_trajectory_slot) {
    auto it = trajectory_bin.find(c.trajectory);
    if (it != trajectory_bin.end()) {
      fixed_leaf = bin_leaf[it->second];
      lo = fixed_leaf;
      hi = fixed_leaf + 1;
      return true;
    }
  }
  if (node == kNone) {
    lo = 0;
    hi = part.free_tree.leaves();
    return true;
  }
  lo = part.node_lo[node];
  hi = part.node_hi[node];
  return lo >= 0;
}

// The one node a class is confined to (affinity, its service's device, its trajectory's
// slot), or kNone when it may use any bin of its partition.
std::int32_t Scheduler::Impl::scope_node(const Class& c) const {
  if (c.in_trajectory_slot) {
    auto it = trajectory_bin.find(c.trajectory);
    if (it != trajectory_bin.end()) return bin_node[it->second];
  }
  if (c.service != kNone) {
    std::int32_t d = services[c.service].device;
    return d == kNone ? kNone : dev_node[d];
  }
  return c.affinity_node;
}

Scheduler::Impl::Try Scheduler::Impl::try_head(std::int32_t c, std::vector<Decision>& out) {
  Class& cl = classes[c];
  const std::int32_t slot = cl.waiting.head().slot;
  ActionRec& a = slots[slot];
  // A start commits to the head's record and takes the head off the queue, most likely
  // cache misses: fetch them while the placement search runs.
  prefetch(&a);
  cl.waiting.prefetch_pop();
  if (cl.quota != kNone && quota_blocked[cl.quota]) {
    cl.block = quotas[cl.quota].last_block == QuotaState::Blocked::kRate ? Block::kQuotaRate
               : quotas[cl.quota].last_block == QuotaState::Blocked::kTokens ? Block::kQuotaTokens
                                                                             : Block::kQuotaConcurrency;
    cl.block_until = quotas[cl.quota].last_until;
    return Try::kWaits;
  }
  std::int32_t device = kNone;
  if (cl.service != kNone) {
    ServiceRec& svc = services[cl.service];
    if (svc.device != kNone && !node_online[dev_node[svc.device]]) {
      // Resident on an offline node: evicted once its running actions there have ended.
      cl.block = Block::kServiceNoRoom;
      return Try::kWaits;
    }
    if (svc.device != kNone && svc.ready_ns <= now && dev_total[svc.device] < inv.services[cl.service].memory + cl.gpu_memory) {
      // Its device can never hold this action beside the service: move the service once
      // its running batch is done.
      if (svc.running > 0) {
        cl.block = Block::kServiceNoRoom;
        return Try::kWaits;
      }
      const std::int32_t node = dev_node[svc.device];
      evict(cl.service, out);
      refresh_node_devices(node);
      release_on_node(node, kNone);
    }
    if (svc.device == kNone && !restore(cl.service, cl, out)) {
      cl.block = Block::kServiceNoRoom;
      return Try::kWaits;
    }
    if (svc.ready_ns > now) {
      cl.block = Block::kServiceRestoring;
      cl.block_until = svc.ready_ns;
      wakeup = std::min(wakeup, svc.ready_ns);
      return Try::kWaits;
    }
    if (svc.running >= inv.services[cl.service].max_batch) {
      cl.block = Block::kServiceBatchFull;
      return Try::kWaits;
    }
    device = svc.device;
  }
  Partition& part = partitions[cl.partition];
  std::int32_t lo, hi, fixed_leaf;
  bool has_range = eligible_range(cl, lo, hi, fixed_leaf);
  const std::int32_t node_scope = scope_node(cl);

  cand.clear();
  // A trajectory's own slot is nobody else's: a starving action elsewhere cannot claim it.
  const bool own_slot = fixed_leaf != kNone;
  bool masked = !own_slot && partition_masked[cl.partition] == pass_epoch;
  if (has_range && !masked) {
    if (fixed_leaf != kNone) {
      std::int32_t b = part.bins[fixed_leaf];
      const Quantity* f = free_of(b);
      bool fits = true;
      for (std::int32_t k = 0; k < K && fits; ++k) fits = f[k] >= cl.demand[k];
      if (fits && cl.gpu_memory > 0 && device == kNone) fits = node_max_dev_free[bin_node[b]] >= cl.gpu_memory;
      if (fits) fits = node_online[bin_node[b]] != 0;
      if (fits) cand.push_back(fixed_leaf);
    } else {
      std::copy(cl.demand, cl.demand + K, scratch.begin());
      if (has_gpus) scratch[K] = device == kNone ? cl.gpu_memory : 0;
      auto skip = [&](std::int32_t leaf) { return any_mask && node_masked[bin_node[part.bins[leaf]]] == pass_epoch; };
      if (cl.fit_pass == pass_epoch && lo == 0 && hi == part.free_tree.leaves()) {
        // Woken by this pass's releases: only released leaves can hold it (see Class).
        const std::vector<std::int32_t>& leaves = released_leaves[cl.partition];
        const std::int32_t first = first_released_fit(cl.partition, cl.fit_from, cl.demand);
        // Leaves before `first` do not fit now, and room only shrinks in a pass: later
        // heads of this class start their scan there.
        cl.fit_from = first < 0 ? static_cast<std::int32_t>(leaves.size()) : first;
        for (std::int32_t i = first; i >= 0; i = first_released_fit(cl.partition, i + 1, cl.demand)) {
          const std::int32_t leaf = leaves[i];
          if (bin_bound[part.bins[leaf]] || !node_online[bin_node[part.bins[leaf]]] || skip(leaf)) continue;
          if (has_gpus && node_max_dev_free[bin_node[part.bins[leaf]]] < scratch[K]) continue;
          cand.push_back(leaf);
          if (static_cast<std::int32_t>(cand.size()) == policy.candidates) break;
        }
      } else if (lo == 0 && hi == part.free_tree.leaves()) {
        // Its heads are tried again and again in one pass: each search starts where the
        // last one found its first fit, past the leaves filled up since the pass began.
        const std::int32_t from = cl.tree_epoch == search_epoch ? cl.tree_from : 0;
        part.free_tree.find(from, hi, scratch.data(), policy.candidates, skip, cand);
        cl.tree_epoch = search_epoch;
        cl.tree_from = cand.empty() ? hi : cand[0];
      } else {
        part.free_tree.find(lo, hi, scratch.data(), policy.candidates, skip, cand);
      }
    }
  }
  if (!cand.empty() && device != kNone && dev_free[device] < cl.gpu_memory) cand.clear();
  // GPU memory held by resident services is reclaimed for an action that needs it.
  if (cand.empty() && cl.gpu_memory > 0 && has_range && !masked && make_gpu_room(cl, lo, hi, fixed_leaf, device, out))
    return try_head(c, out);
  if (cand.empty()) {
    bool held = masked || (!own_slot && node_scope != kNone && node_masked[node_scope] == pass_epoch);
    cl.block = held ? Block::kHeldBack : Block::kResources;
    // While a node is offline, an action that fits no online node's capacity holds nothing
    // back (it waits for the node, or for a new one, parked like any other).
    if (!own_slot && now - cl.waiting.head().submit_ns >= starvation_ns &&
        (n_offline == 0 || (has_range && fits_online_capacity(cl, lo, hi, device)))) {
      // A starving action keeps everything behind it off the bins it could use. Under
      // kTrajectory those are the free slots only, so the pass goes on for bound ones.
      if (node_scope == kNone) {
        partition_masked[cl.partition] = pass_epoch;
        if (starving_head_halts) return Try::kHalt;
      } else {
        node_masked[node_scope] = pass_epoch;
      }
      any_mask = true;
      return Try::kBlocked;
    }
    // Parking waits for a release; GPU classes are looked at every pass instead, since
    // memory also frees when a cached service turns idle.
    if (!any_mask && cl.service == kNone && cl.gpu_memory == 0) return Try::kParked;
    return Try::kBlocked;
  }
  if (cl.quota != kNone) {
    QuotaState& q = quotas[cl.quota];
    if (!q.admits(now, cl.tokens)) {
      quota_blocked[cl.quota] = 1;
      cl.block = q.last_block == QuotaState::Blocked::kRate ? Block::kQuotaRate
                 : q.last_block == QuotaState::Blocked::kTokens ? Block::kQuotaTokens
                                                                : Block::kQuotaConcurrency;
      cl.block_until = q.last_until;
      if (q.last_until != kNever) wakeup = std::min(wakeup, q.last_until);
      return Try::kWaits;
    }
    q.take(now, cl.tokens);
  }
  // Best fit among the candidates: least normalised room left over; first on ties.
  std::int32_t best_leaf = cand[0];
  if (cand.size() > 1) {
    std::int64_t best_score = INT64_MAX;
    for (std::int32_t leaf : cand) {
      std::int32_t b = part.bins[leaf];
      const Quantity* f = free_of(b);
      const Quantity* cap = cap_of(b);
      std::int64_t score = 0;
      for (std::int32_t k = 0; k < K; ++k)
        if (cap[k] > 0) score += ((f[k] - cl.demand[k]) * 1024) / cap[k];
      if (score < best_score) {
        best_score = score;
        best_leaf = leaf;
      }
    }
  }
  const std::int32_t bin = part.bins[best_leaf];
  const std::int32_t node = bin_node[bin];
  if (device == kNone && cl.gpu_memory > 0) {
    Quantity best_left = INT64_MAX;
    for (std::int32_t d = node_first_dev[node]; d < node_first_dev[node + 1]; ++d)
      if (dev_free[d] >= cl.gpu_memory && dev_free[d] - cl.gpu_memory < best_left) {
        best_left = dev_free[d] - cl.gpu_memory;
        device = d;
      }
  }
  // Commit.
  Quantity* f = free_of(bin);
  for (std::int32_t k = 0; k < K; ++k) f[k] -= cl.demand[k];
  a.grant = a.elastic_kind == kNone ? 0 : cl.demand[a.elastic_kind];
  if (a.elastic_kind != kNone && cl.in_trajectory_slot) {
    // The trajectory's slot is all its own: the action gets all of it, up to its bound.
    Quantity extra = std::min(f[a.elastic_kind], a.elastic_max - a.grant);
    a.grant += extra;
    f[a.elastic_kind] -= extra;
  }
  if (bin_released_pass[bin] == pass_epoch) {  // keep the released columns exact
    const std::int32_t p = bin_partition[bin];
    std::vector<Quantity>& cols = released_free[p];
    const std::size_t n_leaves = released_leaves[p].size();
    const Quantity was = cols[bin_released_at[bin]];
    for (std::int32_t k = 0; k < K; ++k) cols[static_cast<std::size_t>(k) * n_leaves + bin_released_at[bin]] = f[k];
    if (was == released_first_max[p] && f[0] < was)  // it held the maximum: find the new one
      released_first_max[p] = *std::max_element(cols.begin(), cols.begin() + static_cast<std::ptrdiff_t>(n_leaves));
  }
  if (cl.gpu_memory > 0) {
    dev_free[device] -= cl.gpu_memory;
    refresh_node_devices(node);
  }
  if (cl.in_trajectory_slot && fixed_leaf == kNone) {
    trajectory_bin[cl.trajectory] = bin;
    bin_bound[bin] = 1;
    std::vector<Quantity> hidden(D, -1);
    part.free_tree.set(best_leaf, hidden.data());
  } else if (!bin_bound[bin]) {
    refresh_leaf(bin);
  }
  if (cl.service != kNone) {
    services[cl.service].running += 1;
    services[cl.service].waiting -= 1;
    services[cl.service].queued_ns -= details[slot].est_ns;
  }
  deactivate(c);
  cl.waiting.pop(queue_pos);
  // The class's next head would be tried later in this pass, where room only shrinks: if
  // it surely cannot start now, it parks now, as that try would park it.
  if (!cl.waiting.empty() && cl.service == kNone && cl.gpu_memory == 0 &&
      now - cl.waiting.head().submit_ns < starvation_ns && !may_start_now(cl)) {
    cl.block = Block::kResources;
    const std::int32_t next_scope = scope_node(cl);  // its trajectory's slot may be bound now
    if (next_scope == kNone) partition_contended[cl.partition] = pass_epoch;
    else node_contended[next_scope] = pass_epoch;
    park(c, next_scope);
  } else {
    activate(c);
  }
  a.state = ActionState::kRunning;
  a.bin = bin;
  a.device = device;
  a.start_ns = now;
  --n_waiting;
  ++n_running;
  Decision d;
  d.kind = DecisionKind::kStart;
  d.action = a.id;
  d.node = node;
  d.device = device == kNone ? kNone : dev_local[device];
  d.service = cl.service;
  d.elastic_kind = a.elastic_kind;
  d.grant = a.grant;
  d.time = now;
  started.push_back(slot);
  started_decision.push_back(out.size());
  out.push_back(d);
  return Try::kStarted;
}

// Greedy eviction plan for `need` milli-MiB on device d: never a service with running
// actions, still restoring or ready only since the last pass (nor `keep`); idle ones (nothing waiting) first, then the
// least queued work per unit of restore cost, then service order.
Scheduler::Impl::RoomPlan Scheduler::Impl::plan_room(std::int32_t d, Quantity need, std::int32_t keep) const {
  RoomPlan plan;
  Quantity room = dev_free[d];
  if (room >= need) {
    plan.ok = true;
    return plan;
  }
  std::vector<std::int32_t> cands;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(services.size()); ++s) {
    const ServiceRec& o = services[s];
    // A service that became ready since the last pass gets that pass for its waiting
    // actions before it may be evicted: otherwise a restore can be undone unused.
    if (s != keep && o.device == d && o.running == 0 && o.ready_ns <= prev_pass_now) cands.push_back(s);
  }
  std::sort(cands.begin(), cands.end(), [&](std::int32_t x, std::int32_t y) {
    const ServiceRec& a = services[x];
    const ServiceRec& b = services[y];
    bool ia = a.waiting == 0, ib = b.waiting == 0;
    if (ia != ib) return ia;
    __int128 lhs = static_cast<__int128>(a.queued_ns) * std::max<TimeNs>(b.restore_ns, 1);
    __int128 rhs = static_cast<__int128>(b.queued_ns) * std::max<TimeNs>(a.restore_ns, 1);
    if (lhs != rhs) return lhs < rhs;
    return x < y;
  });
  for (std::size_t i = 0; i < cands.size() && room < need; ++i) {
    const ServiceRec& o = services[cands[i]];
    room += inv.services[cands[i]].memory;
    plan.busy += o.waiting > 0 ? 1 : 0;
    plan.queued += o.queued_ns;
    plan.victims.push_back(cands[i]);
  }
  plan.ok = room >= need;
  return plan;
}

void Scheduler::Impl::evict(std::int32_t v, std::vector<Decision>& out) {
  const std::int32_t d = services[v].device;
  services[v].device = kNone;
  dev_free[d] += inv.services[v].memory;
  Decision e;
  e.kind = DecisionKind::kEvict;
  e.service = v;
  e.node = dev_node[d];
  e.device = dev_local[d];
  e.time = now;
  out.push_back(e);
}

// Makes `svc_id` resident (or restoring) somewhere, evicting greedily (plan_room).
// Emits the evict and restore decisions; false when no device can make room now.
bool Scheduler::Impl::restore(std::int32_t svc_id, const Class& head, std::vector<Decision>& out) {
  ServiceRec& svc = services[svc_id];
  const Quantity need = inv.services[svc_id].memory;
  const Partition& part = partitions[head.partition];
  std::int32_t dlo = svc.home_device != kNone ? svc.home_device : 0;
  std::int32_t dhi = svc.home_device != kNone ? svc.home_device + 1 : static_cast<std::int32_t>(dev_node.size());
  std::vector<std::int32_t> found;
  auto no_skip = [](std::int32_t) { return false; };
  std::vector<Quantity> demand(head.demand, head.demand + K);
  if (has_gpus) demand.push_back(0);
  auto usable = [&](std::int32_t d) {
    if (dev_total[d] < need + head.gpu_memory) return false;
    std::int32_t n = dev_node[d];
    if (!node_online[n]) return false;
    if (part.node_lo[n] < 0) return false;
    found.clear();
    part.cap_tree.find(part.node_lo[n], part.node_hi[n], demand.data(), 1, no_skip, found);
    return !found.empty();
  };
  // Prefer devices whose node has room for the waiting action right now.
  auto busy_node = [&](std::int32_t d) -> std::int64_t {
    std::int32_t n = dev_node[d];
    found.clear();
    part.free_tree.find(part.node_lo[n], part.node_hi[n], demand.data(), 1, no_skip, found);
    return found.empty() ? 1 : 0;
  };
  // 1. A device with room already: best fit. 2. Else the cheapest eviction plan.
  std::int32_t target = kNone;
  std::pair<std::int64_t, Quantity> best_fit{2, 0};
  for (std::int32_t d = dlo; d < dhi; ++d)
    if (dev_free[d] >= need && usable(d)) {
      std::pair<std::int64_t, Quantity> fit{busy_node(d), dev_free[d] - need};
      if (fit < best_fit) {
        best_fit = fit;
        target = d;
      }
    }
  RoomPlan chosen;
  if (target == kNone) {
    std::tuple<std::int64_t, std::int64_t, std::int64_t, std::size_t, std::int32_t> best{INT64_MAX, 0, 0, 0, 0};
    for (std::int32_t d = dlo; d < dhi; ++d) {
      if (!usable(d)) continue;
      RoomPlan plan = plan_room(d, need, svc_id);
      if (!plan.ok) continue;
      auto cost = std::make_tuple(busy_node(d), plan.busy, plan.queued, plan.victims.size(), d);
      if (cost < best) {
        best = cost;
        target = d;
        chosen = std::move(plan);
      }
    }
    if (target == kNone) return false;
    for (std::int32_t v : chosen.victims) evict(v, out);
  }
  svc.device = target;
  svc.ready_ns = now + svc.restore_ns;
  dev_free[target] -= need;
  refresh_node_devices(dev_node[target]);
  if (!chosen.victims.empty()) release_on_node(dev_node[target], kNone);
  Decision d;
  d.kind = DecisionKind::kRestore;
  d.service = svc_id;
  d.node = dev_node[target];
  d.device = dev_local[target];
  d.time = svc.ready_ns;
  out.push_back(d);
  if (svc.ready_ns > now) wakeup = std::min(wakeup, svc.ready_ns);
  return true;
}

// kTangram: a restore serves a service's whole queue, so offloaded services with waiting
// actions are restored before the walk, in queue order rather than action order: starving
// ones first (the first of their waiting actions in policy order has waited
// starvation_seconds), then the most waiting actions per second the restore and the queue
// occupy the GPU memory (Smith's rule: waiting / (restore + queued work / max_batch), cross
// multiplied in integers), then service order. Each is restored by restore() (the usual
// device choice and greedy eviction) with its first waiting action in policy order as the
// head; one that finds no room now is left to the walk.
void Scheduler::Impl::restore_queues(std::vector<Decision>& out) {
  std::vector<std::int32_t> order;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(services.size()); ++s)
    if (services[s].device == kNone && services[s].waiting > 0) order.push_back(s);
  if (order.empty()) return;
  std::vector<std::int32_t> head(services.size(), kNone);  // class holding the service's first waiting action
  for (std::int32_t c = 0; c < static_cast<std::int32_t>(classes.size()); ++c) {
    const Class& cl = classes[c];
    if (cl.service == kNone || cl.waiting.empty() || services[cl.service].device != kNone) continue;
    std::int32_t& h = head[cl.service];
    if (h == kNone || cl.waiting.head() < classes[h].waiting.head()) h = c;
  }
  auto starving = [&](std::int32_t s) { return now - classes[head[s]].waiting.head().submit_ns >= starvation_ns; };
  auto span = [&](std::int32_t s) {
    return services[s].restore_ns + services[s].queued_ns / inv.services[s].max_batch;
  };
  std::sort(order.begin(), order.end(), [&](std::int32_t x, std::int32_t y) {
    bool sx = starving(x), sy = starving(y);
    if (sx != sy) return sx;
    __int128 lhs = static_cast<__int128>(services[x].waiting) * span(y);
    __int128 rhs = static_cast<__int128>(services[y].waiting) * span(x);
    if (lhs != rhs) return lhs > rhs;
    return x < y;
  });
  for (std::int32_t s : order)
    if (services[s].device == kNone) restore(s, classes[head[s]], out);
}

// An action needs GPU memory that resident services hold: evict by the same greedy plan,
// on its service's device, or else on the device with the cheapest plan among the nodes
// (in its range) where the rest of its demand fits now. False when no plan exists.
bool Scheduler::Impl::make_gpu_room(const Class& c, std::int32_t lo, std::int32_t hi, std::int32_t fixed_leaf,
                                    std::int32_t device, std::vector<Decision>& out) {
  std::int32_t target = kNone;
  RoomPlan chosen;
  if (device != kNone) {
    if (dev_free[device] >= c.gpu_memory) return false;  // it waits for something else
    chosen = plan_room(device, c.gpu_memory, c.service);
    if (!chosen.ok) return false;
    target = device;
  } else {
    const Partition& part = partitions[c.partition];
    std::tuple<std::int64_t, std::int64_t, std::size_t, std::int32_t> best{INT64_MAX, 0, 0, 0};
    if (fixed_leaf != kNone) lo = fixed_leaf, hi = fixed_leaf + 1;
    for (std::int32_t leaf = lo; leaf < hi; ++leaf) {
      const std::int32_t b = part.bins[leaf];
      const std::int32_t n = bin_node[b];
      if (fixed_leaf == kNone && bin_bound[b]) continue;
      if (!node_online[n]) continue;
      if (any_mask && node_masked[n] == pass_epoch) continue;
      const Quantity* f = free_of(b);
      bool fits = true;
      for (std::int32_t k = 0; k < K && fits; ++k) fits = f[k] >= c.demand[k];
      if (!fits) continue;
      for (std::int32_t d = node_first_dev[n]; d < node_first_dev[n + 1]; ++d) {
        if (dev_total[d] < c.gpu_memory) continue;
        RoomPlan plan = plan_room(d, c.gpu_memory, kNone);
        if (!plan.ok || plan.victims.empty()) continue;
        auto cost = std::make_tuple(plan.busy, plan.queued, plan.victims.size(), d);
        if (cost < best) {
          best = cost;
          target = d;
          chosen = std::move(plan);
        }
      }
    }
    if (target == kNone) return false;
  }
  for (std::int32_t v : chosen.victims) evict(v, out);
  refresh_node_devices(dev_node[target]);
  release_on_node(dev_node[target], kNone);
  return true;
}

// Spare elastic units go to the actions started in this pass with the largest marginal cut
// in run time, one unit at a time: under kTangram only on bins nobody waits for, under
// kOptimus on every bin.
void Scheduler::Impl::grant_spare(std::vector<Decision>& out) {
  // Group this pass's elastic starts by bin, keeping start order.
  std::map<std::int32_t, std::vector<std::size_t>> by_bin;  // ordered: deterministic
  for (std::size_t i = 0; i < started.size(); ++i) {
    const ActionRec& a = slots[started[i]];
    if (a.elastic_kind == kNone || a.grant >= a.elastic_max) continue;
    std::int32_t node = bin_node[a.bin];
    // Parked classes still wait for resources where they are parked.
    std::int32_t part = bin_partition[a.bin];
    if (row.rules.spare == SpareRule::kUncontended &&
        (partition_contended[part] == pass_epoch || partitions[part].parked_count > 0 ||
         node_contended[node] == pass_epoch || node_parked_count[node] > 0))
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

void Scheduler::Impl::pass(std::vector<Decision>& out) {
  ++pass_epoch;
  ++search_epoch;
  any_mask = false;
  wakeup = kNever;
  std::fill(quota_blocked.begin(), quota_blocked.end(), 0);
  started.clear();
  started_decision.clear();
  pending_wakes.clear();
  flush_releases();
  while (!park_deadlines.empty() && park_deadlines.front().at <= now) {
    ParkDeadline due = park_deadlines.front();
    std::pop_heap(park_deadlines.begin(), park_deadlines.end(), std::greater<>());
    park_deadlines.pop_back();
    const Class& cl = classes[due.cls];
    if (cl.parked && cl.park_generation == due.generation) unpark(due.cls);
  }
  in_pass = true;
  if (n_offline > 0 && !services.empty()) evict_offline_services(out);
  if (row.rules.restore == RestoreRule::kQueuesFirst && !services.empty()) restore_queues(out);
  // Walk the heads in policy order. A head pushed behind the cursor (a class woken by an
  // eviction) waits for the next pass, like any head this pass has already passed by.
  active_deferred.clear();
  bool have_cursor = false;
  OrderKey cursor{};
  std::size_t next_wake = 0;
  for (;;) {
    while (!active.empty() && !live(active.front())) {
      std::pop_heap(active.begin(), active.end(), std::greater<>());
      active.pop_back();
    }
    ActiveEntry e{};  // the head tried next
    bool woken = false;
    // A pending wake still parked (not woken since, nor parked again) whose head comes
    // before the heap's: at its turn it is tried if it may still fit, or else stays parked,
    // exactly where a failed try would park it.
    if (next_wake < pending_wakes.size()) {
      const ClassHead& w = pending_wakes[next_wake];
      Class& wc = classes[w.cls];
      if (!wc.parked || wc.pending_pass != pass_epoch) {
        ++next_wake;
        continue;
      }
      if (active.empty() || policy_before(w, active.front().key)) {
        ++next_wake;
        if (!may_start_now(wc)) {
          wc.fit_pass = 0;
          wc.pending_pass = 0;
          wc.block = Block::kResources;
          if (wc.park_node == kNone) partition_contended[wc.partition] = pass_epoch;
          else node_contended[wc.park_node] = pass_epoch;
          continue;
        }
        // Woken: its head comes before every head in the heap, so it is tried now (what
        // a trip into the heap and straight out again would come to).
        e = unpark_for_try(w.cls);
        woken = true;
      }
    }
    if (!woken) {
      if (active.empty()) break;
      e = active.front();
      std::pop_heap(active.begin(), active.end(), std::greater<>());
      active.pop_back();
      if (!live(e)) continue;
    }
    if (have_cursor && e.key < cursor) {
      active_deferred.push_back(e);
      continue;
    }
    cursor = e.key;
    have_cursor = true;
    const std::int32_t c = e.cls;
    // The heads tried after this one start by committing to their action's record, most
    // likely a cache miss: fetch them while this one is tried.
    if (!active.empty()) prefetch(&slots[active.front().key.slot]);
    if (next_wake < pending_wakes.size()) {
      const WaitQueue<OrderKey>& next = classes[pending_wakes[next_wake].cls].waiting;
      if (!next.empty()) prefetch(&slots[next.head().slot]);
    }
    pass_cursor = &cursor;
    Try r = try_head(c, out);
    pass_cursor = nullptr;
    if (r == Try::kHalt) {
      // A starving action that may use any bin stops the pass: the whole partition is its.
      // Pending wakes not reached join the heap, held back like every head behind it.
      for (; next_wake < pending_wakes.size(); ++next_wake) {
        const Class& wc = classes[pending_wakes[next_wake].cls];
        if (wc.parked && wc.pending_pass == pass_epoch) unpark(pending_wakes[next_wake].cls);
      }
      partition_contended[classes[c].partition] = pass_epoch;
      active_deferred.push_back(e);
      for (const ActiveEntry& rest : active)
        if (live(rest)) classes[rest.cls].block = Block::kHeldBack;
      break;
    }
    if (r == Try::kStarted) continue;  // try_head pushed the class's next head, if any
    // Whoever still waits for resources has a claim on the bins it could use: no spare
    // units there. (Waiting for a quota or a service is waiting for something else.)
    std::int32_t node = scope_node(classes[c]);
    if (r != Try::kWaits) {
      if (node == kNone) partition_contended[classes[c].partition] = pass_epoch;
      else node_contended[node] = pass_epoch;
    }
    if (r == Try::kParked) park(c, node);
    else active_deferred.push_back(e);
  }
  for (const ActiveEntry& e : active_deferred)
    if (live(e)) push_active(e);
  in_pass = false;
  if (row.rules.spare != SpareRule::kNone && !started.empty()) grant_spare(out);
  for (std::size_t q = 0; q < quotas.size(); ++q)
    if (quota_blocked[q] && quotas[q].last_until != kNever) wakeup = std::min(wakeup, quotas[q].last_until);
  for (const ServiceRec& s : services)
    if (s.device != kNone && s.ready_ns > now) wakeup = std::min(wakeup, s.ready_ns);
  prev_pass_now = now;
}

// ============================================================ explain

std::string Scheduler::Impl::explain(ActionId id) const {
  const std::int32_t* slot = by_id.find(id);
  if (slot == nullptr) return "action " + std::to_string(id) + " is not live (never submitted, or already ended)";
  const ActionRec& a = slots[*slot];
  std::ostringstream os;
  if (a.state == ActionState::kRunning) {
    os << "running on node " << bin_node[a.bin] << " (" << inv.nodes[bin_node[a.bin]].name << ")";
    if (a.device != kNone) os << ", GPU " << dev_local[a.device];
    if (a.elastic_kind != kNone) os << ", " << inv.kinds[a.elastic_kind] << " grant " << a.grant / 1000.0;
    return os.str();
  }
  const Class& cl = classes[a.cls];
  std::size_t ahead = 0;
  for (const OrderKey& k : cl.waiting.sorted()) {
    if (k.slot == *slot) break;
    ++ahead;
  }
  os << "waiting";
  if (ahead > 0) os << " behind " << ahead << " earlier action" << (ahead > 1 ? "s" : "") << " of the same shape;";
  auto when = [&](TimeNs t) { return std::to_string(to_seconds(t)) + " s"; };
  switch (cl.parked ? Block::kResources : cl.block) {
    case Block::kNotConsidered:
      os << " not yet considered by a scheduling pass";
      break;
    case Block::kResources: {
      os << " for resources: needs";
      for (std::int32_t k = 0; k < K; ++k)
        if (cl.demand[k] > 0) os << " " << inv.kinds[k] << "=" << cl.demand[k] / 1000.0;
      if (cl.gpu_memory > 0) os << " gpu_memory=" << cl.gpu_memory / 1000.0;
      if (cl.affinity_node != kNone) os << " on node " << cl.affinity_node;
      if (cl.service != kNone) os << " beside service '" << inv.services[cl.service].name << "'";
      const Partition& part = partitions[cl.partition];
      std::vector<Quantity> best(K, 0);
      for (std::int32_t b : part.bins)
        for (std::int32_t k = 0; k < K; ++k) best[k] = std::max(best[k], free_of(b)[k]);
      os << "; most free on one bin:";
      for (std::int32_t k = 0; k < K; ++k) os << " " << inv.kinds[k] << "=" << best[k] / 1000.0;
      if (cl.in_trajectory_slot && !trajectory_bin.count(cl.trajectory)) os << " (no free trajectory slot)";
      break;
    }
    case Block::kHeldBack:
      os << " held back: an action that has waited over " << policy.starvation_seconds << " s has first claim on the resources it needs";
      break;
    case Block::kQuotaRate:
      os << " for quota '" << inv.quotas[cl.quota].name << "' rate limit; next admission at " << when(cl.block_until);
      break;
    case Block::kQuotaTokens:
      os << " for quota '" << inv.quotas[cl.quota].name << "' token budget; enough tokens at " << when(cl.block_until);
      break;
    case Block::kQuotaConcurrency:
      os << " for quota '" << inv.quotas[cl.quota].name << "' concurrency limit (" << inv.quotas[cl.quota].max_concurrency << " in flight)";
      break;
    case Block::kServiceRestoring:
      os << " for service '" << inv.services[cl.service].name << "' to finish restoring at " << when(cl.block_until);
      break;
    case Block::kServiceNoRoom:
      os << " for service '" << inv.services[cl.service].name << "': no GPU can make room for it now (resident services are busy)";
      break;
    case Block::kServiceBatchFull:
      os << " for service '" << inv.services[cl.service].name << "': its batch is full (" << inv.services[cl.service].max_batch << " running)";
      break;
  }
  return os.str();
}

// ============================================================ invariants

void Scheduler::Impl::check() const {
  auto fail = [](const std::string& what) { throw std::logic_error("invariant violated: " + what); };
  const std::size_t B = bin_node.size();
  std::vector<Quantity> used(B * K, 0);
  std::vector<Quantity> dev_used(dev_node.size(), 0);
  std::vector<std::int32_t> svc_running(services.size(), 0), quota_running(quotas.size(), 0);
  std::size_t waiting = 0, running = 0;
  by_id.for_each([&](ActionId id, std::int32_t slot) {
    const ActionRec& a = slots[slot];
    if (a.id != id) fail("id index out of sync");
    const Class& cl = classes[a.cls];
    if (a.state == ActionState::kRunning) {
      ++running;
      for (std::int32_t k = 0; k < K; ++k) used[a.bin * K + k] += cl.demand[k];
      if (a.elastic_kind != kNone) {
        if (a.grant < cl.demand[a.elastic_kind] || a.grant > std::max(a.elastic_max, cl.demand[a.elastic_kind]))
          fail("grant outside [minimum, elastic_max] for action " + std::to_string(id));
        used[a.bin * K + a.elastic_kind] += a.grant - cl.demand[a.elastic_kind];
      }
      if (cl.gpu_memory > 0) dev_used[a.device] += cl.gpu_memory;
      if (cl.service != kNone) {
        ++svc_running[cl.service];
        if (a.device != services[cl.service].device) fail("service action off its service's device");
      }
      if (cl.quota != kNone) ++quota_running[cl.quota];
    } else if (a.state == ActionState::kWaiting) {
      ++waiting;
      if (!cl.waiting.contains(details[slot].order, queue_pos)) fail("waiting action missing from its class");
    } else {
      fail("live action in a terminal state");
    }
  });
  if (waiting != n_waiting || running != n_running) fail("waiting/running counts");
  for (std::size_t b = 0; b < B; ++b)
    for (std::int32_t k = 0; k < K; ++k) {
      Quantity cap = cap_of(static_cast<std::int32_t>(b))[k], f = free_of(static_cast<std::int32_t>(b))[k];
      if (f < 0) fail("capacity exceeded on bin " + std::to_string(b));
      if (f + used[b * K + k] != cap) fail("free + used != capacity on bin " + std::to_string(b));
    }
  for (std::size_t s = 0; s < services.size(); ++s) {
    if (services[s].running != svc_running[s]) fail("service running count");
    if (services[s].device != kNone) dev_used[services[s].device] += inv.services[s].memory;
    else if (services[s].running) fail("offloaded service with running actions");
  }
  for (std::size_t d = 0; d < dev_node.size(); ++d) {
    if (dev_free[d] < 0) fail("GPU memory exceeded on device " + std::to_string(d));
    if (dev_free[d] + dev_used[d] != dev_total[d]) fail("GPU free + used != total on device " + std::to_string(d));
  }
  for (std::size_t q = 0; q < quotas.size(); ++q)
    if (quotas[q].running != quota_running[q]) fail("quota running count");
  std::size_t heads = 0;
  for (std::size_t c = 0; c < classes.size(); ++c) {
    const Class& cl = classes[c];
    if (cl.in_active) {
      ++heads;
      std::size_t entries = 0;
      for (const ActiveEntry& e : active)
        if (live(e)) {
          if (e.cls == static_cast<std::int32_t>(c)) ++entries;
        }
      if (cl.waiting.empty() || entries != 1) fail("active class head missing or duplicated");
      for (const ActiveEntry& e : active)
        if (live(e) && e.cls == static_cast<std::int32_t>(c) && e.key.seq != cl.waiting.head().seq)
          fail("active entry is not the class head");
      if (cl.parked) fail("class both parked and active");
    } else if (!cl.waiting.empty() && !cl.parked) {
      fail("waiting class neither active nor parked");
    }
  }
  if (heads != active_count) fail("active count out of sync");
  std::vector<std::uint8_t> is_free(classes.size(), 0);
  for (std::int32_t c : free_classes) {
    if (is_free[c]) fail("class freed twice");
    is_free[c] = 1;
    const Class& cl = classes[c];
    if (!cl.waiting.empty() || cl.in_active || cl.parked) fail("freed class in use");
  }
  for (std::size_t c = 0; c < classes.size(); ++c) {
    if (is_free[c]) continue;
    const std::int32_t* head = class_index.find(classes[c].key_hash);
    std::int32_t p = head == nullptr ? kNone : *head;
    while (p != kNone && p != static_cast<std::int32_t>(c)) {
      if (is_free[p]) fail("freed class still indexed");
      p = classes[p].next_same_hash;
    }
    if (p == kNone) fail("class missing from its hash chain");
  }
  for (const auto& [traj, list] : trajectory_classes)
    for (std::int32_t c : list)
      if (is_free[c] || classes[c].trajectory != traj) fail("trajectory's class list out of sync");
  std::vector<std::int64_t> node_count(node_parked.size(), 0), part_count(partitions.size(), 0);
  std::size_t deadlines = 0;
  for (const Class& cl : classes) {
    if (!cl.parked) continue;
    ++deadlines;
    if (cl.waiting.empty()) fail("parked class without waiting actions");
    if (cl.park_node == kNone) ++part_count[cl.partition];
    else ++node_count[cl.park_node];
  }
  for (const ParkDeadline& d : park_deadlines) {
    const Class& cl = classes[d.cls];
    if (cl.parked && cl.park_generation == d.generation && d.at != cl.park_deadline) fail("park deadline out of sync");
  }
  if (deadlines > park_deadlines.size()) fail("parked class without a deadline");
  std::int32_t offline = 0;
  for (std::uint8_t on : node_online) offline += on ? 0 : 1;
  if (offline != n_offline || node_online.size() != inv.nodes.size()) fail("offline node count");
  for (std::size_t n = 0; n < node_count.size(); ++n)
    if (node_count[n] != node_parked_count[n]) fail("node parked count");
  for (std::size_t p = 0; p < part_count.size(); ++p)
    if (part_count[p] != partitions[p].parked_count) fail("partition parked count");
  for (const Partition& part : partitions)
    for (std::size_t leaf = 0; leaf < part.bins.size(); ++leaf) {
      std::int32_t b = part.bins[leaf];
      const Quantity* v = part.free_tree.leaf(static_cast<std::int32_t>(leaf));
      if (bin_bound[b] || !node_online[bin_node[b]]) {
        for (std::int32_t d = 0; d < D; ++d)
          if (v[d] != -1) fail(bin_bound[b] ? "bound trajectory slot visible in the free tree" : "offline node's bin visible in the free tree");
        continue;
      }
      for (std::int32_t k = 0; k < K; ++k)
        if (v[k] != free_of(static_cast<std::int32_t>(b))[k]) fail("free tree out of sync");
      if (has_gpus && v[K] != node_max_dev_free[bin_node[b]]) fail("free tree GPU entry out of sync");
    }
}

// ============================================================ public face

Scheduler::Scheduler(Inventory inventory, PolicyConfig policy)
    : impl_(std::make_unique<Impl>(std::move(inventory), std::move(policy))) {}
Scheduler::~Scheduler() = default;
Scheduler::Scheduler(Scheduler&&) noexcept = default;
Scheduler& Scheduler::operator=(Scheduler&&) noexcept = default;

std::int32_t Scheduler::add_table(std::vector<std::pair<double, double>> points) {
  validate_table(points, "table");
  impl_->tables.push_back(std::move(points));
  return static_cast<std::int32_t>(impl_->tables.size() - 1);
}

void Scheduler::submit(const ActionSpec* actions, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  impl_->validate_now(now);
  impl_->submit(actions, count, now, out);
  impl_->pass(out);
}

namespace {
// Every id is live and passes state_ok; then no id repeats (reported at its later position).
// Repeats are found by marking slots, so the check is one probe per id.
template <class F>
void validate_ids(const IdMap& by_id, std::vector<ActionRec>& slots, std::uint32_t& mark, const ActionId* ids,
                  std::size_t n, F&& state_ok) {
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
}  // namespace

void Scheduler::complete(const ActionId* ids, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  validate_ids(m.by_id, m.slots, m.mark, ids, count, [&](std::int32_t slot, std::size_t i) {
    if (m.slots[slot].state != ActionState::kRunning)
      throw Error(ErrorCode::kInvalidState, "ids[" + std::to_string(i) + "]",
                  "action " + std::to_string(m.slots[slot].id) + " has not started");
    m.trajectory_live.prefetch(m.slots[slot].trajectory);  // finish() counts it down
  });
  m.messages.clear();
  m.now = now;
  for (std::size_t i = 0; i < count; ++i) m.finish(*m.by_id.find(ids[i]));
  m.pass(out);
}

void Scheduler::cancel(const ActionId* ids, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  validate_ids(m.by_id, m.slots, m.mark, ids, count, [](std::int32_t, std::size_t) {});
  m.messages.clear();
  m.now = now;
  for (std::size_t i = 0; i < count; ++i) {
    std::int32_t slot = *m.by_id.find(ids[i]);
    if (m.slots[slot].state == ActionState::kRunning) m.finish(slot);
    else m.unqueue(slot);
  }
  m.pass(out);
}

void Scheduler::end_trajectories(const TrajectoryId* ids, std::size_t count, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  for (std::size_t i = 0; i < count; ++i) {
    const std::int32_t* live = m.trajectory_live.find(ids[i]);
    if (live != nullptr)
      throw Error(ErrorCode::kInvalidState, "trajectories[" + std::to_string(i) + "]",
                  "trajectory " + std::to_string(ids[i]) + " still has " + std::to_string(*live) + " live action(s)");
  }
  m.messages.clear();
  m.now = now;
  for (std::size_t i = 0; i < count; ++i) {
    // No live action: its classes are empty, neither active nor parked.
    auto classes_of = m.trajectory_classes.find(ids[i]);
    if (classes_of != m.trajectory_classes.end()) {
      for (std::int32_t c : classes_of->second) m.free_class(c);
      m.trajectory_classes.erase(classes_of);
    }
    auto it = m.trajectory_bin.find(ids[i]);
    if (it == m.trajectory_bin.end()) continue;
    std::int32_t bin = it->second;
    m.trajectory_bin.erase(it);
    m.bin_bound[bin] = 0;
    m.refresh_leaf(bin);
    m.release_on_node(m.bin_node[bin], m.bin_partition[bin]);
  }
  m.pass(out);
}

void Scheduler::tick(TimeNs now, std::vector<Decision>& out) {
  out.clear();
  impl_->validate_now(now);
  impl_->messages.clear();
  impl_->now = now;
  impl_->pass(out);
}

void Scheduler::set_node_online(std::int32_t node, bool online, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  if (node < 0 || node >= static_cast<std::int32_t>(m.inv.nodes.size()))
    throw Error(ErrorCode::kUnknownName, "node", "no node with index " + std::to_string(node));
  m.messages.clear();
  m.now = now;
  m.set_node_online(node, online);
  m.pass(out);
}

std::int32_t Scheduler::add_node(NodeSpec node, TimeNs now, std::vector<Decision>& out) {
  out.clear();
  Impl& m = *impl_;
  m.validate_now(now);
  const std::string f = "node";
  if (node.name.empty()) throw Error(ErrorCode::kInvalidArgument, f + ".name", "a node needs a name");
  for (const NodeSpec& o : m.inv.nodes)
    if (o.name == node.name) throw Error(ErrorCode::kInvalidArgument, f + ".name", "duplicate node '" + node.name + "'");
  if (static_cast<std::int32_t>(node.capacity.size()) != m.K)
    throw Error(ErrorCode::kInvalidArgument, f + ".capacity", "has " + std::to_string(node.capacity.size()) + " entries for " + std::to_string(m.K) + " kinds");
  for (std::int32_t k = 0; k < m.K; ++k)
    if (node.capacity[k] < 0 || node.capacity[k] > kMaxMilli)
      throw Error(ErrorCode::kInvalidArgument, f + ".capacity." + m.inv.kinds[k], "must be in [0, 1e12] units");
  for (std::size_t g = 0; g < node.gpus.size(); ++g)
    if (node.gpus[g].memory <= 0 || node.gpus[g].memory > kMaxMilli)
      throw Error(ErrorCode::kInvalidArgument, f + ".gpus[" + std::to_string(g) + "].memory", "must be in (0, 1e12] MiB");
  m.messages.clear();
  m.now = now;
  std::int32_t index = m.add_node(std::move(node));
  m.pass(out);
  return index;
}

bool Scheduler::node_online(std::int32_t node) const {
  const Impl& m = *impl_;
  if (node < 0 || node >= static_cast<std::int32_t>(m.inv.nodes.size()))
    throw Error(ErrorCode::kUnknownName, "node", "no node with index " + std::to_string(node));
  return m.node_online[node] != 0;
}

TimeNs Scheduler::next_wakeup() const { return impl_->wakeup; }
TimeNs Scheduler::now() const { return impl_->now; }

const std::string& Scheduler::message(std::int32_t reason) const {
  if (reason < 0 || reason >= static_cast<std::int32_t>(impl_->messages.size()))
    throw Error(ErrorCode::kInvalidArgument, "reason", "no message with index " + std::to_string(reason) + " in the last call");
  return impl_->messages[reason];
}

std::size_t Scheduler::message_count() const { return impl_->messages.size(); }

std::string Scheduler::explain(ActionId id) const { return impl_->explain(id); }

ActionState Scheduler::state(ActionId id) const {
  const std::int32_t* slot = impl_->by_id.find(id);
  return slot == nullptr ? ActionState::kUnknown : impl_->slots[*slot].state;
}

Decision Scheduler::placement(ActionId id) const {
  const std::int32_t* slot = impl_->by_id.find(id);
  if (slot == nullptr || impl_->slots[*slot].state != ActionState::kRunning)
    throw Error(ErrorCode::kInvalidState, "id", "action " + std::to_string(id) + " is not running");
  const ActionRec& a = impl_->slots[*slot];
  Decision d;
  d.kind = DecisionKind::kStart;
  d.action = id;
  d.node = impl_->bin_node[a.bin];
  d.device = a.device == kNone ? kNone : impl_->dev_local[a.device];
  d.service = impl_->classes[a.cls].service;
  d.elastic_kind = a.elastic_kind;
  d.grant = a.grant;
  d.time = a.start_ns;
  return d;
}

const Inventory& Scheduler::inventory() const { return impl_->inv; }
const PolicyConfig& Scheduler::policy() const { return impl_->policy; }
std::size_t Scheduler::waiting_count() const { return impl_->n_waiting; }
std::size_t Scheduler::running_count() const { return impl_->n_running; }
std::size_t Scheduler::class_count() const { return impl_->classes.size() - impl_->free_classes.size(); }

Quantity Scheduler::free(std::int32_t node, std::int32_t kind) const {
  const Impl& m = *impl_;
  if (node < 0 || node >= static_cast<std::int32_t>(m.inv.nodes.size())) throw Error(ErrorCode::kUnknownName, "node", "no node with index " + std::to_string(node));
  if (kind < 0 || kind >= m.K) throw Error(ErrorCode::kUnknownName, "kind", "no kind with index " + std::to_string(kind));
  Quantity total = 0;
  for (std::size_t b = 0; b < m.bin_node.size(); ++b)
    if (m.bin_node[b] == node) total += m.free_of(static_cast<std::int32_t>(b))[kind];
  return total;
}

Quantity Scheduler::gpu_free(std::int32_t node, std::int32_t device) const {
  const Impl& m = *impl_;
  if (node < 0 || node >= static_cast<std::int32_t>(m.inv.nodes.size())) throw Error(ErrorCode::kUnknownName, "node", "no node with index " + std::to_string(node));
  std::int32_t d = m.node_first_dev[node] + device;
  if (device < 0 || d >= m.node_first_dev[node + 1]) throw Error(ErrorCode::kUnknownName, "device", "node " + std::to_string(node) + " has no GPU " + std::to_string(device));
  return m.dev_free[d];
}

std::pair<std::int32_t, std::int32_t> Scheduler::service_location(std::int32_t service) const {
  const Impl& m = *impl_;
  if (service < 0 || service >= static_cast<std::int32_t>(m.services.size())) throw Error(ErrorCode::kUnknownName, "service", "no service with index " + std::to_string(service));
  std::int32_t d = m.services[service].device;
  if (d == kNone) return {kNone, kNone};
  return {m.dev_node[d], m.dev_local[d]};
}

bool Scheduler::service_ready(std::int32_t service) const {
  const Impl& m = *impl_;
  if (service < 0 || service >= static_cast<std::int32_t>(m.services.size())) throw Error(ErrorCode::kUnknownName, "service", "no service with index " + std::to_string(service));
  return m.service_is_ready(m.services[service]);
}

double Scheduler::runtime(ActionId id, Quantity units) const {
  const std::int32_t* slot = impl_->by_id.find(id);
  if (slot == nullptr) throw Error(ErrorCode::kUnknownAction, "id", "action " + std::to_string(id) + " is not live");
  const ActionRec& a = impl_->slots[*slot];
  if (a.elastic_kind != kNone && units <= 0) throw Error(ErrorCode::kInvalidArgument, "units", "must be positive");
  return impl_->seconds(*slot, units);
}

void Scheduler::check_invariants() const { impl_->check(); }

}  // namespace tangram
