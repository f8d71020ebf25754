// SHA-256 block rounds on the ARMv8 SHA-2 instructions (FEAT_SHA256:
// SHA256H/H2/SU0/SU1), the path Apple silicon takes (expected several times
// the portable rounds there; unmeasured). Only this file is built with the
// crypto extension (CMakeLists: -march=armv8-a+crypto on Linux/arm64;
// Apple's arm64 target has it by default), so nothing else can use those
// instructions on a CPU without them; sha256.cpp calls in here only when
// sha256_armv8_usable() says the CPU has them.
//
// Verified here: compiled with aarch64-linux-gnu-g++ and run under
// qemu-aarch64 against NIST vectors and hashlib (tools/check_sha256.py).
// For macOS only type-checked: clang++ --target=arm64-apple-macos14
// -fsyntax-only (C++ headers stubbed) takes the intrinsic branch with no
// extra flag. Not verified: an Apple SDK build, real Apple silicon and its
// speed (AFN-013).
#include "sha256.h"

#if defined(__aarch64__)
#if defined(__ARM_FEATURE_SHA2) || defined(__ARM_FEATURE_CRYPTO)
#include <arm_neon.h>
#if defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace hebrus::detail {

bool sha256_armv8_usable() {
#if defined(__APPLE__)
  return true; // every Apple silicon CPU implements FEAT_SHA256
#elif defined(__linux__) && defined(HWCAP_SHA2)
  return (getauxval(AT_HWCAP) & HWCAP_SHA2) != 0;
#else
  return false;
#endif
}

void sha256_blocks_armv8(uint32_t h[8], const uint8_t* data, size_t n) {
  uint32x4_t abcd = vld1q_u32(h), efgh = vld1q_u32(h + 4);
  for (size_t blk = 0; blk < n; ++blk, data += 64) {
    const uint32x4_t abcd0 = abcd, efgh0 = efgh;
    uint32x4_t m[4];
    for (int j = 0; j < 4; ++j) {
      // Message words are big-endian.
      m[j] = vreinterpretq_u32_u8(vrev32q_u8(vld1q_u8(data + 16 * j)));
    }
    // 16 groups of 4 rounds; m[i & 3] holds W[4i..4i+3].
    for (int i = 0; i < 16; ++i) {
      uint32x4_t wk = vaddq_u32(m[i & 3], vld1q_u32(kSha256K + 4 * i));
      uint32x4_t prev = abcd;
      abcd = vsha256hq_u32(abcd, efgh, wk);
      efgh = vsha256h2q_u32(efgh, prev, wk);
      if (i < 12) {
        // W[4i+16..4i+19] from W[4i..4i+15].
        m[i & 3] = vsha256su1q_u32(
            vsha256su0q_u32(m[i & 3], m[(i + 1) & 3]),
            m[(i + 2) & 3],
            m[(i + 3) & 3]);
      }
    }
    abcd = vaddq_u32(abcd, abcd0);
    efgh = vaddq_u32(efgh, efgh0);
  }
  vst1q_u32(h, abcd);
  vst1q_u32(h + 4, efgh);
}

} // namespace hebrus::detail

#else // built without the crypto extension: never picked

namespace hebrus::detail {
bool sha256_armv8_usable() {
  return false;
}
void sha256_blocks_armv8(uint32_t*, const uint8_t*, size_t) {}
} // namespace hebrus::detail

#endif
#endif // __aarch64__
