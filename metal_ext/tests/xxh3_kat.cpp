// XXH3-128 known-answer driver (tools/check_xxh3.py): reads records
// [u32 little-endian length][bytes] from the file argv[1] and prints the
// usable backends (comma-separated, the picked one first), then per record
// one line of hex digests: for every backend the one-shot digest and the
// digest of the same bytes fed in uneven chunks (exercises the stream
// buffer, the block boundaries and the last-stripe catch-up).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "xxh3.h"

namespace {
void hex(const hebrus::Xxh3Digest& d) {
  for (uint8_t b : d) {
    std::printf("%02x", b);
  }
}
} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: xxh3_kat RECORDS\n");
    return 2;
  }
  std::FILE* f = std::fopen(argv[1], "rb");
  if (!f) {
    std::perror(argv[1]);
    return 2;
  }
  std::vector<std::string> names = hebrus::xxh3_backends();
  for (size_t i = 0; i < names.size(); ++i) {
    std::printf("%s%s", i ? "," : "", names[i].c_str());
  }
  std::printf("\n");
  uint8_t len[4];
  while (std::fread(len, 1, 4, f) == 4) {
    size_t n = len[0] | len[1] << 8 | len[2] << 16 | size_t(len[3]) << 24;
    std::vector<uint8_t> buf(n);
    if (std::fread(buf.data(), 1, n, f) != n) {
      std::fprintf(stderr, "truncated record\n");
      return 2;
    }
    for (size_t b = 0; b < names.size(); ++b) {
      hebrus::Xxh3Backend id = hebrus::xxh3_backend_named(names[b]);
      std::printf(b ? " " : "");
      hex(hebrus::xxh3_128(buf.data(), n, id));
      std::printf(" ");
      hebrus::Xxh3_128 s(id);
      for (size_t at = 0, i = 0; at < n; ++i) {
        size_t take = std::min(n - at, (i * 97) % 700 + 1);
        s.update(buf.data() + at, take);
        at += take;
      }
      hex(s.finish());
    }
    std::printf("\n");
  }
  return 0;
}
