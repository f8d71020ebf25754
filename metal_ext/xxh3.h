// XXH3-128: the per-read fast check of streamed records (docs/INTEGRITY.md).
// SHA-256 (sha256.h) stays the publication and `verify` digest; this one is
// what the engine checks every read against when the artifact carries it,
// at memory speed instead of ~1.5-2 GB/s per core.
//
// Written here from the published algorithm description (Yann Collet,
// "xxHash fast digest algorithm", doc/xxhash_spec.md of
// https://github.com/Cyan4973/xxHash, sections "XXH3 Algorithm
// Description"), default secret and seed 0. Checked against the `xxhash`
// package from PyPI and its published vectors (tests/test_xxh3.py,
// tools/check_xxh3.py, which also runs the arm64 build under qemu).
//
// No dependency but the C++ standard library and the compiler's SIMD
// intrinsics: the long-input accumulate/scramble steps run on AVX2 or SSE2
// (x86-64, picked at load by cpuid) or NEON (arm64, always present), with a
// scalar path every platform has and tests can force.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hebrus {

// Canonical form: the high 64 bits then the low 64 bits, each big-endian
// (what xxhash's xxh3_128().digest() returns).
using Xxh3Digest = std::array<uint8_t, 16>;

// Which accumulate/scramble implementation a hasher uses. kAuto: the fastest
// this CPU has (xxh3_backend()).
enum class Xxh3Backend : int { kAuto = 0, kScalar, kSse2, kAvx2, kNeon };

// Incremental form: a record scattered over arena parts is hashed as one
// byte stream (same digest as one call on the concatenation).
class Xxh3_128 {
 public:
  // Throws std::invalid_argument for a backend this CPU/build lacks.
  explicit Xxh3_128(Xxh3Backend backend = Xxh3Backend::kAuto);
  void update(const uint8_t* data, size_t size);
  Xxh3Digest finish() const;

  struct Kernels; // accumulate/scramble of one backend (xxh3.cpp)

 private:
  void consume(const uint8_t* stripes, size_t n);
  alignas(32) uint64_t acc_[8];
  alignas(32) uint8_t buf_[256]; // input not yet consumed, stripe-aligned
  uint8_t tail_[64]; // the 64 bytes consumed just before buf_
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
  unsigned block_stripes_ = 0; // stripes accumulated in the current block
  const Kernels* k_;
};

Xxh3Digest xxh3_128(
    const uint8_t* data, size_t size, Xxh3Backend backend = Xxh3Backend::kAuto);

// "avx2", "sse2", "neon" or "scalar": what kAuto picks on this CPU.
const char* xxh3_backend();
// Every backend usable here, by name (the picked one first, "scalar" last).
std::vector<std::string> xxh3_backends();
// By name ("auto" included); throws std::invalid_argument otherwise.
Xxh3Backend xxh3_backend_named(const std::string& name);

} // namespace hebrus
