#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "bindings.h"
#include "sha256.h"
#include "xxh3.h"

namespace hebrus::bind {

using namespace nb::literals;

namespace {

nb::bytes as_bytes(const uint8_t* p, size_t n) {
  return nb::bytes(reinterpret_cast<const char*>(p), n);
}

// Whole-file XXH3-128 from `fd` (offset 0 to EOF) in 8 MiB preads, the GIL
// released: a resident store is checked as it is read, never held twice.
Xxh3Digest xxh3_fd(int fd, Xxh3Backend backend) {
  Xxh3_128 h(backend);
  std::vector<uint8_t> buf(8 << 20);
  for (off_t at = 0;;) {
    ssize_t n = ::pread(fd, buf.data(), buf.size(), at);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      throw std::system_error(errno, std::generic_category(), "xxh3_128_fd");
    }
    if (n == 0) {
      return h.finish();
    }
    h.update(buf.data(), size_t(n));
    at += n;
  }
}

// A read-only view of any contiguous buffer (bytes, bytearray, memoryview, a
// numpy array): readers hash slices of their read buffers without a copy.
class ByteView {
 public:
  explicit ByteView(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) {
      throw nb::python_error();
    }
  }
  ~ByteView() {
    PyBuffer_Release(&view_);
  }
  ByteView(const ByteView&) = delete;
  ByteView& operator=(const ByteView&) = delete;
  const uint8_t* data() const {
    return static_cast<const uint8_t*>(view_.buf);
  }
  size_t size() const {
    return size_t(view_.len);
  }

 private:
  Py_buffer view_{};
};

} // namespace

void register_hash(nb::module_& m) {
  m.def(
      "sha256",
      [](const nb::bytes& b, bool portable) {
        Digest d = sha256(reinterpret_cast<const uint8_t*>(b.c_str()), b.size(), portable);
        return as_bytes(d.data(), d.size());
      },
      "data"_a,
      "portable"_a = false);
  m.def("sha256_backend", &sha256_backend);
  // backend: "auto" (the fastest here), or one of xxh3_backends() - tests
  // pin "scalar" to check the portable path next to the SIMD one.
  m.def(
      "xxh3_128",
      [](nb::handle data, const std::string& backend) {
        Xxh3Backend id = xxh3_backend_named(backend);
        ByteView b(data);
        Xxh3Digest d;
        {
          nb::gil_scoped_release nogil;
          d = xxh3_128(b.data(), b.size(), id);
        }
        return as_bytes(d.data(), d.size());
      },
      "data"_a,
      "backend"_a = "auto");
  m.def(
      "xxh3_128_fd",
      [](int fd, const std::string& backend) {
        Xxh3Backend id = xxh3_backend_named(backend);
        Xxh3Digest d;
        {
          nb::gil_scoped_release nogil;
          d = xxh3_fd(fd, id);
        }
        return as_bytes(d.data(), d.size());
      },
      "fd"_a,
      "backend"_a = "auto");
  m.def("xxh3_backend", &xxh3_backend);
  m.def("xxh3_backends", &xxh3_backends);
}

} // namespace hebrus::bind
