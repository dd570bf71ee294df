// Basic types of the tangram core: fixed-point quantities, integer time, typed errors.
//
// The core is a pure function of the events it is fed: no threads, no I/O, no wall clock.
// Quantities are integers in milli-units of their kind (1 core = 1000), so grants and
// releases always return a pool to exactly full. Time is integer nanoseconds, supplied by
// the caller with every event.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tangram {

using Quantity = std::int64_t;  // milli-units of a resource kind
using TimeNs = std::int64_t;    // nanoseconds on the caller's clock
using ActionId = std::uint64_t;
using TrajectoryId = std::uint64_t;

// Starts loading the cache line holding `p` (a hint: no effect on results). An asm
// statement on x86-64 because GCC 12's dead-code elimination drops __builtin_prefetch when
// its address comes through inlined arithmetic (a hash, a heap index).
inline void prefetch(const void* p) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

inline constexpr Quantity kMilli = 1000;
// Largest accepted amount of any kind, in base units (cores, MiB, tokens...). Anything
// above is rejected as absurd rather than risking overflow in sums.
inline constexpr double kMaxBaseUnits = 1e12;
// Largest accepted time or duration, in seconds (about 31 years).
inline constexpr double kMaxSeconds = 1e9;
inline constexpr TimeNs kNever = INT64_MAX;
inline constexpr TimeNs kNoDeadline = INT64_MIN;  // a class with no deadline entry (Class::deadline_listed)

// Conversions shared bit-for-bit with the Python reference (tangram/bench/reference.py):
// round half up after scaling, computed in IEEE doubles.
inline Quantity to_milli(double base_units) {
  return static_cast<Quantity>(std::floor(base_units * 1000.0 + 0.5));
}
inline TimeNs to_ns(double seconds) {
  return static_cast<TimeNs>(std::floor(seconds * 1e9 + 0.5));
}
inline double to_seconds(TimeNs ns) { return static_cast<double>(ns) / 1e9; }

// Why a call was refused. Python maps each code to its own exception type.
enum class ErrorCode {
  kInvalidArgument,  // a field has a bad value (NaN, negative, out of range, inconsistent)
  kUnknownName,      // an unknown kind, service, quota, table, node or task pool
  kDuplicateId,      // an action id that is already live
  kUnknownAction,    // an id that is not live (never submitted or already terminal)
  kInvalidState,     // the action exists but the event does not apply to its state
};

// A refused call. `field` names the offending input ("actions[3].demand.cpu", "now"),
// `reason` says what is wrong with it. Nothing of the refused batch has been applied.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string field, std::string reason)
      : std::runtime_error(field + ": " + reason),
        code_(code),
        field_(std::move(field)),
        reason_(std::move(reason)) {}
  ErrorCode code() const { return code_; }
  const std::string& field() const { return field_; }
  const std::string& reason() const { return reason_; }

 private:
  ErrorCode code_;
  std::string field_;
  std::string reason_;
};

}  // namespace tangram
