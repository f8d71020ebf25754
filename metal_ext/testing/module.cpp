// hebrus_mlx._testing: the engine's fault injection, built only as this
// test module (never into the runtime's _ext) and imported only by tests
// (tests/fault_injection.py). Its functions take an engine made by
// hebrus_mlx._ext (same nanobind domain) and install a FaultInjector on it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "engine.h"
#include "faults.h"
#include "py_errors.h"

namespace nb = nanobind;
using namespace nb::literals;
using hebrus::Engine;
using namespace hebrus::testing;

NB_MODULE(_testing, m) {
  m.doc() = "hebrus-mlx engine fault injection (test builds only)";
  hebrus::register_stream_error_translator();
  m.def(
      "inject_fault",
      [](Engine& e, const std::string& kind, int count) {
        injector(e)->inject(fault_named(kind), count);
      },
      "engine"_a,
      "kind"_a,
      "count"_a = 1);
  m.def(
      "hold",
      [](Engine& e, bool on) {
        injector(e)->hold(on);
        e.wake_workers();
      },
      "engine"_a,
      "on"_a);
  m.def(
      "set_read_delay_us",
      [](Engine& e, int64_t us) { injector(e)->set_delay_us(us); },
      "engine"_a,
      "us"_a);
  m.def(
      "set_offset_delay_us",
      [](Engine& e, uint64_t offset, int64_t us) {
        injector(e)->set_offset_delay_us(offset, us);
      },
      "engine"_a,
      "offset"_a,
      "us"_a);
  m.def(
      "widen_bf16",
      [](nb::bytes bf16) {
        // The readers' in-place widening, on a copy: bf16 in the first half
        // of a buffer twice its size, fp32 out.
        std::string buf(2 * bf16.size(), '\0');
        std::memcpy(buf.data(), bf16.c_str(), bf16.size());
        hebrus::widen_bf16_in_place(reinterpret_cast<uint8_t*>(buf.data()), bf16.size());
        return nb::bytes(buf.data(), buf.size());
      },
      "bf16"_a);
}
