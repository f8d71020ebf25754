#include "ops.h"
#include "ops_metal.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "io_mtlio.h"

namespace hebrus {

namespace {

// engine.request(r), retrying while the cache is full: `make_room` frees
// space (returns true) or has nothing to free (false); then the reads other
// callers left in flight are awaited, and once the engine is idle the
// refusal propagates. The last retry after the engine went idle closes the
// race with a read that finished just before wait_progress looked.
template <class MakeRoom>
uint64_t request_with_room(Engine& engine, const Request& r, MakeRoom make_room) {
  for (bool busy = true;;) {
    try {
      return engine.request(r);
    } catch (const StreamError& e) {
      if (e.code != ErrorCode::kCacheFull) {
        throw;
      }
      if (make_room()) {
        continue;
      }
      if (!busy) {
        throw;
      }
      busy = engine.wait_progress();
    }
  }
}

// Tickets consumed in issue order: wait, consume(tag, view), release. Issued
// in waves as large as the cache can pin, so reads overlap; a full cache
// consumes the issued wave and issuing continues. Whatever is left when it
// goes out of scope (a failure) is cancelled, so no slot stays pinned.
template <class Consume>
class Waves {
 public:
  Waves(Engine& engine, Consume consume)
      : engine_(engine), consume_(std::move(consume)) {}
  Waves(const Waves&) = delete;
  Waves& operator=(const Waves&) = delete;
  ~Waves() {
    for (; next_ < tickets_.size(); ++next_) {
      engine_.cancel(tickets_[next_].second);
    }
  }
  // A ticket issued elsewhere; this wave owns it from now on.
  void adopt(size_t tag, uint64_t ticket) {
    tickets_.emplace_back(tag, ticket);
  }
  void issue(size_t tag, const Request& r) {
    adopt(tag, request_with_room(engine_, r, [this] {
            bool any = next_ < tickets_.size();
            drain();
            return any;
          }));
  }
  void drain() {
    for (; next_ < tickets_.size(); ++next_) {
      auto [tag, ticket] = tickets_[next_];
      consume_(tag, engine_.wait(ticket, task_wait_timeout()));
      engine_.release(ticket);
    }
    tickets_.clear();
    next_ = 0;
  }

 private:
  Engine& engine_;
  Consume consume_;
  std::vector<std::pair<size_t, uint64_t>> tickets_;
  size_t next_ = 0; // tickets_[:next_] are consumed and released
};

// The indices as contiguous uint32 on `s` (the op's own stream, so a GPU
// op's host task reads them once the GPU has produced them).
mx::array index_input(const mx::array& indices, mx::Stream s) {
  if (!mx::issubdtype(indices.dtype(), mx::integer)) {
    throw StreamError(ErrorCode::kBadRequest, "indices: must be integers");
  }
  return mx::contiguous(mx::astype(indices, mx::uint32, s), false, s);
}

// Allocates each output: the first step of a writing op's bind (the host
// task writes the buffers; under MLX's Metal allocator they are shared
// memory the GPU consumers read).
void allocate(std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
}

using Arrays = HostTaskPrimitive::Arrays;
using Output = HostTaskPrimitive::Output;

// A writing op over a table: its one output (shape, dtype; T its element
// type) is filled by host(idx, dst) from `indices` as contiguous uint32,
// which the op reads on its own stream.
template <class T, class Host>
mx::array table_op(
    const char* name, mx::Shape shape, mx::Dtype dtype,
    const mx::array& indices, Host host, Output output = Output::kWritten) {
  mx::Stream s = op_stream();
  return mx::array(
      std::move(shape),
      dtype,
      std::make_shared<HostTaskPrimitive>(
          s, name, output,
          [host](const Arrays& inputs, Arrays& outputs) -> std::function<void()> {
            allocate(outputs);
            return [host, idx = inputs[0], dst = outputs[0].data<T>()]() { host(idx, dst); };
          }),
      {index_input(indices, s)});
}

uint64_t table_length(Engine& engine, int table) {
  const Table& t = engine.table(table);
  if (t.uniform_length == 0) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "table " + std::to_string(table) +
            ": rows must share one length to be gathered");
  }
  return t.uniform_length;
}

} // namespace

Request TableRead::row(const Table& t, uint32_t id) const {
  if (id >= t.rows.size()) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "indices: " + std::to_string(id) + " out of range for table " +
            std::to_string(table) + " with " + std::to_string(t.rows.size()) +
            " rows");
  }
  const TableRow& row = t.rows[id];
  Request r;
  r.store = t.store;
  r.offset = row.offset;
  r.length = row.length;
  r.owner = owner;
  r.generation = generation;
  r.layer = layer;
  r.expert = static_cast<int>(id);
  r.check = row.check;
  r.arena = t.arena;
  return r;
}

std::function<void()> HostTaskPrimitive::prepare(
    const Arrays& inputs, Arrays& outputs) {
  if (output_ == Output::kPassThrough) {
    // The value passes through untouched; the task runs after its producer,
    // which is what makes its side effect (releasing pins, a mark) safe.
    outputs[0].copy_shared_buffer(inputs[0]);
  }
  return bind_(inputs, outputs);
}

namespace {
std::atomic<double> g_gpu_task_wait_bound{2.0};
thread_local bool t_gpu_waits_on_task = false;
} // namespace

double gpu_task_wait_bound() {
  return g_gpu_task_wait_bound.load();
}

void set_gpu_task_wait_bound(double seconds) {
  g_gpu_task_wait_bound.store(seconds);
}

double task_wait_timeout() {
  double bound = g_gpu_task_wait_bound.load();
  return t_gpu_waits_on_task && bound > 0 ? bound : -1.0;
}

void HostTaskPrimitive::eval_cpu(const Arrays& inputs, Arrays& outputs) {
  auto task = prepare(inputs, outputs);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    enc.set_input_array(in);
  }
  if (output_ != Output::kPassThrough) {
    for (auto& o : outputs) {
      enc.set_output_array(o);
    }
  }
  // The task runs in stream order (after the producers of `inputs`) and
  // keeps them alive until it has run.
  enc.dispatch([task = std::move(task), inputs]() { task(); });
}

void HostTaskPrimitive::eval_gpu(const Arrays& inputs, Arrays& outputs) {
  // A writing op's task runs once the GPU has produced the inputs, and later
  // GPU work waits for it; a pass-through op's runs once the GPU is past the
  // value, and the GPU never waits for it.
  bool written = output_ != Output::kPassThrough;
  bool gpu_waits = output_ == Output::kWritten;
  auto bound = [task = prepare(inputs, outputs), gpu_waits]() {
    // The GPU holds a command buffer open while it waits for this task: bound its reads.
    struct Scope {
      explicit Scope(bool on) {
        t_gpu_waits_on_task = on;
      }
      ~Scope() {
        t_gpu_waits_on_task = false;
      }
    } scope(gpu_waits);
    task();
  };
  eval_gpu_via_io(stream(), inputs, written ? outputs : Arrays{}, std::move(bound), gpu_waits);
}

// The host work of each op lives in one function, which the op's bind hands
// to eval_cpu (a CPU stream task) or eval_gpu (a GPU-event host task).
static void load_tickets_host(
    const std::shared_ptr<Engine>& engine, const std::vector<uint64_t>& tickets,
    uint64_t length, uint8_t* dst) {
  Waves waves(*engine, [&](size_t i, const Engine::View& v) {
    engine->copy_out(v, dst + i * length);
  });
  for (size_t i = 0; i < tickets.size(); ++i) {
    waves.adopt(i, tickets[i]);
  }
  waves.drain();
}

// The tickets a load_tickets op owns until it is evaluated; if it never is,
// they are given back (release is exactly-once).
struct OwnedTickets {
  OwnedTickets(std::shared_ptr<Engine> e, std::vector<uint64_t> t)
      : engine(std::move(e)), tickets(std::move(t)) {}
  OwnedTickets(const OwnedTickets&) = delete;
  OwnedTickets& operator=(const OwnedTickets&) = delete;
  ~OwnedTickets() {
    for (uint64_t t : tickets) {
      engine->release(t);
    }
  }
  std::shared_ptr<Engine> engine;
  std::vector<uint64_t> tickets;
};

mx::array load_tickets(
    std::shared_ptr<Engine> engine,
    std::vector<uint64_t> tickets) {
  if (tickets.empty()) {
    throw StreamError(ErrorCode::kBadRequest, "tickets: need at least one");
  }
  std::vector<uint64_t> sorted = tickets;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw StreamError(
        ErrorCode::kBadRequest, "tickets: each ticket may appear once");
  }
  uint64_t length = engine->ticket_info(tickets[0]).request.length;
  for (uint64_t t : tickets) {
    if (engine->ticket_info(t).request.length != length) {
      throw StreamError(
          ErrorCode::kBadRequest, "tickets: records differ in length");
    }
  }
  mx::Shape shape{
      static_cast<int>(tickets.size()), static_cast<int>(length)};
  auto owned = std::make_shared<OwnedTickets>(std::move(engine), std::move(tickets));
  return mx::array(
      shape,
      mx::uint8,
      std::make_shared<HostTaskPrimitive>(
          op_stream(), "HebrusLoadTickets", Output::kWritten,
          [owned, length](const Arrays&, Arrays& outputs) {
            allocate(outputs);
            // The task owns the tickets from here: the primitive may be
            // detached from the graph before the task runs.
            return [engine = owned->engine, tickets = std::exchange(owned->tickets, {}), length,
                    dst = outputs[0].data<uint8_t>()]() {
              load_tickets_host(engine, tickets, length, dst);
            };
          }),
      {});
}

static void gather_records_host(
    const TableRead& read, const mx::array& idx, uint8_t* dst) {
  Engine& engine = *read.engine;
  const Table& t = engine.table(read.table);
  const uint32_t* ix = idx.data<uint32_t>();
  const uint64_t length = t.uniform_length;
  // Repeated indices join the same read.
  Waves waves(engine, [&](size_t i, const Engine::View& v) {
    engine.copy_out(v, dst + i * length);
  });
  for (size_t i = 0; i < idx.size(); ++i) {
    waves.issue(i, read.row(t, ix[i])); // out of range: kBadRequest
  }
  waves.drain();
}

mx::array gather_records(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    uint64_t owner, uint64_t generation, int layer) {
  uint64_t length = table_length(*engine, table);
  mx::Shape shape = indices.shape();
  shape.push_back(static_cast<int>(length));
  TableRead read{std::move(engine), table, owner, generation, layer};
  return table_op<uint8_t>(
      "HebrusGatherRecords", std::move(shape), mx::uint8, indices,
      [read](const mx::array& idx, uint8_t* dst) { gather_records_host(read, idx, dst); });
}

// Issues the hints for `idx` and writes how many were issued: the host work of both eval paths.
static void issue_hints(const TableRead& read, int priority, double confidence, bool exact,
                        const mx::array& idx, uint32_t* dst) {
  Engine& engine = *read.engine;
  const Table& t = engine.table(read.table);
  const uint32_t* ix = idx.data<uint32_t>();
  uint32_t issued = 0;
  for (size_t i = 0; i < idx.size(); ++i) {
    if (ix[i] >= t.rows.size()) {
      continue; // a hint, not a dependency: bad ids are skipped
    }
    Request r = read.row(t, ix[i]);
    r.priority = priority;
    r.exact = exact;
    r.confidence = confidence;
    try {
      // Released at once: the read continues as a cache candidate.
      engine.release(engine.request(r));
      issued++;
    } catch (const StreamError&) {
      // Speculation never fails the graph (full cache, stale generation).
    }
  }
  *dst = issued;
}

mx::array prefetch_records(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    int priority, double confidence, bool exact, uint64_t owner,
    uint64_t generation, int layer) {
  engine->table(table); // validates the id now, not at eval time
  if (priority < 0 || priority >= kNumPriorities) {
    throw StreamError(
        ErrorCode::kBadRequest, "priority: must be 0, 1 or 2");
  }
  // On the GPU path the host issues the hints once the GPU has produced the
  // indices, and no GPU work waits for that: the count only orders later ops
  // (a hint is advisory; waiting for it cost a host round trip per layer).
  TableRead read{std::move(engine), table, owner, generation, layer};
  return table_op<uint32_t>(
      "HebrusPrefetchRecords", mx::Shape{}, mx::uint32, indices,
      [read, priority, confidence, exact](const mx::array& idx, uint32_t* dst) {
        issue_hints(read, priority, confidence, exact, idx, dst);
      },
      Output::kHint);
}

static void gather_rows_host(
    const TableRead& read, uint64_t rpp, uint64_t row_bytes, uint64_t header,
    const mx::array& idx, uint8_t* dst) {
  Engine& engine = *read.engine;
  const Table& t = engine.table(read.table);
  const uint32_t* rows = idx.data<uint32_t>();
  // Positions of each unique page's rows, pages in first-use order.
  std::unordered_map<uint64_t, size_t> slot;
  std::vector<uint64_t> pages;
  std::vector<std::vector<size_t>> uses;
  for (size_t i = 0; i < idx.size(); ++i) {
    uint64_t page = rows[i] / rpp;
    if (page >= t.rows.size()) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "row_ids: row " + std::to_string(rows[i]) + " is past page " +
              std::to_string(t.rows.size() - 1));
    }
    auto [it, fresh] = slot.emplace(page, pages.size());
    if (fresh) {
      pages.push_back(page);
      uses.emplace_back();
    }
    uses[it->second].push_back(i);
  }
  // One P0 ticket per unique page; rows are copied from that verified
  // snapshot before the page is released. An empty wave waits for
  // draining lookahead reads; only a single page larger than the cache is
  // an error.
  Waves waves(engine, [&](size_t page, const Engine::View& v) {
    for (size_t i : uses[page]) {
      std::memcpy(
          dst + i * row_bytes,
          v.data + header + (rows[i] % rpp) * row_bytes,
          row_bytes);
    }
  });
  for (size_t s = 0; s < pages.size(); ++s) {
    Request r = read.row(t, pages[s]);
    r.expert = -1; // a page, not an expert
    waves.issue(s, r);
  }
  waves.drain();
}

mx::array gather_rows(
    std::shared_ptr<Engine> engine, int table, const mx::array& row_ids,
    uint64_t rows_per_page, uint64_t row_bytes, uint64_t header_bytes,
    uint64_t owner, uint64_t generation, int layer) {
  const Table& t = engine->table(table);
  if (t.arena >= 0 || t.uniform_length == 0) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "table: gather_rows needs a slab table of equal-length pages");
  }
  if (rows_per_page == 0 || row_bytes == 0 ||
      header_bytes + rows_per_page * row_bytes > t.uniform_length) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "rows_per_page/row_bytes/header_bytes: rows do not fit in a " +
            std::to_string(t.uniform_length) + "-byte page");
  }
  mx::Shape shape = row_ids.shape();
  shape.push_back(static_cast<int>(row_bytes));
  TableRead read{std::move(engine), table, owner, generation, layer};
  return table_op<uint8_t>(
      "HebrusGatherRows", std::move(shape), mx::uint8, row_ids,
      [read, rows_per_page, row_bytes, header_bytes](const mx::array& idx, uint8_t* dst) {
        gather_rows_host(read, rows_per_page, row_bytes, header_bytes, idx, dst);
      });
}

std::pair<uint8_t*, std::shared_ptr<void>> allocate_mlx_slab(uint64_t size) {
  // Data frees its buffer through MLX's allocator when the owner drops.
  auto owner = std::make_shared<mx::allocator::Data>(mx::allocator::malloc(size + kAlign));
  auto* base = static_cast<uint8_t*>(owner->buffer().raw_ptr());
  if (base == nullptr) {
    return {nullptr, nullptr};
  }
  uint8_t* data = base + (kAlign - reinterpret_cast<uintptr_t>(base) % kAlign) % kAlign;
  return {data, std::move(owner)};
}

std::pair<mx::array, mx::array> aligned_rows(uint32_t rows, uint64_t row_bytes) {
  uint64_t n = uint64_t(rows) * row_bytes;
  // Over-allocate and slice to a kAlign-aligned start; the slice shares the buffer.
  mx::array base = mx::zeros({static_cast<int>(n + kAlign)}, mx::uint8, io_stream());
  base.eval();
  auto addr = reinterpret_cast<uintptr_t>(base.data<uint8_t>());
  int skip = static_cast<int>((kAlign - addr % kAlign) % kAlign);
  mx::array part = mx::reshape(
      mx::slice(base, {skip}, {skip + static_cast<int>(n)}, io_stream()),
      {static_cast<int>(rows), static_cast<int>(row_bytes)},
      io_stream());
  part.eval();
  if (part.data<uint8_t>() != base.data<uint8_t>() + skip) {
    throw std::runtime_error("aligned rows are not a view of their buffer");
  }
  return {base, part};
}

std::pair<int, std::vector<mx::array>> create_arena(
    std::shared_ptr<Engine> engine, std::vector<uint64_t> part_bytes,
    uint32_t rows, std::vector<uint8_t> expand) {
  check_arena_spec(part_bytes, rows, expand);
  auto owned = std::make_shared<std::vector<mx::array>>();
  std::vector<mx::array> parts;
  std::vector<uint8_t*> ptrs;
  std::vector<DevicePart> device;
  for (size_t p = 0; p < part_bytes.size(); ++p) {
    // An expanded part's row holds fp32: twice the stored bf16 bytes.
    uint64_t pb = expand[p] ? 2 * part_bytes[p] : part_bytes[p];
    uint64_t n = pb * rows;
    if (pb == 0 || n > uint64_t(INT32_MAX) - kAlign) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "part_bytes: each part must be in [1, 2^31 / rows)");
    }
    auto [base, part] = aligned_rows(rows, pb);
    ptrs.push_back(part.data<uint8_t>());
#if HEBRUS_MTLIO
    // Under MLX's Metal allocator every array's buffer is an MTL::Buffer;
    // the mtlio backend loads into it at the part's offset. Only recorded
    // when that backend was chosen, so pread engines are unchanged.
    if (engine->options().backend == "mtlio") {
      mx::allocator::Buffer buf = base.buffer();
      auto* contents = static_cast<uint8_t*>(buf.raw_ptr());
      if (contents == nullptr || part.data<uint8_t>() < contents) {
        throw std::runtime_error("arena part is not inside its MTL::Buffer");
      }
      device.push_back(
          {buf.ptr(), uint64_t(part.data<uint8_t>() - contents)});
    }
#endif
    owned->push_back(base);
    owned->push_back(part);
    parts.push_back(part);
  }
  int id = engine->add_arena(
      ptrs,
      std::move(part_bytes),
      std::move(expand),
      rows,
      owned,
      std::move(device));
  return {id, parts};
}

// The pins a resolve took, owned by its lease buffer: release_after releases
// them when the consumer is computed; if the lease dies before that (the
// evaluation stopped after queueing the resolve but before its release_after:
// MLX raises a failed task's error at the main thread's next enqueue), they
// are released with it. A second release of a ticket is a no-op (ids are
// never reused).
struct LeasePins {
  std::shared_ptr<Engine> engine;
  std::vector<uint64_t> tickets;
  ~LeasePins() {
    for (uint64_t t : tickets) {
      engine->release(t);
    }
  }
};

// Allocates rows and the lease; the lease buffer keeps `pins` alive.
static void allocate_resolve(
    std::vector<mx::array>& outputs, const std::shared_ptr<LeasePins>& pins) {
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  mx::allocator::Buffer buf = mx::allocator::allocator().malloc(outputs[1].nbytes());
  if (outputs[1].nbytes() && !buf.ptr()) {
    throw std::runtime_error("[resolve] could not allocate the lease");
  }
  outputs[1].set_data(mx::allocator::Data(buf, [pins](mx::allocator::Buffer b) {
    mx::allocator::allocator().free(b);
  }));
}

static void resolve_host(
    const TableRead& read, const mx::array& idx, uint32_t* rows,
    uint64_t* lease, LeasePins& pins) {
  const std::shared_ptr<Engine>& engine = read.engine;
  // Ticket 0 never exists: if this task fails, release_after sees an
  // empty lease instead of garbage ids.
  std::memset(lease, 0, idx.size() * sizeof(uint64_t));
  std::memset(rows, 0, idx.size() * sizeof(uint32_t));
  const Table& t = engine->table(read.table);
  const uint32_t* ix = idx.data<uint32_t>();
  std::vector<uint64_t> tickets;
  tickets.reserve(idx.size());
  size_t waited = 0;
  try {
    // Every record must be pinned at once (the kernel reads them all), so
    // a full arena is an error here rather than a wave boundary.
    for (size_t i = 0; i < idx.size(); ++i) {
      // Rows held by draining prefetches free up; our own pins do not.
      tickets.push_back(request_with_room(
          *engine, read.row(t, ix[i]),
          [] { return false; }));
    }
    for (; waited < tickets.size(); ++waited) {
      rows[waited] = engine->wait(tickets[waited], task_wait_timeout()).row;
      lease[waited] = tickets[waited];
    }
    pins.tickets = std::move(tickets);
  } catch (...) {
    for (uint64_t tk : tickets) {
      engine->cancel(tk);
    }
    throw;
  }
}

std::pair<mx::array, mx::array> resolve_records(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    uint64_t owner, uint64_t generation, int layer) {
  const Table& t = engine->table(table);
  if (t.arena < 0) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "table " + std::to_string(table) + ": resolve needs an arena table");
  }
  mx::Stream s = op_stream();
  mx::array idx = index_input(indices, s);
  auto outs = mx::array::make_arrays(
      {indices.shape(), mx::Shape{static_cast<int>(indices.size())}},
      {mx::uint32, mx::uint64},
      std::make_shared<HostTaskPrimitive>(
          s, "HebrusResolveRecords", Output::kWritten,
          [read = TableRead{std::move(engine), table, owner, generation, layer}](
              const Arrays& inputs, Arrays& outputs) {
            // On the GPU path the records are already in the arena (MLX
            // buffers the GPU reads in place); the host task only pins them
            // and writes rows/lease.
            auto pins = std::make_shared<LeasePins>(LeasePins{read.engine, {}});
            allocate_resolve(outputs, pins);
            return [read, idx = inputs[0], rows = outputs[0].data<uint32_t>(),
                    lease = outputs[1].data<uint64_t>(), pins]() {
              resolve_host(read, idx, rows, lease, *pins);
            };
          }),
      {idx});
  return {outs[0], outs[1]};
}

// What a wave's issue op and take ops share: the tickets in position order
// (written once by the issue task, before any take task runs: each take op
// reads the lease) and which positions are taken. Owned by the lease buffer
// and the ops; whatever is still held when the last owner drops is released.
//
// A wave fails once: the task that meets the failure (the issue, or a take
// whose record failed or was cancelled) cancels every ticket and raises;
// the wave's later takes then give row 0 for each position still open and
// raise nothing. MLX clears a stream's error once the main thread has
// raised it, and a pipelined step's main thread can raise it while the
// failed step's later takes are still queued: a second error from one of
// them would fail the next, healthy evaluation, naming this wave's ticket.
struct Wave::State {
  std::shared_ptr<Engine> engine;
  std::vector<uint64_t> tickets;
  std::vector<uint8_t> taken; // one per position, set by resolve_wave
  std::atomic<bool> failed{false};
  ~State() {
    for (uint64_t t : tickets) {
      engine->release(t);
    }
  }
  void fail() {
    failed.store(true);
    for (uint64_t t : tickets) {
      engine->cancel(t);
    }
  }
};

static void wave_issue_host(
    const TableRead& read, int64_t deadline_ns, const mx::array& idx,
    uint64_t* lease, Wave::State& state) {
  Engine& engine = *read.engine;
  std::memset(lease, 0, idx.size() * sizeof(uint64_t));
  const Table& t = engine.table(read.table);
  const uint32_t* ix = idx.data<uint32_t>();
  try {
    for (size_t i = 0; i < idx.size(); ++i) {
      Request r = read.row(t, ix[i]);
      r.deadline_ns = deadline_ns;
      // Every record is pinned at once, as in resolve.
      state.tickets.push_back(
          request_with_room(engine, r, [] { return false; }));
    }
  } catch (...) {
    state.fail();
    throw;
  }
  std::memcpy(lease, state.tickets.data(), state.tickets.size() * sizeof(uint64_t));
}

// After a failure: the open positions in order, each with row 0 (a valid
// arena row; the evaluation has already failed, so nothing reads it as a
// record).
static void wave_take_failed(Wave::State& state, int n, uint32_t* rows, uint32_t* pos) {
  size_t i = 0;
  for (int j = 0; j < n; ++j) {
    while (i < state.taken.size() && state.taken[i]) {
      ++i;
    }
    // Takes cover the positions once (checked when they are built).
    pos[j] = static_cast<uint32_t>(std::min(i, state.taken.size() - 1));
    rows[j] = 0;
    if (i < state.taken.size()) {
      state.taken[i] = 1;
    }
  }
}

static void wave_take_host(Wave::State& state, int n, uint32_t* rows, uint32_t* pos) {
  if (state.failed.load()) {
    wave_take_failed(state, n, rows, pos);
    return;
  }
  Engine& engine = *state.engine;
  try {
    for (int j = 0; j < n; ++j) {
      std::vector<uint64_t> open;
      std::vector<uint32_t> where;
      for (size_t i = 0; i < state.tickets.size(); ++i) {
        if (!state.taken[i]) {
          open.push_back(state.tickets[i]);
          where.push_back(static_cast<uint32_t>(i));
        }
      }
      if (open.empty()) {
        throw StreamError(ErrorCode::kBadRequest, "wave: every record is taken");
      }
      size_t i = engine.wait_any(open, task_wait_timeout());
      rows[j] = engine.wait(open[i], task_wait_timeout()).row;
      pos[j] = where[i];
      state.taken[where[i]] = 1;
    }
  } catch (...) {
    state.fail();
    throw;
  }
}

std::shared_ptr<Wave> resolve_wave(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    uint64_t owner, uint64_t generation, int layer, double deadline_s) {
  const Table& t = engine->table(table);
  if (t.arena < 0) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "table " + std::to_string(table) + ": a wave needs an arena table");
  }
  if (indices.size() == 0) {
    throw StreamError(ErrorCode::kBadRequest, "indices: need at least one");
  }
  auto state = std::make_shared<Wave::State>();
  state->engine = engine;
  state->taken.assign(indices.size(), 0);
  int64_t budget = deadline_s > 0 ? int64_t(deadline_s * 1e9) : -1;
  mx::Stream s = op_stream();
  mx::array idx = index_input(indices, s);
  mx::array lease(
      mx::Shape{static_cast<int>(indices.size())},
      mx::uint64,
      std::make_shared<HostTaskPrimitive>(
          s, "HebrusWaveIssue", Output::kWritten,
          [read = TableRead{std::move(engine), table, owner, generation, layer}, budget,
           state](const Arrays& inputs, Arrays& outputs) {
            mx::allocator::Buffer buf = mx::allocator::allocator().malloc(outputs[0].nbytes());
            if (!buf.ptr()) {
              throw std::runtime_error("[wave] could not allocate the lease");
            }
            // The lease buffer keeps the wave's pins until it is freed.
            outputs[0].set_data(mx::allocator::Data(buf, [state](mx::allocator::Buffer b) {
              mx::allocator::allocator().free(b);
            }));
            return [read, budget, idx = inputs[0], lease = outputs[0].data<uint64_t>(), state]() {
              int64_t deadline = budget < 0 ? INT64_MAX : now_ns() + budget;
              wave_issue_host(read, deadline, idx, lease, *state);
            };
          }),
      {idx});
  return std::make_shared<Wave>(std::move(state), std::move(lease), static_cast<int>(indices.size()));
}

std::pair<mx::array, mx::array> Wave::take(const mx::array& after, int n) {
  if (n < 1 || built_ + n > size_) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "n: takes must cover the wave's " + std::to_string(size_) +
            " records once (" + std::to_string(size_ - built_) + " left, asked " +
            std::to_string(n) + ")");
  }
  built_ += n;
  mx::Stream s = op_stream();
  auto outs = mx::array::make_arrays(
      {mx::Shape{n}, mx::Shape{n}},
      {mx::uint32, mx::uint32},
      std::make_shared<HostTaskPrimitive>(
          s, "HebrusWaveTake", Output::kWritten,
          [state = state_, n](const Arrays&, Arrays& outputs) {
            allocate(outputs);
            return [state, n, rows = outputs[0].data<uint32_t>(), pos = outputs[1].data<uint32_t>()]() {
              wave_take_host(*state, n, rows, pos);
            };
          }),
      {lease_, after});
  return {outs[0], outs[1]};
}

static void release_leases(Engine& engine, const mx::array& lease) {
  const uint64_t* t = lease.data<uint64_t>();
  for (size_t i = 0; i < lease.size(); ++i) {
    engine.release(t[i]);
  }
}

mx::array host_roundtrip(const mx::array& value) {
  mx::Stream s = op_stream();
  return mx::array(
      value.shape(),
      value.dtype(),
      std::make_shared<HostTaskPrimitive>(
          s, "HebrusHostRoundTrip", Output::kWritten,
          [](const Arrays& inputs, Arrays& outputs) -> std::function<void()> {
            allocate(outputs);
            return [in = inputs[0], out = outputs[0]]() mutable {
              std::memcpy(out.data<uint8_t>(), in.data<uint8_t>(), in.nbytes());
            };
          }),
      {mx::contiguous(value, false, s)});
}

mx::array release_after(
    std::shared_ptr<Engine> engine, const mx::array& value,
    const mx::array& lease) {
  if (lease.dtype() != mx::uint64) {
    throw StreamError(
        ErrorCode::kBadRequest, "lease: must be the uint64 output of resolve");
  }
  return mx::array(
      value.shape(),
      value.dtype(),
      std::make_shared<HostTaskPrimitive>(
          op_stream(), "HebrusReleaseAfter", Output::kPassThrough,
          [engine = std::move(engine)](const Arrays& inputs, Arrays&) {
            // Pins are released once the value that read the records is
            // computed (on the GPU path: once the GPU is past it).
            return [engine, lease = inputs[1]]() { release_leases(*engine, lease); };
          }),
      {value, lease});
}

} // namespace hebrus
