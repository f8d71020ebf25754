#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "ops.h"

namespace hebrus::bind {

using namespace nb::literals;

void register_ops(nb::module_& m) {
  m.def(
      "create_arena",
      &create_arena,
      "engine"_a,
      "part_bytes"_a,
      "rows"_a,
      "expand"_a = std::vector<uint8_t>{});
  m.def(
      "gather_rows", &gather_rows, "engine"_a, "table"_a, "row_ids"_a,
      "rows_per_page"_a, "row_bytes"_a, "header_bytes"_a = 0, "owner"_a = 0,
      "generation"_a = 0, "layer"_a = -1);
  m.def(
      "resolve_records", &resolve_records, "engine"_a, "table"_a, "indices"_a,
      "owner"_a = 0, "generation"_a = 0, "layer"_a = -1);
  nb::class_<Wave>(m, "Wave")
      .def_prop_ro("lease", &Wave::lease)
      .def_prop_ro("size", &Wave::size)
      .def("take", &Wave::take, "after"_a, "n"_a = 1);
  m.def(
      "resolve_wave", &resolve_wave, "engine"_a, "table"_a, "indices"_a,
      "owner"_a = 0, "generation"_a = 0, "layer"_a = -1, "deadline_s"_a = 0.0);
  m.def("release_after", &release_after, "engine"_a, "value"_a, "lease"_a);
  m.def("host_roundtrip", &host_roundtrip, "value"_a);
  m.def("load_tickets", &load_tickets, "engine"_a, "tickets"_a);
  m.def(
      "gather_records", &gather_records, "engine"_a, "table"_a, "indices"_a,
      "owner"_a = 0, "generation"_a = 0, "layer"_a = -1);
  m.def(
      "prefetch_records", &prefetch_records, "engine"_a, "table"_a, "indices"_a,
      "priority"_a = 1, "confidence"_a = 1.0, "exact"_a = false, "owner"_a = 0,
      "generation"_a = 0, "layer"_a = -1);
}

} // namespace hebrus::bind
