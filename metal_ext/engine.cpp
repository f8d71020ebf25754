#include "engine.h"
#include "io_mtlio.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <sstream>

namespace hebrus {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

uint64_t round_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

constexpr size_t kLatencyWindow = 1 << 16;

} // namespace

const char* error_name(ErrorCode code) {
  switch (code) {
#define HEBRUS_ERROR_CASE(id, value, name) \
  case ErrorCode::id:                      \
    return name;
    HEBRUS_ERROR_CODES(HEBRUS_ERROR_CASE)
#undef HEBRUS_ERROR_CASE
  }
  return "unknown";
}

const char* check_name(Check kind) {
  switch (kind) {
    case Check::kNone:
      return "none";
    case Check::kSha256:
      return "sha256";
    case Check::kXxh3:
      return "xxh3-128";
  }
  return "unknown";
}

bool check_matches(
    const RecordCheck& check, const struct iovec* segs, size_t nsegs,
    uint64_t length, const std::function<void(size_t)>& after) {
  auto each = [&](auto&& update) {
    uint64_t left = length;
    for (size_t i = 0; i < nsegs; ++i) {
      uint64_t n = std::min<uint64_t>(left, segs[i].iov_len);
      if (n > 0) {
        update(static_cast<const uint8_t*>(segs[i].iov_base), n);
      }
      left -= n;
      if (after) {
        after(i);
      }
    }
  };
  if (check.kind == Check::kNone) {
    each([](const uint8_t*, uint64_t) {});
    return true;
  }
  if (check.kind == Check::kXxh3) {
    Xxh3_128 h;
    each([&](const uint8_t* p, uint64_t n) { h.update(p, n); });
    Xxh3Digest d = h.finish();
    return std::equal(d.begin(), d.end(), check.digest.begin()) &&
        std::all_of(check.digest.begin() + d.size(), check.digest.end(),
                    [](uint8_t b) { return b == 0; });
  }
  Sha256 h;
  each([&](const uint8_t* p, uint64_t n) { h.update(p, n); });
  return h.finish() == check.digest;
}

void widen_bf16_in_place(uint8_t* base, uint64_t bf16_bytes) {
  // Backwards a chunk at a time: a chunk's inputs are copied out first, and
  // its outputs start at byte 4n, at or past the end (2n) of every input not
  // yet copied. The inner loop then vectorizes (the scalar in-place loop did
  // not: a reader spent twice its digest time there).
  constexpr uint64_t kChunk = 2048;
  uint16_t in[kChunk];
  uint64_t n = bf16_bytes / 2;
  while (n > 0) {
    uint64_t c = std::min(n, kChunk);
    n -= c;
    std::memcpy(in, base + 2 * n, 2 * c);
    uint8_t* out = base + 4 * n;
    for (uint64_t j = 0; j < c; ++j) {
      uint32_t f = uint32_t(in[j]) << 16;
      std::memcpy(out + 4 * j, &f, 4);
    }
  }
}

std::string trace_outcome_name(const TraceEvent& e) {
  static const char* names[] = {
      "published", "stale", "dropped", "failed", "timeout", "cancelled"};
  if (e.kind == TraceKind::kMark) {
    return "";
  }
  if (e.outcome >= kTraceErrorBase) {
    return std::string("error:") +
        error_name(ErrorCode(e.outcome - kTraceErrorBase));
  }
  return e.outcome < std::size(names) ? names[e.outcome]
                                      : std::to_string(e.outcome);
}

Engine::Engine(const EngineOptions& options) : opts_(options) {
  if (opts_.threads < 1 || opts_.threads > 256) {
    throw StreamError(ErrorCode::kBadRequest, "threads must be in [1, 256]");
  }
  if (opts_.cache_bytes < kAlign) {
    throw StreamError(
        ErrorCode::kBadRequest, "cache_bytes must be at least 4096");
  }
  if (opts_.policy != "lru" && opts_.policy != "clock" &&
      opts_.policy != "score") {
    throw StreamError(
        ErrorCode::kBadRequest, "policy must be 'lru', 'clock' or 'score'");
  }
  if (opts_.backend != "pread" && opts_.backend != "mtlio") {
    throw StreamError(
        ErrorCode::kBadRequest,
        "backend: expected 'pread' or 'mtlio', got '" + opts_.backend + "'");
  }
  if (opts_.backend == "mtlio") {
#if HEBRUS_MTLIO
    // Throws (no Metal device, no IO queue) before any thread exists.
    mtlio_ = std::make_shared<MtlioReader>(opts_.threads);
#else
    throw StreamError(
        ErrorCode::kBadRequest,
        "backend: 'mtlio' is not compiled into this build (it needs macOS "
        "with Metal and MLX's metal-cpp headers); available: pread");
#endif
  }
  latencies_.reserve(kLatencyWindow);
  // opts_.threads readers plus one checker per core (at most as many as
  // readers): reads stay at opts_.threads in flight while the records
  // already read are checked beside them.
  int cores = std::max(1, int(std::thread::hardware_concurrency()));
  int workers = opts_.threads + std::min(opts_.threads, cores);
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

Engine::~Engine() {
  close();
  for (auto& s : slots_) {
    if (s.slab.arena < 0) {
      free_slab(s.slab);
    }
    if (s.job && s.job->slab.arena < 0) {
      free_slab(s.job->slab);
    }
  }
  for (auto& [size, slab] : pool_) {
    free_slab(slab);
  }
}

void Engine::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      return;
    }
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
  workers_.clear();
  std::lock_guard<std::mutex> lk(mu_);
  // Queued reads never ran: fail their tickets so no waiter hangs. Slabs stay
  // until the destructor because a released view may still be in use.
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == SlotState::kLoading) {
      fail_slot_locked(i, ErrorCode::kClosed, "stream engine closed");
    }
  }
  // No worker is left to read: the descriptors go now, not at destruction
  // (a failed construction closes its engine and must not hold files open).
  for (auto& st : stores_) {
    for (int* fd : {&st.fd, &st.direct_fd}) {
      if (*fd >= 0) {
        ::close(*fd);
        *fd = -1;
      }
    }
    for (auto& mi : st.mirrors) {
      for (int* fd : {&mi.fd, &mi.direct_fd}) {
        if (*fd >= 0) {
          ::close(*fd);
          *fd = -1;
        }
      }
    }
  }
  done_cv_.notify_all();
}

void Engine::free_slab(Slab& slab) {
  if (slab.data) {
    auto owner = slab_owners_.find(slab.data);
    if (owner != slab_owners_.end()) {
      slab_owners_.erase(owner);
    } else {
      std::free(slab.data);
    }
  }
  slab = Slab{};
}

void Engine::check_store_locked(int store) const {
  if (store < 0 || store >= static_cast<int>(stores_.size())) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "store: unknown store id " + std::to_string(store));
  }
}

int open_uncached(const std::string& path, int fd, const EngineOptions& opts) {
  int direct_fd = -1;
#if defined(__linux__)
  if (opts.direct) {
    // Filesystems without O_DIRECT (tmpfs) refuse it: the buffered fd serves.
    direct_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  }
#elif defined(__APPLE__)
  if (opts.nocache) {
    fcntl(fd, F_NOCACHE, 1);
  }
#endif
  (void)path;
  (void)fd;
  (void)opts;
  return direct_fd;
}

int Engine::add_store(const std::string& path, const std::string& digest_id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      throw StreamError(ErrorCode::kClosed, "stream engine closed");
    }
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "store path " + path + ": " + std::strerror(errno));
  }
  int direct_fd = open_uncached(path, fd, opts_);
  std::lock_guard<std::mutex> lk(mu_);
  stores_.emplace_back(path, digest_id, fd, direct_fd);
  return static_cast<int>(stores_.size()) - 1;
}

int Engine::add_mirror(int store, const std::string& path) {
  if (opts_.backend != "pread") {
    throw StreamError(
        ErrorCode::kBadRequest,
        "mirror: only the pread backend reads mirrors, not '" + opts_.backend +
            "'");
  }
  std::string primary;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      throw StreamError(ErrorCode::kClosed, "stream engine closed");
    }
    check_store_locked(store);
    primary = stores_[store].path;
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "mirror path " + path + ": " + std::strerror(errno));
  }
  struct stat a, b;
  if (::fstat(fd, &b) != 0 || ::stat(primary.c_str(), &a) != 0 ||
      a.st_size != b.st_size) {
    ::close(fd);
    throw StreamError(
        ErrorCode::kBadRequest,
        "mirror " + path + ": size differs from the store " + primary);
  }
  int direct_fd = open_uncached(path, fd, opts_);
  std::lock_guard<std::mutex> lk(mu_);
  Store& st = stores_[store];
  st.mirrors.push_back(Mirror{path, fd, direct_fd});
  st.file_reads.push_back(0);
  st.file_bytes.push_back(0);
  return static_cast<int>(st.mirrors.size()) - 1;
}

Engine::FileReads Engine::file_reads(int store) {
  std::lock_guard<std::mutex> lk(mu_);
  check_store_locked(store);
  const Store& st = stores_[store];
  FileReads out;
  out.paths.push_back(st.path);
  for (const auto& mi : st.mirrors) {
    out.paths.push_back(mi.path);
  }
  out.reads = st.file_reads;
  out.bytes = st.file_bytes;
  out.fallbacks = st.fallbacks;
  return out;
}

int Engine::register_table(int store, std::vector<TableRow> rows, int arena) {
  std::lock_guard<std::mutex> lk(mu_);
  check_store_locked(store);
  if (arena >= static_cast<int>(arenas_.size())) {
    throw StreamError(
        ErrorCode::kBadRequest, "arena: unknown arena id " + std::to_string(arena));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (arena >= 0 && rows[i].length != arenas_[arena].record_bytes) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "table row " + std::to_string(i) + ": length " +
              std::to_string(rows[i].length) + " != arena record bytes " +
              std::to_string(arenas_[arena].record_bytes));
    }
    if (arena < 0 && (rows[i].length == 0 || rows[i].length > opts_.cache_bytes)) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "table row " + std::to_string(i) +
              ": length must be in [1, cache_bytes]");
    }
  }
  uint64_t uniform = rows.empty() ? 0 : rows[0].length;
  for (const auto& r : rows) {
    if (r.length != uniform) {
      uniform = 0;
    }
  }
  tables_.push_back(Table{store, std::move(rows), uniform, arena});
  return static_cast<int>(tables_.size()) - 1;
}

int Engine::add_arena(
    std::vector<uint8_t*> parts, std::vector<uint64_t> part_bytes,
    std::vector<uint8_t> expand, uint32_t rows, std::shared_ptr<void> keepalive,
    std::vector<DevicePart> device) {
  check_arena_spec(part_bytes, rows, expand);
  if (parts.size() != part_bytes.size()) {
    throw StreamError(ErrorCode::kBadRequest, "parts: need one per part_bytes");
  }
  if (!device.empty() && device.size() != parts.size()) {
    throw StreamError(
        ErrorCode::kBadRequest, "device: need one buffer per part or none");
  }
  Arena a;
  for (size_t p = 0; p < part_bytes.size(); ++p) {
    if (part_bytes[p] == 0) {
      throw StreamError(ErrorCode::kBadRequest, "part_bytes: must be > 0");
    }
    if (expand[p] && part_bytes[p] % 2 != 0) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "part_bytes: an expanded (bf16) part needs an even byte count");
    }
    a.record_bytes += part_bytes[p];
  }
  a.expand = std::move(expand);
  a.parts = std::move(parts);
  a.part_bytes = std::move(part_bytes);
  a.rows = rows;
  for (uint32_t r = rows; r-- > 0;) {
    a.free_rows.push_back(r); // row 0 is handed out first
  }
  a.keepalive = std::move(keepalive);
  a.device = std::move(device);
  std::lock_guard<std::mutex> lk(mu_);
  arenas_.push_back(std::move(a));
  return static_cast<int>(arenas_.size()) - 1;
}

void check_arena_spec(
    const std::vector<uint64_t>& part_bytes, uint32_t rows,
    std::vector<uint8_t>& expand) {
  if (part_bytes.empty() || rows == 0) {
    throw StreamError(
        ErrorCode::kBadRequest, "arena: need >= 1 part and >= 1 row");
  }
  if (expand.empty()) {
    expand.assign(part_bytes.size(), 0);
  }
  if (expand.size() != part_bytes.size()) {
    throw StreamError(
        ErrorCode::kBadRequest, "expand: need one flag per part");
  }
}

uint64_t Engine::arena_record_bytes(int arena) {
  std::lock_guard<std::mutex> lk(mu_);
  if (arena < 0 || arena >= static_cast<int>(arenas_.size())) {
    throw StreamError(
        ErrorCode::kBadRequest, "arena: unknown arena id " + std::to_string(arena));
  }
  return arenas_[arena].record_bytes;
}

void Engine::copy_out(const View& v, uint8_t* dst) {
  if (v.arena < 0) {
    std::memcpy(dst, v.data, v.length);
    return;
  }
  // (start, stored bytes); negative: an expanded bf16 part.
  std::vector<std::pair<const uint8_t*, int64_t>> segs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const Arena& a = arenas_[v.arena];
    for (size_t p = 0; p < a.parts.size(); ++p) {
      segs.emplace_back(
          a.parts[p] + uint64_t(v.row) * a.row_bytes(p),
          a.expand[p] ? -int64_t(a.part_bytes[p]) : int64_t(a.part_bytes[p]));
    }
  }
  for (auto& [ptr, n] : segs) {
    if (n >= 0) {
      std::memcpy(dst, ptr, n);
      dst += n;
      continue;
    }
    // Expanded part: hand back the stored bf16 bytes (the high halves).
    uint64_t count = uint64_t(-n) / 2;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(ptr);
    for (uint64_t i = 0; i < count; ++i) {
      uint16_t h = static_cast<uint16_t>(src[i] >> 16);
      std::memcpy(dst + 2 * i, &h, 2);
    }
    dst += uint64_t(-n);
  }
}

const Table& Engine::table(int table_id) const {
  // Tables are append-only and never mutated after registration; the deque
  // keeps references stable.
  std::lock_guard<std::mutex> lk(const_cast<std::mutex&>(mu_));
  if (table_id < 0 || table_id >= static_cast<int>(tables_.size())) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "table: unknown table id " + std::to_string(table_id));
  }
  return tables_[table_id];
}

uint32_t Engine::alloc_slot_locked() {
  if (!free_slots_.empty()) {
    uint32_t idx = free_slots_.back();
    free_slots_.pop_back();
    return idx;
  }
  slots_.emplace_back();
  return static_cast<uint32_t>(slots_.size() - 1);
}

void Engine::retire_slot_locked(uint32_t idx) {
  Slot& s = slots_[idx];
  if (s.exact) {
    count_exact_locked(idx, -1);
  }
  s.arena = -1;
  s.state = SlotState::kFree;
  reindex_locked(idx); // leaves the evictable index
  // The generation bump is what keeps an in-flight read of the old owner
  // from ever publishing here.
  s.gen++;
  auto it = index_.find(s.key);
  if (it != index_.end() && it->second == idx) {
    index_.erase(it);
  }
  if (s.slab.valid()) {
    recycle_slab_locked(s.slab);
    s.slab = Slab{};
  }
  if (s.job) {
    if (trace_) {
      trace_read_end_locked(idx, s.job->gen, uint8_t(TraceOutcome::kDropped));
    }
    recycle_slab_locked(s.job->slab);
    s.job.reset();
  }
  s.state = SlotState::kFree;
  s.pins = 0;
  s.detached = false;
  s.exact = false;
  s.used = false;
  s.inflight = false;
  s.queued_priority = -1;
  s.deadline_ns = INT64_MAX;
  s.waiters.clear();
  free_slots_.push_back(idx);
}

void Engine::fail_slot_locked(
    uint32_t idx, ErrorCode code, const std::string& msg) {
  Slot& s = slots_[idx];
  for (uint64_t id : s.waiters) {
    auto it = tickets_.find(id);
    if (it == tickets_.end()) {
      continue;
    }
    it->second.state = TicketState::kFailed;
    it->second.error = code;
    it->second.message = msg;
    it->second.holds_pin = false;
  }
  retire_slot_locked(idx);
}

double Engine::eviction_key(const Slot& s) const {
  if (opts_.policy == "score") {
    // Stall removed per byte: P(use) * latency a miss would cost / bytes.
    double stall = s.stall_ns > 0 ? s.stall_ns : stall_ewma_ns_;
    return s.p_use * std::max(stall, 1.0) / double(s.key.length);
  }
  if (opts_.policy == "clock") {
    return double(s.clock_pos);
  }
  return double(s.lru);
}

void Engine::recycle_slab_locked(const Slab& slab) {
  if (slab.arena >= 0) {
    arenas_[slab.arena].free_rows.push_back(slab.row);
  } else {
    pool_.emplace(slab.size, slab);
  }
}

void Engine::reindex_locked(uint32_t idx) {
  Slot& s = slots_[idx];
  int dest = s.slab.arena;
  if (s.indexed) {
    evictable_[s.evict_key_arena].erase(s.evict_key);
    s.indexed = false;
  }
  if (s.state == SlotState::kReady && s.pins == 0) {
    s.evict_key = {eviction_key(s), s.lru, idx};
    // Arena rows: exact and predicted records in separate buckets (2a, 2a+1)
    // so a prediction can be kept from evicting an exact record.
    if (dest >= 0) {
      dest = 2 * dest + (s.exact ? 0 : 1);
    }
    s.evict_key_arena = dest;
    evictable_[dest].insert(s.evict_key);
    s.indexed = true;
  }
}

int64_t Engine::pick_bucket_locked(int bucket) {
  auto it = evictable_.find(bucket);
  if (it == evictable_.end() || it->second.empty()) {
    return -1;
  }
  if (opts_.policy == "clock") {
    // The hand passes referenced records once (clearing the bit, moving them
    // behind the hand); pinned ones are not on the ring. Ends: bits only clear.
    while (true) {
      uint32_t v = std::get<2>(*it->second.begin());
      Slot& s = slots_[v];
      if (!s.ref) {
        return v;
      }
      s.ref = false;
      s.clock_pos = ++lru_clock_;
      reindex_locked(v);
    }
  }
  return std::get<2>(*it->second.begin());
}

int64_t Engine::pick_victim_locked(int arena) {
  if (arena < 0) {
    return pick_bucket_locked(-1);
  }
  // The policy's order over both classes of the arena's rows.
  int64_t e = pick_bucket_locked(2 * arena);
  int64_t p = pick_bucket_locked(2 * arena + 1);
  if (e < 0 || p < 0) {
    return e < 0 ? p : e;
  }
  return slots_[p].evict_key < slots_[e].evict_key ? p : e;
}

void Engine::count_exact_locked(uint32_t idx, int delta) {
  int arena = slots_[idx].arena;
  if (arena >= 0) {
    arenas_[arena].exact_rows += delta;
  }
}

void Engine::set_staging(int arena, uint32_t rows) {
  std::lock_guard<std::mutex> lk(mu_);
  if (arena < 0 || arena >= static_cast<int>(arenas_.size())) {
    throw StreamError(
        ErrorCode::kBadRequest, "arena: unknown arena id " + std::to_string(arena));
  }
  if (rows >= arenas_[arena].rows) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "staging: must be below the arena's " +
            std::to_string(arenas_[arena].rows) + " rows, got " +
            std::to_string(rows));
  }
  arenas_[arena].staging = rows;
}

Slab Engine::reserve_row_locked(int arena, bool exact) {
  Arena& a = arenas_[arena];
  if (exact) {
    // Over its share, an exact read recycles exact rows (oldest first) and
    // leaves the staging rows to predictions; if every exact row is pinned
    // it falls through to any free or evictable row.
    while (a.staging > 0 && a.exact_rows >= a.rows - a.staging) {
      int64_t v = pick_bucket_locked(2 * arena);
      if (v < 0) {
        break;
      }
      if (!slots_[v].used) {
        counters_.wasted_bytes += slots_[v].key.length;
      }
      counters_.evictions++;
      retire_slot_locked(static_cast<uint32_t>(v));
    }
  }
  while (true) {
    if (!a.free_rows.empty()) {
      uint32_t row = a.free_rows.back();
      a.free_rows.pop_back();
      return Slab{nullptr, a.record_bytes, arena, row};
    }
    // Advisory: a prediction only ever displaces another prediction.
    int64_t best = exact ? pick_victim_locked(arena)
                         : pick_bucket_locked(2 * arena + 1);
    if (best < 0) {
      throw StreamError(
          ErrorCode::kCacheFull,
          "arena " + std::to_string(arena) + " full: all " +
              std::to_string(a.rows) + " rows are pinned or in flight" +
              (exact ? "" : " or hold exact records"));
    }
    Slot& v = slots_[best];
    if (!v.used) {
      counters_.wasted_bytes += v.key.length;
    }
    counters_.evictions++;
    retire_slot_locked(static_cast<uint32_t>(best));
  }
}

Slab Engine::reserve_slab_locked(uint64_t size) {
  while (true) {
    auto it = pool_.find(size);
    if (it != pool_.end()) {
      Slab slab = it->second;
      pool_.erase(it);
      return slab;
    }
    if (allocated_ + size <= opts_.cache_bytes) {
      void* p = nullptr;
      if (opts_.allocate_slab) {
        auto [data, owner] = opts_.allocate_slab(size);
        if (data == nullptr || reinterpret_cast<uintptr_t>(data) % kAlign) {
          throw StreamError(
              ErrorCode::kCacheFull,
              "slab allocator returned no aligned " + std::to_string(size) +
                  "-byte block");
        }
        slab_owners_[data] = std::move(owner);
        p = data;
      } else if (posix_memalign(&p, kAlign, size) != 0) {
        throw StreamError(
            ErrorCode::kCacheFull,
            "could not allocate a " + std::to_string(size) + "-byte slab");
      }
      allocated_ += size;
      return Slab{static_cast<uint8_t*>(p), size};
    }
    if (!pool_.empty()) {
      // A pooled slab of another size: give its bytes back to the budget.
      auto victim = std::prev(pool_.end());
      allocated_ -= victim->second.size;
      free_slab(victim->second);
      pool_.erase(victim);
      continue;
    }
    int64_t best = pick_victim_locked(-1);
    if (best < 0) {
      throw StreamError(
          ErrorCode::kCacheFull,
          "slot cache full: every byte of the " +
              std::to_string(opts_.cache_bytes) +
              "-byte cache is pinned or in flight; need " +
              std::to_string(size));
    }
    Slot& v = slots_[best];
    if (!v.used) {
      counters_.wasted_bytes += v.key.length;
    }
    counters_.evictions++;
    retire_slot_locked(static_cast<uint32_t>(best));
  }
}

void Engine::enqueue_locked(uint32_t idx, int priority) {
  Slot& s = slots_[idx];
  s.queued_priority = priority;
  queues_[priority].push(QueueItem{s.deadline_ns, ++queue_seq_, idx, s.gen});
}

void Engine::validate_locked(const Request& req) const {
  if (stop_) {
    throw StreamError(ErrorCode::kClosed, "stream engine closed");
  }
  check_store_locked(req.store);
  if (req.arena >= static_cast<int>(arenas_.size())) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "arena: unknown arena id " + std::to_string(req.arena));
  }
  if (req.arena >= 0 && req.length != arenas_[req.arena].record_bytes) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "length: must equal the arena record bytes " +
            std::to_string(arenas_[req.arena].record_bytes));
  }
  if (req.length == 0 || (req.arena < 0 && req.length > opts_.cache_bytes)) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "length: must be in [1, cache_bytes], got " +
            std::to_string(req.length));
  }
  if (req.priority < 0 || req.priority >= kNumPriorities) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "priority: must be 0 (P0), 1 (P1) or 2 (P2), got " +
            std::to_string(req.priority));
  }
  if (!(req.confidence >= 0.0 && req.confidence <= 1.0)) {
    throw StreamError(ErrorCode::kBadRequest, "confidence: must be in [0, 1]");
  }
  auto og = owner_generation_.find(req.owner);
  if (og != owner_generation_.end() && req.generation < og->second) {
    throw StreamError(
        ErrorCode::kStale,
        "generation " + std::to_string(req.generation) + " of owner " +
            std::to_string(req.owner) + " is stale (current " +
            std::to_string(og->second) + ")");
  }
}

void Engine::join_locked(
    uint32_t idx, const Request& req, uint64_t id, Ticket& t) {
  Slot& s = slots_[idx];
  s.pins++;
  s.used = true;
  s.lru = ++lru_clock_;
  s.ref = true;
  s.p_use = std::max(s.p_use, req.confidence);
  if (req.exact && !s.exact) {
    (s.state == SlotState::kReady ? counters_.predicted_hits
                                  : counters_.predicted_joins)++;
    count_exact_locked(idx, +1); // a hit promotes the prediction
  }
  s.exact = s.exact || req.exact;
  reindex_locked(idx); // now pinned
  t.slot = idx;
  t.gen = s.gen;
  if (s.state == SlotState::kReady) {
    t.state = TicketState::kReady;
    t.kind = TicketKind::kHit;
    t.complete_seq = 0;
    counters_.hits++;
    return;
  }
  t.state = TicketState::kPending;
  t.kind = TicketKind::kJoined;
  counters_.joins++;
  s.waiters.push_back(id);
  // Still queued: a more urgent joiner moves the read up.
  if (s.job &&
      (req.priority < s.queued_priority || req.deadline_ns < s.deadline_ns)) {
    s.deadline_ns = std::min(s.deadline_ns, req.deadline_ns);
    enqueue_locked(idx, std::min(req.priority, s.queued_priority));
    work_cv_.notify_one();
  }
}

void Engine::start_read_locked(
    const Key& key, const Request& req, uint64_t id, Ticket& t) {
  // Reserve before touching any state: a full cache leaves nothing behind.
  Slab slab = req.arena >= 0 ? reserve_row_locked(req.arena, req.exact)
                             : reserve_slab_locked(round_up(req.length, kAlign));
  uint32_t idx = alloc_slot_locked();
  Slot& s = slots_[idx];
  s.state = SlotState::kLoading;
  s.key = key;
  s.pins = 1;
  s.exact = req.exact;
  s.arena = req.arena;
  if (s.exact) {
    count_exact_locked(idx, +1);
    counters_.exact_misses++;
  } else {
    counters_.predicted_reads++;
  }
  s.lru = ++lru_clock_;
  s.clock_pos = s.lru;
  s.ref = false;
  s.p_use = req.confidence;
  s.stall_ns = 0;
  s.deadline_ns = req.deadline_ns;
  s.waiters = {id};
  Store& st = stores_[req.store];
  s.job = std::make_unique<Job>(Job{
      idx, s.gen, key, slab, now_ns(), req.priority, st.fd, st.direct_fd});
  if (!st.mirrors.empty()) {
    // Mirrors: alternate files read by read, so concurrent reads (reader
    // threads, P0 next to P1) go to both disks.
    int f = static_cast<int>(st.next_file++ % (st.mirrors.size() + 1));
    s.job->file = f;
    s.job->primary_fd = st.fd;
    s.job->primary_direct_fd = st.direct_fd;
    if (f > 0) {
      s.job->fd = st.mirrors[f - 1].fd;
      s.job->direct_fd = st.mirrors[f - 1].direct_fd;
    }
  }
  if (trace_) {
    trace_->pending[{idx, s.gen}] = TraceRing::Pending{
        s.job->issue_ns, 0, -1, req.layer, req.expert, req.exact, req.length};
  }
  index_[key] = idx;
  enqueue_locked(idx, req.priority);
  t.slot = idx;
  t.gen = s.gen;
  t.state = TicketState::kPending;
  t.kind = TicketKind::kMiss;
  counters_.misses++;
  work_cv_.notify_one();
}

uint64_t Engine::request(const Request& req) {
  std::lock_guard<std::mutex> lk(mu_);
  validate_locked(req);
  counters_.requests++;
  Key key = key_of(req);
  uint64_t id = next_ticket_;
  Ticket t;
  t.req = req;
  auto found = index_.find(key);
  if (found != index_.end()) {
    join_locked(found->second, req, id, t);
  } else {
    start_read_locked(key, req, id, t);
  }
  next_ticket_++;
  tickets_.emplace(id, std::move(t));
  return id;
}

Engine::View Engine::wait(uint64_t id, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end()) {
    if (id > 0 && id < next_ticket_) {
      throw StreamError(
          ErrorCode::kCancelled,
          "ticket " + std::to_string(id) + " was already released or cancelled");
    }
    throw StreamError(
        ErrorCode::kBadRequest, "ticket: unknown id " + std::to_string(id));
  }
  counters_.waits++;
  if (it->second.state == TicketState::kPending) {
    counters_.waits_blocked++;
    int64_t t0 = now_ns();
    const int layer = it->second.req.layer, expert = it->second.req.expert;
    auto trace_wait = [&](TraceOutcome o) {
      if (trace_) {
        int64_t t = now_ns();
        trace_->push(TraceEvent{
            TraceKind::kWait, uint8_t(o), -1, false, false, layer, expert, 0,
            t0, t, t});
      }
    };
    auto deadline = std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(
                            timeout_s < 0 ? 1e9 : timeout_s));
    while (true) {
      it = tickets_.find(id);
      if (it == tickets_.end()) {
        counters_.exposed_wait_ns += now_ns() - t0;
        trace_wait(TraceOutcome::kCancelled);
        throw StreamError(
            ErrorCode::kCancelled,
            "ticket " + std::to_string(id) + " was cancelled while waiting");
      }
      if (it->second.state != TicketState::kPending) {
        break;
      }
      if (done_cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
        it = tickets_.find(id);
        if (it != tickets_.end() &&
            it->second.state == TicketState::kPending) {
          counters_.exposed_wait_ns += now_ns() - t0;
          trace_wait(TraceOutcome::kTimeout);
          throw StreamError(
              ErrorCode::kTimeout,
              "ticket " + std::to_string(id) + " not ready within timeout");
        }
      }
    }
    int64_t waited = now_ns() - t0;
    counters_.exposed_wait_ns += waited;
    counters_.exposed_wait_ns_by_layer[it->second.req.layer] += waited;
    counters_.exposed_wait_ns_by_store[it->second.req.store] += waited;
    trace_wait(
        it->second.state == TicketState::kReady ? TraceOutcome::kPublished
                                                : TraceOutcome::kFailed);
  }
  Ticket& t = it->second;
  if (t.state == TicketState::kFailed) {
    throw StreamError(t.error, t.message);
  }
  Slot& s = slots_[t.slot];
  s.used = true;
  s.lru = ++lru_clock_;
  reindex_locked(t.slot);
  return View{s.slab.data, s.key.length, s.slab.arena, s.slab.row};
}

bool Engine::drop_ticket_locked(uint64_t id, bool cancel) {
  auto it = tickets_.find(id);
  if (it == tickets_.end()) {
    return false;
  }
  Ticket t = std::move(it->second);
  tickets_.erase(it);
  if (cancel) {
    counters_.cancelled++;
  }
  if (!t.holds_pin) {
    return true;
  }
  Slot& s = slots_[t.slot];
  if (s.gen != t.gen) {
    return true;
  }
  s.pins--;
  s.waiters.erase(
      std::remove(s.waiters.begin(), s.waiters.end(), id), s.waiters.end());
  reindex_locked(t.slot);
  if (s.state == SlotState::kLoading) {
    if (!cancel) {
      s.detached = true;
    } else if (s.pins == 0 && !s.detached) {
      // Nobody wants the record: drop a queued read; an in-flight read
      // finishes into its own slab and is discarded (generation moved on).
      retire_slot_locked(t.slot);
    }
  }
  return true;
}

bool Engine::release(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  bool r = drop_ticket_locked(id, false);
  done_cv_.notify_all();
  return r;
}

bool Engine::cancel(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  bool r = drop_ticket_locked(id, true);
  done_cv_.notify_all();
  return r;
}

int Engine::advance_generation(uint64_t owner, uint64_t generation) {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t& cur = owner_generation_[owner];
  cur = std::max(cur, generation);
  std::vector<uint64_t> stale;
  for (auto& [id, t] : tickets_) {
    if (t.req.owner == owner && t.req.generation < cur &&
        t.state != TicketState::kFailed) {
      stale.push_back(id);
    }
  }
  for (uint64_t id : stale) {
    Ticket& t = tickets_.at(id);
    std::string msg = "ticket " + std::to_string(id) + " of owner " +
        std::to_string(owner) + " generation " +
        std::to_string(t.req.generation) + " is stale (current " +
        std::to_string(cur) + ")";
    if (t.state == TicketState::kPending) {
      Slot& s = slots_[t.slot];
      if (s.gen == t.gen) {
        s.pins--;
        s.waiters.erase(
            std::remove(s.waiters.begin(), s.waiters.end(), id),
            s.waiters.end());
        reindex_locked(t.slot);
        if (s.pins == 0 && !s.detached) {
          retire_slot_locked(t.slot);
        }
      }
      t.holds_pin = false;
    }
    // A ready ticket keeps its pin until released: its consumer may be
    // reading the slot right now.
    t.state = TicketState::kFailed;
    t.error = ErrorCode::kStale;
    t.message = msg;
  }
  counters_.stale_tickets += stale.size();
  done_cv_.notify_all();
  return static_cast<int>(stale.size());
}

bool Engine::set_hint(
    int store, uint64_t offset, uint64_t length, double p, int arena,
    const RecordCheck& check) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = index_.find(make_key(store, offset, length, arena, check));
  if (it == index_.end()) {
    return false;
  }
  slots_[it->second].p_use = std::clamp(p, 0.0, 1.0);
  reindex_locked(it->second);
  return true;
}

bool Engine::pick_job_locked(std::unique_ptr<Job>& job) {
  if (reading_ >= opts_.threads) {
    return false; // every read slot is moving bytes
  }
  for (int p = 0; p < kNumPriorities; ++p) {
    // P2 only takes spare bandwidth: never while P0/P1 reads are queued, and
    // one worker stays free for an exact miss that may arrive next.
    if (p == kNumPriorities - 1 && opts_.threads > 1 &&
        inflight_[p] >= opts_.threads - 1) {
      return false;
    }
    // Predictions (P1 and P2 together) never take the last free worker: an
    // exact miss that arrives next starts at once.
    if (p >= 1 && opts_.threads > 1 &&
        inflight_[1] + inflight_[2] >= opts_.threads - 1) {
      return false;
    }
    Queue& q = queues_[p];
    while (!q.empty()) {
      QueueItem item = q.top();
      q.pop();
      Slot& s = slots_[item.slot];
      if (s.gen != item.gen || s.state != SlotState::kLoading || !s.job ||
          s.queued_priority != p) {
        continue; // superseded entry (cancelled, upgraded or already taken)
      }
      job = std::move(s.job);
      job->priority = p;
      s.inflight = true;
      s.queued_priority = -1;
      inflight_[p]++;
      reading_++;
      return true;
    }
  }
  return false;
}

ErrorCode Engine::pread_into(
    const Job& job, const std::vector<struct iovec>& segs, uint64_t& got,
    std::string& msg) {
  // O_DIRECT needs block-aligned file offset, buffers and lengths; a slab
  // read is padded to 4096 (the slab is), arena parts must align exactly.
  bool direct = job.direct_fd >= 0 && job.key.offset % kAlign == 0;
  for (auto& v : segs) {
    direct = direct && reinterpret_cast<uintptr_t>(v.iov_base) % 512 == 0 &&
        (job.slab.arena < 0 || v.iov_len % 512 == 0);
  }
  std::vector<struct iovec> iov = segs;
  if (direct && job.slab.arena < 0) {
    iov[0].iov_len = round_up(job.key.length, kAlign);
  }
  int fd = direct ? job.direct_fd : job.fd;
  uint64_t want = 0;
  for (auto& v : iov) {
    want += v.iov_len;
  }
#if defined(__APPLE__)
  if (opts_.rdadvise) {
    struct radvisory ra;
    ra.ra_offset = static_cast<off_t>(job.key.offset);
    ra.ra_count = static_cast<int>(std::min<uint64_t>(want, INT32_MAX));
    fcntl(fd, F_RDADVISE, &ra);
  }
#endif
  got = 0;
  size_t first = 0;
  while (got < want) {
    int cnt = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    ssize_t n = ::preadv(fd, iov.data() + first, cnt, job.key.offset + got);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (direct && errno == EINVAL && got == 0) {
        // The filesystem refused this direct read: retry buffered.
        direct = false;
        fd = job.fd;
        iov = segs;
        want = job.key.length;
        continue;
      }
      msg = std::strerror(errno);
      return ErrorCode::kIO;
    }
    if (n == 0) {
      break;
    }
    got += static_cast<uint64_t>(n);
    consume_iov(iov.data(), first, static_cast<uint64_t>(n));
  }
  return ErrorCode::kNone;
}

ErrorCode Engine::do_read(
    const Job& job, std::string& msg, ReadHooks* hooks,
    const std::function<void()>& read_done) {
  auto where = [&] {
    std::ostringstream os;
    os << "store " << job.key.store << " offset " << job.key.offset
       << " length " << job.key.length;
    return os.str();
  };
  // Destination segments: one slab, or one row of every arena part.
  // Expanded parts are read into the first half of their row and widened
  // in place once verified.
  std::vector<struct iovec> segs;
  std::vector<uint8_t> expand;
#if HEBRUS_MTLIO
  std::vector<IoTarget> targets; // same rows as segs, as device buffers
  std::string path;
#endif
  if (job.slab.arena >= 0) {
    std::lock_guard<std::mutex> lk(mu_);
    const Arena& a = arenas_[job.slab.arena];
    for (size_t p = 0; p < a.parts.size(); ++p) {
      segs.push_back({a.parts[p] + uint64_t(job.slab.row) * a.row_bytes(p),
                      a.part_bytes[p]});
    }
    expand = a.expand;
#if HEBRUS_MTLIO
    if (mtlio_ && !a.device.empty()) {
      for (size_t p = 0; p < a.parts.size(); ++p) {
        targets.push_back(
            {a.device[p].buffer,
             a.device[p].offset + uint64_t(job.slab.row) * a.row_bytes(p),
             a.part_bytes[p]});
      }
      path = stores_[job.key.store].path;
    }
#endif
  } else {
    segs.push_back({job.slab.data, job.key.length});
  }
  // Only the byte-moving step depends on the backend; the short-read,
  // digest and widening below (and publication in worker_loop) are shared.
  uint64_t got = 0;
  ErrorCode moved;
  std::string detail;
#if HEBRUS_MTLIO
  struct stat st;
  if (!targets.empty() && ::fstat(job.fd, &st) == 0 &&
      uint64_t(st.st_size) < job.key.offset + job.key.length) {
    // A load past EOF is an MTLIO error, not a count: report it as the
    // short read it is, like the pread path.
    got = uint64_t(st.st_size) > job.key.offset
        ? uint64_t(st.st_size) - job.key.offset
        : 0;
    moved = ErrorCode::kNone;
  } else if (!targets.empty()) {
    moved = mtlio_->load(
        job.key.store, path, job.key.offset, targets, job.priority == 0, detail);
    if (moved == ErrorCode::kNone) {
      got = job.key.length;
    } else {
      detail += " (mtlio)";
    }
  } else
#endif
  {
    moved = pread_into(job, segs, got, detail);
  }
  if (hooks) {
    ReadOutcome r{moved, got, detail, static_cast<uint8_t*>(segs[0].iov_base),
                  job.key.check.kind != Check::kNone, job.key.offset};
    hooks->after_read(r);
    moved = r.code;
    got = r.got;
    detail = r.detail;
  }
  if (read_done) {
    read_done();
  }
  if (moved != ErrorCode::kNone) {
    msg = "I/O error reading " + where() + ": " + detail;
    return moved;
  }
  if (got < job.key.length) {
    msg = "short read of " + where() + ": got " + std::to_string(got) +
        " bytes";
    return ErrorCode::kShortRead;
  }
  // The reading thread checks its own record (the other readers keep
  // their reads in flight meanwhile), on the bytes it will publish, and
  // widens each bf16 part right after hashing it, while it is in cache: a
  // row whose record does not match is never published.
  auto widen = [&](size_t p) {
    if (p < expand.size() && expand[p]) {
      widen_bf16_in_place(static_cast<uint8_t*>(segs[p].iov_base), segs[p].iov_len);
    }
  };
  if (!check_matches(job.key.check, segs.data(), segs.size(), job.key.length, widen)) {
    msg = std::string(job.key.check.kind == Check::kXxh3 ? "XXH3-128" : "SHA-256") +
        " mismatch for " + where();
    return ErrorCode::kDigest;
  }
  return ErrorCode::kNone;
}

void Engine::worker_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    if (stop_) {
      return;
    }
    std::unique_ptr<Job> job;
    if ((hooks_ && hooks_->held()) || !pick_job_locked(job)) {
      work_cv_.wait(lk);
      continue;
    }
    std::shared_ptr<ReadHooks> hooks = hooks_;
    if (trace_) {
      auto p = trace_->pending.find({job->slot, job->gen});
      if (p != trace_->pending.end()) {
        p->second.start_ns = now_ns();
        p->second.priority = job->priority;
      }
    }
    lk.unlock();
    std::string msg;
    bool reading = true;
    auto read_done = [&] {
      {
        std::lock_guard<std::mutex> g(mu_);
        reading_--;
        reading = false;
      }
      work_cv_.notify_one(); // a read slot is free: the next queued read starts
    };
    ErrorCode code = do_read(*job, msg, hooks.get(), read_done);
    bool fallback = false;
    if (job->file > 0 &&
        (code == ErrorCode::kIO || code == ErrorCode::kShortRead ||
         code == ErrorCode::kDigest)) {
      // The mirror could not give the verified bytes: the primary can. (This
      // error path reads outside the read slots: one read over the depth.)
      Job primary = *job;
      primary.file = 0;
      primary.fd = job->primary_fd;
      primary.direct_fd = job->primary_direct_fd;
      msg.clear();
      code = do_read(primary, msg, nullptr);
      fallback = true;
    }
    lk.lock();
    if (reading) {
      reading_--; // do_read ended before its bytes moved
    }
    {
      Store& st = stores_[job->key.store];
      st.file_reads[job->file]++;
      st.file_bytes[job->file] += job->key.length;
      if (fallback) {
        st.fallbacks++;
        st.file_reads[0]++;
        st.file_bytes[0] += job->key.length;
      }
    }
    inflight_[job->priority]--;
    Slot& s = slots_[job->slot];
    if (trace_) {
      trace_read_end_locked(
          job->slot,
          job->gen,
          s.gen != job->gen              ? uint8_t(TraceOutcome::kStale)
              : code == ErrorCode::kNone ? uint8_t(TraceOutcome::kPublished)
                                         : uint8_t(kTraceErrorBase + int(code)));
    }
    if (s.gen != job->gen) {
      // The slot was abandoned or recycled while we read: never publish.
      counters_.stale_drops++;
      counters_.wasted_bytes += job->key.length;
      recycle_slab_locked(job->slab);
    } else if (code == ErrorCode::kNone) {
      int64_t done = now_ns();
      int64_t lat = done - job->issue_ns;
      if (done > s.deadline_ns) {
        counters_.deadline_misses++;
      }
      s.slab = job->slab;
      s.state = SlotState::kReady;
      s.inflight = false;
      s.stall_ns = double(lat);
      uint64_t seq = ++complete_seq_;
      for (uint64_t id : s.waiters) {
        auto it = tickets_.find(id);
        if (it != tickets_.end() && it->second.state == TicketState::kPending) {
          it->second.state = TicketState::kReady;
          it->second.complete_seq = seq;
        }
      }
      s.waiters.clear();
      reindex_locked(job->slot);
      if (latencies_.size() < kLatencyWindow) {
        latencies_.push_back(lat);
      } else {
        latencies_[latency_pos_] = lat;
      }
      latency_pos_ = (latency_pos_ + 1) % kLatencyWindow;
      counters_.latency_samples++;
      stall_ewma_ns_ = stall_ewma_ns_ == 0 ? lat : 0.9 * stall_ewma_ns_ + 0.1 * lat;
      counters_.reads_by_store[job->key.store]++;
      counters_.bytes_by_store[job->key.store] += job->key.length;
      if (s.exact) {
        counters_.exact_bytes += job->key.length;
        counters_.exact_read_ns += lat;
      } else {
        counters_.predicted_bytes += job->key.length;
      }
    } else {
      counters_.errors++;
      recycle_slab_locked(job->slab);
      fail_slot_locked(job->slot, code, msg);
    }
    // No other worker is woken: a completion queues no read, and the
    // inflight count it frees is this worker's, which picks next itself.
    done_cv_.notify_all();
  }
}

bool Engine::wait_progress() {
  std::unique_lock<std::mutex> lk(mu_);
  auto busy = [&] {
    for (int p = 0; p < kNumPriorities; ++p) {
      if (inflight_[p] > 0) {
        return true;
      }
    }
    for (const Slot& s : slots_) {
      if (s.state == SlotState::kLoading && s.job) {
        return true;
      }
    }
    return false;
  };
  if (stop_ || !busy()) {
    return false;
  }
  uint64_t seq = complete_seq_, errs = counters_.errors,
           drops = counters_.stale_drops;
  done_cv_.wait(lk, [&] {
    return stop_ || complete_seq_ != seq || counters_.errors != errs ||
        counters_.stale_drops != drops;
  });
  return true;
}

size_t Engine::wait_any(const std::vector<uint64_t>& ids, double timeout_s) {
  if (ids.empty()) {
    throw StreamError(ErrorCode::kBadRequest, "tickets: need at least one");
  }
  std::unique_lock<std::mutex> lk(mu_);
  auto first_done = [&]() -> size_t {
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = tickets_.find(ids[i]);
      if (it == tickets_.end() || it->second.state != TicketState::kPending) {
        return i;
      }
    }
    return ids.size();
  };
  size_t i = first_done();
  if (i < ids.size()) {
    return i;
  }
  auto it = tickets_.find(ids[0]);
  const int layer = it->second.req.layer, store = it->second.req.store;
  int64_t t0 = now_ns();
  auto deadline = std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(
                          timeout_s < 0 ? 1e9 : timeout_s));
  bool timed_out = false;
  while ((i = first_done()) == ids.size()) {
    if (done_cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      i = first_done();
      timed_out = i == ids.size();
      break;
    }
  }
  int64_t t = now_ns();
  counters_.waits_blocked++;
  counters_.exposed_wait_ns += t - t0;
  counters_.exposed_wait_ns_by_layer[layer] += t - t0;
  counters_.exposed_wait_ns_by_store[store] += t - t0;
  if (trace_) {
    trace_->push(TraceEvent{
        TraceKind::kWait,
        uint8_t(timed_out ? TraceOutcome::kTimeout : TraceOutcome::kPublished),
        -1, false, false, layer, -1, 0, t0, t, t});
  }
  if (timed_out) {
    throw StreamError(
        ErrorCode::kTimeout, "no ticket of the wave ready within timeout");
  }
  return i;
}

TicketInfo Engine::ticket_info(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end()) {
    throw StreamError(
        ErrorCode::kCancelled,
        "ticket " + std::to_string(id) + " is not outstanding");
  }
  const Ticket& t = it->second;
  return TicketInfo{
      t.state,
      t.kind,
      t.error,
      t.message,
      t.slot,
      t.gen,
      t.complete_seq,
      t.req,
      stores_[t.req.store].digest_id};
}

Counters Engine::counters() {
  std::lock_guard<std::mutex> lk(mu_);
  Counters c = counters_;
  if (!latencies_.empty()) {
    std::vector<int64_t> v = latencies_;
    auto pct = [&](double q) {
      size_t k = std::min(v.size() - 1, size_t(q * (v.size() - 1) + 0.5));
      std::nth_element(v.begin(), v.begin() + k, v.end());
      return double(v[k]);
    };
    c.latency_p50_ns = pct(0.50);
    c.latency_p95_ns = pct(0.95);
    c.latency_p99_ns = pct(0.99);
  }
  return c;
}

void Engine::reset_counters() {
  std::lock_guard<std::mutex> lk(mu_);
  counters_ = Counters{};
  latencies_.clear();
  latency_pos_ = 0;
}

MemoryInfo Engine::memory() {
  std::lock_guard<std::mutex> lk(mu_);
  MemoryInfo m;
  m.capacity = opts_.cache_bytes;
  m.allocated = allocated_;
  for (auto& [size, slab] : pool_) {
    m.pooled += size;
  }
  for (const Slot& s : slots_) {
    if (s.state == SlotState::kFree) {
      continue;
    }
    m.slots_in_use++;
    if (s.pins > 0) {
      m.pinned_slots++;
    }
    if (s.state == SlotState::kReady && s.slab.arena >= 0) {
      m.arena_rows++;
    } else if (s.state == SlotState::kReady) {
      m.resident += s.slab.size;
    } else if (s.inflight) {
      m.inflight_reads++;
    } else {
      m.queued_reads++;
    }
  }
  m.tickets = static_cast<uint32_t>(tickets_.size());
  return m;
}

void Engine::trace_read_end_locked(
    uint32_t slot, uint64_t gen, uint8_t outcome) {
  auto it = trace_->pending.find({slot, gen});
  if (it == trace_->pending.end()) {
    return; // issued before tracing was enabled
  }
  const TraceRing::Pending& p = it->second;
  const Slot& s = slots_[slot];
  bool promoted = !p.exact && s.gen == gen && s.exact;
  int64_t t = now_ns();
  trace_->push(TraceEvent{
      TraceKind::kRead, outcome, int8_t(p.priority), p.exact, promoted,
      p.layer, p.expert, p.bytes, p.issue_ns, p.start_ns, t});
  trace_->pending.erase(it);
}

void Engine::enable_trace(size_t capacity) {
  std::lock_guard<std::mutex> lk(mu_);
  if (capacity > (size_t(1) << 24)) {
    throw StreamError(
        ErrorCode::kBadRequest, "capacity: at most 2^24 trace events");
  }
  trace_ = capacity ? std::make_unique<TraceRing>(capacity) : nullptr;
}

std::vector<TraceEvent> Engine::trace_events(bool clear, uint64_t* dropped) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!trace_) {
    *dropped = 0;
    return {};
  }
  *dropped = trace_->dropped();
  std::vector<TraceEvent> out = trace_->events();
  if (clear) {
    trace_->clear();
  }
  return out;
}

void Engine::mark(int layer, int tag) {
  std::lock_guard<std::mutex> lk(mu_);
  if (trace_) {
    int64_t t = now_ns();
    trace_->push(TraceEvent{
        TraceKind::kMark, uint8_t(TraceOutcome::kPublished), -1, false,
        false, layer, tag, 0, t, t, t});
  }
}

void Engine::set_read_hooks(std::shared_ptr<ReadHooks> hooks) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    hooks_ = std::move(hooks);
  }
  work_cv_.notify_all();
}

std::shared_ptr<ReadHooks> Engine::read_hooks() {
  std::lock_guard<std::mutex> lk(mu_);
  return hooks_;
}

void Engine::wake_workers() {
  { std::lock_guard<std::mutex> lk(mu_); }
  work_cv_.notify_all();
}

} // namespace hebrus
