// Shared by the extension modules (_ext, _bench): StreamError crosses into
// Python as the class hebrus_mlx.stream.errors names for its error_name().
#pragma once

#include <nanobind/nanobind.h>

#include "engine.h"

namespace hebrus {

inline void register_stream_error_translator() {
  namespace nb = nanobind;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StreamError& e) {
      nb::object cls;
      try {
        cls = nb::module_::import_("hebrus_mlx.stream.errors")
                  .attr("BY_NAME")[error_name(e.code)];
      } catch (...) {
        PyErr_Clear();
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return;
      }
      PyErr_SetString(cls.ptr(), e.message.c_str());
    }
  });
}

} // namespace hebrus
