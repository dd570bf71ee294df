// tangram._core: the private compiled module. One register_<area>.cc per area.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_errors(py::module_& m);
void register_scheduler(py::module_& m);

PYBIND11_MODULE(_core, m) {
  m.doc() = "tangram scheduler core (private; use the tangram package)";
  // The package version it was built for: a source folder borrowing an installed build
  // checks it (tangram/_compiled.py).
  m.attr("__version__") = TANGRAM_VERSION;
  register_errors(m);
  register_scheduler(m);
}
