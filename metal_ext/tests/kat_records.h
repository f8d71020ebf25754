// What the known-answer drivers (sha256_kat.cpp, xxh3_kat.cpp) share: hex output and the
// records file [u32 little-endian length][bytes]... they digest.
#pragma once

#include <cstdint>
#include <cstdio>
#include <vector>

namespace hebrus::kat {

template <class Digest>
void hex(const Digest& d) {
  for (uint8_t b : d) {
    std::printf("%02x", b);
  }
}

// Opens argv[1], runs `header()`, then `record(bytes)` per record (one output line each);
// the process exit status (2: bad usage, unreadable or truncated file).
template <class Header, class Record>
int for_each_record(int argc, char** argv, const char* usage, Header header, Record record) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s RECORDS\n", usage);
    return 2;
  }
  std::FILE* f = std::fopen(argv[1], "rb");
  if (!f) {
    std::perror(argv[1]);
    return 2;
  }
  header();
  uint8_t len[4];
  while (std::fread(len, 1, 4, f) == 4) {
    size_t n = len[0] | len[1] << 8 | len[2] << 16 | size_t(len[3]) << 24;
    std::vector<uint8_t> buf(n);
    if (std::fread(buf.data(), 1, n, f) != n) {
      std::fprintf(stderr, "truncated record\n");
      return 2;
    }
    record(buf);
    std::printf("\n");
  }
  return 0;
}

} // namespace hebrus::kat
