// The engine's fault injector (ReadHooks, engine.h). Compiled only into
// test builds: the hebrus_mlx._testing module (module.cpp), which the
// runtime never imports, and the sanitizer stress driver. The runtime
// module hebrus_mlx._ext has none of this.
#pragma once

#if !HEBRUS_TESTING
#error "fault injection is test-only: build it into hebrus_mlx._testing (HEBRUS_TESTING=1)"
#endif

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "engine.h"

namespace hebrus::testing {

enum class Fault : int { kNone = 0, kEIO = 1, kShortRead = 2, kDigest = 3 };

// "eio", "short_read" or "digest"; throws StreamError(kBadRequest) otherwise.
Fault fault_named(const std::string& kind);

class FaultInjector : public ReadHooks {
 public:
  // The next `count` reads fail with `fault`; a digest fault skips reads
  // that have no digest to check (it flips the record's first byte, so the
  // check must catch it). 0 clears.
  void inject(Fault fault, int count);
  // While on, the engine's workers leave queued reads alone (so a test can
  // queue several requests before any runs).
  void hold(bool on);
  // Every read stays in flight `us` microseconds longer.
  void set_delay_us(int64_t us);
  // The read of the record at store offset `offset` stays in flight `us`
  // microseconds longer (on top of set_delay_us): a test orders arrivals.
  // 0 clears that offset's delay.
  void set_offset_delay_us(uint64_t offset, int64_t us);

  bool held() const override;
  void after_read(ReadOutcome& r) override;

 private:
  std::mutex mu_;
  Fault fault_ = Fault::kNone;
  int count_ = 0;
  std::atomic<bool> hold_{false};
  std::atomic<int64_t> delay_us_{0};
  std::unordered_map<uint64_t, int64_t> offset_delay_us_; // under mu_
};

// The injector installed on `engine`, installing one first (an engine has at
// most one; it lives as long as the engine).
std::shared_ptr<FaultInjector> injector(Engine& engine);

} // namespace hebrus::testing
