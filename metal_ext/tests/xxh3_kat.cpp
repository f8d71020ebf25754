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

#include "kat_records.h"
#include "xxh3.h"

using hebrus::kat::hex;

int main(int argc, char** argv) {
  std::vector<std::string> names = hebrus::xxh3_backends();
  return hebrus::kat::for_each_record(
      argc, argv, "xxh3_kat",
      [&] {
        for (size_t i = 0; i < names.size(); ++i) {
          std::printf("%s%s", i ? "," : "", names[i].c_str());
        }
        std::printf("\n");
      },
      [&](const std::vector<uint8_t>& buf) {
        size_t n = buf.size();
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
      });
}
