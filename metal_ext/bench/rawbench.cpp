#include "rawbench.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "engine.h"

namespace hebrus {

namespace {

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
};

// One batch at a time: workers claim offsets from `next`; the last one to
// finish wakes the caller.
struct Pool {
  std::mutex mu;
  std::condition_variable start_cv, done_cv;
  const std::vector<uint64_t>* batch = nullptr;
  uint8_t* out = nullptr; // collect: where this batch's first read goes
  uint64_t round = 0;
  std::atomic<size_t> next{0};
  int busy = 0;
  bool stop = false;
  ErrorCode error = ErrorCode::kNone;
  std::string message;
};

void read_one(int fd, uint8_t* buf, uint64_t off, uint64_t length,
              const std::string& path, Pool& pool) {
  uint64_t got = 0;
  while (got < length) {
    ssize_t n = ::pread(fd, buf + got, length - got, off + got);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      std::lock_guard<std::mutex> lk(pool.mu);
      if (pool.error == ErrorCode::kNone) {
        pool.error = n < 0 ? ErrorCode::kIO : ErrorCode::kShortRead;
        pool.message = (n < 0 ? "I/O error reading " : "short read of ") +
            path + " offset " + std::to_string(off) +
            (n < 0 ? std::string(": ") + std::strerror(errno)
                   : ": got " + std::to_string(got) + " bytes");
      }
      return;
    }
    got += uint64_t(n);
  }
}

} // namespace

RawReadResult raw_pread(
    const std::string& path, const std::vector<std::vector<uint64_t>>& batches,
    uint64_t length, int threads, bool direct, bool collect) {
  auto bad = [](const std::string& m) {
    return StreamError(ErrorCode::kBadRequest, m);
  };
  if (threads < 1 || threads > 256) {
    throw bad("threads: must be in [1, 256], got " + std::to_string(threads));
  }
  if (length == 0 || length > (uint64_t(1) << 31)) {
    throw bad("length: must be in [1, 2^31], got " + std::to_string(length));
  }
  if (direct && length % kAlign != 0) {
    throw bad("length: must be a multiple of 4096 with direct=True, got " +
              std::to_string(length));
  }
  if (batches.empty()) {
    throw bad("batches: need at least one batch");
  }
  uint64_t reads = 0;
  for (size_t b = 0; b < batches.size(); ++b) {
    if (batches[b].empty()) {
      throw bad("batches: batch " + std::to_string(b) + " is empty");
    }
    for (uint64_t off : batches[b]) {
      if (direct && off % kAlign != 0) {
        throw bad("batches: offset " + std::to_string(off) +
                  " is not 4096-aligned (direct=True)");
      }
      if (off > UINT64_MAX - length) {
        throw bad("batches: offset " + std::to_string(off) + " overflows");
      }
    }
    reads += batches[b].size();
  }
  if (collect && reads * length > (uint64_t(1) << 30)) {
    throw bad("collect: at most 1 GiB of reads can be collected");
  }
  Fd fd, dfd;
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd.fd < 0) {
    throw bad("path: " + path + ": " + std::strerror(errno));
  }
  struct stat st;
  if (fstat(fd.fd, &st) != 0) {
    throw bad("path: " + path + ": " + std::strerror(errno));
  }
  for (const auto& batch : batches) {
    for (uint64_t off : batch) {
      if (off + length > uint64_t(st.st_size)) {
        throw bad("batches: offset " + std::to_string(off) + " + length " +
                  std::to_string(length) + " is past the end of " + path +
                  " (" + std::to_string(st.st_size) + " bytes)");
      }
    }
  }
  bool uncached = false;
#if defined(__linux__)
  if (direct) {
    dfd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    uncached = dfd.fd >= 0;
  }
#elif defined(__APPLE__)
  // No O_DIRECT on macOS: F_NOCACHE keeps these reads out of the unified
  // buffer cache (pages already in it may still be served from it).
  // Unverified: never built on macOS.
  if (direct) {
    uncached = ::fcntl(fd.fd, F_NOCACHE, 1) == 0;
  }
#endif
  const int rfd = dfd.fd >= 0 ? dfd.fd : fd.fd;

  // Buffers are allocated and touched before the clock starts, so page
  // faults are not billed to the reads.
  uint64_t buf_bytes = (length + kAlign - 1) / kAlign * kAlign;
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> bufs;
  for (int i = 0; i < threads; ++i) {
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, buf_bytes) != 0) {
      throw StreamError(ErrorCode::kIO, "could not allocate read buffers");
    }
    std::memset(p, 0, buf_bytes);
    bufs.emplace_back(static_cast<uint8_t*>(p), &std::free);
  }

  RawReadResult res;
  if (collect) {
    res.data.resize(reads * length);
  }
  Pool pool;
  std::vector<std::thread> workers;
  for (int i = 0; i < threads; ++i) {
    workers.emplace_back([&, buf = bufs[i].get()] {
      uint64_t seen = 0;
      std::unique_lock<std::mutex> lk(pool.mu);
      while (true) {
        pool.start_cv.wait(lk, [&] { return pool.stop || pool.round != seen; });
        if (pool.stop) {
          return;
        }
        seen = pool.round;
        const std::vector<uint64_t>& batch = *pool.batch;
        uint8_t* out = pool.out;
        lk.unlock();
        for (size_t k; (k = pool.next.fetch_add(1)) < batch.size();) {
          read_one(rfd, buf, batch[k], length, path, pool);
          if (out) {
            std::memcpy(out + k * length, buf, length);
          }
        }
        lk.lock();
        if (--pool.busy == 0) {
          pool.done_cv.notify_one();
        }
      }
    });
  }
  int64_t t0 = now_ns();
  {
    std::unique_lock<std::mutex> lk(pool.mu);
    uint64_t done = 0;
    for (const auto& batch : batches) {
      if (pool.error != ErrorCode::kNone) {
        break;
      }
      pool.batch = &batch;
      pool.out = collect ? res.data.data() + done * length : nullptr;
      done += batch.size();
      pool.next = 0;
      pool.busy = threads;
      pool.round++;
      pool.start_cv.notify_all();
      pool.done_cv.wait(lk, [&] { return pool.busy == 0; });
    }
  }
  int64_t t1 = now_ns();
  {
    std::lock_guard<std::mutex> lk(pool.mu);
    pool.stop = true;
  }
  pool.start_cv.notify_all();
  for (auto& w : workers) {
    w.join();
  }
  if (pool.error != ErrorCode::kNone) {
    throw StreamError(pool.error, pool.message);
  }
  res.elapsed_ns = t1 - t0;
  res.bytes = reads * length;
  res.reads = reads;
  res.direct = uncached;
  return res;
}

} // namespace hebrus
