#include "sweep.h"

#include "ops.h"
#include "ops_metal.h"

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace hebrus {

namespace {

// Records per preadv batch stop growing past this many bytes: large enough
// for sequential throughput, small enough that a slot's threads interleave
// reading and hashing.
constexpr uint64_t kBatchBytes = 32ull << 20;
// A hole between records larger than this ends a batch (not an extent).
constexpr uint64_t kMaxGap = 1ull << 20;

} // namespace

SweepRing::SweepRing(
    std::shared_ptr<Engine> engine, int table, const std::string& path,
    std::vector<uint64_t> part_bytes, std::vector<uint8_t> expand,
    uint32_t span, uint32_t slots, int threads)
    : engine_(std::move(engine)),
      table_(table),
      span_(span),
      threads_(std::max(1, threads)) {
  check_arena_spec(part_bytes, span, expand);
  if (slots == 0) {
    throw StreamError(ErrorCode::kBadRequest, "slots: must be >= 1");
  }
  const Table& t = engine_->table(table_); // validates the id
  uint64_t record = 0;
  for (uint64_t b : part_bytes) {
    record += b;
  }
  if (t.uniform_length != record) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "part_bytes: sum must equal the table's record length");
  }
  if (t.rows.size() % span != 0) {
    throw StreamError(ErrorCode::kBadRequest, "span: must divide the table's rows");
  }
  part_bytes_ = std::move(part_bytes);
  expand_ = std::move(expand);
  uint32_t rows = span * slots;
  for (size_t p = 0; p < part_bytes_.size(); ++p) {
    uint64_t pb = expand_[p] ? 2 * part_bytes_[p] : part_bytes_[p];
    uint64_t n = pb * rows;
    if (pb == 0 || (expand_[p] && part_bytes_[p] % 2) ||
        n > uint64_t(INT32_MAX) - kAlign) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "part_bytes: each part must be in [1, 2^31 / rows) (even if expanded)");
    }
    mx::array part = aligned_rows(rows, pb).second; // the view keeps its buffer
    ptrs_.push_back(part.data<uint8_t>());
    parts_.push_back(part);
    bytes_ += n + kAlign;
  }
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    throw StreamError(ErrorCode::kIO, "cannot open " + path + ": " + std::strerror(errno));
  }
  direct_fd_ = open_uncached(path, fd_, engine_->options());
  slots_.resize(slots);
}

SweepRing::~SweepRing() {
  close();
}

void SweepRing::close() {
  std::unique_lock<std::mutex> lk(mu_);
  for (auto& s : slots_) {
    join_locked(lk, s);
    s.ready = false;
    s.first = UINT32_MAX;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (direct_fd_ >= 0) {
    ::close(direct_fd_);
    direct_fd_ = -1;
  }
}

void SweepRing::join_locked(std::unique_lock<std::mutex>& lk, Slot& s) {
  std::vector<std::thread> workers;
  workers.swap(s.workers);
  if (workers.empty()) {
    return;
  }
  lk.unlock();
  for (auto& w : workers) {
    w.join();
  }
  lk.lock();
}

void SweepRing::issue(uint32_t slot, uint32_t first) {
  std::unique_lock<std::mutex> lk(mu_);
  if (slot >= slots_.size()) {
    throw StreamError(ErrorCode::kBadRequest, "slot: out of range");
  }
  const Table& t = engine_->table(table_);
  if (first % span_ != 0 || uint64_t(first) + span_ > t.rows.size()) {
    throw StreamError(ErrorCode::kBadRequest, "first: not the start of an extent");
  }
  if (fd_ < 0) {
    throw StreamError(ErrorCode::kClosed, "sweep ring is closed");
  }
  Slot& s = slots_[slot];
  if (s.first == first && s.error == ErrorCode::kNone &&
      (s.ready || !s.workers.empty())) {
    return; // held verified, or being read
  }
  join_locked(lk, s); // never rewrite rows a read still targets
  s.first = first;
  s.ready = false;
  s.error = ErrorCode::kNone;
  s.message.clear();
  sweeps_++;
  uint32_t n = static_cast<uint32_t>(std::min<int>(threads_, span_));
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t a = uint32_t(uint64_t(span_) * i / n);
    uint32_t b = uint32_t(uint64_t(span_) * (i + 1) / n);
    s.workers.emplace_back([this, slot, first, a, b] { read_span(slot, first, a, b); });
  }
}

void SweepRing::wait(uint32_t slot, uint32_t first) {
  issue(slot, first);
  std::unique_lock<std::mutex> lk(mu_);
  Slot& s = slots_[slot];
  int64_t t0 = now_ns();
  join_locked(lk, s);
  wait_ns_ += uint64_t(now_ns() - t0);
  if (s.first != first) {
    throw StreamError(ErrorCode::kStale, "sweep slot was reissued for another extent");
  }
  if (s.error != ErrorCode::kNone) {
    ErrorCode code = s.error;
    std::string msg = s.message;
    s.first = UINT32_MAX; // never hand out a failed slot
    s.ready = false;
    throw StreamError(code, msg);
  }
  s.ready = true;
}

void SweepRing::read_span(uint32_t slot, uint32_t first, uint32_t a, uint32_t b) {
  const Table& t = engine_->table(table_);
  std::shared_ptr<ReadHooks> hooks = engine_->read_hooks(); // test build only
  const size_t np = part_bytes_.size();
  auto fail = [&](ErrorCode code, const std::string& msg) {
    std::lock_guard<std::mutex> lk(mu_);
    if (slots_[slot].error == ErrorCode::kNone) {
      slots_[slot].error = code;
      slots_[slot].message = msg;
    }
  };
  std::vector<uint8_t> gap_store;
  uint8_t* gap = nullptr;
  for (uint32_t i = a; i < b;) {
    // One batch: consecutive records, contiguous on disk but for padding.
    const TableRow& r0 = t.rows[first + i];
    std::vector<struct iovec> iov;
    uint64_t want = 0;
    uint32_t j = i;
    while (j < b && want < kBatchBytes) {
      const TableRow& r = t.rows[first + j];
      if (j > i) {
        // Padding between records is read into scratch; anything else
        // (a hole too large, records out of order) ends the batch.
        uint64_t end = r0.offset + want;
        if (r.offset < end || r.offset - end > kMaxGap) {
          break;
        }
        if (r.offset > end) {
          uint64_t g = r.offset - end;
          if (gap_store.size() < g + kAlign) {
            gap_store.assign(g + kAlign, 0);
            gap = gap_store.data() +
                (kAlign - reinterpret_cast<uintptr_t>(gap_store.data()) % kAlign) % kAlign;
          }
          iov.push_back({gap, g});
          want += g;
        }
      }
      uint32_t row = slot * span_ + j;
      for (size_t p = 0; p < np; ++p) {
        uint64_t rb = expand_[p] ? 2 * part_bytes_[p] : part_bytes_[p];
        iov.push_back({ptrs_[p] + uint64_t(row) * rb, part_bytes_[p]});
      }
      want += r.length;
      ++j;
    }
    bool direct = direct_fd_ >= 0 && r0.offset % kAlign == 0;
    for (auto& v : iov) {
      direct = direct && reinterpret_cast<uintptr_t>(v.iov_base) % 512 == 0 && v.iov_len % 512 == 0;
    }
    std::vector<struct iovec> cur = iov;
    int fd = direct ? direct_fd_ : fd_;
    uint64_t got = 0;
    size_t k = 0;
    while (got < want) {
      int cnt = static_cast<int>(std::min<size_t>(cur.size() - k, IOV_MAX));
      ssize_t n = ::preadv(fd, cur.data() + k, cnt, r0.offset + got);
      if (n < 0) {
        if (errno == EINTR) {
          continue;
        }
        if (direct && errno == EINVAL && got == 0) {
          direct = false; // the filesystem refused a direct read
          fd = fd_;
          continue;
        }
        fail(ErrorCode::kIO, "I/O error sweeping offset " + std::to_string(r0.offset) + ": " + std::strerror(errno));
        return;
      }
      if (n == 0) {
        break;
      }
      got += uint64_t(n);
      consume_iov(cur.data(), k, uint64_t(n));
    }
    if (got < want) {
      fail(ErrorCode::kShortRead, "short read sweeping offset " + std::to_string(r0.offset) +
           ": got " + std::to_string(got) + " of " + std::to_string(want) + " bytes");
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      read_bytes_ += want;
    }
    for (uint32_t q = i; q < j; ++q) {
      const TableRow& r = t.rows[first + q];
      uint32_t row = slot * span_ + q;
      std::vector<struct iovec> segs(np);
      for (size_t p = 0; p < np; ++p) {
        uint64_t rb = expand_[p] ? 2 * part_bytes_[p] : part_bytes_[p];
        segs[p] = {ptrs_[p] + uint64_t(row) * rb, part_bytes_[p]};
      }
      if (hooks) {
        ReadOutcome o{ErrorCode::kNone, r.length, "",
                      static_cast<uint8_t*>(segs[0].iov_base), r.check.kind != Check::kNone,
                      r.offset};
        hooks->after_read(o);
        if (o.code != ErrorCode::kNone || o.got < r.length) {
          fail(o.code != ErrorCode::kNone ? o.code : ErrorCode::kShortRead,
               "read of record " + std::to_string(first + q) + " failed in a prefill sweep: " +
                   (o.detail.empty() ? "short read" : o.detail));
          return;
        }
      }
      // This sweep thread checks the records it read while the slot's other
      // threads keep reading theirs, widening each bf16 part (in place, as
      // the arena) once hashed; a failed check fails the sweep.
      auto widen = [&](size_t p) {
        if (expand_[p]) {
          widen_bf16_in_place(static_cast<uint8_t*>(segs[p].iov_base), part_bytes_[p]);
        }
      };
      if (!check_matches(r.check, segs.data(), segs.size(), r.length, widen)) {
        fail(ErrorCode::kDigest,
             std::string(r.check.kind == Check::kXxh3 ? "XXH3-128" : "SHA-256") +
                 " mismatch for record " + std::to_string(first + q) + " (offset " +
                 std::to_string(r.offset) + ") in a prefill sweep");
        return;
      }
    }
    i = j;
  }
}

uint64_t SweepRing::sweeps() const {
  std::lock_guard<std::mutex> lk(mu_);
  return sweeps_;
}
uint64_t SweepRing::read_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return read_bytes_;
}
uint64_t SweepRing::wait_ns() const {
  std::lock_guard<std::mutex> lk(mu_);
  return wait_ns_;
}
static mx::array sweep_op(std::shared_ptr<SweepRing> ring, const mx::array& value,
                          uint32_t slot, uint32_t first, bool wait) {
  return mx::array(
      value.shape(), value.dtype(),
      std::make_shared<SweepOp>(io_stream(), std::move(ring), slot, first, wait),
      {value});
}

mx::array sweep_issue(std::shared_ptr<SweepRing> ring, const mx::array& dep,
                      uint32_t slot, uint32_t first) {
  return sweep_op(std::move(ring), dep, slot, first, false);
}

mx::array sweep_wait(std::shared_ptr<SweepRing> ring, const mx::array& value,
                     uint32_t slot, uint32_t first) {
  return sweep_op(std::move(ring), value, slot, first, true);
}

void SweepOp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.copy_shared_buffer(inputs[0]);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.dispatch([ring = ring_, slot = slot_, first = first_, wait = wait_, value = inputs[0]]() {
    if (wait) {
      ring->wait(slot, first);
    } else {
      ring->issue(slot, first);
    }
  });
}

void SweepOp::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  throw std::runtime_error("Hebrus sweep ops run on the CPU stream only");
}

} // namespace hebrus
