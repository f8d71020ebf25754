#include "ops.h"

#include <cstring>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace hebrus {

namespace {

mx::Stream io_stream() {
  // Unified memory on Apple silicon: a CPU-stream output is directly usable
  // by GPU consumers; MLX orders the cross-stream dependency.
  return mx::default_stream(mx::Device::cpu);
}

// Wait, copy and release tickets in order. On failure every remaining ticket
// is cancelled, so no slot stays pinned, and the error propagates.
void copy_tickets(
    Engine& engine,
    const std::vector<uint64_t>& tickets,
    uint64_t length,
    uint8_t* dst) {
  size_t i = 0;
  try {
    for (; i < tickets.size(); ++i) {
      Engine::View v = engine.wait(tickets[i]);
      std::memcpy(dst + i * length, v.data, length);
      engine.release(tickets[i]);
    }
  } catch (...) {
    for (; i < tickets.size(); ++i) {
      engine.cancel(tickets[i]);
    }
    throw;
  }
}

mx::array index_input(const mx::array& indices) {
  if (!mx::issubdtype(indices.dtype(), mx::integer)) {
    throw StreamError(ErrorCode::kBadRequest, "indices: must be integers");
  }
  return mx::contiguous(mx::astype(indices, mx::uint32, io_stream()), false, io_stream());
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

mx::array load_tickets(
    std::shared_ptr<Engine> engine,
    std::vector<uint64_t> tickets) {
  if (tickets.empty()) {
    throw StreamError(ErrorCode::kBadRequest, "tickets: need at least one");
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
          io_stream(), std::move(engine), std::move(tickets), length),
      {});
}

LoadTickets::~LoadTickets() {
  // Never evaluated: give the tickets back (release is exactly-once).
  for (uint64_t t : tickets_) {
    engine_->release(t);
  }
}

void LoadTickets::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_output_array(out);
  // The task owns the tickets from here: the primitive may be detached from
  // the graph before the task runs.
  enc.dispatch([engine = engine_,
                tickets = std::move(tickets_),
                length = length_,
                dst = out.data<uint8_t>()]() {
    copy_tickets(*engine, tickets, length, dst);
  });
  tickets_.clear();
}

void LoadTickets::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  throw std::runtime_error("HebrusLoadTickets runs on the CPU stream only");
}

mx::array gather_records(
    std::shared_ptr<Engine> engine,
    int table,
    const mx::array& indices,
    uint64_t owner,
    uint64_t generation) {
  uint64_t length = table_length(*engine, table);
  mx::Shape shape = indices.shape();
  shape.push_back(static_cast<int>(length));
  return mx::array(
      shape,
      mx::uint8,
      std::make_shared<GatherRecords>(
          io_stream(), std::move(engine), table, owner, generation),
      {index_input(indices)});
}

void GatherRecords::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_output_array(out);
  enc.dispatch([engine = engine_,
                table = table_,
                owner = owner_,
                generation = generation_,
                idx = inputs[0],
                dst = out.data<uint8_t>()]() {
    const Table& t = engine->table(table);
    const uint32_t* ix = idx.data<uint32_t>();
    const uint64_t length = t.uniform_length;
    // Issue as many records as the cache can pin so the reads overlap; when
    // it is full, consume the issued wave and continue (repeated indices
    // join the same read).
    std::vector<std::pair<size_t, uint64_t>> wave;
    auto drain = [&] {
      size_t k = 0;
      try {
        for (; k < wave.size(); ++k) {
          Engine::View v = engine->wait(wave[k].second);
          std::memcpy(dst + wave[k].first * length, v.data, length);
          engine->release(wave[k].second);
        }
      } catch (...) {
        for (; k < wave.size(); ++k) {
          engine->cancel(wave[k].second);
        }
        wave.clear();
        throw;
      }
      wave.clear();
    };
    try {
      for (size_t i = 0; i < idx.size(); ++i) {
        if (ix[i] >= t.rows.size()) {
          throw StreamError(
              ErrorCode::kBadRequest,
              "indices: " + std::to_string(ix[i]) + " out of range for table " +
                  std::to_string(table) + " with " +
                  std::to_string(t.rows.size()) + " rows");
        }
        const TableRow& row = t.rows[ix[i]];
        Request r;
        r.store = t.store;
        r.offset = row.offset;
        r.length = row.length;
        r.priority = 0;
        r.exact = true;
        r.owner = owner;
        r.generation = generation;
        r.expert = static_cast<int>(ix[i]);
        r.comp_end = row.length;
        r.has_digest = row.has_digest;
        r.digest = row.digest;
        while (true) {
          try {
            wave.emplace_back(i, engine->request(r));
            break;
          } catch (const StreamError& e) {
            if (e.code != ErrorCode::kCacheFull || wave.empty()) {
              throw;
            }
            drain();
          }
        }
      }
      drain();
    } catch (...) {
      for (auto& [pos, tk] : wave) {
        engine->cancel(tk);
      }
      throw;
    }
  });
}

void GatherRecords::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  throw std::runtime_error("HebrusGatherRecords runs on the CPU stream only");
}

mx::array prefetch_records(
    std::shared_ptr<Engine> engine,
    int table,
    const mx::array& indices,
    int priority,
    double confidence,
    uint64_t owner,
    uint64_t generation) {
  engine->table(table); // validates the id now, not at eval time
  if (priority < 0 || priority >= kNumPriorities) {
    throw StreamError(
        ErrorCode::kBadRequest, "priority: must be 0, 1 or 2");
  }
  return mx::array(
      mx::Shape{},
      mx::uint32,
      std::make_shared<PrefetchRecords>(
          io_stream(),
          std::move(engine),
          table,
          priority,
          confidence,
          owner,
          generation),
      {index_input(indices)});
}

void PrefetchRecords::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_output_array(out);
  enc.dispatch([engine = engine_,
                table = table_,
                priority = priority_,
                confidence = confidence_,
                owner = owner_,
                generation = generation_,
                idx = inputs[0],
                dst = out.data<uint32_t>()]() {
    const Table& t = engine->table(table);
    const uint32_t* ix = idx.data<uint32_t>();
    uint32_t issued = 0;
    for (size_t i = 0; i < idx.size(); ++i) {
      if (ix[i] >= t.rows.size()) {
        continue; // a hint, not a dependency: bad ids are skipped
      }
      const TableRow& row = t.rows[ix[i]];
      Request r;
      r.store = t.store;
      r.offset = row.offset;
      r.length = row.length;
      r.priority = priority;
      r.exact = false;
      r.confidence = confidence;
      r.owner = owner;
      r.generation = generation;
      r.expert = static_cast<int>(ix[i]);
      r.comp_end = row.length;
      r.has_digest = row.has_digest;
      r.digest = row.digest;
      try {
        // Released at once: the read continues as a cache candidate.
        engine->release(engine->request(r));
        issued++;
      } catch (const StreamError&) {
        // Speculation never fails the graph (full cache, stale generation).
      }
    }
    *dst = issued;
  });
}

void PrefetchRecords::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  throw std::runtime_error("HebrusPrefetchRecords runs on the CPU stream only");
}

} // namespace hebrus
