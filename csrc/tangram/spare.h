// What spare elastic units must leave free in a pass (SpareRule): where classes wait for
// room, and each bin's reserve. A part of Scheduler::Impl (scheduler_impl.h); spare.cc
// holds contend and the coordinators (grant_spare, bin_reserve).
//
// Owns: per node and partition, whether a class waited for room there in the pass and the
// most of each kind such a class asks for; per bin its reserve row of the pass, per
// partition the row of its parked classes' needs; which kinds any action was elastic in.
// Guarantees: a row stamped with another pass is stale and read as empty: contention and
// reserves never outlive their pass.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tangram/model.h"

namespace tangram {

// A candidate for spare units: an action started in this pass (its kStart's index in
// `out`), or a running one (decision SIZE_MAX) on a bin a completion freed room on.
struct SpareMember {
  std::int32_t slot;
  std::size_t decision;
  double work;        // fraction of its work left now (1 for a start)
  Quantity was;       // its grant before this pass's spare units
};

struct SpareReserve {
  std::int32_t K = 0;  // kinds
  std::vector<std::uint64_t> node_contended, partition_contended;  // == the pass when set
  // While contended: the most of each kind (K per node / partition) a class waiting there
  // asks for; spare units leave that much free (bin_reserve).
  std::vector<Quantity> node_need, partition_need;
  std::vector<std::uint64_t> parked_need_pass;  // by partition: the pass of its parked_need_rows row
  std::vector<Quantity> parked_need_rows;       // by partition, K each: parked_need(part, kNone)
  std::vector<std::uint64_t> reserve_pass;  // by bin: the pass its reserve_rows row is of
  std::vector<Quantity> reserve_rows;       // by bin, K each
  std::vector<std::uint8_t> elastic_kind_seen;  // by kind: some action was elastic in it
  std::vector<SpareMember> spare_running;  // scratch of grant_spare

  void resize(std::int32_t kinds, std::size_t n_nodes, std::size_t n_partitions) {
    K = kinds;
    node_contended.resize(n_nodes, 0);
    node_need.resize(n_nodes * K, 0);
    partition_contended.resize(n_partitions, 0);
    partition_need.resize(n_partitions * K, 0);
    parked_need_pass.resize(n_partitions, 0);
    parked_need_rows.resize(n_partitions * K, 0);
    elastic_kind_seen.resize(K, 0);
  }
  void append_bin() {
    reserve_pass.push_back(0);
    reserve_rows.resize(reserve_rows.size() + K, 0);
  }
  // In pass `pass`, a class waits for room in partition `part`, on `node` (kNone: anywhere
  // in it); its `demand` (nullptr: all of every kind, a starving head that halts the pass)
  // is held back from spare units there.
  void contend(std::int32_t part, std::int32_t node, const Quantity* demand, std::uint64_t pass);
};

}  // namespace tangram
