// XXH3-128 (seed 0, default secret), written from the xxHash specification
// (Yann Collet, doc/xxhash_spec.md, https://github.com/Cyan4973/xxHash): the
// section numbers below are that document's. No xxHash code is used.
#include "xxh3.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HEBRUS_XXH3_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#define HEBRUS_XXH3_NEON 1
#include <arm_neon.h>
#endif

namespace hebrus {

namespace {

using u128 = unsigned __int128;

constexpr uint64_t kP32_1 = 0x9E3779B1u;
constexpr uint64_t kP32_2 = 0x85EBCA77u;
constexpr uint64_t kP32_3 = 0xC2B2AE3Du;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP64_3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP64_5 = 0x27D4EB2F165667C5ull;
constexpr uint64_t kMx1 = 0x165667919E3779F9ull;
constexpr uint64_t kMx2 = 0x9FB21C651E98DF25ull;

// "Seed and Secret": the default 192-byte secret.
alignas(64) constexpr uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c,
    0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb,
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
    0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
    0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97,
    0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
    0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83,
    0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26,
    0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc,
    0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
constexpr size_t kSecretSize = sizeof(kSecret);
constexpr size_t kStripe = 64;
constexpr unsigned kBlockStripes = (kSecretSize - 64) / 8; // 16
const uint8_t* const kScrambleKey = kSecret + kSecretSize - 64;

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "xxh3.cpp reads little-endian words; every supported target is little-endian"
#endif

inline uint64_t rd64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint32_t rotl32(uint32_t x, int r) {
  return (x << r) | (x >> (32 - r));
}
inline uint64_t fold64(u128 m) {
  return uint64_t(m) ^ uint64_t(m >> 64);
}
// "Final Mixing Step": avalanche() and avalanche_XXH64().
inline uint64_t avalanche(uint64_t x) {
  x ^= x >> 37;
  x *= kMx1;
  return x ^ (x >> 32);
}
inline uint64_t avalanche_xxh64(uint64_t x) {
  x ^= x >> 33;
  x *= kP64_2;
  x ^= x >> 29;
  x *= kP64_3;
  return x ^ (x >> 32);
}

struct H128 {
  uint64_t lo, hi;
};

Xxh3Digest canonical(H128 h) {
  Xxh3Digest out;
  for (int i = 0; i < 8; ++i) {
    out[i] = uint8_t(h.hi >> (56 - 8 * i));
    out[8 + i] = uint8_t(h.lo >> (56 - 8 * i));
  }
  return out;
}

// ---- small inputs (0-16 bytes) -------------------------------------------
H128 hash_0to16(const uint8_t* p, size_t n) {
  const uint8_t* s = kSecret;
  if (n == 0) {
    return {avalanche_xxh64(rd64(s + 64) ^ rd64(s + 72)),
            avalanche_xxh64(rd64(s + 80) ^ rd64(s + 88))};
  }
  if (n <= 3) {
    uint32_t combined = uint32_t(p[n - 1]) | (uint32_t(n) << 8) |
        (uint32_t(p[0]) << 16) | (uint32_t(p[n >> 1]) << 24);
    uint64_t lo = uint64_t(rd32(s) ^ rd32(s + 4)) ^ combined;
    uint64_t hi = uint64_t(rd32(s + 8) ^ rd32(s + 12)) ^
        rotl32(__builtin_bswap32(combined), 13);
    return {avalanche_xxh64(lo), avalanche_xxh64(hi)};
  }
  if (n <= 8) {
    uint64_t combined = uint64_t(rd32(p)) | (uint64_t(rd32(p + n - 4)) << 32);
    uint64_t v = (rd64(s + 16) ^ rd64(s + 24)) ^ combined;
    u128 m = u128(v) * (kP64_1 + (uint64_t(n) << 2));
    uint64_t hi = uint64_t(m >> 64), lo = uint64_t(m);
    hi += lo << 1;
    lo ^= hi >> 3;
    lo ^= lo >> 35;
    lo *= kMx2;
    lo ^= lo >> 28;
    return {lo, avalanche(hi)};
  }
  uint64_t first = rd64(p), last = rd64(p + n - 8);
  uint64_t v1 = (rd64(s + 32) ^ rd64(s + 40)) ^ first ^ last;
  uint64_t v2 = (rd64(s + 48) ^ rd64(s + 56)) ^ last;
  u128 m = u128(v1) * kP64_1;
  uint64_t lo = uint64_t(m) + (uint64_t(n - 1) << 54);
  uint64_t hi = uint64_t(m >> 64) + v2 + uint64_t(uint32_t(v2)) * (kP32_2 - 1);
  lo ^= __builtin_bswap64(hi);
  u128 m2 = u128(lo) * kP64_2;
  lo = uint64_t(m2);
  hi = uint64_t(m2 >> 64) + hi * kP64_2;
  return {avalanche(lo), avalanche(hi)};
}

// ---- medium inputs (17-240 bytes) ----------------------------------------
inline uint64_t mix_step(const uint8_t* d, const uint8_t* s) {
  return fold64(u128(rd64(d) ^ rd64(s)) * u128(rd64(d + 8) ^ rd64(s + 8)));
}

inline void mix_two(uint64_t acc[2], const uint8_t* d1, const uint8_t* d2, const uint8_t* s) {
  acc[0] += mix_step(d1, s);
  acc[1] += mix_step(d2, s + 16);
  acc[0] ^= rd64(d2) + rd64(d2 + 8);
  acc[1] ^= rd64(d1) + rd64(d1 + 8);
}

H128 finish_medium(const uint64_t acc[2], size_t n) {
  uint64_t lo = acc[0] + acc[1];
  uint64_t hi = acc[0] * kP64_1 + acc[1] * kP64_4 + uint64_t(n) * kP64_2;
  return {avalanche(lo), 0 - avalanche(hi)};
}

H128 hash_17to240(const uint8_t* p, size_t n) {
  uint64_t acc[2] = {uint64_t(n) * kP64_1, 0};
  if (n <= 128) {
    for (size_t i = ((n - 1) >> 5) + 1; i-- > 0;) {
      mix_two(acc, p + 16 * i, p + n - 16 * i - 16, kSecret + 32 * i);
    }
    return finish_medium(acc, n);
  }
  size_t chunks = n >> 5;
  for (size_t i = 0; i < 4; ++i) {
    mix_two(acc, p + 32 * i, p + 32 * i + 16, kSecret + 32 * i);
  }
  acc[0] = avalanche(acc[0]);
  acc[1] = avalanche(acc[1]);
  for (size_t i = 4; i < chunks; ++i) {
    mix_two(acc, p + 32 * i, p + 32 * i + 16, kSecret + 32 * (i - 4) + 3);
  }
  mix_two(acc, p + n - 16, p + n - 32, kSecret + 103);
  return finish_medium(acc, n);
}

// ---- large inputs: accumulate / scramble (steps 2-3) ---------------------
// accumulate: `n` consecutive stripes of one block, the secret advancing 8
// bytes per stripe; scramble: the end-of-block step.
void accumulate_scalar(uint64_t* acc, const uint8_t* in, const uint8_t* secret, size_t n) {
  for (size_t k = 0; k < n; ++k, in += kStripe, secret += 8) {
    for (int i = 0; i < 8; ++i) {
      uint64_t v = rd64(in + 8 * i);
      uint64_t key = v ^ rd64(secret + 8 * i);
      acc[i ^ 1] += v;
      acc[i] += (key & 0xffffffffu) * (key >> 32);
    }
  }
}

// scramble, written once for every lane width: V is uint64_t (one lane) or
// a GCC vector of 2 or 4 uint64_t lanes (an SSE2 / AVX2 register once
// inlined into the target function). Per accumulator, as the spec writes
// it: acc ^= acc >> 47; acc ^= secret; acc *= PRIME32_1.
template <class V>
__attribute__((always_inline)) inline void scramble_lanes(uint64_t* acc, const uint8_t* secret) {
  for (size_t b = 0; b < 64; b += sizeof(V)) {
    V a;
    V key;
    std::memcpy(&a, reinterpret_cast<const uint8_t*>(acc) + b, sizeof(V));
    std::memcpy(&key, secret + b, sizeof(V));
    a ^= a >> 47;
    a ^= key;
    a *= kP32_1;
    std::memcpy(reinterpret_cast<uint8_t*>(acc) + b, &a, sizeof(V));
  }
}

void scramble_scalar(uint64_t* acc, const uint8_t* secret) {
  scramble_lanes<uint64_t>(acc, secret);
}

#if HEBRUS_XXH3_X86
// Two (SSE2) or four (AVX2) 64-bit lanes per register: lo32 x hi32 of
// (data ^ secret) is one unsigned 32x32->64 multiply per lane, and
// acc[i ^ 1] += data[i] swaps neighbouring lanes of the data.
__attribute__((target("sse2"))) void accumulate_sse2(
    uint64_t* acc, const uint8_t* in, const uint8_t* secret, size_t n) {
  __m128i a[4];
  for (int j = 0; j < 4; ++j) {
    a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc + 2 * j));
  }
  for (size_t k = 0; k < n; ++k, in += kStripe, secret += 8) {
    for (int j = 0; j < 4; ++j) {
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 16 * j));
      __m128i key = _mm_xor_si128(
          d, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret + 16 * j)));
      __m128i prod = _mm_mul_epu32(key, _mm_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1)));
      a[j] = _mm_add_epi64(a[j], _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2)));
      a[j] = _mm_add_epi64(a[j], prod);
    }
  }
  for (int j = 0; j < 4; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + 2 * j), a[j]);
  }
}

using u64x2 = uint64_t __attribute__((vector_size(16)));
using u64x4 = uint64_t __attribute__((vector_size(32)));

__attribute__((target("sse2"))) void scramble_sse2(uint64_t* acc, const uint8_t* secret) {
  scramble_lanes<u64x2>(acc, secret);
}

__attribute__((target("avx2"))) void accumulate_avx2(
    uint64_t* acc, const uint8_t* in, const uint8_t* secret, size_t n) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
  for (size_t k = 0; k < n; ++k, in += kStripe, secret += 8) {
    __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
    __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32));
    __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret)));
    __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32)));
    __m256i p0 = _mm256_mul_epu32(k0, _mm256_shuffle_epi32(k0, _MM_SHUFFLE(0, 3, 0, 1)));
    __m256i p1 = _mm256_mul_epu32(k1, _mm256_shuffle_epi32(k1, _MM_SHUFFLE(0, 3, 0, 1)));
    a0 = _mm256_add_epi64(a0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2)));
    a1 = _mm256_add_epi64(a1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2)));
    a0 = _mm256_add_epi64(a0, p0);
    a1 = _mm256_add_epi64(a1, p1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
}

__attribute__((target("avx2"))) void scramble_avx2(uint64_t* acc, const uint8_t* secret) {
  scramble_lanes<u64x4>(acc, secret);
}

bool cpu_has_avx2() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) {
    return false; // no OSXSAVE: the OS may not save YMM registers
  }
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 6u) != 6u) {
    return false; // XMM and YMM state not enabled by the OS
  }
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 5));
}
#endif

#if HEBRUS_XXH3_NEON
// Advanced SIMD is part of every ARMv8-A (arm64) CPU, Apple silicon included.
void accumulate_neon(uint64_t* acc, const uint8_t* in, const uint8_t* secret, size_t n) {
  uint64x2_t a[4];
  for (int j = 0; j < 4; ++j) {
    a[j] = vld1q_u64(acc + 2 * j);
  }
  for (size_t k = 0; k < n; ++k, in += kStripe, secret += 8) {
    for (int j = 0; j < 4; ++j) {
      uint64x2_t d = vreinterpretq_u64_u8(vld1q_u8(in + 16 * j));
      uint64x2_t key = veorq_u64(d, vreinterpretq_u64_u8(vld1q_u8(secret + 16 * j)));
      a[j] = vaddq_u64(a[j], vextq_u64(d, d, 1));
      a[j] = vmlal_u32(a[j], vmovn_u64(key), vshrn_n_u64(key, 32));
    }
  }
  for (int j = 0; j < 4; ++j) {
    vst1q_u64(acc + 2 * j, a[j]);
  }
}

void scramble_neon(uint64_t* acc, const uint8_t* secret) {
  const uint32x2_t prime = vdup_n_u32(uint32_t(kP32_1));
  for (int j = 0; j < 4; ++j) {
    uint64x2_t a = vld1q_u64(acc + 2 * j);
    a = veorq_u64(a, vshrq_n_u64(a, 47));
    a = veorq_u64(a, vreinterpretq_u64_u8(vld1q_u8(secret + 16 * j)));
    uint64x2_t hi = vshlq_n_u64(vmull_u32(vshrn_n_u64(a, 32), prime), 32);
    vst1q_u64(acc + 2 * j, vmlal_u32(hi, vmovn_u64(a), prime));
  }
}
#endif

} // namespace

struct Xxh3_128::Kernels {
  void (*accumulate)(uint64_t*, const uint8_t*, const uint8_t*, size_t);
  void (*scramble)(uint64_t*, const uint8_t*);
  const char* name;
  Xxh3Backend id;
};

namespace {

using Kernels = Xxh3_128::Kernels;

const Kernels kScalar{accumulate_scalar, scramble_scalar, "scalar", Xxh3Backend::kScalar};
#if HEBRUS_XXH3_X86
const Kernels kSse2{accumulate_sse2, scramble_sse2, "sse2", Xxh3Backend::kSse2};
const Kernels kAvx2{accumulate_avx2, scramble_avx2, "avx2", Xxh3Backend::kAvx2};
const bool kHaveAvx2 = cpu_has_avx2();
#endif
#if HEBRUS_XXH3_NEON
const Kernels kNeon{accumulate_neon, scramble_neon, "neon", Xxh3Backend::kNeon};
#endif

// Fastest first.
std::vector<const Kernels*> usable() {
  std::vector<const Kernels*> out;
#if HEBRUS_XXH3_X86
  if (kHaveAvx2) {
    out.push_back(&kAvx2);
  }
  out.push_back(&kSse2); // baseline of x86-64
#endif
#if HEBRUS_XXH3_NEON
  out.push_back(&kNeon);
#endif
  out.push_back(&kScalar);
  return out;
}

const Kernels& kernels_for(Xxh3Backend b) {
  static const std::vector<const Kernels*> have = usable();
  if (b == Xxh3Backend::kAuto) {
    return *have.front();
  }
  for (const Kernels* k : have) {
    if (k->id == b) {
      return *k;
    }
  }
  throw std::invalid_argument("xxh3 backend not available on this CPU/build");
}

// Stripes in stream order: each block of 16 uses the secret at 8-byte
// steps and ends in a scramble (step 2), however the stream was split.
void consume_stripes(
    const Kernels& k, uint64_t* acc, unsigned& block_stripes, const uint8_t* p, size_t n) {
  while (n > 0) {
    size_t take = std::min<size_t>(n, kBlockStripes - block_stripes);
    k.accumulate(acc, p, kSecret + 8 * block_stripes, take);
    block_stripes += unsigned(take);
    p += kStripe * take;
    n -= take;
    if (block_stripes == kBlockStripes) {
      k.scramble(acc, kScrambleKey);
      block_stripes = 0;
    }
  }
}

// Step 4: finalMerge over the accumulators.
uint64_t merge(const uint64_t* acc, const uint8_t* s, uint64_t start) {
  uint64_t r = start;
  for (int i = 0; i < 4; ++i) {
    r += fold64(u128(acc[2 * i] ^ rd64(s + 16 * i)) * u128(acc[2 * i + 1] ^ rd64(s + 16 * i + 8)));
  }
  return avalanche(r);
}

} // namespace

Xxh3_128::Xxh3_128(Xxh3Backend backend) : k_(&kernels_for(backend)) {
  // Step 1 (large inputs).
  const uint64_t init[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  std::memcpy(acc_, init, sizeof(acc_));
}

// The buffer is consumed only once more input follows it, so at finish()
// it holds the last 1..256 bytes (all of them for inputs up to 240 bytes).
void Xxh3_128::update(const uint8_t* data, size_t size) {
  if (size == 0) {
    return;
  }
  total_ += size;
  if (buf_len_ + size <= sizeof(buf_)) {
    std::memcpy(buf_ + buf_len_, data, size);
    buf_len_ += size;
    return;
  }
  if (buf_len_ > 0) {
    size_t fill = sizeof(buf_) - buf_len_;
    std::memcpy(buf_ + buf_len_, data, fill);
    data += fill;
    size -= fill;
    consume(buf_, sizeof(buf_) / kStripe);
    std::memcpy(tail_, buf_ + sizeof(buf_) - kStripe, kStripe);
    buf_len_ = 0;
  }
  if (size > sizeof(buf_)) {
    size_t n = (size - 1) / kStripe; // keep 1..64 bytes back
    consume(data, n);
    std::memcpy(tail_, data + kStripe * (n - 1), kStripe);
    data += kStripe * n;
    size -= kStripe * n;
  }
  std::memcpy(buf_, data, size);
  buf_len_ = size;
}

void Xxh3_128::consume(const uint8_t* stripes, size_t n) {
  consume_stripes(*k_, acc_, block_stripes_, stripes, n);
}

Xxh3Digest Xxh3_128::finish() const {
  if (total_ <= 16) {
    return canonical(hash_0to16(buf_, total_));
  }
  if (total_ <= 240) {
    return canonical(hash_17to240(buf_, total_));
  }
  // Step 3: the last block's full stripes but its last, then the input's
  // last 64 bytes (which may overlap what was already consumed).
  alignas(32) uint64_t acc[8];
  std::memcpy(acc, acc_, sizeof(acc));
  unsigned block_stripes = block_stripes_;
  consume_stripes(*k_, acc, block_stripes, buf_, (buf_len_ - 1) / kStripe);
  uint8_t last[kStripe];
  if (buf_len_ >= kStripe) {
    std::memcpy(last, buf_ + buf_len_ - kStripe, kStripe);
  } else {
    size_t back = kStripe - buf_len_;
    std::memcpy(last, tail_ + kStripe - back, back);
    std::memcpy(last + back, buf_, buf_len_);
  }
  k_->accumulate(acc, last, kSecret + kSecretSize - 64 - 7, 1);
  return canonical({merge(acc, kSecret + 11, total_ * kP64_1),
                    merge(acc, kSecret + kSecretSize - 64 - 11, ~(total_ * kP64_2))});
}

Xxh3Digest xxh3_128(const uint8_t* data, size_t size, Xxh3Backend backend) {
  kernels_for(backend); // refuses an unusable backend whatever the size
  if (size <= 16) {
    return canonical(hash_0to16(data, size));
  }
  if (size <= 240) {
    return canonical(hash_17to240(data, size));
  }
  Xxh3_128 h(backend);
  h.update(data, size);
  return h.finish();
}

const char* xxh3_backend() {
  return kernels_for(Xxh3Backend::kAuto).name;
}

std::vector<std::string> xxh3_backends() {
  std::vector<std::string> out;
  for (const Kernels* k : usable()) {
    out.emplace_back(k->name);
  }
  return out;
}

Xxh3Backend xxh3_backend_named(const std::string& name) {
  static const std::pair<const char*, Xxh3Backend> names[] = {
      {"auto", Xxh3Backend::kAuto}, {"scalar", Xxh3Backend::kScalar},
      {"sse2", Xxh3Backend::kSse2}, {"avx2", Xxh3Backend::kAvx2},
      {"neon", Xxh3Backend::kNeon}};
  for (auto& [n, b] : names) {
    if (name == n) {
      kernels_for(b); // throws when not usable here
      return b;
    }
  }
  throw std::invalid_argument("unknown xxh3 backend '" + name + "'");
}

} // namespace hebrus
