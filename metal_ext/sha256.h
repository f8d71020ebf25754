// Portable SHA-256 (FIPS 180-4) used to verify a record before publication.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace hebrus {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const uint8_t* data, size_t size);

} // namespace hebrus
