#include "tangram/policy.h"

namespace tangram {

namespace {

// One row per PolicyKind, in its order. docs/scheduling.md has the same table in words;
// tangram/reference.py's POLICY_RULES holds the same rows (a test compares them).
const std::vector<PolicyRow>& rows() {
  static const std::vector<PolicyRow> kPolicyRows = {
      //  name          order                 bins                          spare                     restore                    service devices
      {"tangram",    {OrderRule::kEstimate, BinLayout::kNodes,           SpareRule::kUncontended, RestoreRule::kQueuesFirst, ServiceDevices::kAny}},
      {"fifo",       {OrderRule::kArrival,  BinLayout::kNodes,           SpareRule::kNone,        RestoreRule::kOnDemand,    ServiceDevices::kAny}},
      {"trajectory", {OrderRule::kArrival,  BinLayout::kTrajectorySlots, SpareRule::kNone,        RestoreRule::kOnDemand,    ServiceDevices::kHome}},
      {"isolated",   {OrderRule::kArrival,  BinLayout::kTaskPools,       SpareRule::kNone,        RestoreRule::kOnDemand,    ServiceDevices::kHome}},
      {"optimus",    {OrderRule::kArrival,  BinLayout::kNodes,           SpareRule::kEveryBin,    RestoreRule::kOnDemand,    ServiceDevices::kAny}},
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

void validate_rules(const PolicyRow& row, const std::string& field) {
  if (row.name.empty()) throw Error(ErrorCode::kInvalidArgument, field + ".name", "a policy needs a name");
  const PolicyRules& r = row.rules;
  auto check = [&](const char* rule, std::uint8_t value, std::uint8_t count) {
    if (value >= count)
      throw Error(ErrorCode::kInvalidArgument, field + "." + rule, "no such rule (" + std::to_string(value) + ")");
  };
  check("order", static_cast<std::uint8_t>(r.order), 2);
  check("bins", static_cast<std::uint8_t>(r.bins), 3);
  check("spare", static_cast<std::uint8_t>(r.spare), 3);
  check("restore", static_cast<std::uint8_t>(r.restore), 2);
  check("service_devices", static_cast<std::uint8_t>(r.service_devices), 2);
}

}  // namespace tangram
