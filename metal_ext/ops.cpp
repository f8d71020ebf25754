#include "ops.h"
#include "ops_metal.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

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
      consume_(tag, engine_.wait(ticket));
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

// Allocates `out` and returns the CPU encoder with `inputs` and `out`
// registered: the prologue of every copying op here.
mx::cpu::CommandEncoder& cpu_encoder(
    const mx::Stream& stream, const std::vector<mx::array>& inputs,
    mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    enc.set_input_array(in);
  }
  enc.set_output_array(out);
  return enc;
}

// The indices as contiguous uint32 on `s` (the op's own stream, so a GPU
// op's host task reads them once the GPU has produced them).
mx::array index_input(const mx::array& indices, mx::Stream s) {
  if (!mx::issubdtype(indices.dtype(), mx::integer)) {
    throw StreamError(ErrorCode::kBadRequest, "indices: must be integers");
  }
  return mx::contiguous(mx::astype(indices, mx::uint32, s), false, s);
}

// Allocates each output: the prologue of every GPU-event eval_gpu (the host
// task writes the buffers; MLX's Metal allocator makes them shared memory).
void allocate(std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
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
  return mx::array(
      shape,
      mx::uint8,
      std::make_shared<LoadTickets>(
          op_stream(), std::move(engine), std::move(tickets), length),
      {});
}

LoadTickets::~LoadTickets() {
  // Never evaluated: give the tickets back (release is exactly-once).
  for (uint64_t t : tickets_) {
    engine_->release(t);
  }
}

// The host work of each op lives in one function shared by eval_cpu (a CPU
// stream task) and eval_gpu (a GPU-event host task, ops_metal.h).
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

void LoadTickets::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& enc = cpu_encoder(stream(), inputs, out);
  // The task owns the tickets from here: the primitive may be detached from
  // the graph before the task runs.
  enc.dispatch([engine = engine_,
                tickets = std::move(tickets_),
                length = length_,
                dst = out.data<uint8_t>()]() {
    load_tickets_host(engine, tickets, length, dst);
  });
  tickets_.clear();
}

void LoadTickets::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  std::vector<mx::array> outs{out};
  allocate(outs);
  eval_gpu_via_io(
      stream(), inputs, outs,
      [engine = engine_, tickets = std::move(tickets_), length = length_,
       dst = out.data<uint8_t>()]() {
        load_tickets_host(engine, tickets, length, dst);
      },
      true);
  tickets_.clear();
}

mx::array gather_records(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    uint64_t owner, uint64_t generation, int layer) {
  uint64_t length = table_length(*engine, table);
  mx::Shape shape = indices.shape();
  shape.push_back(static_cast<int>(length));
  return mx::array(
      shape,
      mx::uint8,
      std::make_shared<GatherRecords>(
          op_stream(),
          TableRead{std::move(engine), table, owner, generation, layer}),
      {index_input(indices, op_stream())});
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
    if (ix[i] >= t.rows.size()) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "indices: " + std::to_string(ix[i]) + " out of range for table " +
              std::to_string(read.table) + " with " +
              std::to_string(t.rows.size()) + " rows");
    }
    waves.issue(i, read.row(t, ix[i]));
  }
  waves.drain();
}

void GatherRecords::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& enc = cpu_encoder(stream(), inputs, out);
  enc.dispatch([read = read_, idx = inputs[0], dst = out.data<uint8_t>()]() {
    gather_records_host(read, idx, dst);
  });
}

void GatherRecords::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  std::vector<mx::array> outs{out};
  allocate(outs);
  eval_gpu_via_io(
      stream(), inputs, outs,
      [read = read_, idx = inputs[0], dst = out.data<uint8_t>()]() {
        gather_records_host(read, idx, dst);
      },
      true);
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
  return mx::array(
      mx::Shape{},
      mx::uint32,
      std::make_shared<PrefetchRecords>(
          op_stream(),
          TableRead{std::move(engine), table, owner, generation, layer},
          priority,
          confidence,
          exact),
      {index_input(indices, op_stream())});
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

void PrefetchRecords::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& enc = cpu_encoder(stream(), inputs, out);
  enc.dispatch([read = read_, priority = priority_, confidence = confidence_, exact = exact_,
                idx = inputs[0], dst = out.data<uint32_t>()]() {
    issue_hints(read, priority, confidence, exact, idx, dst);
  });
}

void PrefetchRecords::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  // The host issues the hints once the GPU has produced the indices; the GPU
  // waits for the (µs-scale) issue so the count it may read is written.
  std::vector<mx::array> outs{out};
  allocate(outs);
  eval_gpu_via_io(
      stream(), inputs, outs,
      [read = read_, priority = priority_, confidence = confidence_,
       exact = exact_, idx = inputs[0], dst = out.data<uint32_t>()]() {
        issue_hints(read, priority, confidence, exact, idx, dst);
      },
      true);
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
  return mx::array(
      shape,
      mx::uint8,
      std::make_shared<GatherRows>(
          op_stream(),
          TableRead{std::move(engine), table, owner, generation, layer},
          rows_per_page,
          row_bytes,
          header_bytes),
      {index_input(row_ids, op_stream())});
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

void GatherRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = cpu_encoder(stream(), inputs, out);
  enc.dispatch([read = read_, rpp = rows_per_page_, row_bytes = row_bytes_,
                header = header_bytes_, idx = inputs[0],
                dst = out.data<uint8_t>()]() {
    gather_rows_host(read, rpp, row_bytes, header, idx, dst);
  });
}

void GatherRows::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  std::vector<mx::array> outs{out};
  allocate(outs);
  eval_gpu_via_io(
      stream(), inputs, outs,
      [read = read_, rpp = rows_per_page_, row_bytes = row_bytes_,
       header = header_bytes_, idx = inputs[0], dst = out.data<uint8_t>()]() {
        gather_rows_host(read, rpp, row_bytes, header, idx, dst);
      },
      true);
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
      std::make_shared<ResolveRecords>(
          s,
          TableRead{std::move(engine), table, owner, generation, layer}),
      {idx});
  return {outs[0], outs[1]};
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
      if (ix[i] >= t.rows.size()) {
        throw StreamError(
            ErrorCode::kBadRequest,
            "indices: " + std::to_string(ix[i]) + " out of range for table " +
                std::to_string(read.table));
      }
      // Rows held by draining prefetches free up; our own pins do not.
      tickets.push_back(request_with_room(
          *engine, read.row(t, ix[i]),
          [] { return false; }));
    }
    for (; waited < tickets.size(); ++waited) {
      rows[waited] = engine->wait(tickets[waited]).row;
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

void ResolveRecords::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto pins = std::make_shared<LeasePins>(LeasePins{read_.engine, {}});
  allocate_resolve(outputs, pins);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_output_array(outputs[0]);
  enc.set_output_array(outputs[1]);
  enc.dispatch([read = read_,
                idx = inputs[0],
                rows = outputs[0].data<uint32_t>(),
                lease = outputs[1].data<uint64_t>(),
                pins]() {
    resolve_host(read, idx, rows, lease, *pins);
  });
}

void ResolveRecords::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  // The records are already in the arena (MLX buffers the GPU reads in
  // place); the host task only pins them and writes rows/lease.
  auto pins = std::make_shared<LeasePins>(LeasePins{read_.engine, {}});
  allocate_resolve(outputs, pins);
  eval_gpu_via_io(
      stream(), inputs, outputs,
      [read = read_, idx = inputs[0], rows = outputs[0].data<uint32_t>(),
       lease = outputs[1].data<uint64_t>(), pins]() {
        resolve_host(read, idx, rows, lease, *pins);
      },
      true);
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
      std::make_shared<ReleaseAfter>(op_stream(), std::move(engine)),
      {value, lease});
}

static void release_leases(Engine& engine, const mx::array& lease) {
  const uint64_t* t = lease.data<uint64_t>();
  for (size_t i = 0; i < lease.size(); ++i) {
    engine.release(t[i]);
  }
}

void ReleaseAfter::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  // Pass the value through untouched; runs after its producer, which is
  // what makes releasing the pins safe.
  out.copy_shared_buffer(inputs[0]);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_input_array(inputs[1]);
  enc.dispatch([engine = engine_, lease = inputs[1], value = inputs[0]]() {
    release_leases(*engine, lease);
  });
}

void ReleaseAfter::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  // Pins are released once the GPU has computed the value that read the
  // records; the GPU itself never waits for that.
  out.copy_shared_buffer(inputs[0]);
  eval_gpu_via_io(
      stream(), inputs, {},
      [engine = engine_, lease = inputs[1]]() {
        release_leases(*engine, lease);
      },
      false);
}

} // namespace hebrus
