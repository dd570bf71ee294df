// The policies' rows and the names of their rules (policy.h).
//
// Reads and changes no scheduler state: a Scheduler resolves its row here once, when it is
// made. Guarantees: one row per PolicyKind, in its order, with a distinct name; every rule
// of a row validate_rules accepts is one the pass implements.
#include "tangram/policy.h"

#include <cmath>

namespace tangram {

namespace {

// One row per PolicyKind, in its order: the one list of policies. _core exports it as
// POLICIES and POLICY_RULES (tangram/bench/reference.py takes its rows from there);
// docs/scheduling.md has the same table in words; tests/cpp/test_policy_rows.cc pins it.
const std::vector<PolicyRow>& rows() {
  static const std::vector<PolicyRow> kPolicyRows = {
      //  name          order                 bins                          spare                     restore                    service devices        resize                  gain
      {"tangram",    {OrderRule::kEstimate, BinLayout::kNodes,           SpareRule::kUncontended, RestoreRule::kQueuesFirst, ServiceDevices::kAny,  ResizeRule::kMalleable, GainRule::kWait}},
      {"fifo",       {OrderRule::kArrival,  BinLayout::kNodes,           SpareRule::kNone,        RestoreRule::kOnDemand,    ServiceDevices::kAny,  ResizeRule::kFixed,     GainRule::kRelative}},
      {"trajectory", {OrderRule::kArrival,  BinLayout::kTrajectorySlots, SpareRule::kNone,        RestoreRule::kOnDemand,    ServiceDevices::kHome, ResizeRule::kFixed,     GainRule::kRelative}},
      {"isolated",   {OrderRule::kArrival,  BinLayout::kTaskPools,       SpareRule::kNone,        RestoreRule::kOnDemand,    ServiceDevices::kHome, ResizeRule::kFixed,     GainRule::kRelative}},
      {"optimus",    {OrderRule::kArrival,  BinLayout::kNodes,           SpareRule::kEveryBin,    RestoreRule::kOnDemand,    ServiceDevices::kAny,  ResizeRule::kFixed,     GainRule::kRelative}},
  };
  return kPolicyRows;
}

}  // namespace

const std::vector<PolicyRow>& builtin_policies() { return rows(); }

const PolicyRow& policy_row(PolicyKind kind) {
  const auto index = static_cast<std::size_t>(kind);
  if (index >= rows().size()) throw Error(ErrorCode::kUnknownName, "policy.kind", "no built-in policy with index " + std::to_string(index));
  return rows()[index];
}

const PolicyRow& resolve_policy(const PolicyConfig& config) {
  return config.row ? *config.row : policy_row(config.kind);
}

const char* policy_name(PolicyKind kind) {
  const auto index = static_cast<std::size_t>(kind);
  return index < rows().size() ? rows()[index].name.c_str() : "?";
}

PolicyKind policy_from_name(const std::string& name) {
  std::string known;
  for (std::size_t i = 0; i < rows().size(); ++i) {
    if (rows()[i].name == name) return static_cast<PolicyKind>(i);
    known += (i ? ", " : "") + rows()[i].name;
  }
  throw Error(ErrorCode::kUnknownName, "policy", "unknown policy '" + name + "' (" + known + ")");
}

const RuleNames& rule_names() {
  static const RuleNames kNames = {
      {"order", {"arrival", "estimate", "progress"}},
      {"bins", {"node", "trajectory_slots", "task_pools"}},
      {"spare", {"none", "uncontended", "every_bin"}},
      {"restore", {"on_demand", "queues_first"}},
      {"service_devices", {"any", "home"}},
      {"resize", {"fixed", "malleable"}},
      {"gain", {"relative", "wait"}},
  };
  return kNames;
}

namespace {

// The rules as their enums' values, in rule_names() order.
std::vector<std::uint8_t> rule_values(const PolicyRules& r) {
  return {static_cast<std::uint8_t>(r.order), static_cast<std::uint8_t>(r.bins), static_cast<std::uint8_t>(r.spare),
          static_cast<std::uint8_t>(r.restore), static_cast<std::uint8_t>(r.service_devices),
          static_cast<std::uint8_t>(r.resize), static_cast<std::uint8_t>(r.gain)};
}

}  // namespace

void validate_rules(const PolicyRow& row, const std::string& field) {
  if (row.name.empty()) throw Error(ErrorCode::kInvalidArgument, field + ".name", "a policy needs a name");
  const std::vector<std::uint8_t> values = rule_values(row.rules);
  for (std::size_t i = 0; i < values.size(); ++i)
    if (values[i] >= rule_names()[i].second.size())
      throw Error(ErrorCode::kInvalidArgument, field + "." + rule_names()[i].first,
                  "no such rule (" + std::to_string(values[i]) + ")");
  if (row.rules.gain == GainRule::kWait && row.rules.resize != ResizeRule::kMalleable)
    throw Error(ErrorCode::kInvalidArgument, field + ".rules.gain",
                "'wait' needs resize 'malleable' (it counts the actions running on a bin)");
}

std::vector<std::pair<std::string, std::string>> describe_rules(const PolicyRules& rules) {
  const std::vector<std::uint8_t> values = rule_values(rules);
  std::vector<std::pair<std::string, std::string>> out;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto& [field, names] = rule_names()[i];
    out.emplace_back(field, values[i] < names.size() ? names[values[i]] : "?");
  }
  return out;
}

PolicyRules parse_rules(const std::vector<std::pair<std::string, std::string>>& fields, const std::string& where) {
  const RuleNames& names = rule_names();
  std::vector<int> value(names.size(), -1);
  for (const auto& [field, name] : fields) {
    std::size_t i = 0;
    while (i < names.size() && names[i].first != field) ++i;
    if (i == names.size()) throw Error(ErrorCode::kInvalidArgument, where + "." + field, "no such rule");
    if (value[i] >= 0) throw Error(ErrorCode::kInvalidArgument, where + "." + field, "given twice");
    const std::vector<std::string>& allowed = names[i].second;
    std::string known;
    for (std::size_t v = 0; v < allowed.size(); ++v) {
      if (allowed[v] == name) value[i] = static_cast<int>(v);
      known += (v ? ", " : "") + allowed[v];
    }
    if (value[i] < 0) throw Error(ErrorCode::kInvalidArgument, where + "." + field, "unknown value '" + name + "' (" + known + ")");
  }
  for (std::size_t i = 0; i < names.size(); ++i)
    if (value[i] < 0) throw Error(ErrorCode::kInvalidArgument, where + "." + names[i].first, "missing");
  PolicyRules r;
  r.order = static_cast<OrderRule>(value[0]);
  r.bins = static_cast<BinLayout>(value[1]);
  r.spare = static_cast<SpareRule>(value[2]);
  r.restore = static_cast<RestoreRule>(value[3]);
  r.service_devices = static_cast<ServiceDevices>(value[4]);
  r.resize = static_cast<ResizeRule>(value[5]);
  r.gain = static_cast<GainRule>(value[6]);
  return r;
}

// How many trajectory slots of `slot_cpu` cores a node of `cpu` milli-cores holds: the most
// that fit, with the slot taken at a billionth of a core and the benefit of its rounding
// there (slot_nano - 1/2), so a slot given as cpu / n, which floating point may put a hair
// above the quotient, still gives n slots, while a slot even a millionth of a core larger
// gives fewer. In integers, so the core and the reference count alike.
Quantity trajectory_slots(Quantity cpu, double slot_cpu) {
  const __int128 slot_nano = static_cast<__int128>(std::floor(slot_cpu * 1e9 + 0.5));
  const __int128 cpu_nano = static_cast<__int128>(cpu) * 1000000;
  return static_cast<Quantity>((2 * cpu_nano) / (2 * slot_nano - 1));
}

}  // namespace tangram
