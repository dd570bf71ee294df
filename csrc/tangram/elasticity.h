// Elasticity models: run time as a function of the elastic grant.
//
// Evaluated in the same IEEE double operations, in the same order, as the Python
// reference (tangram/bench/reference.py), so both take identical decisions.
#pragma once

#include <utility>
#include <vector>

#include "tangram/model.h"

namespace tangram {

using RuntimeTable = std::vector<std::pair<double, double>>;  // (units, seconds), units rising

// Seconds to run with `units` milli-units of the elastic kind, whose minimum grant is
// `minimum` milli-units. Non-elastic actions are evaluated at units == minimum == 1000.
double model_seconds(const ElasticityModel& model, Quantity units, Quantity minimum,
                     const std::vector<RuntimeTable>& tables);

// Throws Error(kInvalidArgument, field) unless the table is usable.
void validate_table(const RuntimeTable& points, const std::string& field);

}  // namespace tangram
