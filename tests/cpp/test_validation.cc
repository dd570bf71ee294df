// Bad input and actions that can never run: typed errors naming the field, with nothing of
// the refused call applied; rejects at submit with their reasons.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "harness.h"

namespace tangram_test {
namespace {

// An action that can never fit (no node, GPU or quota could hold it even empty) is
// rejected by its own submit, in batch order before the pass's starts, with a message
// naming the shortfall; it never becomes live, and the feasible actions of the same batch
// are unaffected.
TEST(Infeasible, RejectedAtSubmitWithAMessage) {
  Inventory inv = cpu_mem_inventory(2, 8, 4096);
  inv.nodes[0].gpus = {{U(8000)}};
  inv.services = {{"huge", U(9000), 1.0, 1}};
  inv.quotas = {{"llm", 0, 1, 0, 1000}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec too_big = action(1, {U(10), U(100)});
  ActionSpec ok = action(2, {U(1), U(100)});
  ActionSpec too_much_gpu = action(3, {U(1), 0});
  too_much_gpu.gpu_memory = U(9000);
  ActionSpec huge_service = action(4, {U(1), 0});
  huge_service.service = 0;
  ActionSpec too_many_tokens = action(5, {U(1), 0});
  too_many_tokens.quota = 0;
  too_many_tokens.tokens = 1001;
  ActionSpec affinity_too_big = action(6, {U(1), U(5000)});
  affinity_too_big.affinity_node = 1;
  const auto& out = h.submit({too_big, ok, too_much_gpu, huge_service, too_many_tokens, affinity_too_big}, 0);
  // Both nodes fit action 2 equally well (the score counts cpu and memory only): the first.
  EXPECT_EQ(out, (Decisions{reject(1, 0).at(0), reject(3, 1).at(0), reject(4, 2).at(0), reject(5, 3).at(0),
                            reject(6, 4).at(0), start(2).on(0).at(0)}));
  ASSERT_EQ(h.s.message_count(), 5u);
  EXPECT_EQ(h.s.message(0), "action 1 can never run: demand does not fit on any node: cpu needs 10, largest is 8");
  EXPECT_EQ(h.s.message(1),
            "action 3 can never run: demand does not fit on any node: gpu_memory needs 9000, largest is 8000");
  EXPECT_EQ(h.s.message(2),
            "action 4 can never run: service 'huge' needs 9000 MiB of GPU memory with the action's demand on the "
            "same node, and no device has that");
  EXPECT_EQ(h.s.message(3), "action 5 can never run: needs 1001 tokens, more than quota 'llm' grants per minute");
  EXPECT_EQ(h.s.message(4),
            "action 6 can never run: demand does not fit on its affinity node: memory needs 5000, largest is 4096");
  for (ActionId id : {1, 3, 4, 5, 6}) EXPECT_EQ(h.s.state(id), ActionState::kUnknown);
  EXPECT_EQ(h.s.waiting_count(), 0u);
  EXPECT_EQ(h.s.running_count(), 1u);
  // The message table belongs to the last call; the id of a rejected action is free again.
  EXPECT_EQ(h.tick(1), Decisions{});
  EXPECT_EQ(h.s.message_count(), 0u);
  expect_error([&] { h.s.message(0); }, ErrorCode::kInvalidArgument, "reason");
  // Best fit: node 0, where action 2 runs, has less room left than the empty node 1.
  EXPECT_EQ(h.submit({action(1, {U(1), 0})}, 1), (Decisions{start(1).on(0).at(1)}));
}

// An action of a GPU service that needs more tokens than its quota grants per minute can
// never run: it is rejected at submit like any other (the token check covers service
// actions too), and its service is not restored for it.
TEST(Regressions, ServiceActionOverTokenBudgetIsRejected) {
  Inventory inv = cpu_inventory(1, 4);
  inv.nodes[0].gpus = {{U(1000)}};
  inv.services = {{"rm", U(500), 0, 1}};
  inv.quotas = {{"llm", 0, 1, 0, 100}};
  Harness h(inv, policy_of(PolicyKind::kTangram));
  ActionSpec a = action(1, {U(1)}, 10);
  a.service = 0;
  a.quota = 0;
  a.tokens = 1000;
  EXPECT_EQ(h.submit({a}, 0), (Decisions{reject(1, 0).at(0)}));
  EXPECT_EQ(h.s.message(0), "action 1 can never run: needs 1000 tokens, more than quota 'llm' grants per minute");
  EXPECT_EQ(h.s.service_location(0), std::make_pair(kNone, kNone));
  EXPECT_EQ(h.s.next_wakeup(), kNever);
}

class Validation : public ::testing::Test {
 protected:
  Validation() : h(make_inventory(), policy_of(PolicyKind::kTangram)) {}
  static Inventory make_inventory() {
    Inventory inv = cpu_mem_inventory(1, 8, 8192);
    inv.nodes[0].gpus = {{U(16000)}};
    inv.services = {{"rm", U(1000), 0.0, 1}};
    inv.quotas = {{"api", 1.0, 1, 0, 0}};
    return inv;
  }
  // Submitting `batch` (at the current time, or at `now`) must fail with (code, field) and
  // apply none of it: the counts, the states of its ids and the clock stay as they were.
  void refused(std::vector<ActionSpec> batch, ErrorCode code, const std::string& field, TimeNs now = -1) {
    const std::size_t waiting = h.s.waiting_count(), running = h.s.running_count();
    const TimeNs clock = h.s.now();
    std::vector<ActionState> states;
    for (const ActionSpec& a : batch) states.push_back(h.s.state(a.id));
    if (now < 0) now = h.s.now();
    expect_error([&] { h.s.submit(batch.data(), batch.size(), now, h.out); }, code, field);
    h.s.check_invariants();
    EXPECT_EQ(h.s.waiting_count(), waiting);
    EXPECT_EQ(h.s.running_count(), running);
    EXPECT_EQ(h.s.now(), clock);
    for (std::size_t i = 0; i < batch.size(); ++i) EXPECT_EQ(h.s.state(batch[i].id), states[i]) << batch[i].id;
  }
  ActionSpec ok(ActionId id) { return action(id, {U(1), U(100)}); }
  Harness h;
};

// A negative demand is refused with kInvalidArgument naming the kind.
TEST_F(Validation, NegativeDemand) {
  refused({action(1, {-1, 0})}, ErrorCode::kInvalidArgument, "actions[0].demand.cpu");
  refused({ok(1), action(2, {0, -U(1)})}, ErrorCode::kInvalidArgument, "actions[1].demand.memory");
  refused({action(1, {U(1)})}, ErrorCode::kInvalidArgument, "actions[0].demand");  // wrong length
  refused({action(1, {U(2000000000000), 0})}, ErrorCode::kInvalidArgument, "actions[0].demand.cpu");
}

// An elastic upper bound below the minimum demand is refused, naming elastic_max; so are a
// zero elastic minimum and an elastic kind that does not exist.
TEST_F(Validation, ElasticBounds) {
  refused({amdahl(1, {U(2), 0}, 0, U(1), 10, 0.5)}, ErrorCode::kInvalidArgument, "actions[0].elastic_max");
  refused({amdahl(1, {0, 0}, 0, U(4), 10, 0.5)}, ErrorCode::kInvalidArgument, "actions[0].demand.cpu");
  refused({amdahl(1, {U(1), 0}, 2, U(4), 10, 0.5)}, ErrorCode::kInvalidArgument, "actions[0].elastic_kind");
  refused({amdahl(1, {U(1), 0}, 0, U(4), 10, 1.5)}, ErrorCode::kInvalidArgument, "actions[0].model.parallel_fraction");
}

// Indices of services, quotas, nodes, tables and task pools that do not exist are refused
// with kUnknownName naming the field.
TEST_F(Validation, UnknownIndices) {
  ActionSpec a = ok(1);
  a.service = 1;
  refused({a}, ErrorCode::kUnknownName, "actions[0].service");
  a = ok(1);
  a.quota = 1;
  refused({a}, ErrorCode::kUnknownName, "actions[0].quota");
  a = ok(1);
  a.quota = -5;
  refused({a}, ErrorCode::kUnknownName, "actions[0].quota");
  a = ok(1);
  a.affinity_node = 3;
  refused({ok(7), a}, ErrorCode::kUnknownName, "actions[1].affinity_node");
  a = ok(1);
  a.model.kind = ModelKind::kTable;
  a.model.table = 0;
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].model.table");
  a = ok(1);
  a.tokens = 5;  // tokens without a quota
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].tokens");
  a = ok(1);
  a.model.seconds = std::nan("");
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].model.seconds");
  a = ok(1);
  a.service = 0;
  a.affinity_node = 0;
  refused({a}, ErrorCode::kInvalidArgument, "actions[0].affinity_node");

  PolicyConfig iso = policy_of(PolicyKind::kIsolated);
  iso.pools = {{3, 1.0}};
  Harness hi(cpu_inventory(1, 4), iso);
  ActionSpec t = action(1, {U(1)});
  t.task = 4;
  expect_error([&] { hi.s.submit(&t, 1, 0, hi.out); }, ErrorCode::kUnknownName, "actions[0].task");
  expect_error([] { tangram::policy_from_name("lifo"); }, ErrorCode::kUnknownName, "policy");
}

// Duplicate ids are refused with kDuplicateId, within one batch and against live actions,
// and the whole batch is refused (nothing of it is applied).
TEST_F(Validation, DuplicateIds) {
  refused({ok(1), ok(2), ok(1)}, ErrorCode::kDuplicateId, "actions[2].id");
  EXPECT_EQ(h.submit({ok(1)}, 1), (Decisions{start(1).on(0).at(1)}));
  refused({ok(2), ok(1)}, ErrorCode::kDuplicateId, "actions[1].id");
  EXPECT_EQ(h.s.state(2), ActionState::kUnknown);
  Decisions out;
  ActionId twice[] = {1, 1};
  expect_error([&] { h.s.complete(twice, 2, S(2), out); }, ErrorCode::kDuplicateId, "ids[1]");
  EXPECT_EQ(h.s.state(1), ActionState::kRunning);
}

// Completing an id that is not live is kUnknownAction; completing a waiting action is
// kInvalidState (cancel is the way out of the queue); neither applies anything.
TEST_F(Validation, CompleteUnknownOrWaiting) {
  // 2 needs all 8 cores; 1 holds one of them.
  EXPECT_EQ(h.submit({ok(1), action(2, {U(8), U(100)})}, 1), (Decisions{start(1).on(0).at(1)}));
  ASSERT_EQ(h.s.state(2), ActionState::kWaiting);
  Decisions out;
  ActionId unknown[] = {1, 99};
  expect_error([&] { h.s.complete(unknown, 2, S(2), out); }, ErrorCode::kUnknownAction, "ids[1]");
  EXPECT_EQ(h.s.state(1), ActionState::kRunning);  // the valid id was not applied
  ActionId waiting[] = {2};
  expect_error([&] { h.s.complete(waiting, 1, S(2), out); }, ErrorCode::kInvalidState, "ids[0]");
  expect_error([&] { h.s.placement(2); }, ErrorCode::kInvalidState, "id");
  expect_error([&] { h.s.runtime(99, U(1)); }, ErrorCode::kUnknownAction, "id");
  EXPECT_EQ(h.s.explain(99), "action 99 is not live (never submitted, or already ended)");
  // Trajectory 0 still has live actions: it cannot end.
  TrajectoryId t0 = 0;
  expect_error([&] { h.s.end_trajectories(&t0, 1, S(2), out); }, ErrorCode::kInvalidState, "trajectories[0]");
  h.s.check_invariants();
  EXPECT_EQ(h.complete({1}, 3), (Decisions{start(2).on(0).at(3)}));
}

// Time must never go backwards, for every event; a refused call leaves now() unchanged.
TEST_F(Validation, TimeGoingBackwards) {
  h.submit({ok(1)}, 5);
  refused({ok(2)}, ErrorCode::kInvalidArgument, "now", S(4.5));
  Decisions out;
  expect_error([&] { h.s.tick(S(4), out); }, ErrorCode::kInvalidArgument, "now");
  ActionId one = 1;
  expect_error([&] { h.s.complete(&one, 1, S(4), out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.cancel(&one, 1, S(4), out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.end_trajectories(nullptr, 0, S(4), out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.tick(-1, out); }, ErrorCode::kInvalidArgument, "now");
  expect_error([&] { h.s.tick(S(2e9), out); }, ErrorCode::kInvalidArgument, "now");
  EXPECT_EQ(h.s.now(), S(5));
  EXPECT_EQ(h.s.state(1), ActionState::kRunning);
  EXPECT_EQ(h.tick(5), Decisions{});  // the same time is fine
}

// Bad inventories and policies are refused at construction, naming the field.
TEST(ValidationConstruction, InventoryAndPolicy) {
  Inventory none;
  expect_error([&] { Scheduler s(none, PolicyConfig{}); }, ErrorCode::kInvalidArgument, "inventory.kinds");
  Inventory dup = cpu_inventory(1, 4);
  dup.kinds = {"cpu"};
  dup.quotas = {{"q", 1, 1, 0, 0}, {"q", 1, 1, 0, 0}};
  expect_error([&] { Scheduler s(dup, PolicyConfig{}); }, ErrorCode::kInvalidArgument, "inventory.quotas[1].name");
  Inventory svc = cpu_inventory(1, 4);
  svc.services = {{"rm", U(1), 0, 1}};
  expect_error([&] { Scheduler s(svc, PolicyConfig{}); }, ErrorCode::kInvalidArgument, "inventory.services[0]");
  PolicyConfig traj = policy_of(PolicyKind::kTrajectory);
  traj.trajectory_slot_cpu = 16.0;
  expect_error([&] { Scheduler s(cpu_inventory(1, 4), traj); }, ErrorCode::kInvalidArgument,
               "policy(trajectory).trajectory_slot_cpu");
  expect_error([&] { Scheduler s(cpu_inventory(1, 4), policy_of(PolicyKind::kIsolated)); },
               ErrorCode::kInvalidArgument, "policy(isolated).pools");
  PolicyConfig starve;
  starve.starvation_seconds = 0;
  expect_error([&] { Scheduler s(cpu_inventory(1, 4), starve); }, ErrorCode::kInvalidArgument,
               "policy(tangram).starvation_seconds");
}

// A submit refused by validation leaves the clock alone (nothing of the refused batch is
// applied, types.h): a caller that fixes the batch can resubmit it at the original time.
TEST(Regressions, RefusedSubmitLeavesTheClockAlone) {
  Harness h(cpu_inventory(1, 4), policy_of(PolicyKind::kTangram));
  h.submit({action(1, {U(1)})}, 1);
  std::vector<ActionSpec> bad = {action(2, {-1})};
  EXPECT_THROW(h.s.submit(bad.data(), bad.size(), S(10), h.out), Error);
  EXPECT_EQ(h.s.now(), S(1));
  EXPECT_EQ(h.submit({action(2, {U(1)})}, 2), (Decisions{start(2).on(0).at(2)}));
}

}  // namespace
}  // namespace tangram_test
