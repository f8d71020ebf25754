// The raw-read roofline for benchmarks (issue 6 (a), AFN-019): a pool of C
// threads preads batches of records into aligned buffers, batch by batch
// like a decode layer (every read of a batch issued, all awaited, then the
// next batch). No engine, no cache, no digest: the bandwidth the engine and
// streamed decode are compared with.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hebrus {

struct RawReadResult {
  int64_t elapsed_ns = 0; // first batch issued -> last batch done
  uint64_t bytes = 0;
  uint64_t reads = 0;
  bool direct = false; // O_DIRECT (Linux) / F_NOCACHE (macOS) was used (else the page cache)
  std::vector<uint8_t> data; // with collect: every read, in batch order
};

// Throws StreamError: kBadRequest naming the field (before any allocation),
// kIO / kShortRead if a read fails. With direct, offsets and length must be
// multiples of 4096; a filesystem without O_DIRECT (tmpfs) falls back to
// buffered reads and reports direct = false. `collect` copies every read
// out (for tests: the copy is inside the timed region).
RawReadResult raw_pread(
    const std::string& path, const std::vector<std::vector<uint64_t>>& batches,
    uint64_t length, int threads, bool direct, bool collect = false);

} // namespace hebrus
