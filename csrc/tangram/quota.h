// Admission for one named API quota: GCRA for the request rate (with a burst), a cap on
// requests in flight, and a token bucket for a per-minute token budget. All in integer
// nanoseconds; the bucket counts tokens in units of 1/60e9 token so refill is exact.
#pragma once

#include <algorithm>
#include <string>

#include "tangram/model.h"

namespace tangram {

class QuotaState {
 public:
  enum class Blocked { kNone, kRate, kConcurrency, kTokens };

  QuotaState(const QuotaSpec& spec, const std::string& field);

  // Whether a request for `tokens` may start at `now`. When not, last_block says which
  // limit holds and last_until when it lifts (kNever: when a request in flight ends).
  bool admits(TimeNs now, std::int64_t tokens);
  void take(TimeNs now, std::int64_t tokens);  // after admits() said yes
  void release() { --running; }
  // The API asked callers to slow down: nothing new is admitted before `until` (held as by
  // the rate). A later backoff extends the pause; an earlier one changes nothing.
  void back_off(TimeNs until) { paused_until_ = std::max(paused_until_, until); }
  bool tokens_fit(std::int64_t tokens) const { return tokens_per_minute_ == 0 || tokens <= tokens_per_minute_; }
  // What the quota would admit at `now`, for a live view (nothing changes).
  QuotaSnapshot snapshot(TimeNs now) const;

  std::int64_t running = 0;
  Blocked last_block = Blocked::kNone;
  TimeNs last_until = kNever;

 private:
  void refill(TimeNs now);

  TimeNs interval_ = 0;   // GCRA emission interval; 0 = no rate limit
  TimeNs tolerance_ = 0;  // (burst - 1) * interval
  TimeNs tat_ = 0;        // theoretical arrival time
  std::int64_t max_concurrency_ = 0;
  std::int64_t tokens_per_minute_ = 0;
  __int128 level_ = 0;  // bucket level in 1/60e9 tokens
  __int128 capacity_ = 0;
  TimeNs refilled_at_ = 0;
  TimeNs paused_until_ = 0;  // back_off(): no admission before this
};

}  // namespace tangram
