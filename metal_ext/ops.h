// MLX primitives over the I/O engine. They run on the CPU stream: eval_cpu
// dispatches a task that waits on exactly the tickets it consumes, so graph
// evaluation (not Python) blocks on I/O, and only for the records it needs.
#pragma once

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
  // The exact P0 request for row `id` (callers lower priority / exact).
  Request row(const Table& t, uint32_t id) const;
};

class GatherRows : public mx::UnaryPrimitive {
 public:
  GatherRows(
      mx::Stream s, TableRead read, uint64_t rows_per_page, uint64_t row_bytes,
      uint64_t header_bytes)
      : mx::UnaryPrimitive(s),
        read_(std::move(read)),
        rows_per_page_(rows_per_page),
        row_bytes_(row_bytes),
        header_bytes_(header_bytes) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "HebrusGatherRows";
  }

 private:
  TableRead read_;
  uint64_t rows_per_page_;
  uint64_t row_bytes_;
  uint64_t header_bytes_;
};

class ResolveRecords : public mx::Primitive {
 public:
  ResolveRecords(mx::Stream s, TableRead read)
      : mx::Primitive(s), read_(std::move(read)) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "HebrusResolveRecords";
  }

 private:
  TableRead read_;
};

class ReleaseAfter : public mx::UnaryPrimitive {
 public:
  ReleaseAfter(mx::Stream s, std::shared_ptr<Engine> engine)
      : mx::UnaryPrimitive(s), engine_(std::move(engine)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "HebrusReleaseAfter";
  }

 private:
  std::shared_ptr<Engine> engine_;
};

class LoadTickets : public mx::UnaryPrimitive {
 public:
  LoadTickets(
      mx::Stream s, std::shared_ptr<Engine> engine,
      std::vector<uint64_t> tickets, uint64_t length)
      : mx::UnaryPrimitive(s),
        engine_(std::move(engine)),
        tickets_(std::move(tickets)),
        length_(length) {}
  ~LoadTickets() override;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "HebrusLoadTickets";
  }

 private:
  std::shared_ptr<Engine> engine_;
  std::vector<uint64_t> tickets_;
  uint64_t length_;
};

class GatherRecords : public mx::UnaryPrimitive {
 public:
  GatherRecords(mx::Stream s, TableRead read)
      : mx::UnaryPrimitive(s), read_(std::move(read)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "HebrusGatherRecords";
  }

 private:
  TableRead read_;
};

class PrefetchRecords : public mx::UnaryPrimitive {
 public:
  PrefetchRecords(
      mx::Stream s, TableRead read, int priority, double confidence, bool exact)
      : mx::UnaryPrimitive(s),
        read_(std::move(read)),
        priority_(priority),
        confidence_(confidence),
        exact_(exact) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "HebrusPrefetchRecords";
  }

 private:
  TableRead read_;
  int priority_;
  double confidence_;
  bool exact_;
};

} // namespace hebrus
