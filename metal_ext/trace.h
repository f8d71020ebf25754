// Opt-in bounded event trace of the I/O engine (AFN-019: measure exposed
// wait per layer from the engine's own timestamps, not from a run that syncs
// the host once per layer). Every call is made under Engine::mu_; the engine
// holds a null pointer while tracing is off, so a disabled trace costs one
// branch.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace hebrus {

enum class TraceKind : uint8_t { kRead = 0, kWait = 1, kMark = 2 };

// Outcome of a traced read or wait; a failed read's outcome is
// kTraceErrorBase + its ErrorCode (trace_outcome_name spells both).
constexpr uint8_t kTraceErrorBase = 8;
enum class TraceOutcome : uint8_t {
  kPublished = 0, // read: bytes published; wait: ticket ready
  kStale = 1, // read finished for a recycled slot: discarded
  kDropped = 2, // read never ran: cancelled / retired while queued
  kFailed = 3, // wait: the ticket failed (the read event has the error)
  kTimeout = 4,
  kCancelled = 5, // wait: ticket cancelled while waiting
};

// All times are steady-clock ns (CLOCK_MONOTONIC on Linux, the clock of
// Python's time.monotonic_ns()).
struct TraceEvent {
  TraceKind kind;
  uint8_t outcome; // TraceOutcome, or kTraceErrorBase + ErrorCode
  int8_t priority; // read: queue it ran from; -1 if it never ran
  bool exact; // read: issued as exact (P0) rather than a prediction
  bool promoted; // read: issued as a prediction, joined by an exact request
  int32_t layer;
  int32_t expert; // mark: the caller's tag
  uint64_t bytes;
  int64_t t0; // read: request (issue); wait: begin; mark: time
  int64_t t1; // read: worker picked it (0 if never); wait/mark: = t2
  int64_t t2; // read: published/failed/dropped; wait: end
};

class TraceRing {
 public:
  explicit TraceRing(size_t capacity) : cap_(capacity) {
    ring_.reserve(capacity);
  }

  void push(const TraceEvent& e) {
    if (ring_.size() < cap_) {
      ring_.push_back(e);
    } else {
      ring_[head_] = e; // drop the oldest
      head_ = (head_ + 1) % cap_;
      dropped_++;
    }
  }

  // Oldest first.
  std::vector<TraceEvent> events() const {
    std::vector<TraceEvent> out;
    out.reserve(ring_.size());
    for (size_t i = 0; i < ring_.size(); ++i) {
      out.push_back(ring_[(head_ + i) % ring_.size()]);
    }
    return out;
  }

  void clear() {
    ring_.clear();
    head_ = 0;
  }

  size_t capacity() const {
    return cap_;
  }
  uint64_t dropped() const {
    return dropped_;
  }

  // A read's fields known at request time, keyed by (slot, generation)
  // until the read finishes or is dropped. Bounded by the reads in flight
  // or queued, which the slot cache bounds.
  struct Pending {
    int64_t issue_ns;
    int64_t start_ns = 0;
    int priority = -1;
    int layer;
    int expert;
    bool exact;
    uint64_t bytes;
  };
  std::map<std::pair<uint32_t, uint64_t>, Pending> pending;

 private:
  size_t cap_;
  std::vector<TraceEvent> ring_;
  size_t head_ = 0;
  uint64_t dropped_ = 0;
};

} // namespace hebrus
