// SHA-256 known-answer driver (tools/check_sha256.py): reads records
// [u32 little-endian length][bytes] from the file argv[1] and prints the
// picked backend, then per record three hex digests: one-shot on the picked
// rounds, one-shot on the portable rounds, and the picked rounds fed in
// uneven chunks (exercises the partial-block buffer).
#include <algorithm>
#include <cstdio>
#include <vector>

#include "kat_records.h"
#include "sha256.h"

using hebrus::kat::hex;

int main(int argc, char** argv) {
  return hebrus::kat::for_each_record(
      argc, argv, "sha256_kat",
      [] { std::printf("%s\n", hebrus::sha256_backend()); },
      [](const std::vector<uint8_t>& buf) {
        size_t n = buf.size();
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
      });
}
