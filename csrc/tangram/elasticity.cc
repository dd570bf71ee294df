#include "tangram/elasticity.h"

#include <algorithm>
#include <cmath>

namespace tangram {

namespace {
double table_seconds(const RuntimeTable& t, double x) {
  if (x <= t.front().first) return t.front().second;
  if (x >= t.back().first) return t.back().second;
  // First point strictly above x; the segment is [i - 1, i].
  auto it = std::upper_bound(t.begin(), t.end(), x,
                             [](double v, const std::pair<double, double>& p) { return v < p.first; });
  const auto& hi = *it;
  const auto& lo = *(it - 1);
  return lo.second + (hi.second - lo.second) * ((x - lo.first) / (hi.first - lo.first));
}
}  // namespace

double model_seconds(const ElasticityModel& model, Quantity units, Quantity minimum,
                     const std::vector<RuntimeTable>& tables) {
  switch (model.kind) {
    case ModelKind::kConstant:
      return model.seconds;
    case ModelKind::kAmdahl: {
      double p = model.parallel_fraction;
      return model.seconds * ((1.0 - p) + p * (static_cast<double>(minimum) / static_cast<double>(units)));
    }
    case ModelKind::kTable:
      return table_seconds(tables[static_cast<std::size_t>(model.table)], static_cast<double>(units) / 1000.0);
    case ModelKind::kCallback:
      return model.callback(static_cast<double>(units) / 1000.0);
  }
  return NAN;
}

void validate_table(const RuntimeTable& points, const std::string& field) {
  if (points.empty()) throw Error(ErrorCode::kInvalidArgument, field, "a table needs at least one point");
  for (std::size_t i = 0; i < points.size(); ++i) {
    const auto& [units, seconds] = points[i];
    std::string at = field + "[" + std::to_string(i) + "]";
    if (!std::isfinite(units) || units <= 0 || units > kMaxBaseUnits)
      throw Error(ErrorCode::kInvalidArgument, at + ".units", "must be a finite number in (0, 1e12]");
    if (!std::isfinite(seconds) || seconds < 0 || seconds > kMaxSeconds)
      throw Error(ErrorCode::kInvalidArgument, at + ".seconds", "must be a finite number in [0, 1e9]");
    if (i > 0 && !(units > points[i - 1].first))
      throw Error(ErrorCode::kInvalidArgument, at + ".units", "units must rise strictly from point to point");
  }
}

}  // namespace tangram
