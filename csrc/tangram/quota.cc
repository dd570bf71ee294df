#include "tangram/quota.h"

#include <algorithm>
#include <cmath>

namespace tangram {

namespace {
constexpr std::int64_t kUnitsPerToken = 60'000'000'000;  // ns per minute
}

QuotaState::QuotaState(const QuotaSpec& spec, const std::string& field) {
  if (spec.name.empty()) throw Error(ErrorCode::kInvalidArgument, field + ".name", "a quota needs a name");
  if (!std::isfinite(spec.rate) || spec.rate < 0 || spec.rate > 1e9)
    throw Error(ErrorCode::kInvalidArgument, field + ".rate", "must be a finite number of requests per second in [0, 1e9] (0: no rate limit)");
  if (spec.burst < 1 || spec.burst > 1'000'000'000) throw Error(ErrorCode::kInvalidArgument, field + ".burst", "must be in [1, 1e9]");
  if (spec.max_concurrency < 0) throw Error(ErrorCode::kInvalidArgument, field + ".max_concurrency", "must be non-negative (0: no cap)");
  if (spec.tokens_per_minute < 0 || spec.tokens_per_minute > 100'000'000)
    throw Error(ErrorCode::kInvalidArgument, field + ".tokens_per_minute", "must be in [0, 1e8] (0: no budget)");
  if (spec.rate > 0) {
    interval_ = std::max<TimeNs>(1, to_ns(1.0 / spec.rate));
    tolerance_ = (spec.burst - 1) * interval_;
  }
  max_concurrency_ = spec.max_concurrency;
  tokens_per_minute_ = spec.tokens_per_minute;
  capacity_ = static_cast<__int128>(tokens_per_minute_) * kUnitsPerToken;
  level_ = capacity_;
}

void QuotaState::refill(TimeNs now) {
  if (now <= refilled_at_) return;
  level_ = std::min(capacity_, level_ + static_cast<__int128>(now - refilled_at_) * tokens_per_minute_);
  refilled_at_ = now;
}

bool QuotaState::admits(TimeNs now, std::int64_t tokens) {
  last_block = Blocked::kNone;
  last_until = kNever;
  if (max_concurrency_ > 0 && running >= max_concurrency_) {
    last_block = Blocked::kConcurrency;
    return false;
  }
  if (now < paused_until_) {
    last_block = Blocked::kRate;
    last_until = paused_until_;
    return false;
  }
  if (interval_ > 0 && now < tat_ - tolerance_) {
    last_block = Blocked::kRate;
    last_until = tat_ - tolerance_;
    return false;
  }
  if (tokens_per_minute_ > 0) {
    refill(now);
    __int128 need = static_cast<__int128>(tokens) * kUnitsPerToken;
    if (level_ < need) {
      last_block = Blocked::kTokens;
      __int128 wait = (need - level_ + tokens_per_minute_ - 1) / tokens_per_minute_;
      last_until = now + static_cast<TimeNs>(wait);
      return false;
    }
  }
  return true;
}

QuotaSnapshot QuotaState::snapshot(TimeNs now) const {
  QuotaSnapshot out;
  out.paused_until = paused_until_;
  if (interval_ > 0) {
    // GCRA: each request admitted ahead of now takes one interval of the burst's tolerance.
    const std::int64_t burst = tolerance_ / interval_ + 1;
    const TimeNs ahead = tat_ - now;
    const std::int64_t taken = ahead <= 0 ? 0 : (ahead + interval_ - 1) / interval_;
    out.requests = std::max<std::int64_t>(0, burst - taken);
  }
  if (tokens_per_minute_ > 0) {
    const __int128 level = now <= refilled_at_ ? level_
                                               : std::min(capacity_, level_ + static_cast<__int128>(now - refilled_at_) *
                                                                                  tokens_per_minute_);
    out.tokens = static_cast<std::int64_t>(level / kUnitsPerToken);
  }
  return out;
}

void QuotaState::take(TimeNs now, std::int64_t tokens) {
  ++running;
  if (interval_ > 0) tat_ = std::max(tat_, now) + interval_;
  if (tokens_per_minute_ > 0) {
    refill(now);
    level_ -= static_cast<__int128>(tokens) * kUnitsPerToken;
  }
}

}  // namespace tangram
