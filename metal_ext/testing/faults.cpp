#include "faults.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <unordered_map>

namespace hebrus::testing {

Fault fault_named(const std::string& kind) {
  if (kind == "eio") {
    return Fault::kEIO;
  }
  if (kind == "short_read") {
    return Fault::kShortRead;
  }
  if (kind == "digest") {
    return Fault::kDigest;
  }
  throw StreamError(
      ErrorCode::kBadRequest, "kind: expected 'eio', 'short_read' or 'digest'");
}

void FaultInjector::inject(Fault fault, int count) {
  std::lock_guard<std::mutex> lk(mu_);
  fault_ = count > 0 ? fault : Fault::kNone;
  count_ = count > 0 ? count : 0;
}

void FaultInjector::hold(bool on) {
  hold_ = on;
}

void FaultInjector::set_delay_us(int64_t us) {
  delay_us_ = us;
}

void FaultInjector::set_offset_delay_us(uint64_t offset, int64_t us) {
  std::lock_guard<std::mutex> lk(mu_);
  if (us > 0) {
    offset_delay_us_[offset] = us;
  } else {
    offset_delay_us_.erase(offset);
  }
}

bool FaultInjector::held() const {
  return hold_;
}

void FaultInjector::after_read(ReadOutcome& r) {
  int64_t delay = delay_us_;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = offset_delay_us_.find(r.offset);
    if (it != offset_delay_us_.end()) {
      delay += it->second;
    }
  }
  if (delay > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(delay));
  }
  Fault f = Fault::kNone;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (count_ > 0 && (fault_ != Fault::kDigest || r.checked)) {
      f = fault_;
      if (--count_ == 0) {
        fault_ = Fault::kNone;
      }
    }
  }
  if (r.code != ErrorCode::kNone) {
    return; // a real failure stands
  }
  switch (f) {
    case Fault::kEIO:
      r.code = ErrorCode::kIO;
      r.detail = std::string(std::strerror(EIO)) + " (injected)";
      break;
    case Fault::kShortRead:
      r.got /= 2;
      break;
    case Fault::kDigest:
      r.first[0] ^= 0xff;
      break;
    case Fault::kNone:
      break;
  }
}

std::shared_ptr<FaultInjector> injector(Engine& engine) {
  // Injectors this module installed, by engine; an entry counts only while
  // that engine still holds it (a new engine at a reused address does not).
  static std::mutex mu;
  static std::unordered_map<const Engine*, std::weak_ptr<FaultInjector>> known;
  std::lock_guard<std::mutex> lk(mu);
  auto it = known.find(&engine);
  if (it != known.end()) {
    auto f = it->second.lock();
    if (f && engine.read_hooks() == f) {
      return f;
    }
  }
  auto f = std::make_shared<FaultInjector>();
  engine.set_read_hooks(f);
  known[&engine] = f;
  return f;
}

} // namespace hebrus::testing
