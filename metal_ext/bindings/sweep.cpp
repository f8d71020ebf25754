#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "sweep.h"

namespace hebrus::bind {

using namespace nb::literals;

void register_sweep(nb::module_& m) {
  nb::class_<SweepRing>(m, "SweepRing")
      .def(
          // make_shared for the same reason as Engine (bindings/engine.cpp).
          nb::new_([](std::shared_ptr<Engine> engine, int table, const std::string& path,
                      std::vector<uint64_t> part_bytes, std::vector<uint8_t> expand,
                      uint32_t span, uint32_t slots, int threads) {
            return std::make_shared<SweepRing>(std::move(engine), table, path,
                                               std::move(part_bytes), std::move(expand),
                                               span, slots, threads);
          }),
          "engine"_a, "table"_a, "path"_a, "part_bytes"_a, "expand"_a, "span"_a,
          "slots"_a = 2, "threads"_a = 4)
      .def("parts", &SweepRing::parts)
      .def_prop_ro("bytes", &SweepRing::bytes)
      .def("counters", [](const SweepRing& r) {
        nb::dict d;
        d["sweeps"] = r.sweeps();
        d["read_bytes"] = r.read_bytes();
        d["wait_ns"] = r.wait_ns();
        return d;
      })
      .def("close", &SweepRing::close);
  m.def("sweep_issue", &sweep_issue, "ring"_a, "dep"_a, "slot"_a, "first"_a);
  m.def("sweep_wait", &sweep_wait, "ring"_a, "value"_a, "slot"_a, "first"_a);
}

} // namespace hebrus::bind
