// tangram._core.Scheduler: batches of NumPy records in, NumPy decision records out.
// Floats from Python are checked here (NaN, infinities, negatives, absurd sizes) and
// turned into the core's fixed-point integers with the same rounding as tangram/bench/reference.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "records.h"
#include "tangram/scheduler.h"

namespace py = pybind11;
using namespace tangram;
using tangram::bindings::ActionHeader;
using tangram::bindings::DecisionRecord;

namespace {

// `field()` names the value; it is only called to build an error (the hot path stays free
// of string building).
template <class Field>
Quantity milli_field(double v, const Field& field) {
  if (v >= 0 && v <= kMaxBaseUnits) return to_milli(v);  // NaN fails both comparisons
  if (!std::isfinite(v)) throw Error(ErrorCode::kInvalidArgument, field(), "must be a finite number, got " + std::to_string(v));
  if (v < 0) throw Error(ErrorCode::kInvalidArgument, field(), "must not be negative, got " + std::to_string(v));
  throw Error(ErrorCode::kInvalidArgument, field(), "is absurdly large (over 1e12 units)");
}

TimeNs time_field(double now) {
  if (!std::isfinite(now) || now < 0 || now > kMaxSeconds)
    throw Error(ErrorCode::kInvalidArgument, "now", "must be a finite time in [0, 1e9] seconds");
  return to_ns(now);
}

class PyScheduler {
 public:
  PyScheduler(std::vector<std::string> kinds, std::vector<std::string> node_names,
              py::array_t<std::int64_t, py::array::c_style | py::array::forcecast> capacity,
              std::vector<std::vector<std::int64_t>> gpus,
              std::vector<std::tuple<std::string, double, std::int64_t, std::int64_t, std::int64_t>> quotas,
              std::vector<std::tuple<std::string, std::int64_t, double, std::int32_t, double, std::int64_t, bool, std::int64_t, std::int32_t, bool>> services,
              std::vector<std::int64_t> offload_memory,
              const std::string& policy, double aging, std::int32_t candidates, double min_relative_gain,
              double starvation_seconds, double trajectory_slot_cpu,
              std::vector<std::pair<std::uint32_t, double>> pools, py::dtype decision_dtype,
              std::optional<std::vector<std::pair<std::string, std::string>>> rules)
      : sched_(make_inventory(kinds, node_names, capacity, gpus, quotas, services, offload_memory),
               make_policy(policy, aging, candidates, min_relative_gain, starvation_seconds, trajectory_slot_cpu, pools,
                           rules)),
        decision_dtype_(std::move(decision_dtype)),
        kinds_(static_cast<std::int32_t>(kinds.size())) {}

  std::int32_t add_table(std::vector<std::pair<double, double>> points) { return sched_.add_table(std::move(points)); }

  py::array submit(py::array records, double now) {
    TimeNs t = time_field(now);
    const std::size_t item = sizeof(ActionHeader) + sizeof(double) * static_cast<std::size_t>(kinds_);
    if (records.ndim() != 1 || static_cast<std::size_t>(records.itemsize()) != item ||
        (records.size() > 1 && records.strides(0) != static_cast<py::ssize_t>(item)))
      throw Error(ErrorCode::kInvalidArgument, "actions",
                  "expected a contiguous 1-d array of the scheduler's action dtype (itemsize " + std::to_string(item) + ")");
    const std::size_t n = static_cast<std::size_t>(records.size());
    // Decoded into scratch that every scheduler on this thread shares and that never
    // shrinks: each spec keeps its demand vector, so a burst on a new scheduler (a
    // simulator run, say) does not allocate one per action again. Nothing re-enters
    // submit while it runs (elasticity callbacks are native functions).
    // (It keeps at most kKeptSpecs after a larger batch: about 11 MB.)
    constexpr std::size_t kKeptSpecs = std::size_t{1} << 16;
    thread_local std::vector<ActionSpec> specs;
    if (specs.size() < n) specs.resize(n);
    struct Trim {
      ~Trim() {
        if (specs.size() > kKeptSpecs) {
          specs.resize(kKeptSpecs);
          specs.shrink_to_fit();
        }
      }
    } trim;
    const char* base = static_cast<const char*>(records.data());
    for (std::size_t i = 0; i < n; ++i) decode(base + i * item, i, specs[i]);
    sched_.submit(specs.data(), n, t, out_);
    return decisions();
  }

  py::array complete(py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast> ids, double now) {
    TimeNs t = time_field(now);
    sched_.complete(ids.data(), static_cast<std::size_t>(ids.size()), t, out_);
    return decisions();
  }
  py::array cancel(py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast> ids, double now) {
    TimeNs t = time_field(now);
    sched_.cancel(ids.data(), static_cast<std::size_t>(ids.size()), t, out_);
    return decisions();
  }
  // limits: units of each action's elastic kind (floats, as in records), checked here.
  py::array limit(py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast> ids,
                  py::array_t<double, py::array::c_style | py::array::forcecast> limits, double now) {
    TimeNs t = time_field(now);
    const std::size_t n = static_cast<std::size_t>(ids.size());
    if (static_cast<std::size_t>(limits.size()) != n)
      throw Error(ErrorCode::kInvalidArgument, "limits",
                  "has " + std::to_string(limits.size()) + " entries for " + std::to_string(n) + " ids");
    limit_milli_.resize(n);
    for (std::size_t i = 0; i < n; ++i)
      limit_milli_[i] = milli_field(limits.data()[i], [i] { return "limits[" + std::to_string(i) + "]"; });
    sched_.limit(ids.data(), limit_milli_.data(), n, t, out_);
    return decisions();
  }
  py::array end_trajectories(py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast> ids, double now) {
    TimeNs t = time_field(now);
    sched_.end_trajectories(ids.data(), static_cast<std::size_t>(ids.size()), t, out_);
    return decisions();
  }
  py::array tick(double now) {
    sched_.tick(time_field(now), out_);
    return decisions();
  }
  py::array service_restored(std::int32_t service, std::int32_t node, std::int32_t device, double now) {
    sched_.service_restored(service, node, device, time_field(now), out_);
    return decisions();
  }
  py::array set_device_online(std::int32_t node, std::int32_t device, bool online, double now) {
    sched_.set_device_online(node, device, online, time_field(now), out_);
    return decisions();
  }
  py::array set_node_online(std::int32_t node, bool online, double now) {
    sched_.set_node_online(node, online, time_field(now), out_);
    return decisions();
  }
  // capacity: one milli-unit entry per kind; gpus: milli-MiB per GPU.
  py::tuple add_node(const std::string& name, std::vector<std::int64_t> capacity, std::vector<std::int64_t> gpus,
                     double now, std::int64_t offload_memory) {
    NodeSpec node;
    node.name = name;
    node.offload_memory = offload_memory;
    node.capacity = std::move(capacity);
    for (std::int64_t mem : gpus) node.gpus.push_back(GpuSpec{mem});
    std::int32_t index = sched_.add_node(std::move(node), time_field(now), out_);
    return py::make_tuple(index, decisions());
  }

  Scheduler& core() { return sched_; }

 private:
  static Inventory make_inventory(const std::vector<std::string>& kinds, const std::vector<std::string>& names,
                                  const py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>& capacity,
                                  const std::vector<std::vector<std::int64_t>>& gpus,
                                  const std::vector<std::tuple<std::string, double, std::int64_t, std::int64_t, std::int64_t>>& quotas,
                                  const std::vector<std::tuple<std::string, std::int64_t, double, std::int32_t, double, std::int64_t, bool, std::int64_t, std::int32_t, bool>>& services,
                                  const std::vector<std::int64_t>& offload_memory) {
    Inventory inv;
    inv.kinds = kinds;
    const std::size_t N = names.size(), K = kinds.size();
    if (capacity.ndim() != 2 || static_cast<std::size_t>(capacity.shape(0)) != N || static_cast<std::size_t>(capacity.shape(1)) != K)
      throw Error(ErrorCode::kInvalidArgument, "inventory.capacity", "must be a nodes x kinds array");
    if (gpus.size() != N) throw Error(ErrorCode::kInvalidArgument, "inventory.gpus", "needs one list per node");
    for (std::size_t n = 0; n < N; ++n) {
      NodeSpec node;
      node.name = names[n];
      node.capacity.assign(capacity.data() + n * K, capacity.data() + (n + 1) * K);
      for (std::int64_t mem : gpus[n]) node.gpus.push_back(GpuSpec{mem});
      inv.nodes.push_back(std::move(node));
    }
    for (const auto& [name, rate, burst, conc, tpm] : quotas) inv.quotas.push_back(QuotaSpec{name, rate, burst, conc, tpm});
    for (const auto& [name, mem, restore, batch, offload, asleep, movable, host, replica_of, surplus] : services)
      inv.services.push_back(ServiceSpec{name, mem, restore, batch, offload, asleep, movable, host, replica_of, surplus});
    if (!offload_memory.empty() && offload_memory.size() != N)
      throw Error(ErrorCode::kInvalidArgument, "inventory.offload_memory", "needs one entry per node");
    for (std::size_t n = 0; n < offload_memory.size(); ++n) inv.nodes[n].offload_memory = offload_memory[n];
    return inv;
  }

  static PolicyConfig make_policy(const std::string& name, double aging, std::int32_t candidates, double gain,
                                  double starvation, double slot_cpu, std::vector<std::pair<std::uint32_t, double>> pools,
                                  const std::optional<std::vector<std::pair<std::string, std::string>>>& rules) {
    PolicyConfig p;
    // A built-in policy by name; or, with `rules`, a row of its own under that name.
    if (rules) p.row = PolicyRow{name, parse_rules(*rules, "policy(" + name + ").rules")};
    else p.kind = policy_from_name(name);
    p.aging = aging;
    p.candidates = candidates;
    p.min_relative_gain = gain;
    p.starvation_seconds = starvation;
    p.trajectory_slot_cpu = slot_cpu;
    p.pools = std::move(pools);
    return p;
  }

  void decode(const char* rec, std::size_t i, ActionSpec& s) const {
    ActionHeader h;
    std::memcpy(&h, rec, sizeof h);
    auto field = [i](const char* name) {
      return [i, name] { return "actions[" + std::to_string(i) + "]." + name; };
    };
    s.id = h.id;
    s.trajectory = h.trajectory;
    s.task = h.task;
    s.priority = h.priority;
    s.elastic_kind = h.elastic_kind;
    if (h.model > static_cast<std::uint32_t>(ModelKind::kCallback))
      throw Error(ErrorCode::kInvalidArgument, field("model")(), "unknown model kind " + std::to_string(h.model));
    s.model.kind = static_cast<ModelKind>(h.model);
    s.model.seconds = h.seconds;
    s.model.parallel_fraction = h.parallel_fraction;
    s.model.table = h.table;
    s.model.callback = reinterpret_cast<RuntimeCallback>(static_cast<std::uintptr_t>(h.callback));
    s.gpu_memory = milli_field(h.gpu_memory, field("gpu_memory"));
    s.elastic_max = h.elastic_kind >= 0 ? milli_field(h.elastic_max, field("elastic_max")) : 0;
    s.affinity_node = h.affinity;
    s.service = h.service;
    s.quota = h.quota;
    s.tokens = h.tokens;
    s.any_replica = h.any_replica != 0;
    s.demand.resize(static_cast<std::size_t>(kinds_));
    const char* d = rec + sizeof(ActionHeader);
    for (std::int32_t k = 0; k < kinds_; ++k) {
      double v;
      std::memcpy(&v, d + k * sizeof(double), sizeof v);
      s.demand[k] = milli_field(v, [&] { return field("demand.")() + sched_.inventory().kinds[k]; });
    }
  }

  // The records are written into a buffer the array owns through a capsule: cheaper than
  // letting NumPy allocate (and zero-fill) a structured array.
  py::array decisions() {
    const std::size_t n = out_.size();
    auto* dst = new DecisionRecord[n == 0 ? 1 : n];
    for (std::size_t i = 0; i < n; ++i) {
      const Decision& d = out_[i];
      dst[i] = DecisionRecord{d.action, d.grant, static_cast<double>(d.grant) / 1000.0, to_seconds(d.time),
                              static_cast<std::int32_t>(d.kind), d.node, d.device, d.service, d.elastic_kind, d.reason};
    }
    py::capsule owner(dst, [](void* p) { delete[] static_cast<DecisionRecord*>(p); });
    return py::array(decision_dtype_, py::array::ShapeContainer{static_cast<py::ssize_t>(n)},
                     py::array::StridesContainer{static_cast<py::ssize_t>(sizeof(DecisionRecord))}, dst, owner);
  }

  Scheduler sched_;
  py::dtype decision_dtype_;
  std::int32_t kinds_;
  std::vector<Decision> out_;
  std::vector<Quantity> limit_milli_;  // scratch of limit()
};

}  // namespace

void register_scheduler(py::module_& m) {
  // The built-in policies (policy.cc's rows): POLICIES their names in order, POLICY_RULES
  // each one's rules by name, RULES every rule with its values.
  py::list names;
  py::dict rows;
  for (const PolicyRow& row : builtin_policies()) {
    names.append(row.name);
    py::dict rules;
    for (const auto& [field, value] : describe_rules(row.rules)) rules[py::str(field)] = value;
    rows[py::str(row.name)] = rules;
  }
  m.attr("POLICIES") = py::tuple(names);
  m.attr("POLICY_RULES") = rows;
  py::dict rule_values;
  for (const auto& [field, values] : rule_names()) rule_values[py::str(field)] = py::tuple(py::cast(values));
  m.attr("RULES") = rule_values;
  m.attr("ACTION_HEADER_SIZE") = sizeof(ActionHeader);
  m.attr("DECISION_SIZE") = sizeof(DecisionRecord);
  py::class_<PyScheduler>(m, "Scheduler")
      .def(py::init<std::vector<std::string>, std::vector<std::string>,
                    py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>,
                    std::vector<std::vector<std::int64_t>>,
                    std::vector<std::tuple<std::string, double, std::int64_t, std::int64_t, std::int64_t>>,
                    std::vector<std::tuple<std::string, std::int64_t, double, std::int32_t, double, std::int64_t, bool, std::int64_t, std::int32_t, bool>>, std::vector<std::int64_t>, const std::string&,
                    double,
                    std::int32_t, double, double, double, std::vector<std::pair<std::uint32_t, double>>, py::dtype,
                    std::optional<std::vector<std::pair<std::string, std::string>>>>(),
           py::kw_only(), py::arg("kinds"), py::arg("node_names"), py::arg("capacity"), py::arg("gpus"),
           py::arg("quotas"), py::arg("services"), py::arg("offload_memory"), py::arg("policy"), py::arg("aging"), py::arg("candidates"),
           py::arg("min_relative_gain"), py::arg("starvation_seconds"), py::arg("trajectory_slot_cpu"),
           py::arg("pools"), py::arg("decision_dtype"), py::arg("rules") = py::none())
      .def("add_table", &PyScheduler::add_table, py::arg("points"))
      .def("submit", &PyScheduler::submit, py::arg("records"), py::arg("now"))
      .def("complete", &PyScheduler::complete, py::arg("ids"), py::arg("now"))
      .def("cancel", &PyScheduler::cancel, py::arg("ids"), py::arg("now"))
      .def("limit", &PyScheduler::limit, py::arg("ids"), py::arg("limits"), py::arg("now"))
      .def("end_trajectories", &PyScheduler::end_trajectories, py::arg("ids"), py::arg("now"))
      .def("tick", &PyScheduler::tick, py::arg("now"))
      .def("service_restored", &PyScheduler::service_restored, py::arg("service"), py::arg("node"), py::arg("device"),
           py::arg("now"))
      .def("quota_snapshot", [](PyScheduler& s, std::int32_t quota, double now) {
        const tangram::QuotaSnapshot q = s.core().quota_snapshot(quota, time_field(now));
        return py::make_tuple(q.requests, q.tokens, static_cast<double>(q.paused_until) / 1e9);
      }, py::arg("quota"), py::arg("now"))
      .def("back_off_quota", [](PyScheduler& s, std::int32_t quota, double until) {
        if (!std::isfinite(until) || until < 0 || until > kMaxSeconds)
          throw Error(ErrorCode::kInvalidArgument, "until", "must be a finite time in [0, 1e9] seconds");
        s.core().back_off_quota(quota, to_ns(until));
      }, py::arg("quota"), py::arg("until"))
      .def("set_service_times", [](PyScheduler& s, std::int32_t svc, double restore, double offload) {
        s.core().set_service_times(svc, restore, offload);
      }, py::arg("service"), py::arg("restore_seconds"), py::arg("offload_seconds"))
      .def("set_device_online", &PyScheduler::set_device_online, py::arg("node"), py::arg("device"), py::arg("online"),
           py::arg("now"))
      .def("device_online", [](PyScheduler& s, std::int32_t node, std::int32_t device) {
        return s.core().device_online(node, device);
      }, py::arg("node"), py::arg("device"))
      .def("set_node_online", &PyScheduler::set_node_online, py::arg("node"), py::arg("online"), py::arg("now"))
      .def("add_node", &PyScheduler::add_node, py::arg("name"), py::arg("capacity"), py::arg("gpus"), py::arg("now"),
           py::arg("offload_memory") = -1)
      .def("node_online", [](PyScheduler& s, std::int32_t node) { return s.core().node_online(node); }, py::arg("node"))
      .def_property_readonly("next_wakeup", [](PyScheduler& s) -> py::object {
        TimeNs t = s.core().next_wakeup();
        if (t == kNever) return py::none();
        return py::float_(to_seconds(t));
      })
      .def_property_readonly("now", [](PyScheduler& s) { return to_seconds(s.core().now()); })
      .def("message", [](PyScheduler& s, std::int32_t i) { return s.core().message(i); }, py::arg("reason"))
      .def_property_readonly("message_count", [](PyScheduler& s) { return s.core().message_count(); })
      .def("explain", [](PyScheduler& s, std::uint64_t id) { return s.core().explain(id); }, py::arg("id"))
      .def("state", [](PyScheduler& s, std::uint64_t id) { return static_cast<int>(s.core().state(id)); }, py::arg("id"))
      .def("placement", [](PyScheduler& s, std::uint64_t id) {
        Decision d = s.core().placement(id);
        return py::make_tuple(d.node, d.device, d.service, d.elastic_kind, d.grant, to_seconds(d.time));
      }, py::arg("id"))
      .def_property_readonly("waiting_count", [](PyScheduler& s) { return s.core().waiting_count(); })
      .def_property_readonly("running_count", [](PyScheduler& s) { return s.core().running_count(); })
      .def("free", [](PyScheduler& s, std::int32_t node, std::int32_t kind) { return s.core().free(node, kind); },
           py::arg("node"), py::arg("kind"))
      .def("gpu_free", [](PyScheduler& s, std::int32_t node, std::int32_t dev) { return s.core().gpu_free(node, dev); },
           py::arg("node"), py::arg("device"))
      .def("service_location", [](PyScheduler& s, std::int32_t svc) { return s.core().service_location(svc); }, py::arg("service"))
      .def("trajectory_slot_node", [](PyScheduler& s, std::uint64_t t) { return s.core().trajectory_slot_node(t); },
           py::arg("trajectory"))
      .def("service_ready", [](PyScheduler& s, std::int32_t svc) { return s.core().service_ready(svc); }, py::arg("service"))
      .def("runtime", [](PyScheduler& s, std::uint64_t id, double units) {
        return s.core().runtime(id, milli_field(units, [] { return std::string("units"); }));
      }, py::arg("id"), py::arg("units"))
      .def("check_invariants", [](PyScheduler& s) { s.core().check_invariants(); });
}
