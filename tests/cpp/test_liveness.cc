// Liveness: an action that can never run is rejected at submit, and every other one starts
// once the work ahead of it ends (docs/scheduling.md, "Liveness"). Each test below is a
// stream that left an action waiting for good before its rule; tests/test_liveness.py and
// the fuzzer check the rule on random streams under every row.
#include <gtest/gtest.h>

#include <vector>

#include "harness.h"

namespace tangram_test {
namespace {

using tangram::ServiceSpec;
using tangram::to_milli;
using tangram::trajectory_slots;

// A slot of cpu / n cores gives n slots on every node size a user has, although floating
// point puts cpu / n a hair above or below the quotient; a slot a millionth of a core
// larger gives n - 1.
TEST(Liveness, ASlotOfCpuOverNGivesNSlots) {
  for (std::int64_t cores : {1, 2, 3, 7, 16, 64, 96, 100, 128, 1000})
    for (Quantity n = 1; n <= 256; ++n) {
      const double slot = static_cast<double>(cores) / static_cast<double>(n);
      EXPECT_EQ(trajectory_slots(U(cores), slot), n) << cores << " cores / " << n;
      if (n > 1) {
        EXPECT_EQ(trajectory_slots(U(cores), slot + 1e-6), n - 1) << cores << " cores / " << n;
      }
    }
}

// The trajectory baseline as a user writes it: 2 cores, a slot of 2 / 17
// and one action of 2 / 17 cores per trajectory, no trajectory ended before the step's end.
// 2 / 17 rounds up to 0.118 core: the node held 16 such slots and the 17th action waited
// for good. Now it holds 17 (each of 0.118 core, as the demands are rounded).
TEST(Liveness, SeventeenTrajectoriesGetSeventeenSlots) {
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = 2.0 / 17;
  Harness h(cpu_inventory(1, 2), p);
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 17; ++id) {
    ActionSpec a = action(id, {to_milli(2.0 / 17)}, 1);
    a.trajectory = id;
    batch.push_back(a);
  }
  EXPECT_EQ(started(h.submit(batch, 0)).size(), 17u);
}

// More trajectories than slots, none ended: once every holder on the node has nothing live,
// a held slot is lent to a trajectory that holds none (binding nothing); while a holder
// works there, nothing is lent.
TEST(Liveness, IdleHoldersLendTheirSlots) {
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = 1.0;
  Harness h(cpu_inventory(1, 2), p);  // two slots
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 3; ++id) {
    ActionSpec a = action(id, {U(1)}, 1);
    a.trajectory = id;
    batch.push_back(a);
  }
  EXPECT_EQ(h.submit(batch, 0), (Decisions{start(1).on(0).at(0), start(2).on(0).at(0)}));
  EXPECT_EQ(h.complete({1}, 1), Decisions{});  // trajectory 2 still works: nothing lent
  EXPECT_EQ(h.complete({2}, 2), (Decisions{start(3).on(0).at(2)}));  // lent trajectory 1's slot
  // Trajectory 1 comes back: its slot is busy with the borrower, so it waits for it.
  ActionSpec again = action(4, {U(1)}, 1);
  again.trajectory = 1;
  EXPECT_EQ(h.submit({again}, 3), Decisions{});
  EXPECT_EQ(h.complete({3}, 4), (Decisions{start(4).on(0).at(4)}));
}

// A trajectory whose slot can never hold its next action (a node of another shape) gives
// the slot up once nothing of it runs there, and binds one that fits.
TEST(Liveness, ASlotThatCanNeverHoldTheActionIsGivenUp) {
  Inventory inv = cpu_mem_inventory(2, 1, 0);
  inv.nodes[1].capacity[1] = U(1024);
  PolicyConfig p = policy_of(PolicyKind::kTrajectory);
  p.trajectory_slot_cpu = 1.0;
  Harness h(inv, p);
  ActionSpec first = action(1, {U(1), 0}, 1);
  first.trajectory = 7;
  first.affinity_node = 0;
  EXPECT_EQ(h.submit({first}, 0), (Decisions{start(1).on(0).at(0)}));
  ActionSpec big = action(2, {U(1), U(512)}, 1);
  big.trajectory = 7;
  EXPECT_EQ(h.submit({big}, 0.5), Decisions{});  // its own action still runs in the slot
  EXPECT_EQ(h.complete({1}, 1), (Decisions{start(2).on(1).at(1)}));
}

// An idle service resident on a node whose bins can never hold a waiting action's demand
// (restored there for an action that needed no core) is moved: before, nothing evicted it
// and the action waited for good.
TEST(Liveness, AServiceMovesOffANodeThatCanNeverHoldItsAction) {
  Inventory inv = cpu_inventory(2, 0);
  inv.nodes[1].capacity[0] = U(1);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.nodes[1].gpus = {{U(1000)}};
  inv.services = {{"s0", 0, 0, 1}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec light = action(1, {0}, 1), heavy = action(2, {U(1)}, 1);
  light.service = heavy.service = 0;
  EXPECT_EQ(h.submit({light}, 0), (Decisions{restore(0).on(0, 0).at(0), start(1).on(0, 0).service(0).at(0)}));
  EXPECT_EQ(h.submit({heavy}, 0.5), Decisions{});  // its batch of one still runs
  EXPECT_EQ(h.complete({1}, 1),
            (Decisions{evict(0).on(0, 0).at(1), restore(0).on(1, 0).at(1), start(2).on(1, 0).service(0).at(1)}));
}

// An eviction plan still short once its victims are offloaded discards its unmovable
// victims instead, so the memory they would keep asleep there never blocks an action that
// needs the whole device.
TEST(Liveness, UnmovableVictimsAreDiscardedWhenOffloadingFallsShort) {
  Inventory inv = cpu_inventory(1, 1);
  inv.nodes[0].gpus = {{U(2000)}};
  ServiceSpec server{"server", U(1500), 0, 1};
  server.asleep_memory = U(750);
  server.movable = false;
  inv.services = {server};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec reward = action(1, {0}, 1);
  reward.service = 0;
  EXPECT_EQ(h.submit({reward}, 0), (Decisions{restore(0).on(0, 0).at(0), start(1).on(0, 0).service(0).at(0)}));
  EXPECT_EQ(h.complete({1}, 1), Decisions{});
  ActionSpec gpu = action(2, {0}, 1);
  gpu.gpu_memory = U(1500);  // 500 free + 750 offloaded would fall short
  EXPECT_EQ(h.submit({gpu}, 2), (Decisions{discard(0).on(0, 0).at(2), start(2).on(0, 0).at(2)}));
}

// A restore is not made for an action its quota refuses now: the memory would sit unused
// (and two services kept apart by their quotas would swap places pass after pass).
TEST(Liveness, NoRestoreForAnActionItsQuotaRefuses) {
  Inventory inv = cpu_inventory(1, 1);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.services = {{"s0", U(500), 0, 1}};
  inv.quotas = {{"q", 0.5, 1, 0, 0}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec call = action(1, {0}, 1);
  call.quota = 0;
  EXPECT_EQ(h.submit({call}, 0), (Decisions{start(1).on(0).at(0)}));
  ActionSpec reward = action(2, {0}, 1);
  reward.service = 0;
  reward.quota = 0;
  EXPECT_EQ(h.submit({reward}, 0.5), Decisions{});  // the quota admits it at 2 s
  EXPECT_EQ(h.s.next_wakeup(), S(2));
  EXPECT_EQ(h.tick(2), (Decisions{restore(0).on(0, 0).at(2), start(2).on(0, 0).service(0).at(2)}));
}

// No eviction for a service action whose node has no room for the rest of its demand: the
// memory would go unused, and its victim be restored and evicted again pass after pass.
TEST(Liveness, NoEvictionForGpuMemoryTheActionCannotUseYet) {
  Inventory inv = cpu_inventory(1, 1);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.services = {{"a", U(500), 0, 1}, {"b", U(500), 0, 1}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec ra = action(1, {0}, 1), rb = action(2, {0}, 1), busy = action(3, {U(1)}, 10);
  ra.service = 0;
  rb.service = 1;
  EXPECT_EQ(started(h.submit({ra, rb, busy}, 0)), (std::vector<ActionId>{1, 2, 3}));
  h.complete({1, 2}, 1);
  ActionSpec wide = action(4, {U(1)}, 1);  // b plus 500 MiB more, and the core busy holds
  wide.service = 1;
  wide.gpu_memory = U(500);
  EXPECT_EQ(h.submit({wide}, 2), Decisions{});  // before: a evicted here, for nothing
  EXPECT_EQ(h.s.service_location(0), std::make_pair(0, 0));
  EXPECT_EQ(h.complete({3}, 3), (Decisions{evict(0).on(0, 0).at(3), start(4).on(0, 0).service(1).at(3)}));
}

// A plan that falls short only because it spares a service ready since the last pass (its
// waiting actions get that pass) asks for the next pass at once: here service a's only
// action is held back by its quota until 101 s, and b's action would otherwise wait for it.
TEST(Liveness, APlanSparingAFreshServiceAsksForTheNextPass) {
  Inventory inv = cpu_inventory(1, 1);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.services = {{"a", U(1000), 2, 1}, {"b", U(1000), 0, 1}};
  inv.quotas = {{"q", 0.01, 1, 0, 0}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec for_a = action(1, {0}, 1);
  for_a.service = 0;
  for_a.quota = 0;
  EXPECT_EQ(h.submit({for_a}, 0), (Decisions{restore(0).on(0, 0).at(2)}));
  ActionSpec call = action(2, {0}, 1), for_b = action(3, {0}, 1);
  call.quota = 0;  // takes the quota's one request until 101 s
  for_b.service = 1;
  EXPECT_EQ(h.submit({call, for_b}, 1), (Decisions{start(2).on(0).at(1)}));  // a still restoring
  h.complete({2}, 1.5);
  EXPECT_EQ(h.tick(2), Decisions{});  // a is ready now: spared for its action's pass
  EXPECT_EQ(h.s.next_wakeup(), S(2) + 1);
  EXPECT_EQ(h.tick_ns(S(2) + 1), (Decisions{evict(0).on(0, 0).at_ns(S(2) + 1), restore(1).on(0, 0).at_ns(S(2) + 1),
                                           start(3).on(0, 0).service(1).at_ns(S(2) + 1)}));
}

// A restore makes room for its head beside the service, not for the service alone: here b,
// restored into the 2,500 MiB that a leaves while a restores, would fill the device, neither
// action would fit beside its service, and each would evict the other's service for its
// own, pass after pass.
TEST(Liveness, ARestoreMakesRoomForItsHeadBesideTheService) {
  Inventory inv = cpu_inventory(1, 2);
  inv.nodes[0].gpus = {{U(4000)}};
  inv.services = {{"a", U(1500), 1, 1}, {"b", U(2500), 1, 1}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec for_a = action(1, {0}, 1), for_b = action(2, {0}, 1);
  for_a.service = 0;
  for_a.gpu_memory = U(200);
  for_b.service = 1;
  for_b.gpu_memory = U(1000);
  EXPECT_EQ(h.submit({for_a, for_b}, 0), (Decisions{restore(0).on(0, 0).at(1)}));  // before: b restored too
  EXPECT_EQ(h.tick(1), (Decisions{start(1).on(0, 0).service(0).at(1)}));
  EXPECT_EQ(h.complete({1}, 2), (Decisions{evict(0).on(0, 0).at(2), restore(1).on(0, 0).at(3)}));
  EXPECT_EQ(h.tick(3), (Decisions{start(2).on(0, 0).service(1).at(3)}));
}

// b and its action fit beside a, but not beside a and a's action: b's restore waits until
// a's action has started (before, b was restored at once into the room a was restored
// for, a's action found none, and with more services a's restore was undone unused).
TEST(Liveness, ARestoreLeavesTheRoomAnEarlierRestoreWasMadeFor) {
  Inventory inv = cpu_inventory(1, 2);
  inv.nodes[0].gpus = {{U(4000)}};
  inv.services = {{"a", U(1000), 1, 1}, {"b", U(2000), 1, 1}};
  Harness h(inv, policy_of(PolicyKind::kFifo));
  ActionSpec for_a = action(1, {0}, 1), for_b = action(2, {0}, 1);
  for_a.service = 0;
  for_a.gpu_memory = U(1500);
  for_b.service = 1;
  for_b.gpu_memory = U(200);
  EXPECT_EQ(h.submit({for_a, for_b}, 0), (Decisions{restore(0).on(0, 0).at(1)}));  // before: b's at 2 too
  EXPECT_EQ(h.tick(1), (Decisions{start(1).on(0, 0).service(0).at(1)}));
  EXPECT_EQ(h.complete({1}, 2), (Decisions{restore(1).on(0, 0).at(3)}));  // beside a, a's action done
  EXPECT_EQ(h.tick(3), (Decisions{start(2).on(0, 0).service(1).at(3)}));
}

}  // namespace
}  // namespace tangram_test
