#include <array>
#include <iterator>

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "trace_ops.h"

namespace hebrus::bind {

using namespace nb::literals;

namespace {

// Columns of trace events (oldest first); the Python side turns them into a
// numpy structured array. One event's values, in kTraceColumns order.
constexpr const char* kTraceColumns[] = {
    "kind", "outcome", "priority", "exact", "promoted", "layer",
    "expert", "bytes", "t0", "t1", "t2"};
constexpr size_t kNumTraceColumns = std::size(kTraceColumns);

std::array<nb::object, kNumTraceColumns> trace_row(const TraceEvent& e) {
  return {nb::cast(int(e.kind)), nb::cast(trace_outcome_name(e)), nb::cast(int(e.priority)),
          nb::cast(e.exact), nb::cast(e.promoted), nb::cast(e.layer), nb::cast(e.expert),
          nb::cast(e.bytes), nb::cast(e.t0), nb::cast(e.t1), nb::cast(e.t2)};
}

nb::dict trace_dict(const std::vector<TraceEvent>& ev, uint64_t dropped) {
  std::array<nb::list, kNumTraceColumns> columns;
  for (const auto& e : ev) {
    auto row = trace_row(e);
    for (size_t c = 0; c < kNumTraceColumns; ++c) {
      columns[c].append(row[c]);
    }
  }
  nb::dict d;
  for (size_t c = 0; c < kNumTraceColumns; ++c) {
    d[kTraceColumns[c]] = columns[c];
  }
  d["dropped"] = dropped;
  return d;
}

} // namespace

void register_trace(nb::module_& m, nb::class_<Engine>& engine) {
  engine.def("enable_trace", &Engine::enable_trace, "capacity"_a)
      .def(
          "trace_events",
          [](Engine& e, bool clear) {
            uint64_t dropped = 0;
            auto ev = e.trace_events(clear, &dropped);
            return trace_dict(ev, dropped);
          },
          "clear"_a = false)
      .def("mark", &Engine::mark, "layer"_a, "tag"_a = 0);
  m.def("mark_after", &mark_after, "engine"_a, "value"_a, "layer"_a, "tag"_a = 0);
  // The engine trace's clock.
  m.def("trace_clock_ns", &now_ns);
}

} // namespace hebrus::bind
