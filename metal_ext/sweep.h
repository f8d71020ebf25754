// Prefill sweep (issue 13): for a long prefill chunk most of a layer's
// experts are routed to, so instead of one arena-slot read per missed
// record, a layer's whole expert extent is read with large sequential
// preadv's into one slot of a two-slot ring (layer l+1's extent is read in
// the background while layer l computes). Every record is checked against
// its table digest (XXH3-128, or SHA-256 for artifacts without fast digests)
// before the slot is marked ready; a failed or
// unverified slot is never handed to the graph (sweep_wait throws the
// typed StreamError). Bf16 parts are widened to fp32 after the check,
// exactly as the arena does, so the grouped matmuls over the ring compute
// the same values as over arena rows.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "mlx/array.h"
#include "mlx/primitives.h"

namespace hebrus {
namespace mx = mlx::core;

// Owned by a C++ shared_ptr, as Engine (engine.h): its ops drop refs on MLX stream threads.
class SweepRing : public std::enable_shared_from_this<SweepRing> {
 public:
  // `table`: the engine's record table (offsets, lengths, digests) of the
  // store at `path`; a slot holds `span` consecutive records (one layer).
  // The ring's part buffers (uint8 [slots * span, row_bytes(p)]) are
  // allocated here; `parts()` returns them for the graph to view.
  SweepRing(
      std::shared_ptr<Engine> engine, int table, const std::string& path,
      std::vector<uint64_t> part_bytes, std::vector<uint8_t> expand,
      uint32_t span, uint32_t slots, int threads);
  ~SweepRing();
  SweepRing(const SweepRing&) = delete;
  SweepRing& operator=(const SweepRing&) = delete;

  const std::vector<mx::array>& parts() const {
    return parts_;
  }
  uint64_t bytes() const {
    return bytes_;
  }
  // Starts reading records [first, first + span) into `slot` in the
  // background (after the slot's previous reads finished); nothing to do if
  // the slot already holds them verified.
  void issue(uint32_t slot, uint32_t first);
  // Blocks until `slot` holds records [first, first + span) verified
  // (issuing them now if nobody did); throws StreamError otherwise.
  void wait(uint32_t slot, uint32_t first);
  // Counters: extents read, bytes read, ns the graph blocked in wait.
  uint64_t sweeps() const;
  uint64_t read_bytes() const;
  uint64_t wait_ns() const;
  void close();

 private:
  struct Slot {
    uint32_t first = UINT32_MAX;
    bool ready = false; // first.. verified, not being written
    std::vector<std::thread> workers;
    ErrorCode error = ErrorCode::kNone;
    std::string message;
  };
  void join_locked(std::unique_lock<std::mutex>& lk, Slot& s);
  void read_span(uint32_t slot, uint32_t first, uint32_t a, uint32_t b);

  std::shared_ptr<Engine> engine_;
  int table_;
  std::vector<uint64_t> part_bytes_;
  std::vector<uint8_t> expand_;
  std::vector<uint8_t*> ptrs_;
  std::vector<mx::array> parts_;
  uint32_t span_;
  int threads_;
  int fd_ = -1;
  int direct_fd_ = -1;
  uint64_t bytes_ = 0;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  uint64_t sweeps_ = 0;
  uint64_t read_bytes_ = 0;
  uint64_t wait_ns_ = 0;
};

// Graph op: `dep` unchanged; when evaluated, issues records
// [first, first + span) into `slot` (non-blocking).
mx::array sweep_issue(
    std::shared_ptr<SweepRing> ring, const mx::array& dep, uint32_t slot,
    uint32_t first);
// Graph op: `value` unchanged; when evaluated, blocks until the slot holds
// records [first, first + span) verified. Consumers of the ring views must
// depend on its output.
mx::array sweep_wait(
    std::shared_ptr<SweepRing> ring, const mx::array& value, uint32_t slot,
    uint32_t first);

class SweepOp : public mx::UnaryPrimitive {
 public:
  SweepOp(mx::Stream s, std::shared_ptr<SweepRing> ring, uint32_t slot, uint32_t first, bool wait)
      : mx::UnaryPrimitive(s), ring_(std::move(ring)), slot_(slot), first_(first), wait_(wait) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return wait_ ? "HebrusSweepWait" : "HebrusSweepIssue";
  }

 private:
  std::shared_ptr<SweepRing> ring_;
  uint32_t slot_;
  uint32_t first_;
  bool wait_;
};

} // namespace hebrus
