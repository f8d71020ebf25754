#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "trace_ops.h"

namespace hebrus::bind {

using namespace nb::literals;

namespace {

// Columns of trace events (oldest first); the Python side turns them into a
// numpy structured array.
nb::dict trace_dict(const std::vector<TraceEvent>& ev, uint64_t dropped) {
  nb::list kind, outcome, priority, exact, promoted, layer, expert, bytes, t0, t1, t2;
  for (const auto& e : ev) {
    kind.append(int(e.kind));
    outcome.append(trace_outcome_name(e));
    priority.append(int(e.priority));
    exact.append(e.exact);
    promoted.append(e.promoted);
    layer.append(e.layer);
    expert.append(e.expert);
    bytes.append(e.bytes);
    t0.append(e.t0);
    t1.append(e.t1);
    t2.append(e.t2);
  }
  nb::dict d;
  d["kind"] = kind;
  d["outcome"] = outcome;
  d["priority"] = priority;
  d["exact"] = exact;
  d["promoted"] = promoted;
  d["layer"] = layer;
  d["expert"] = expert;
  d["bytes"] = bytes;
  d["t0"] = t0;
  d["t1"] = t1;
  d["t2"] = t2;
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
