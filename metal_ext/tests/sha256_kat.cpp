// SHA-256 known-answer driver (tools/check_sha256.py): reads records
// [u32 little-endian length][bytes] from the file argv[1] and prints the
// picked backend, then per record three hex digests: one-shot on the picked
// rounds, one-shot on the portable rounds, and the picked rounds fed in
// uneven chunks (exercises the partial-block buffer).
#include <algorithm>
#include <cstdio>
#include <vector>

#include "sha256.h"

namespace {
void hex(const hebrus::Digest& d) {
  for (uint8_t b : d) {
    std::printf("%02x", b);
  }
}
} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: sha256_kat RECORDS\n");
    return 2;
  }
  std::FILE* f = std::fopen(argv[1], "rb");
  if (!f) {
    std::perror(argv[1]);
    return 2;
  }
  std::printf("%s\n", hebrus::sha256_backend());
  uint8_t len[4];
  while (std::fread(len, 1, 4, f) == 4) {
    size_t n = len[0] | len[1] << 8 | len[2] << 16 | size_t(len[3]) << 24;
    std::vector<uint8_t> buf(n);
    if (std::fread(buf.data(), 1, n, f) != n) {
      std::fprintf(stderr, "truncated record\n");
      return 2;
    }
    hex(hebrus::sha256(buf.data(), n));
    std::printf(" ");
    hex(hebrus::sha256(buf.data(), n, /*portable=*/true));
    std::printf(" ");
    hebrus::Sha256 s;
    for (size_t at = 0, i = 0; at < n; ++i) {
      size_t take = std::min(n - at, (i * 37) % 200 + 1);
      s.update(buf.data() + at, take);
      at += take;
    }
    hex(s.finish());
    std::printf("\n");
  }
  return 0;
}
