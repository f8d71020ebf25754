// SHA-256 (FIPS 180-4) used to verify a record before publication: the
// CPU's SHA instructions where it has them (x86 SHA-NI, ARMv8 SHA-2), the
// portable rounds otherwise.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace hebrus {

using Digest = std::array<uint8_t, 32>;

// Incremental form: a record scattered over arena parts is hashed as one
// byte stream without first gathering it.
class Sha256 {
 public:
  // portable=true forces the plain C++ rounds (tests cover both paths).
  explicit Sha256(bool portable = false);
  void update(const uint8_t* data, size_t size);
  Digest finish();

 private:
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
  void (*blocks_)(uint32_t*, const uint8_t*, size_t);
};

Digest sha256(const uint8_t* data, size_t size, bool portable = false);

// The block rounds picked at load: "sha-ni" (x86 SHA extensions), "armv8"
// (ARMv8 SHA-2 instructions) or "portable".
const char* sha256_backend();

namespace detail {
extern const uint32_t kSha256K[64]; // round constants, shared by every path
#if defined(__aarch64__)
// sha256_armv8.cpp (the only file built with the crypto extension).
bool sha256_armv8_usable();
void sha256_blocks_armv8(uint32_t h[8], const uint8_t* data, size_t n);
#endif
} // namespace detail

} // namespace hebrus
