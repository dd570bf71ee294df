// tangram::Error -> the typed exceptions of tangram/_errors.py, with field and reason.
#include <pybind11/pybind11.h>

#include "tangram/types.h"

namespace py = pybind11;

void register_errors(py::module_&) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tangram::Error& e) {
      const char* name = "ValidationError";
      switch (e.code()) {
        case tangram::ErrorCode::kInvalidArgument: name = "ValidationError"; break;
        case tangram::ErrorCode::kUnknownName: name = "UnknownNameError"; break;
        case tangram::ErrorCode::kDuplicateId: name = "DuplicateIdError"; break;
        case tangram::ErrorCode::kUnknownAction: name = "UnknownActionError"; break;
        case tangram::ErrorCode::kInvalidState: name = "InvalidStateError"; break;
      }
      py::object cls = py::module_::import("tangram._errors").attr(name);
      py::object exc = cls(e.field(), e.reason());
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });
}
