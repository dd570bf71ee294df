// API quotas: the GCRA rate with its burst, the concurrency cap and the token budget.
#include <vector>

#include "harness.h"

namespace tangram_test {
namespace {

Inventory quota_inventory(tangram::QuotaSpec q) {
  Inventory inv = cpu_inventory(1, 64);
  inv.quotas = {std::move(q)};
  return inv;
}

ActionSpec quota_action(ActionId id, std::int64_t tokens = 0) {
  ActionSpec a = action(id, {U(1)}, 100);
  a.quota = 0;
  a.tokens = tokens;
  return a;
}

// GCRA with rate 2/s and burst 1: ticking at next_wakeup(), starts are spaced exactly
// 0.5 s apart, one per tick, in arrival order; a tick just before the due time starts
// nothing.
TEST(Quota, RateSpacesStarts) {
  Harness h(quota_inventory({"api", 2.0, 1, 0, 0}), policy_of(PolicyKind::kFifo));
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(quota_action(id));
  EXPECT_EQ(h.submit(batch, 0), (Decisions{start(1).on(0).at(0)}));
  EXPECT_EQ(h.s.explain(2), "waiting for quota 'api' rate limit; next admission at 0.500000 s");
  TimeNs last = 0;
  for (ActionId id = 2; id <= 5; ++id) {
    const TimeNs wake = h.s.next_wakeup();
    ASSERT_EQ(wake, last + S(0.5));
    EXPECT_EQ(h.tick_ns(wake - 1), Decisions{});
    ASSERT_EQ(h.tick_ns(wake), (Decisions{start(id).on(0).at_ns(wake)}));
    last = wake;
  }
  EXPECT_EQ(h.s.next_wakeup(), kNever);  // nobody waits
}

// GCRA with rate 1/s and burst 3: three start back to back (the theoretical arrival time
// may run 2 s ahead of now), then one a second.
TEST(Quota, BurstThenRate) {
  Harness h(quota_inventory({"api", 1.0, 3, 0, 0}), policy_of(PolicyKind::kTangram));
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(quota_action(id));
  EXPECT_EQ(h.submit(batch, 0), (Decisions{start(1).on(0).at(0), start(2).on(0).at(0), start(3).on(0).at(0)}));
  EXPECT_EQ(h.s.next_wakeup(), S(1));
  EXPECT_EQ(h.tick(1), (Decisions{start(4).on(0).at(1)}));
  EXPECT_EQ(h.s.next_wakeup(), S(2));
}

// A backoff (the API answered 429): nothing new is admitted before it lifts, though the
// burst would allow it; an earlier backoff changes nothing, a later one extends it; the
// wait is explained as the rate's, and an unknown quota is refused.
TEST(Quota, BackoffHoldsNewRequests) {
  Harness h(quota_inventory({"api", 1.0, 3, 0, 0}), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h.submit({quota_action(1)}, 0), (Decisions{start(1).on(0).at(0)}));
  h.s.back_off_quota(0, S(2));
  h.s.back_off_quota(0, S(1));
  EXPECT_EQ(h.submit({quota_action(2)}, 0), Decisions{});
  EXPECT_EQ(h.s.next_wakeup(), S(2));
  EXPECT_EQ(h.s.explain(2), "waiting for quota 'api' rate limit; next admission at 2.000000 s");
  h.s.back_off_quota(0, S(3));
  EXPECT_EQ(h.tick(2), Decisions{});
  EXPECT_EQ(h.tick(3), (Decisions{start(2).on(0).at(3)}));
  EXPECT_THROW(h.s.back_off_quota(1, S(1)), tangram::Error);
  // A pause the clock could never reach (next_wakeup() would name a time tick() refuses),
  // or one before time began, is refused, naming the field.
  for (TimeNs until : {S(1e9) + 1, TimeNs{-1}}) {
    try {
      h.s.back_off_quota(0, until);
      ADD_FAILURE() << "accepted until=" << until;
    } catch (const tangram::Error& e) {
      EXPECT_EQ(e.code(), tangram::ErrorCode::kInvalidArgument);
      EXPECT_EQ(e.field(), "until");
    }
  }
  EXPECT_EQ(h.s.next_wakeup(), tangram::kNever);  // nothing waits; the refused pauses left no trace
}

// A quota's snapshot (a live view) counts what its rate and budget would admit now, and a
// backoff's end, without changing anything.
TEST(Quota, SnapshotCountsWhatWouldBeAdmitted) {
  Harness h(quota_inventory({"api", 1.0, 3, 0, 600}), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h.s.quota_snapshot(0, 0).requests, 3);
  EXPECT_EQ(h.s.quota_snapshot(0, 0).tokens, 600);
  EXPECT_EQ(h.submit({quota_action(1, 100), quota_action(2, 100)}, 0).size(), 2u);
  EXPECT_EQ(h.s.quota_snapshot(0, 0).requests, 1);
  EXPECT_EQ(h.s.quota_snapshot(0, S(1.5)).requests, 2);
  EXPECT_EQ(h.s.quota_snapshot(0, S(1.5)).tokens, 415);
  EXPECT_EQ(h.s.quota_snapshot(0, S(1.5)).tokens, 415);  // unchanged by looking
  h.s.back_off_quota(0, S(5));
  EXPECT_EQ(h.s.quota_snapshot(0, S(2)).paused_until, S(5));
  Harness unlimited(quota_inventory({"api", 0.0, 1, 2, 0}), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(unlimited.s.quota_snapshot(0, 0).requests, -1);
  EXPECT_EQ(unlimited.s.quota_snapshot(0, 0).tokens, -1);
  EXPECT_THROW(unlimited.s.quota_snapshot(1, 0), tangram::Error);
  EXPECT_THROW(unlimited.s.quota_snapshot(0, -1), tangram::Error);  // outside the clock's range
  EXPECT_THROW(unlimited.s.quota_snapshot(0, S(1e9) + 1), tangram::Error);
}

// Under tangram's shortest-first order, a quota's queue keeps arrival order: every
// request costs the quota one request, so a short call that came later does not pass a
// long one (it would only make long calls wait longest). Actions without a quota still go
// shortest first.
TEST(Quota, QueueKeepsArrivalOrderUnderShortestFirst) {
  Harness h(quota_inventory({"api", 1.0, 1, 0, 0}), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h.submit({quota_action(1)}, 0), (Decisions{start(1).on(0).at(0)}));
  ActionSpec long_call = quota_action(2);
  ActionSpec short_call = quota_action(3);
  short_call.model.seconds = 1.0;
  EXPECT_EQ(h.submit({long_call}, 0.1), Decisions{});
  EXPECT_EQ(h.submit({short_call}, 0.2), Decisions{});
  EXPECT_EQ(h.tick(1), (Decisions{start(2).on(0).at(1)}));
  EXPECT_EQ(h.tick(2), (Decisions{start(3).on(0).at(2)}));

  // The same two without a quota, on a node one of them fills: the short one first.
  Harness cpu(cpu_inventory(1, 1), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(cpu.submit({action(1, {U(1)}, 100)}, 0), (Decisions{start(1).on(0).at(0)}));
  ActionSpec short_action = action(3, {U(1)}, 1);
  EXPECT_EQ(cpu.submit({action(2, {U(1)}, 100)}, 0.1), Decisions{});
  EXPECT_EQ(cpu.submit({short_action}, 0.2), Decisions{});
  EXPECT_EQ(cpu.complete({1}, 100), (Decisions{start(3).on(0).at(100)}));
}

// Order "progress" (Policy(objective="act")): a quota's queue serves the requests of the
// trajectories that have started the most actions first, whatever their arrival;
// end_trajectories forgets a trajectory's count (its id may come back for a new one).
TEST(Quota, ProgressOrderServesFurtherTrajectoriesFirst) {
  PolicyConfig p = policy_of(PolicyKind::kTangram);
  tangram::PolicyRules rules = tangram::policy_row(PolicyKind::kTangram).rules;
  rules.order = tangram::OrderRule::kProgress;
  p.row = tangram::PolicyRow{"tangram-act", rules};
  Harness h(quota_inventory({"api", 1.0, 1, 0, 0}), p);
  auto request = [](ActionId id, TrajectoryId trajectory) {
    ActionSpec a = quota_action(id);
    a.trajectory = trajectory;
    return a;
  };
  EXPECT_EQ(h.submit({request(1, 7)}, 0), (Decisions{start(1).on(0).at(0)}));
  EXPECT_EQ(h.complete({1}, 0.5), Decisions{});
  EXPECT_EQ(h.submit({request(2, 8)}, 0.6), Decisions{});  // trajectory 8: nothing started yet
  EXPECT_EQ(h.submit({request(3, 7)}, 0.7), Decisions{});  // trajectory 7: one started
  EXPECT_EQ(h.tick(1), (Decisions{start(3).on(0).at(1)}));
  EXPECT_EQ(h.tick(2), (Decisions{start(2).on(0).at(2)}));
  EXPECT_EQ(h.complete({2, 3}, 2.5), Decisions{});
  // Trajectory 7 has started two, 8 one: 7's request, submitted later, still goes first.
  EXPECT_EQ(h.submit({request(4, 8)}, 2.6), Decisions{});
  EXPECT_EQ(h.submit({request(5, 7)}, 2.7), Decisions{});
  EXPECT_EQ(h.tick(3), (Decisions{start(5).on(0).at(3)}));
  EXPECT_EQ(h.tick(4), (Decisions{start(4).on(0).at(4)}));
  EXPECT_EQ(h.complete({4, 5}, 4.5), Decisions{});
  // Trajectory 7 (three started) ends and its id comes back with none: 8 (two) goes first.
  EXPECT_EQ(h.end({7}, 4.5), Decisions{});
  EXPECT_EQ(h.submit({request(6, 7)}, 4.6), Decisions{});
  EXPECT_EQ(h.submit({request(7, 8)}, 4.7), Decisions{});
  EXPECT_EQ(h.tick(5), (Decisions{start(7).on(0).at(5)}));
  EXPECT_EQ(h.tick(6), (Decisions{start(6).on(0).at(6)}));

  // Under tangram's own order the same requests keep arrival order.
  Harness arrival(quota_inventory({"api", 1.0, 1, 0, 0}), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(arrival.submit({request(1, 7)}, 0), (Decisions{start(1).on(0).at(0)}));
  EXPECT_EQ(arrival.complete({1}, 0.5), Decisions{});
  EXPECT_EQ(arrival.submit({request(2, 8)}, 0.6), Decisions{});
  EXPECT_EQ(arrival.submit({request(3, 7)}, 0.7), Decisions{});
  EXPECT_EQ(arrival.tick(1), (Decisions{start(2).on(0).at(1)}));
}

// The concurrency cap: at most max_concurrency run at once; a completion or a cancel of a
// running one lets exactly the next in; next_wakeup() stays kNever (only an end can help).
TEST(Quota, ConcurrencyCap) {
  Harness h(quota_inventory({"api", 0, 1, 2, 0}), policy_of(PolicyKind::kTangram));
  std::vector<ActionSpec> batch;
  for (ActionId id = 1; id <= 5; ++id) batch.push_back(quota_action(id));
  EXPECT_EQ(h.submit(batch, 0), (Decisions{start(1).on(0).at(0), start(2).on(0).at(0)}));
  EXPECT_EQ(h.s.next_wakeup(), kNever);
  EXPECT_EQ(h.s.explain(3), "waiting for quota 'api' concurrency limit (2 in flight)");
  EXPECT_EQ(h.tick(100), Decisions{});
  EXPECT_EQ(h.complete({1}, 101), (Decisions{start(3).on(0).at(101)}));
  EXPECT_EQ(h.cancel({2}, 102), (Decisions{start(4).on(0).at(102)}));
  EXPECT_EQ(h.s.running_count(), 2u);
  EXPECT_EQ(h.s.waiting_count(), 1u);
  EXPECT_EQ(h.s.state(5), ActionState::kWaiting);
}

// The token budget: 600 tokens per minute (10 per second), full at the start. Two actions
// of 300 tokens start at once; the third waits exactly 30 s for the refill; one needing
// more than a minute's budget is rejected at submit.
TEST(Quota, TokenBudget) {
  Harness h(quota_inventory({"llm", 0, 1, 0, 600}), policy_of(PolicyKind::kTangram));
  EXPECT_EQ(h.submit({quota_action(1, 300), quota_action(2, 300), quota_action(3, 300)}, 0),
            (Decisions{start(1).on(0).at(0), start(2).on(0).at(0)}));
  EXPECT_EQ(h.s.next_wakeup(), S(30));
  EXPECT_EQ(h.s.explain(3), "waiting for quota 'llm' token budget; enough tokens at 30.000000 s");
  EXPECT_EQ(h.tick(29.9), Decisions{});
  EXPECT_EQ(h.tick(30), (Decisions{start(3).on(0).at(30)}));
  EXPECT_EQ(h.submit({quota_action(4, 601)}, 31), (Decisions{reject(4, 0).at(31)}));
  EXPECT_EQ(h.s.message(0), "action 4 can never run: needs 601 tokens, more than quota 'llm' grants per minute");
}

}  // namespace
}  // namespace tangram_test
