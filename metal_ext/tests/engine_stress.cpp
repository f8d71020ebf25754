// Sanitizer stress of the I/O engine without Python or MLX: threads race
// requests, cancels, releases and generation bumps on a small cache. Every
// byte delivered must match the store; nothing may stay pinned.
// Built and run by tests/test_stream_engine_sanitize.py (TSan, ASan+UBSan).
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "engine.h"
#include "testing/faults.h"

using namespace hebrus;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: engine_stress STORE_PATH\n");
    return 2;
  }
  const uint64_t rec = 3 * 4096;
  const int records = 12;
  std::vector<uint8_t> data(rec * records);
  std::mt19937 fill(1);
  for (auto& b : data) {
    b = static_cast<uint8_t>(fill());
  }
  int fd = ::open(argv[1], O_CREAT | O_TRUNC | O_WRONLY, 0644);
  if (fd < 0 || ::write(fd, data.data(), data.size()) != ssize_t(data.size())) {
    std::perror("store");
    return 2;
  }
  ::close(fd);

  EngineOptions o;
  o.threads = 3;
  o.cache_bytes = 6 * rec;
  Engine e(o);
  int store = e.add_store(argv[1], "");
  testing::injector(e)->set_delay_us(100);
  std::atomic<int> wrong{0}, delivered{0};

  auto worker = [&](uint64_t owner, unsigned seed) {
    std::mt19937 r(seed);
    uint64_t gen = 0;
    for (int i = 0; i < 400; ++i) {
      int k = r() % records;
      Request q;
      q.store = store;
      q.offset = k * rec;
      q.length = rec;
      q.owner = owner;
      q.generation = gen;
      q.priority = r() % 3;
      q.exact = r() % 2;
      // Both digest domains: a fast-checked and a SHA-256-checked request for
      // one record never share a slot (Engine::Key), so both race here.
      if (r() % 5 == 0) {
        q.check.kind = Check::kSha256;
        q.check.digest = sha256(&data[k * rec], rec);
      } else if (r() % 4 == 0) {
        q.check.kind = Check::kXxh3;
        Xxh3Digest d = xxh3_128(&data[k * rec], rec);
        std::copy(d.begin(), d.end(), q.check.digest.begin());
      }
      uint64_t t;
      try {
        t = e.request(q);
      } catch (const StreamError&) {
        continue; // cache full or stale generation
      }
      int x = r() % 100;
      try {
        if (x < 25) {
          e.cancel(t);
          continue;
        }
        if (x < 35) {
          e.advance_generation(owner, ++gen);
        }
        if (x < 40) {
          e.release(t); // the wait below must fail cleanly
        }
        std::vector<uint8_t> buf(rec);
        e.copy_out(e.wait(t), buf.data());
        if (std::memcmp(buf.data(), &data[k * rec], rec) != 0) {
          wrong++;
        }
        delivered++;
      } catch (const StreamError&) {
      }
      e.release(t);
    }
  };
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < 4; ++i) {
    threads.emplace_back(worker, i % 2, i);
  }
  for (auto& t : threads) {
    t.join();
  }
  MemoryInfo m = e.memory();
  std::printf(
      "delivered=%d wrong=%d pinned=%u tickets=%u allocated=%llu\n",
      delivered.load(),
      wrong.load(),
      m.pinned_slots,
      m.tickets,
      static_cast<unsigned long long>(m.allocated));
  bool ok = wrong == 0 && delivered > 0 && m.pinned_slots == 0 &&
      m.tickets == 0 && m.allocated <= o.cache_bytes;
  return ok ? 0 : 1;
}
