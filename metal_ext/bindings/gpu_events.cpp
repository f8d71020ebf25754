#include <nanobind/nanobind.h>

#include "bindings.h"
#include "ops.h"
#include "ops_metal.h"

namespace hebrus::bind {

using namespace nb::literals;

// GPU-event streaming path (ops_metal.h): off unless turned on, which
// hebrus_mlx does only for a machine profile where it passed.
void register_gpu_events(nb::module_& m) {
  m.def("gpu_events_compiled", &gpu_events_compiled);
  m.def("gpu_events_enabled", &gpu_events_enabled);
  m.def("set_gpu_events", &set_gpu_events, "on"_a);
  m.def("check_gpu_event_errors", &check_gpu_event_errors);
  m.def("gpu_task_wait_bound", &gpu_task_wait_bound);
  m.def("set_gpu_task_wait_bound", &set_gpu_task_wait_bound, "seconds"_a);
}

} // namespace hebrus::bind
