// MLX primitives over the I/O engine. They run on the CPU stream: eval_cpu
// dispatches a task that waits on exactly the tickets it consumes, so graph
// evaluation (not Python) blocks on I/O, and only for the records it needs.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "engine.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace hebrus {

namespace mx = mlx::core;

// uint8 [n, length] holding the records of already issued tickets (all of one
// length). The op takes ownership of the tickets and releases each once.
mx::array load_tickets(
    std::shared_ptr<Engine> engine,
    std::vector<uint64_t> tickets);

// Streamed gather: uint8 [*indices.shape, length], row i = table[indices[i]].
// Requests are issued as P0 exact when the indices are evaluated.
mx::array gather_records(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    uint64_t owner, uint64_t generation, int layer);

// Non-blocking: issues table[indices] at `priority` and returns at once; the
// reads stay as cache candidates. `exact` marks known-needed records issued
// early (PLE pages once token ids are known) rather than predictions. The
// uint32 scalar output is the number of requests issued.
mx::array prefetch_records(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    int priority, double confidence, bool exact, uint64_t owner,
    uint64_t generation, int layer);

// Fixed-row arena for one record geometry: part p is an MLX-allocated uint8
// array [rows, part_bytes[p]] (e.g. gate weight | gate scales | ...), so the
// graph can view a part as [rows, out, in] and index it with slot rows.
// expand[p] (empty: none) marks a stored-bf16 part held as fp32 in the
// arena: its rows are [rows, 2 * part_bytes[p]].
// An MLX uint8 array [rows, row_bytes] whose first row starts kAlign-aligned
// inside its own over-allocated buffer (O_DIRECT reads can target its rows);
// returns (buffer, view). rows * row_bytes must stay below 2^31 - kAlign.
std::pair<mx::array, mx::array> aligned_rows(uint32_t rows, uint64_t row_bytes);

// Slab memory from MLX's allocator (EngineOptions::allocate_slab): a
// kAlign-aligned block inside an MLX buffer, freed when the owner drops.
std::pair<uint8_t*, std::shared_ptr<void>> allocate_mlx_slab(uint64_t size);

std::pair<int, std::vector<mx::array>> create_arena(
    std::shared_ptr<Engine> engine,
    std::vector<uint64_t> part_bytes,
    uint32_t rows,
    std::vector<uint8_t> expand = {});

// Waits for table[indices] (P0 exact) in the table's arena and pins them.
// Returns (rows uint32 [*indices.shape], lease uint64 [n]): rows index the
// arena parts (e.g. gather_qmm rhs_indices); the lease must reach
// release_after once the consumer of the rows has been computed.
std::pair<mx::array, mx::array> resolve_records(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    uint64_t owner, uint64_t generation, int layer);

// A decode step's wavefront over one layer's routed records (AFN-019 H4):
// resolve_wave's issue op requests table[indices] (P0 exact, deadline
// now + deadline_s when it runs; <= 0: none) and pins them without waiting;
// then take(after, n) returns the next n records in arrival order as
// (rows uint32 [n], positions in indices uint32 [n]); the takes of a wave
// cover its records once. Its task runs after `after` (e.g. the previous
// experts' output, so the stream computes those while later reads land) and
// blocks until n more records are ready: those already ready come first, in
// position order. `lease` goes to
// release_after once every taken row's consumer is computed.
class Wave {
 public:
  struct State;
  Wave(std::shared_ptr<State> state, mx::array lease, int size)
      : state_(std::move(state)), lease_(std::move(lease)), size_(size) {}
  const mx::array& lease() const {
    return lease_;
  }
  int size() const {
    return size_;
  }
  std::pair<mx::array, mx::array> take(const mx::array& after, int n = 1);

 private:
  std::shared_ptr<State> state_;
  mx::array lease_;
  int size_;
  int built_ = 0; // take ops built so far
};

std::shared_ptr<Wave> resolve_wave(
    std::shared_ptr<Engine> engine, int table, const mx::array& indices,
    uint64_t owner, uint64_t generation, int layer, double deadline_s);

// `value` copied by a host task that the device waits for: the hand-off a
// streamed layer costs with no I/O at all (qualify's event round trip; on the
// GPU path a GPU -> host -> GPU event round trip, else a CPU-stream task).
mx::array host_roundtrip(const mx::array& value);

// Identity on `value` that, when evaluated, releases the lease's pins.
mx::array release_after(
    std::shared_ptr<Engine> engine, const mx::array& value,
    const mx::array& lease);

// PLE-style fixed pages: row r is page r / rows_per_page at byte
// header_bytes + (r % rows_per_page) * row_bytes. Unique pages are read once
// (P0, digest-verified as one snapshot) and rows copied out of that same
// snapshot. Output uint8 [*row_ids.shape, row_bytes].
mx::array gather_rows(
    std::shared_ptr<Engine> engine, int table, const mx::array& row_ids,
    uint64_t rows_per_page, uint64_t row_bytes, uint64_t header_bytes,
    uint64_t owner, uint64_t generation, int layer);

// What a table op reads and for whom: the engine, the record table, the
// owner/generation its requests carry, and the layer that labels them for
// per-layer counters and the trace.
struct TableRead {
  std::shared_ptr<Engine> engine;
  int table;
  uint64_t owner;
  uint64_t generation;
  int layer;
  // The exact P0 request for row `id` (callers lower priority / exact); an id
  // past the table is a StreamError (kBadRequest) naming `indices`.
  Request row(const Table& t, uint32_t id) const;
};

// Every streaming op here (and mark_after, trace_ops.h) is this one MLX
// primitive: its work is one host task, bound when it is evaluated. eval_cpu
// dispatches the task on the op's CPU stream and eval_gpu runs it as a
// GPU-event host task (ops_metal.h), so both paths share everything but the
// dispatch. A writing op's bind allocates its outputs, and GPU work after it
// waits for the task; a pass-through op's one output is inputs[0] unchanged
// (aliased before bind) and its task only acts on the engine (release,
// mark), so the GPU never waits for it.
class HostTaskPrimitive : public mx::Primitive {
 public:
  using Arrays = std::vector<mx::array>;
  // Allocates the outputs (a writing op) and returns the host work bound to
  // them and to the inputs. Called once per evaluation.
  using Bind = std::function<std::function<void()>(const Arrays& inputs, Arrays& outputs)>;
  // kHint: written by its task like kWritten, but on the GPU path no GPU work
  // waits for it: its output only orders later ops (mx.depends), so a read
  // hint never makes the GPU wait on a host round trip. Its value is defined
  // once the task has run (the CPU path: in stream order).
  enum class Output { kWritten, kPassThrough, kHint };

  HostTaskPrimitive(mx::Stream s, const char* name, Output output, Bind bind)
      : mx::Primitive(s), name_(name), output_(output), bind_(std::move(bind)) {}
  void eval_cpu(const Arrays& inputs, Arrays& outputs) override;
  void eval_gpu(const Arrays& inputs, Arrays& outputs) override;
  const char* name() const override {
    return name_;
  }

 private:
  std::function<void()> prepare(const Arrays& inputs, Arrays& outputs);
  const char* name_;
  Output output_;
  Bind bind_;
};

// How long a host task the GPU waits on may wait for one read: a stalled SSD
// read must not hold a command buffer open past macOS's GPU watchdog. Past it
// the read fails typed (StreamError kTimeout), the GPU is released and the
// step rolls back (check_gpu_event_errors), as for any read error. CPU-stream
// tasks wait without bound (they hold no GPU). Seconds; <= 0: unbounded.
double gpu_task_wait_bound();
void set_gpu_task_wait_bound(double seconds);
// The bound that applies to the calling thread's current task (-1: none).
double task_wait_timeout();

} // namespace hebrus
