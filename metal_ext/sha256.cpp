#include "sha256.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace hebrus {

const uint32_t detail::kSha256K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1,
    0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
    0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
    0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

namespace {

using detail::kSha256K;

inline uint32_t rotr(uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

void compress(uint32_t h[8], const uint8_t* block) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t(block[4 * i]) << 24) | (uint32_t(block[4 * i + 1]) << 16) |
        (uint32_t(block[4 * i + 2]) << 8) | uint32_t(block[4 * i + 3]);
  }
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
  uint32_t e = h[4], f = h[5], g = h[6], hh = h[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
    uint32_t ch = (e & f) ^ (~e & g);
    uint32_t t1 = hh + S1 + ch + kSha256K[i] + w[i];
    uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
    uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
    uint32_t t2 = S0 + maj;
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += hh;
}

void compress_blocks_portable(uint32_t* h, const uint8_t* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    compress(h, data + 64 * i);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// SHA-NI: the record verify otherwise costs ~8x the read it protects.
__attribute__((target("sha,sse4.1,ssse3"))) void compress_blocks_shani(
    uint32_t h[8],
    const uint8_t* data,
    size_t n) {
  const __m128i bswap =
      _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  // The rounds instruction wants the state as (A,B,E,F) and (C,D,G,H).
  __m128i t = _mm_shuffle_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(h)), 0xB1);
  __m128i cdgh = _mm_shuffle_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 4)), 0x1B);
  __m128i abef = _mm_alignr_epi8(t, cdgh, 8);
  cdgh = _mm_blend_epi16(cdgh, t, 0xF0);
  for (size_t blk = 0; blk < n; ++blk, data += 64) {
    __m128i abef0 = abef, cdgh0 = cdgh;
    __m128i m[4];
    for (int j = 0; j < 4; ++j) {
      m[j] = _mm_shuffle_epi8(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 16 * j)),
          bswap);
    }
    for (int i = 0; i < 16; ++i) {
      __m128i wk = _mm_add_epi32(
          m[i & 3],
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(kSha256K + 4 * i)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
      if (i < 12) {
        // W[4i+16..4i+19] from the four previous word groups.
        __m128i x = _mm_sha256msg1_epu32(m[i & 3], m[(i + 1) & 3]);
        x = _mm_add_epi32(x, _mm_alignr_epi8(m[(i + 3) & 3], m[(i + 2) & 3], 4));
        m[i & 3] = _mm_sha256msg2_epu32(x, m[(i + 3) & 3]);
      }
    }
    abef = _mm_add_epi32(abef, abef0);
    cdgh = _mm_add_epi32(cdgh, cdgh0);
  }
  t = _mm_shuffle_epi32(abef, 0x1B);
  cdgh = _mm_shuffle_epi32(cdgh, 0xB1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm_blend_epi16(t, cdgh, 0xF0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 4), _mm_alignr_epi8(cdgh, t, 8));
}

bool cpu_has_shani() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 29))) {
    return false;
  }
  __get_cpuid(1, &a, &b, &c, &d);
  return (c & (1u << 19)) && (c & (1u << 9)); // SSE4.1, SSSE3
}
#endif

using BlocksFn = void (*)(uint32_t*, const uint8_t*, size_t);

struct Backend {
  BlocksFn blocks;
  const char* name;
};

Backend pick_blocks() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (cpu_has_shani()) {
    return {compress_blocks_shani, "sha-ni"};
  }
#endif
#if defined(__aarch64__)
  if (detail::sha256_armv8_usable()) {
    return {detail::sha256_blocks_armv8, "armv8"};
  }
#endif
  return {compress_blocks_portable, "portable"};
}

const Backend backend = pick_blocks();

} // namespace

const char* sha256_backend() {
  return backend.name;
}

Sha256::Sha256(bool portable)
    : blocks_(portable ? compress_blocks_portable : backend.blocks) {
  static constexpr uint32_t init[8] = {
      0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
      0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::memcpy(h_, init, sizeof(h_));
}

void Sha256::update(const uint8_t* data, size_t size) {
  total_ += size;
  if (buf_len_ > 0) {
    size_t take = std::min(size, size_t(64) - buf_len_);
    std::memcpy(buf_ + buf_len_, data, take);
    buf_len_ += take;
    data += take;
    size -= take;
    if (buf_len_ < 64) {
      return;
    }
    blocks_(h_, buf_, 1);
    buf_len_ = 0;
  }
  blocks_(h_, data, size / 64);
  data += size / 64 * 64;
  size %= 64;
  std::memcpy(buf_, data, size);
  buf_len_ = size;
}

Digest Sha256::finish() {
  // Remaining bytes, 0x80, zero pad, 64-bit big-endian bit length.
  uint8_t tail[128] = {0};
  std::memcpy(tail, buf_, buf_len_);
  tail[buf_len_] = 0x80;
  size_t tail_len = (buf_len_ + 1 + 8 <= 64) ? 64 : 128;
  uint64_t bits = total_ * 8;
  for (int i = 0; i < 8; ++i) {
    tail[tail_len - 1 - i] = uint8_t(bits >> (8 * i));
  }
  blocks_(h_, tail, tail_len / 64);
  Digest out;
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = uint8_t(h_[i] >> 24);
    out[4 * i + 1] = uint8_t(h_[i] >> 16);
    out[4 * i + 2] = uint8_t(h_[i] >> 8);
    out[4 * i + 3] = uint8_t(h_[i]);
  }
  return out;
}

Digest sha256(const uint8_t* data, size_t size, bool portable) {
  Sha256 s(portable);
  s.update(data, size);
  return s.finish();
}

} // namespace hebrus
