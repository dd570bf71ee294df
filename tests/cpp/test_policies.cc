// What sets the policies apart: fifo's arrival order and minimum grants, priority classes,
// trajectory slots, isolated task pools.
#include <vector>

#include "harness.h"

namespace tangram_test {
namespace {

ActionSpec in_trajectory(ActionSpec a, TrajectoryId t) {
  a.trajectory = t;
  return a;
}

ActionSpec in_task(ActionSpec a, std::uint32_t task) {
  a.task = task;
  return a;
}

// The trajectory policy gives each trajectory its own slot from its first action until
// end_trajectories: a slot stays bound while its trajectory is between actions, later
// actions of the trajectory run in it with the whole slot as their grant, and, while
// another holder on the node has work in progress, another trajectory gets it only after
// the first one ends.
TEST(TrajectoryPolicy, OwnSlotUntilEnd) {
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = 2.0;
  Harness h(cpu_inventory(1, 4), p);  // two slots of 2 cores
  // Trajectory 1's elastic action gets the whole slot (not 8, not 1); 2 takes the other.
  EXPECT_EQ(h.submit({in_trajectory(amdahl(1, {U(1)}, 0, U(8), 10, 0.9), 1), in_trajectory(action(2, {U(1)}, 10), 2),
                      in_trajectory(action(3, {U(1)}, 10), 3)},
                     0),
            (Decisions{start(1).on(0).grant(0, U(2)).at(0), start(2).on(0).at(0)}));
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  EXPECT_EQ(h.s.explain(3), "waiting for resources: needs cpu=1; most free on one bin it may use: cpu=0 (no free "
                            "trajectory slot, and every node's held slots are full or have work in progress)");
  // Trajectory 1 is between actions: its slot stays its own.
  EXPECT_EQ(h.complete({1}, 1), Decisions{});
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  // Both fit in its slot.
  EXPECT_EQ(h.submit({in_trajectory(action(4, {U(1)}, 10), 1), in_trajectory(action(5, {U(1)}, 10), 1)}, 2),
            (Decisions{start(4).on(0).at(2), start(5).on(0).at(2)}));
  EXPECT_EQ(h.complete({4, 5}, 3), Decisions{});
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  // Trajectory 1 ends: trajectory 3 gets the slot.
  EXPECT_EQ(h.end({1}, 4), (Decisions{start(3).on(0).at(4)}));
  h.complete({2, 3}, 5);
  EXPECT_EQ(h.end({2, 3}, 5), Decisions{});
  EXPECT_EQ(h.s.free(0, 0), U(4));
}

// Under kTrajectory a class is per trajectory; an ended trajectory's classes are freed and
// their slots reused, so a long run of short trajectories does not grow by one class each.
// Waits, parks and wakes go through reused slots (the harness checks every invariant,
// including that no stale heap or park entry is taken for a reused class).
TEST(TrajectoryPolicy, EndedTrajectoriesFreeTheirClasses) {
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = 2.0;
  Harness h(cpu_inventory(1, 4), p);  // two slots
  ActionId id = 1;
  double now = 0;
  for (TrajectoryId t = 1; t <= 600; t += 3) {
    // Three trajectories for two slots: the first two (arrival order) bind them, the third
    // waits (its class parks), then runs once the first ends.
    std::vector<ActionSpec> batch;
    for (TrajectoryId u = t; u < t + 3; ++u) batch.push_back(in_trajectory(action(id++, {U(1 + (u % 2))}, 1), u));
    ASSERT_EQ(h.submit(batch, now), (Decisions{start(id - 3).on(0).at(now), start(id - 2).on(0).at(now)}));
    // Its slot stays bound; the other holder still works, so the node lends no slot.
    EXPECT_EQ(h.complete({id - 3}, now + 1), Decisions{});
    ASSERT_EQ(h.end({t}, now + 1), (Decisions{start(id - 1).on(0).at(now + 1)}));
    h.complete({id - 2, id - 1}, now + 2);
    h.end({t + 1, t + 2}, now + 2);
    now += 3;
    EXPECT_EQ(h.s.class_count(), 0u);
  }
  EXPECT_EQ(h.s.free(0, 0), U(4));
}

// Under the pooled policies a class lives while it has waiting or running actions: the
// last one ending, or a rejection, frees it, so actions pinned to ever new nodes (a class
// per node and shape) do not grow the class table for the whole run. A freed class's id
// is reused by the next class made, through waits, parks and wakes (the harness checks
// every invariant after each event, including that no class without actions stays in use).
TEST(TangramPolicy, ClassesWithoutActionsAreFreed) {
  Harness h(cpu_inventory(8, 2), policy_of(PolicyKind::kTangram));
  ActionId id = 1;
  double now = 0;
  for (int round = 0; round < 50; ++round) {
    // Three actions pinned to one node of two cores: two start, the third waits (parked).
    const std::int32_t node = round % 8;
    std::vector<ActionSpec> batch;
    for (int i = 0; i < 3; ++i) {
      ActionSpec a = action(id++, {U(1)});
      a.affinity_node = node;
      batch.push_back(a);
    }
    ASSERT_EQ(h.submit(batch, now), (Decisions{start(id - 3).on(node).at(now), start(id - 2).on(node).at(now)}));
    EXPECT_EQ(h.s.class_count(), 1u);
    // One ends: the waiting one starts in its place.
    ASSERT_EQ(h.complete({id - 3}, now + 1), (Decisions{start(id - 1).on(node).at(now + 1)}));
    EXPECT_EQ(h.s.class_count(), 1u);
    h.complete({id - 2, id - 1}, now + 2);
    EXPECT_EQ(h.s.class_count(), 0u);
    now += 3;
  }
  // A cancelled waiting action and a rejected one leave no class behind either.
  ASSERT_EQ(h.submit({action(id, {U(2)}, 5), action(id + 1, {U(2)}, 5)}, now),
            (Decisions{start(id).on(0).at(now), start(id + 1).on(1).at(now)}));
  ActionSpec pinned = action(id + 2, {U(2)});
  pinned.affinity_node = 0;
  EXPECT_EQ(h.submit({pinned}, now), Decisions{});  // waits for node 0
  EXPECT_EQ(h.s.class_count(), 2u);  // the unpinned ones' class (running) and the pinned one's
  EXPECT_EQ(h.cancel({id + 2}, now + 1), Decisions{});
  EXPECT_EQ(h.s.class_count(), 1u);
  const Decisions& rejected = h.submit({action(id + 3, {U(3)})}, now + 1);  // no node has 3 cores
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_EQ(rejected[0].kind, DecisionKind::kReject);
  EXPECT_EQ(h.s.class_count(), 1u);
  h.complete({id, id + 1}, now + 2);
  EXPECT_EQ(h.s.class_count(), 0u);
  for (std::int32_t n = 0; n < 8; ++n) EXPECT_EQ(h.s.free(n, 0), U(2));
}

// The isolated policy keeps task pools apart: a pool whose share is full makes its own
// actions wait even while another pool's share is idle, and an action larger than its
// pool's share is rejected although the node could hold it.
TEST(IsolatedPolicy, PoolsStayApart) {
  PolicyConfig p = policy_of(PolicyKind::kIsolated);
  p.pools = {{0, 1.0}, {1, 1.0}};
  Harness h(cpu_inventory(1, 8), p);
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(in_task(action(id, {U(1)}, 10), 0));
  // Pool 0's half holds four.
  EXPECT_EQ(h.submit(batch, 0), (Decisions{start(1).on(0).at(0), start(2).on(0).at(0), start(3).on(0).at(0),
                                           start(4).on(0).at(0)}));
  EXPECT_EQ(h.s.state(5), ActionState::kWaiting);
  EXPECT_EQ(h.s.free(0, 0), U(4));  // pool 1's half, idle
  EXPECT_EQ(h.submit({in_task(action(6, {U(3)}, 10), 1)}, 1), (Decisions{start(6).on(0).at(1)}));
  EXPECT_EQ(h.s.state(5), ActionState::kWaiting);
  EXPECT_EQ(h.submit({in_task(action(7, {U(6)}, 10), 1)}, 2), (Decisions{reject(7, 0).at(2)}));
  EXPECT_EQ(h.s.message(0), "action 7 can never run: demand does not fit on any node: cpu needs 6, largest is 4");
  EXPECT_EQ(h.complete({6}, 3), Decisions{});  // pool 1's release does not help pool 0
  EXPECT_EQ(h.complete({1}, 4), (Decisions{start(5).on(0).at(4)}));
}

// Isolated shares split each node exactly: three equal pools on a 3-core node get exactly
// one core each (the floor of each share in parts per million, then the milli-units left
// spread evenly), so a 1-core action (exactly a pool's share) runs and the pools add up to
// the node.
TEST(Regressions, IsolatedPoolsSplitTheNodeExactly) {
  PolicyConfig p = policy_of(PolicyKind::kIsolated);
  p.pools = {{0, 1.0}, {1, 1.0}, {2, 1.0}};
  Harness h(cpu_inventory(1, 3), p);
  EXPECT_EQ(h.s.free(0, 0), U(3));
  EXPECT_EQ(h.submit({action(1, {U(1)}, 10)}, 0), (Decisions{start(1).on(0).at(0)}));
  EXPECT_EQ(h.submit({in_task(action(2, {U(1)}, 10), 2)}, 0), (Decisions{start(2).on(0).at(0)}));
  EXPECT_EQ(h.s.free(0, 0), U(1));
}

// Under the trajectory policy a service action runs where its service is resident, not in
// its trajectory's slot: here trajectory 7's slot is on node 0 while service s1's home
// device is node 1's GPU, so the action starts on node 1 beside it (and binds no slot).
TEST(Regressions, TrajectoryServiceActionRunsOnItsServicesNode) {
  Inventory inv = cpu_inventory(2, 4);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.nodes[1].gpus = {{U(1000)}};
  inv.services = {{"s0", U(500), 0, 1}, {"s1", U(500), 0, 1}};  // homes: round robin over the GPUs
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = 2.0;
  Harness h(inv, p);
  ActionSpec cpu = action(1, {U(1)}, 10);
  cpu.trajectory = 7;
  // Four equal slots, two per node: trajectory 7 binds the first.
  EXPECT_EQ(h.submit({cpu}, 0), (Decisions{start(1).on(0).at(0)}));
  ActionSpec svc = action(2, {U(1)}, 10);
  svc.trajectory = 7;
  svc.service = 1;
  // restore_seconds 0: ready at once, and the action starts in the same pass.
  EXPECT_EQ(h.submit({svc}, 0), (Decisions{restore(1).on(1, 0).at(0), start(2).on(1, 0).service(1).at(0)}));
  EXPECT_EQ(h.s.service_location(1), std::make_pair(1, 0));
}

// One node of 4 cores and a GPU holding service s0 (restored at once, batches of 4).
Inventory one_gpu_node_inventory() {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.services = {{"s0", U(500), 0, 4}};
  return inv;
}

// The trajectory policy with two slots of 2 cores on such a node.
PolicyConfig two_core_slots() {
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = 2.0;
  return p;
}

// Under the trajectory policy every slot of the service's node may be held by trajectories
// that each wait for a reward there (one machine with a GPU): the rewards run in held slots
// with room, their own trajectory's first, instead of waiting for a free slot for ever.
TEST(Regressions, TrajectoryServiceActionsRunInHeldSlots) {
  Harness h(one_gpu_node_inventory(), two_core_slots());  // both slots held below
  ActionSpec a = action(1, {U(2)}, 10), b = action(2, {U(1)}, 10), c = action(3, {U(1)}, 10);
  a.trajectory = 1, b.trajectory = 2, c.trajectory = 3;
  EXPECT_EQ(h.submit({a, b, c}, 0), (Decisions{start(1).on(0).at(0), start(2).on(0).at(0)}));
  // Trajectory 2 still works (b runs): no free slot and none lent, so trajectory 3 waits.
  EXPECT_EQ(h.complete({1}, 1), Decisions{});
  EXPECT_EQ(h.s.state(3), ActionState::kWaiting);
  ActionSpec r1 = action(11, {U(1)}, 10), r2 = action(12, {U(1)}, 10);
  r1.trajectory = 1, r1.service = 0, r2.trajectory = 2, r2.service = 0;
  EXPECT_EQ(h.submit({r1, r2}, 1), (Decisions{restore(0).on(0, 0).at(1), start(11).on(0, 0).service(0).at(1),
                                             start(12).on(0, 0).service(0).at(1)}));
  // Each runs in its own trajectory's slot: trajectory 1's holds 1 core more, no longer 2.
  ActionSpec more = action(4, {U(2)}, 10);
  more.trajectory = 1;
  EXPECT_EQ(h.submit({more}, 1), Decisions{});
  EXPECT_EQ(h.complete({11, 12}, 2), (Decisions{start(4).on(0).at(2)}));
  // A reward of a trajectory with no slot runs in another's held slot with room (b's).
  ActionSpec r3 = action(13, {U(1)}, 10);
  r3.trajectory = 5, r3.service = 0;
  EXPECT_EQ(h.submit({r3}, 2), (Decisions{start(13).on(0, 0).service(0).at(2)}));
  EXPECT_EQ(h.s.free(0, 0), 0);
}

// A trajectory starving for a free slot holds back free slots only: the rewards of the
// trajectories that hold every slot still run in their own, so those end and, with nothing
// live left in them, the node lends a held slot to the starving one.
TEST(Regressions, TrajectoryStarvingForASlotHoldsBackNoReward) {
  Harness h(one_gpu_node_inventory(), two_core_slots());
  ActionSpec a = action(1, {U(1)}, 10), b = action(2, {U(1)}, 10), c = action(3, {U(1)}, 10);
  a.trajectory = 1, b.trajectory = 2, c.trajectory = 3;
  EXPECT_EQ(h.submit({a, b, c}, 0), (Decisions{start(1).on(0).at(0), start(2).on(0).at(0)}));
  ActionSpec r1 = action(11, {U(1)}, 10), r2 = action(12, {U(1)}, 10);
  r1.trajectory = 1, r1.service = 0, r2.trajectory = 2, r2.service = 0;
  // Trajectory 3 has waited 100 s: starving.
  EXPECT_EQ(h.submit({r1, r2}, 100), (Decisions{restore(0).on(0, 0).at(100), start(11).on(0, 0).service(0).at(100),
                                               start(12).on(0, 0).service(0).at(100)}));
  EXPECT_EQ(h.complete({1, 2}, 100.5), Decisions{});  // the rewards still run: nothing lent
  EXPECT_EQ(h.complete({11, 12}, 101), (Decisions{start(3).on(0).at(101)}));
}

// FIFO keeps arrival order (run time plays no part) and grants exactly the minimum; the
// tangram policy, given the same events, runs the shortest first.
TEST(FifoPolicy, ArrivalOrderAndMinimumGrants) {
  auto run = [](PolicyKind kind) {
    Harness h(cpu_inventory(1, 1), policy_of(kind));
    std::vector<ActionId> order;
    auto out = h.submit({action(1, {U(1)}, 100), action(2, {U(1)}, 50), action(3, {U(1)}, 1)}, 0);
    for (double t = 1; order.size() < 3; ++t) {
      EXPECT_EQ(started(out).size(), 1u) << "one core: one start per event";
      for (ActionId id : started(out)) order.push_back(id);
      if (order.size() < 3) out = h.complete({order.back()}, t);
    }
    return order;
  };
  EXPECT_EQ(run(PolicyKind::kFifo), (std::vector<ActionId>{1, 2, 3}));
  EXPECT_EQ(run(PolicyKind::kTangram), (std::vector<ActionId>{3, 2, 1}));

  Harness h(cpu_inventory(1, 8), policy_of(PolicyKind::kFifo));
  // An idle node, but fifo gives the minimum.
  EXPECT_EQ(h.submit({amdahl(1, {U(1)}, 0, U(8), 100, 1.0)}, 0), (Decisions{start(1).on(0).grant(0, U(1)).at(0)}));
  EXPECT_EQ(h.s.free(0, 0), U(7));
}

// FIFO backfills: an earlier action that does not fit (and has not starved) does not stop
// a later one that does.
TEST(FifoPolicy, BackfillBeforeStarvation) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kFifo));
  EXPECT_EQ(h.submit({action(1, {U(2)}, 100)}, 0), (Decisions{start(1).on(0).at(0)}));
  EXPECT_EQ(h.submit({action(2, {U(4)}, 1), action(3, {U(1)}, 1)}, 1), (Decisions{start(3).on(0).at(1)}));
  EXPECT_EQ(h.s.explain(2), "waiting for resources: needs cpu=4; most free on one bin it may use: cpu=1");
}

// Higher priority classes go first, whatever their run time or arrival.
TEST(Priority, HigherClassFirst) {
  for (PolicyKind kind : {PolicyKind::kTangram, PolicyKind::kFifo}) {
    SCOPED_TRACE(tangram::policy_name(kind));
    Harness h(cpu_inventory(1, 1), policy_of(kind));
    ActionSpec urgent = action(2, {U(1)}, 1000);
    urgent.priority = 5;
    EXPECT_EQ(h.submit({action(1, {U(1)}, 1), urgent}, 0), (Decisions{start(2).on(0).at(0)}));
  }
}

}  // namespace
}  // namespace tangram_test
