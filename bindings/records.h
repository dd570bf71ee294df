// Flat records that cross the binding in NumPy structured arrays. tangram/_records.py
// builds the matching dtypes; test_records.py checks that the offsets agree.
#pragma once

#include <cstdint>

namespace tangram::bindings {

// One action, quantities in base units (cores, MiB, tokens). Followed in memory by
// `kinds` float64 minimum demands.
struct ActionHeader {
  std::uint64_t id;
  std::uint64_t trajectory;
  std::uint32_t task;
  std::int32_t priority;
  std::int32_t elastic_kind;  // -1: not elastic
  std::uint32_t model;        // tangram::ModelKind
  double gpu_memory;
  double elastic_max;
  double seconds;
  double parallel_fraction;
  std::int32_t table;
  std::int32_t affinity;  // node index, -1: anywhere
  std::int32_t service;   // -1: none
  std::int32_t quota;     // -1: none
  std::int64_t tokens;
  std::uint64_t callback;  // address of a double(double) native function
  std::int32_t any_replica;  // 1: `service` is a replicated service's first copy, any copy will do
  std::int32_t reserved;     // 0
};
static_assert(sizeof(ActionHeader) == 104, "ActionHeader layout is shared with Python");

struct DecisionRecord {
  std::uint64_t action;
  std::int64_t grant_milli;
  double grant;  // base units of the elastic kind
  double time;   // seconds
  std::int32_t kind;
  std::int32_t node;
  std::int32_t device;
  std::int32_t service;
  std::int32_t elastic_kind;
  std::int32_t reason;
};
static_assert(sizeof(DecisionRecord) == 56, "DecisionRecord layout is shared with Python");

}  // namespace tangram::bindings
