// Optional Metal I/O (MTLIOCommandQueue) backend of the engine's read step.
//
// Compiled only on Apple when CMake finds Metal, Foundation and MLX's
// metal-cpp headers (it then defines HEBRUS_MTLIO=1 for every TU of the
// extension). Everywhere else this header only says that it is absent.
// Selected only by EngineOptions::backend == "mtlio", never by default
// (AFN-013: unverified until a physical A/B on a Mac passes). It replaces
// the preadv of an arena row; verification and publication stay the
// engine's own (engine.cpp, Engine::do_read / worker_loop).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"

#ifndef HEBRUS_MTLIO
#define HEBRUS_MTLIO 0
#endif

namespace hebrus {

inline bool mtlio_compiled() {
  return HEBRUS_MTLIO != 0;
}

// Read backends in this build; the first is the default.
inline std::vector<std::string> compiled_backends() {
  std::vector<std::string> names{"pread"};
  if (mtlio_compiled()) {
    names.push_back("mtlio");
  }
  return names;
}

#if HEBRUS_MTLIO

// One loadBuffer: `length` bytes into `buffer` (an MTL::Buffer*) at byte
// `offset`. Consecutive targets take consecutive file bytes.
struct IoTarget {
  void* buffer;
  uint64_t offset;
  uint64_t length;
};

class MtlioReader {
 public:
  // Throws StreamError(kBadRequest, "backend: ...") when there is no Metal
  // device or the IO queues cannot be created: the engine constructor calls
  // this before it starts any thread.
  explicit MtlioReader(int max_in_flight);
  ~MtlioReader();
  MtlioReader(const MtlioReader&) = delete;
  MtlioReader& operator=(const MtlioReader&) = delete;

  // Loads file bytes [file_offset, file_offset + sum(lengths)) of `path`
  // (cached per store id) into the targets as one IO command buffer and
  // blocks until it completes. kIO with the NSError text in `msg` on
  // failure. `urgent` picks the high-priority queue (P0).
  ErrorCode load(
      int store, const std::string& path, uint64_t file_offset,
      const std::vector<IoTarget>& targets, bool urgent, std::string& msg);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

#endif // HEBRUS_MTLIO

} // namespace hebrus
