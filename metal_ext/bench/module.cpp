// hebrus_mlx._bench: benchmark-only code, kept out of the product module
// (_ext). Today: raw_pread, the raw-read roofline bench_stream.py compares
// the engine with.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "py_errors.h"
#include "rawbench.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_bench, m) {
  m.doc() = "hebrus-mlx benchmark helpers (not used by the runtime)";
  hebrus::register_stream_error_translator();
  m.def(
      "raw_pread",
      [](const std::string& path,
         const std::vector<std::vector<uint64_t>>& batches,
         uint64_t length,
         int threads,
         bool direct,
         bool collect) {
        hebrus::RawReadResult r;
        {
          nb::gil_scoped_release nogil;
          r = hebrus::raw_pread(path, batches, length, threads, direct, collect);
        }
        nb::dict d;
        d["elapsed_ns"] = r.elapsed_ns;
        d["bytes"] = r.bytes;
        d["reads"] = r.reads;
        d["direct"] = r.direct;
        if (collect) {
          d["data"] = nb::bytes(
              reinterpret_cast<const char*>(r.data.data()), r.data.size());
        }
        return d;
      },
      "path"_a,
      "batches"_a,
      "length"_a,
      "threads"_a = 4,
      "direct"_a = true,
      "collect"_a = false);
}
