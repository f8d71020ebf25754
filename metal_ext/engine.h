// I/O engine for streamed records (experts, PLE pages).
//
// A request names (store, offset, length) plus scheduling metadata and gets a
// ticket. Records live in a bounded slot cache; a slot publishes its bytes
// only after the whole read (and its optional digest check: XXH3-128 or
// SHA-256) succeeded, and only if the slot generation the read was issued
// for is still current (AFN-019).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <tuple>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "sha256.h"
#include "trace.h"
#include "xxh3.h"

namespace hebrus {

constexpr uint64_t kAlign = 4096;

// Steady-clock ns: the engine's counters, trace and the raw baseline share it.
int64_t now_ns();

// The one spelling of the engine's error codes: the enum, error_name() and
// the bindings' error_codes() (from which hebrus_mlx.stream.errors maps each
// name to its Python class) all expand this list.
#define HEBRUS_ERROR_CODES(X) \
  X(kNone, 0, "ok")           \
  X(kIO, 1, "io")             \
  X(kShortRead, 2, "short_read") \
  X(kDigest, 3, "digest")     \
  X(kCancelled, 4, "cancelled") \
  X(kStale, 5, "stale")       \
  X(kCacheFull, 6, "cache_full") \
  X(kBadRequest, 7, "bad_request") \
  X(kClosed, 8, "closed")     \
  X(kTimeout, 9, "timeout")

enum class ErrorCode : int {
#define HEBRUS_ERROR_ENUM(id, value, name) id = value,
  HEBRUS_ERROR_CODES(HEBRUS_ERROR_ENUM)
#undef HEBRUS_ERROR_ENUM
};

const char* error_name(ErrorCode code);

// A trace event's outcome as text: "published", "stale", ..., or
// "error:<error_name>" for a failed read; "" for a mark.
std::string trace_outcome_name(const TraceEvent& e);

// what() ends in " [stream:<error_name>]": MLX rethrows a failure inside
// graph evaluation as a plain std::runtime_error(what()), and the tag lets
// hebrus_mlx.stream.errors.translate restore the typed error there.
// `message` is the untagged text (the bindings raise it typed directly).
struct StreamError : std::runtime_error {
  StreamError(ErrorCode c, const std::string& msg)
      : std::runtime_error(msg + " [stream:" + error_name(c) + "]"),
        code(c),
        message(msg) {}
  ErrorCode code;
  std::string message;
};

// P0 exact critical, P1 near-term predicted, P2 speculative.
constexpr int kNumPriorities = 3;

// What a read is checked against before it is published (the digest
// domains of docs/INTEGRITY.md): nothing, its SHA-256 (the publication
// digest; what artifacts without fast digests check per read) or its
// XXH3-128 (the fast per-read check).
enum class Check : uint8_t { kNone = 0, kSha256 = 1, kXxh3 = 2 };

// "none", "sha256" or "xxh3-128".
const char* check_name(Check kind);

// The digest one record must have: 32 bytes of SHA-256, or the 16 canonical
// bytes of XXH3-128 followed by zeros. Part of a slot's identity (Key).
struct RecordCheck {
  Check kind = Check::kNone;
  Digest digest{};
  bool operator==(const RecordCheck& o) const {
    return kind == o.kind && (kind == Check::kNone || digest == o.digest);
  }
};

// Whether the first `length` bytes of the segments (one record, scattered
// over arena parts or in one slab) have the digest `check` names (true
// for Check::kNone). The bytes are hashed where they lie, once.
// `after(i)`, when given, runs for every segment i in order once its bytes
// are hashed (a reader widens a part there while it is still in cache; the
// row is published only if the whole record matched).
bool check_matches(
    const RecordCheck& check, const struct iovec* segs, size_t nsegs,
    uint64_t length, const std::function<void(size_t)>& after = {});

// bf16 -> fp32 in place: the first `bf16_bytes` bytes at `base` widened to
// 2 * bf16_bytes bytes (a 16-bit left shift per value).
void widen_bf16_in_place(uint8_t* base, uint64_t bf16_bytes);

struct Request {
  int store = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  int priority = 0;
  bool exact = true;
  uint64_t owner = 0;
  uint64_t generation = 0;
  int layer = -1;
  int expert = -1;
  // Absolute steady-clock ns; within a class, earlier deadlines go first.
  int64_t deadline_ns = INT64_MAX;
  double confidence = 1.0;
  RecordCheck check; // verified before publication unless kNone
  int arena = -1; // destination: -1 slab cache, else an arena row
};

enum class TicketState : int { kPending = 0, kReady = 1, kFailed = 2 };
enum class TicketKind : int { kHit = 0, kJoined = 1, kMiss = 2 };

struct TicketInfo {
  TicketState state;
  TicketKind kind;
  ErrorCode error;
  std::string message;
  uint32_t slot;
  uint64_t slot_generation;
  uint64_t complete_seq;
  Request request;
  std::string store_digest; // the store's immutable digest id
};

struct Counters {
  uint64_t requests = 0;
  uint64_t hits = 0;
  uint64_t joins = 0;
  uint64_t misses = 0;
  uint64_t exact_bytes = 0;
  uint64_t predicted_bytes = 0;
  uint64_t wasted_bytes = 0;
  uint64_t evictions = 0;
  uint64_t cancelled = 0;
  uint64_t stale_tickets = 0;
  uint64_t stale_drops = 0;
  uint64_t errors = 0;
  uint64_t waits = 0;
  uint64_t waits_blocked = 0;
  uint64_t exposed_wait_ns = 0;
  uint64_t exact_read_ns = 0;
  uint64_t deadline_misses = 0; // reads published after their deadline
  // Exact requests served by a record a prediction brought in: already
  // published (timely) or still in flight (joined, partly hidden).
  uint64_t predicted_hits = 0;
  uint64_t predicted_joins = 0;
  // Reads started by a prediction (the precision denominator) and by an
  // exact request (misses nothing had brought in: the recall denominator).
  uint64_t predicted_reads = 0;
  uint64_t exact_misses = 0;
  std::map<int, uint64_t> exposed_wait_ns_by_layer;
  // Per store (expert records and PLE pages live in different stores): reads
  // published, their bytes, and the exposed wait on them.
  std::map<int, uint64_t> reads_by_store;
  std::map<int, uint64_t> bytes_by_store;
  std::map<int, uint64_t> exposed_wait_ns_by_store;
  double latency_p50_ns = 0;
  double latency_p95_ns = 0;
  double latency_p99_ns = 0;
  uint64_t latency_samples = 0;
};

struct MemoryInfo {
  uint64_t capacity = 0;
  uint64_t allocated = 0; // every slab: cached, in flight, or pooled
  uint64_t resident = 0; // bytes of published slots
  uint64_t pooled = 0;
  uint32_t slots_in_use = 0;
  uint32_t pinned_slots = 0;
  uint32_t tickets = 0;
  uint32_t inflight_reads = 0;
  uint32_t queued_reads = 0;
  uint32_t arena_rows = 0; // published arena rows
};

struct EngineOptions {
  int threads = 4;
  uint64_t cache_bytes = 1ull << 30;
  bool direct = true; // O_DIRECT on Linux when offset/length/buffer align
  bool nocache = false; // macOS F_NOCACHE on the store fd
  bool rdadvise = false; // macOS F_RDADVISE before each read
  std::string policy = "lru"; // "lru", "clock" or "score"
  // How bytes move: "pread" (default, everywhere) or "mtlio" (Apple Metal
  // builds only, arena rows only, unverified: AFN-013; see io_mtlio.h).
  std::string backend = "pread";
  // Slab memory. Set by the MLX bindings to allocate through MLX's
  // allocator (counted by mx.get_active_memory, unified memory on Apple);
  // must return kAlign-aligned memory kept alive by the returned owner.
  // Unset (the sanitizer driver, no MLX): posix_memalign.
  std::function<std::pair<uint8_t*, std::shared_ptr<void>>(uint64_t)> allocate_slab;
};

class MtlioReader; // io_mtlio.h; only defined when HEBRUS_MTLIO

// Where an arena part lives on the device: an MTL::Buffer* (opaque here)
// and the byte offset of the part's row 0 inside it.
struct DevicePart {
  void* buffer = nullptr;
  uint64_t offset = 0;
};

// A finished read as the engine is about to check it (ReadHooks).
struct ReadOutcome {
  ErrorCode code; // kNone: the bytes moved
  uint64_t got; // bytes moved
  std::string detail; // why, when code is an error
  uint8_t* first; // the record's first byte in its destination
  bool checked; // the record will be checked against a digest
  uint64_t offset = 0; // the record's offset in its store file
};

// Test seam: the test build's fault injector (metal_ext/testing/, the
// hebrus_mlx._testing module the runtime never imports) is the only
// implementation. A release engine has none installed and pays one pointer
// test per read.
struct ReadHooks {
  virtual ~ReadHooks() = default;
  // While true, workers leave queued reads alone.
  virtual bool held() const = 0;
  // Called by the worker after the bytes moved, before the short-read and
  // digest checks; may change the outcome or the bytes.
  virtual void after_read(ReadOutcome& r) = 0;
};

// An aligned buffer owned by exactly one of: the pool, a slot, a read job.
// In arena mode `data` is null and the bytes are row `row` of every part
// buffer of arena `arena` (one part per tensor, so gather_qmm reads them).
struct Slab {
  uint8_t* data = nullptr;
  uint64_t size = 0;
  int arena = -1;
  uint32_t row = 0;
  bool valid() const {
    return data != nullptr || arena >= 0;
  }
};

// Caller-owned part buffers [rows, row_bytes(p)]; a record of
// sum(part_bytes) stored bytes is scattered over them by one preadv.
// An expanded part holds bf16 values stored as 16-bit patterns widened to
// fp32 after the digest check (row_bytes = 2 * part_bytes): MLX's CPU
// quantized matmul is exact only with fp32 scales/biases.
struct Arena {
  std::vector<uint8_t*> parts;
  std::vector<uint64_t> part_bytes; // stored bytes per record
  std::vector<uint8_t> expand; // 1: bf16 -> fp32 on publication
  uint64_t row_bytes(size_t p) const {
    return expand[p] ? 2 * part_bytes[p] : part_bytes[p];
  }
  uint64_t record_bytes = 0;
  uint32_t rows = 0;
  // Advisory predictions: rows held by exact records (loading or ready) and
  // the rows kept for predicted ones (exact records hold at most
  // rows - staging unless every other row is pinned).
  uint32_t exact_rows = 0;
  uint32_t staging = 0;
  std::vector<uint32_t> free_rows;
  std::shared_ptr<void> keepalive; // owns the part buffers
  // One per part when the engine's backend can load into device buffers
  // (mtlio); empty otherwise, and then every read is a preadv.
  std::vector<DevicePart> device;
};

// Refuses an arena without parts or rows, or with an expand flag list of
// another length; an empty `expand` becomes "no part expanded".
void check_arena_spec(
    const std::vector<uint64_t>& part_bytes, uint32_t rows,
    std::vector<uint8_t>& expand);

struct TableRow {
  uint64_t offset;
  uint64_t length;
  RecordCheck check;
};

struct Table {
  int store;
  std::vector<TableRow> rows;
  uint64_t uniform_length; // 0 when rows differ in length
  int arena; // -1: records go to the slab cache
};

// The descriptor O_DIRECT reads use for `path` (-1 without one: not Linux,
// not asked, or a filesystem such as tmpfs that refuses it), and F_NOCACHE on
// the buffered `fd` on macOS, as `opts` ask. Every reader of a store opens it so.
int open_uncached(const std::string& path, int fd, const EngineOptions& opts);

// After a preadv moved `n` bytes into iov[first..]: step `first` past the
// entries filled and trim the partly filled one, so the next preadv resumes.
inline void consume_iov(struct iovec* iov, size_t& first, uint64_t n) {
  while (n > 0) {
    if (n >= iov[first].iov_len) {
      n -= iov[first].iov_len;
      first++;
    } else {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + n;
      iov[first].iov_len -= n;
      n = 0;
    }
  }
}

// Always owned by a C++ shared_ptr (the bindings make it with make_shared):
// graph ops and their CPU tasks hold that owner, so dropping the last one on
// an MLX stream thread never needs Python's GIL (a nanobind-made shared_ptr
// would take the GIL in its deleter and deadlock mx.clear_cache()).
class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int add_store(const std::string& path, const std::string& digest_id);
  // A byte-identical copy of `store` (e.g. on a second disk): reads then
  // alternate between the files, one read at a time; a read that fails on a
  // mirror (I/O, short read, digest) is redone from the primary and counted.
  // Refuses a size mismatch and the mtlio backend. Not verified on two
  // disks here (AFN-013): this machine has one.
  int add_mirror(int store, const std::string& path);
  struct FileReads {
    std::vector<std::string> paths; // primary first, then the mirrors
    std::vector<uint64_t> reads; // reads issued to each file
    std::vector<uint64_t> bytes;
    uint64_t fallbacks = 0; // mirror reads redone from the primary
  };
  FileReads file_reads(int store);
  int register_table(int store, std::vector<TableRow> rows, int arena = -1);
  int add_arena(
      std::vector<uint8_t*> parts,
      std::vector<uint64_t> part_bytes,
      std::vector<uint8_t> expand,
      uint32_t rows,
      std::shared_ptr<void> keepalive,
      std::vector<DevicePart> device = {});
  uint64_t arena_record_bytes(int arena);
  const Table& table(int table_id) const;

  // Never blocks on I/O. Throws StreamError (bad request, stale generation,
  // cache full, closed).
  uint64_t request(const Request& req);

  struct View {
    const uint8_t* data; // null for arena records: use copy_out / row
    uint64_t length;
    int arena;
    uint32_t row;
  };
  // Copy a (pinned) record into contiguous memory.
  void copy_out(const View& v, uint8_t* dst);
  // Blocks until the ticket's record is published or failed. The view stays
  // valid until the ticket is released or cancelled (the slot is pinned).
  View wait(uint64_t ticket, double timeout_s = -1.0);

  // Both drop the ticket's ownership exactly once (false on a repeat call).
  // release keeps an unfinished read going as a cache candidate; cancel
  // abandons it when no other ticket still wants the record.
  bool release(uint64_t ticket);
  bool cancel(uint64_t ticket);

  // Tickets of `owner` below `generation` fail as stale; later requests below
  // it are refused. Returns how many tickets went stale.
  int advance_generation(uint64_t owner, uint64_t generation);

  // Rows of `arena` kept for predicted records (advisory read-ahead): exact
  // records then take at most rows - staging of them while others are free.
  void set_staging(int arena, uint32_t rows);

  // Scored policy hint: P(use before eviction) for a cached record (named
  // as its requests name it, digest included).
  bool set_hint(
      int store,
      uint64_t offset,
      uint64_t length,
      double p_use,
      int arena = -1,
      const RecordCheck& check = RecordCheck{});

  // Blocks until some read finishes (returns true) or returns false at once
  // if none is queued or in flight: lets a caller refused with kCacheFull
  // wait for prefetches to drain instead of failing.
  bool wait_progress();
  // Blocks until one of `tickets` is no longer pending (published, failed,
  // or released/cancelled) and returns the first such index in list order:
  // a wavefront takes records in arrival order, resident ones first. The
  // time blocked counts as exposed wait (by the first ticket's layer).
  size_t wait_any(const std::vector<uint64_t>& tickets, double timeout_s = -1.0);

  TicketInfo ticket_info(uint64_t ticket);
  Counters counters();
  void reset_counters();
  MemoryInfo memory();
  void close();

  // Bounded event trace (trace.h): capacity events, oldest dropped first;
  // 0 turns it off and discards the events.
  void enable_trace(size_t capacity);
  // Oldest first; `dropped` gets the events lost to the bound so far.
  std::vector<TraceEvent> trace_events(bool clear, uint64_t* dropped);
  // A caller's timestamp (e.g. when a layer's compute finished).
  void mark(int layer, int tag);

  // The test seam (ReadHooks): installed by the test build only.
  void set_read_hooks(std::shared_ptr<ReadHooks> hooks);
  std::shared_ptr<ReadHooks> read_hooks();
  // Wakes idle workers (after a hook stopped holding them).
  void wake_workers();

  const EngineOptions& options() const {
    return opts_;
  }

 private:
  // A slot's identity: which bytes, where they go, and the digest they must
  // have (kind and value). The check is part of it so a slot is one verified
  // snapshot: a request with a digest never hits or joins a slot published
  // without that digest (a digest-less read, one checked in the other digest
  // domain, or one expecting other bytes); it reads and verifies its own.
  // Requests that agree share one read, as before.
  struct Key {
    int store;
    uint64_t offset;
    uint64_t length;
    int arena;
    RecordCheck check;
    bool operator==(const Key& o) const {
      return store == o.store && offset == o.offset && length == o.length &&
          arena == o.arena && check == o.check;
    }
  };
  // A slot's identity; an unchecked record's digest bytes do not count.
  static Key make_key(
      int store, uint64_t offset, uint64_t length, int arena, RecordCheck check) {
    if (check.kind == Check::kNone) {
      check.digest = Digest{};
    }
    return Key{store, offset, length, arena, check};
  }
  static Key key_of(const Request& r) {
    return make_key(r.store, r.offset, r.length, r.arena, r.check);
  }
  struct KeyHash {
    size_t operator()(const Key& k) const {
      uint64_t d = 0;
      std::memcpy(&d, k.check.digest.data(), sizeof(d));
      return std::hash<uint64_t>()(k.offset * 1000003ull ^ k.length ^ d) ^
          std::hash<int>()(k.store * 131 + k.arena + 7 * int(k.check.kind));
    }
  };
  struct Job {
    uint32_t slot;
    uint64_t gen;
    Key key; // key.check: verify before publishing
    Slab slab;
    int64_t issue_ns;
    int priority;
    int fd;
    int direct_fd;
    int file = 0; // 0: the primary, i: mirror i - 1 (fd/direct_fd are its)
    int primary_fd = -1; // a failed mirror read is redone from these
    int primary_direct_fd = -1;
  };
  enum class SlotState : int { kFree, kLoading, kReady };
  struct Slot {
    uint64_t gen = 0;
    SlotState state = SlotState::kFree;
    Key key{};
    Slab slab;
    int pins = 0;
    bool detached = false;
    bool exact = false;
    bool used = false;
    bool inflight = false;
    int arena = -1; // arena of the row it holds or is loading into
    uint64_t lru = 0;
    // CLOCK: position on the ring (load order; moved to the hand's tail on a
    // second chance) and the reference bit a hit sets.
    uint64_t clock_pos = 0;
    bool ref = false;
    double p_use = 0.0;
    double stall_ns = 0.0;
    int queued_priority = -1;
    int64_t deadline_ns = INT64_MAX;
    std::unique_ptr<Job> job;
    std::vector<uint64_t> waiters;
    bool indexed = false; // present in evictable_[evict_key_arena]
    int evict_key_arena = -1;
    std::tuple<double, uint64_t, uint32_t> evict_key{};
  };
  struct Ticket {
    uint32_t slot;
    uint64_t gen;
    TicketState state;
    TicketKind kind;
    ErrorCode error = ErrorCode::kNone;
    std::string message;
    bool holds_pin = true;
    uint64_t complete_seq = 0;
    Request req;
  };
  struct QueueItem {
    int64_t deadline_ns;
    uint64_t seq;
    uint32_t slot;
    uint64_t gen;
    bool operator>(const QueueItem& o) const {
      return deadline_ns != o.deadline_ns ? deadline_ns > o.deadline_ns
                                          : seq > o.seq;
    }
  };
  using Queue = std::priority_queue<
      QueueItem,
      std::vector<QueueItem>,
      std::greater<QueueItem>>;
  struct Mirror {
    std::string path;
    int fd = -1;
    int direct_fd = -1;
  };
  struct Store {
    Store(std::string p, std::string digest, int fd_, int direct_fd_)
        : path(std::move(p)), digest_id(std::move(digest)), fd(fd_), direct_fd(direct_fd_) {}
    std::string path;
    std::string digest_id;
    int fd = -1;
    int direct_fd = -1;
    std::vector<Mirror> mirrors;
    uint64_t next_file = 0; // round robin over primary + mirrors
    std::vector<uint64_t> file_reads{0}; // per file, primary first
    std::vector<uint64_t> file_bytes{0};
    uint64_t fallbacks = 0;
  };

  void worker_loop();
  // request(): refuse a bad/stale/closed request; serve it from the slot
  // that already holds or is reading its key; or reserve and queue a read.
  void validate_locked(const Request& req) const;
  void join_locked(uint32_t idx, const Request& req, uint64_t id, Ticket& t);
  void start_read_locked(const Key& key, const Request& req, uint64_t id, Ticket& t);
  bool pick_job_locked(std::unique_ptr<Job>& job);
  void enqueue_locked(uint32_t slot_idx, int priority);
  Slab reserve_slab_locked(uint64_t size);
  Slab reserve_row_locked(int arena, bool exact);
  int64_t pick_bucket_locked(int bucket);
  void count_exact_locked(uint32_t idx, int delta);
  void recycle_slab_locked(const Slab& slab);
  int64_t pick_victim_locked(int arena);
  void reindex_locked(uint32_t slot);
  void retire_slot_locked(uint32_t slot_idx);
  void fail_slot_locked(uint32_t slot_idx, ErrorCode code, const std::string& msg);
  uint32_t alloc_slot_locked();
  bool drop_ticket_locked(uint64_t ticket, bool cancel);
  void free_slab(Slab& slab);
  // `read_done` (when given) runs once the bytes have moved, before the
  // record is checked: the worker gives its read slot back there.
  ErrorCode do_read(
      const Job& job, std::string& msg, ReadHooks* hooks,
      const std::function<void()>& read_done = {});
  ErrorCode pread_into(
      const Job& job, const std::vector<struct iovec>& segs, uint64_t& got,
      std::string& msg);
  double eviction_key(const Slot& s) const;
  void check_store_locked(int store) const;

  EngineOptions opts_;
  // Set only for backend "mtlio" (shared_ptr: the type is incomplete here
  // and in builds without it).
  std::shared_ptr<MtlioReader> mtlio_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<std::thread> workers_;
  std::vector<Store> stores_;
  std::deque<Table> tables_; // deque: references stay valid as it grows
  std::deque<Arena> arenas_;
  std::deque<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::unordered_map<Key, uint32_t, KeyHash> index_;
  std::unordered_map<uint64_t, Ticket> tickets_;
  std::unordered_map<uint64_t, uint64_t> owner_generation_;
  std::multimap<uint64_t, Slab> pool_;
  // Owners of slabs from opts_.allocate_slab, by data pointer.
  std::unordered_map<uint8_t*, std::shared_ptr<void>> slab_owners_;
  std::unique_ptr<TraceRing> trace_; // null: tracing off
  void trace_read_end_locked(uint32_t slot, uint64_t gen, uint8_t outcome);
  // Evictable slots (published, unpinned) per destination (-1 = slab
  // cache, else arena id), ordered by (policy key, lru, slot): victim
  // selection is O(log n) however large the cache.
  std::map<int, std::set<std::tuple<double, uint64_t, uint32_t>>> evictable_;
  Queue queues_[kNumPriorities];
  int inflight_[kNumPriorities] = {0, 0, 0};
  // Reads moving bytes now, at most opts_.threads (the queue depth the disk
  // sees). Workers outnumber it so that a worker checking the record it
  // read (digest, widening: CPU) does not hold a read slot meanwhile.
  int reading_ = 0;
  uint64_t next_ticket_ = 1;
  uint64_t queue_seq_ = 0;
  uint64_t complete_seq_ = 0;
  uint64_t lru_clock_ = 0;
  uint64_t allocated_ = 0;
  double stall_ewma_ns_ = 0.0;
  bool stop_ = false;
  std::shared_ptr<ReadHooks> hooks_; // null outside the test build
  Counters counters_;
  std::vector<int64_t> latencies_;
  size_t latency_pos_ = 0;
};

} // namespace hebrus
