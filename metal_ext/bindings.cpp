// Python bindings: hebrus_mlx._ext. Shares MLX's nanobind domain so mx.array
// crosses the boundary without copies.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <cstring>

#include "io_mtlio.h"
#include "ops.h"
#include "ops_metal.h"
#include "py_errors.h"
#include "sweep.h"
#include "trace_ops.h"

namespace nb = nanobind;
using namespace nb::literals;
using hebrus::Engine;

namespace {

hebrus::Digest to_digest(const nb::bytes& b, const char* field) {
  if (b.size() != 32) {
    throw hebrus::StreamError(
        hebrus::ErrorCode::kBadRequest,
        std::string(field) + ": SHA-256 digest must be 32 bytes");
  }
  hebrus::Digest d;
  std::memcpy(d.data(), b.c_str(), 32);
  return d;
}

nb::dict counters_dict(const hebrus::Counters& c) {
  nb::dict d;
  d["requests"] = c.requests;
  d["hits"] = c.hits;
  d["joins"] = c.joins;
  d["misses"] = c.misses;
  d["exact_bytes"] = c.exact_bytes;
  d["predicted_bytes"] = c.predicted_bytes;
  d["wasted_bytes"] = c.wasted_bytes;
  d["evictions"] = c.evictions;
  d["cancelled"] = c.cancelled;
  d["stale_tickets"] = c.stale_tickets;
  d["stale_drops"] = c.stale_drops;
  d["errors"] = c.errors;
  d["waits"] = c.waits;
  d["waits_blocked"] = c.waits_blocked;
  d["exposed_wait_ns"] = c.exposed_wait_ns;
  d["exact_read_ns"] = c.exact_read_ns;
  d["deadline_misses"] = c.deadline_misses;
  d["predicted_hits"] = c.predicted_hits;
  d["predicted_joins"] = c.predicted_joins;
  d["predicted_reads"] = c.predicted_reads;
  d["exact_misses"] = c.exact_misses;
  nb::dict by_layer;
  for (auto& [layer, ns] : c.exposed_wait_ns_by_layer) {
    by_layer[nb::int_(layer)] = ns;
  }
  d["exposed_wait_ns_by_layer"] = by_layer;
  d["latency_p50_ns"] = c.latency_p50_ns;
  d["latency_p95_ns"] = c.latency_p95_ns;
  d["latency_p99_ns"] = c.latency_p99_ns;
  d["latency_samples"] = c.latency_samples;
  return d;
}

// Columns of trace events (oldest first); the Python side turns them into a
// numpy structured array.
nb::dict trace_dict(const std::vector<hebrus::TraceEvent>& ev, uint64_t dropped) {
  nb::list kind, outcome, priority, exact, promoted, layer, expert, bytes, t0,
      t1, t2;
  for (const auto& e : ev) {
    kind.append(int(e.kind));
    outcome.append(hebrus::trace_outcome_name(e));
    priority.append(int(e.priority));
    exact.append(e.exact);
    promoted.append(e.promoted);
    layer.append(e.layer);
    expert.append(e.expert);
    bytes.append(e.bytes);
    t0.append(e.t0);
    t1.append(e.t1);
    t2.append(e.t2);
  }
  nb::dict d;
  d["kind"] = kind;
  d["outcome"] = outcome;
  d["priority"] = priority;
  d["exact"] = exact;
  d["promoted"] = promoted;
  d["layer"] = layer;
  d["expert"] = expert;
  d["bytes"] = bytes;
  d["t0"] = t0;
  d["t1"] = t1;
  d["t2"] = t2;
  d["dropped"] = dropped;
  return d;
}

} // namespace

NB_MODULE(_ext, m) {
  m.doc() = "hebrus-mlx streaming engine (C++ MLX extension)";

  hebrus::register_stream_error_translator();
  // {code: name} of every engine error (engine.h HEBRUS_ERROR_CODES): the
  // Python classes are looked up by these names.
  m.def("error_codes", [] {
    nb::dict d;
#define HEBRUS_ERROR_ITEM(id, value, name) d[nb::int_(value)] = name;
    HEBRUS_ERROR_CODES(HEBRUS_ERROR_ITEM)
#undef HEBRUS_ERROR_ITEM
    return d;
  });

  nb::class_<Engine>(m, "Engine")
      // Made by make_shared, never in place: every shared_ptr<Engine> the ops
      // get then shares this C++ owner (enable_shared_from_this), not a
      // per-call one whose deleter takes the GIL on an MLX stream thread.
      .def(
          nb::new_([](int threads,
             uint64_t cache_bytes,
             bool direct,
             bool nocache,
             bool rdadvise,
             const std::string& policy,
             const std::string& backend,
             bool testing) {
            hebrus::EngineOptions o;
            o.threads = threads;
            o.cache_bytes = cache_bytes;
            o.direct = direct;
            o.nocache = nocache;
            o.rdadvise = rdadvise;
            o.policy = policy;
            o.backend = backend;
            o.testing = testing;
            o.allocate_slab = hebrus::allocate_mlx_slab;
            return std::make_shared<Engine>(o);
          }),
          "threads"_a = 4,
          "cache_bytes"_a = uint64_t(1) << 30,
          "direct"_a = true,
          "nocache"_a = false,
          "rdadvise"_a = false,
          "policy"_a = "lru",
          "backend"_a = "pread",
          "testing"_a = false)
      .def_prop_ro(
          "backend", [](Engine& e) { return e.options().backend; })
      .def("add_store", &Engine::add_store, "path"_a, "digest_id"_a = "")
      .def("add_mirror", &Engine::add_mirror, "store"_a, "path"_a)
      .def(
          "file_reads",
          [](Engine& e, int store) {
            auto r = e.file_reads(store);
            nb::dict d;
            d["paths"] = r.paths;
            d["reads"] = r.reads;
            d["bytes"] = r.bytes;
            d["fallbacks"] = r.fallbacks;
            return d;
          },
          "store"_a)
      .def(
          "register_table",
          [](Engine& e,
             int store,
             const std::vector<uint64_t>& offsets,
             const std::vector<uint64_t>& lengths,
             std::optional<std::vector<nb::bytes>> digests,
             int arena) {
            if (offsets.size() != lengths.size() ||
                (digests && digests->size() != offsets.size())) {
              throw hebrus::StreamError(
                  hebrus::ErrorCode::kBadRequest,
                  "offsets/lengths/digests: must have equal lengths");
            }
            std::vector<hebrus::TableRow> rows(offsets.size());
            for (size_t i = 0; i < rows.size(); ++i) {
              rows[i].offset = offsets[i];
              rows[i].length = lengths[i];
              rows[i].has_digest = bool(digests);
              if (digests) {
                rows[i].digest = to_digest((*digests)[i], "digests");
              }
            }
            return e.register_table(store, std::move(rows), arena);
          },
          "store"_a,
          "offsets"_a,
          "lengths"_a,
          "digests"_a = nb::none(),
          "arena"_a = -1)
      .def(
          "request",
          [](Engine& e,
             int store,
             uint64_t offset,
             uint64_t length,
             int priority,
             bool exact,
             uint64_t owner,
             uint64_t generation,
             int layer,
             int expert,
             std::optional<int64_t> deadline_ns,
             double confidence,
             std::optional<nb::bytes> digest,
             int arena) {
            hebrus::Request r;
            r.arena = arena;
            r.store = store;
            r.offset = offset;
            r.length = length;
            r.priority = priority;
            r.exact = exact;
            r.owner = owner;
            r.generation = generation;
            r.layer = layer;
            r.expert = expert;
            r.deadline_ns = deadline_ns ? *deadline_ns : INT64_MAX;
            r.confidence = confidence;
            if (digest) {
              r.has_digest = true;
              r.digest = to_digest(*digest, "digest");
            }
            nb::gil_scoped_release nogil;
            return e.request(r);
          },
          "store"_a,
          "offset"_a,
          "length"_a,
          "priority"_a = 0,
          "exact"_a = true,
          "owner"_a = 0,
          "generation"_a = 0,
          "layer"_a = -1,
          "expert"_a = -1,
          "deadline_ns"_a = nb::none(),
          "confidence"_a = 1.0,
          "digest"_a = nb::none(),
          "arena"_a = -1)
      .def(
          "wait",
          [](Engine& e, uint64_t t, double timeout) {
            nb::gil_scoped_release nogil;
            return e.wait(t, timeout).length;
          },
          "ticket"_a,
          "timeout"_a = -1.0)
      .def(
          "read",
          [](Engine& e, uint64_t t, double timeout) {
            std::string out;
            {
              nb::gil_scoped_release nogil;
              Engine::View v = e.wait(t, timeout);
              // The ticket's pin keeps the slot valid while we copy.
              out.resize(v.length);
              e.copy_out(v, reinterpret_cast<uint8_t*>(out.data()));
            }
            return nb::bytes(out.data(), out.size());
          },
          "ticket"_a,
          "timeout"_a = -1.0)
      .def("release", &Engine::release, "ticket"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("cancel", &Engine::cancel, "ticket"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("advance_generation", &Engine::advance_generation, "owner"_a,
           "generation"_a, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "set_staging",
          &Engine::set_staging,
          "arena"_a,
          "rows"_a)
      .def(
          "set_hint",
          [](Engine& e,
             int store,
             uint64_t offset,
             uint64_t length,
             double p_use,
             int arena,
             std::optional<nb::bytes> digest) {
            hebrus::Digest d{};
            if (digest) {
              d = to_digest(*digest, "digest");
            }
            return e.set_hint(
                store, offset, length, p_use, arena, digest ? &d : nullptr);
          },
          "store"_a,
          "offset"_a,
          "length"_a,
          "p_use"_a,
          "arena"_a = -1,
          "digest"_a = nb::none())
      .def(
          "ticket_info",
          [](Engine& e, uint64_t t) {
            hebrus::TicketInfo i = e.ticket_info(t);
            nb::dict d;
            static const char* states[] = {"pending", "ready", "failed"};
            static const char* kinds[] = {"hit", "joined", "miss"};
            d["state"] = states[int(i.state)];
            d["kind"] = kinds[int(i.kind)];
            d["error"] = hebrus::error_name(i.error);
            d["message"] = i.message;
            d["slot"] = i.slot;
            d["slot_generation"] = i.slot_generation;
            d["complete_seq"] = i.complete_seq;
            d["store"] = i.request.store;
            d["store_digest"] = i.store_digest;
            d["offset"] = i.request.offset;
            d["length"] = i.request.length;
            d["priority"] = i.request.priority;
            d["exact"] = i.request.exact;
            d["owner"] = i.request.owner;
            d["generation"] = i.request.generation;
            d["layer"] = i.request.layer;
            d["expert"] = i.request.expert;
            d["has_digest"] = i.request.has_digest;
            d["deadline_ns"] = i.request.deadline_ns;
            d["confidence"] = i.request.confidence;
            return d;
          },
          "ticket"_a)
      .def("counters", [](Engine& e) { return counters_dict(e.counters()); })
      .def("reset_counters", &Engine::reset_counters)
      .def(
          "memory",
          [](Engine& e) {
            hebrus::MemoryInfo mi = e.memory();
            nb::dict d;
            d["capacity"] = mi.capacity;
            d["allocated"] = mi.allocated;
            d["resident"] = mi.resident;
            d["pooled"] = mi.pooled;
            d["slots_in_use"] = mi.slots_in_use;
            d["pinned_slots"] = mi.pinned_slots;
            d["tickets"] = mi.tickets;
            d["inflight_reads"] = mi.inflight_reads;
            d["queued_reads"] = mi.queued_reads;
            d["arena_rows"] = mi.arena_rows;
            return d;
          })
      .def("close", &Engine::close, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "inject_fault",
          [](Engine& e, const std::string& kind, int count) {
            hebrus::Fault f;
            if (kind == "eio") {
              f = hebrus::Fault::kEIO;
            } else if (kind == "short_read") {
              f = hebrus::Fault::kShortRead;
            } else if (kind == "digest") {
              f = hebrus::Fault::kDigest;
            } else {
              throw hebrus::StreamError(
                  hebrus::ErrorCode::kBadRequest,
                  "kind: expected 'eio', 'short_read' or 'digest'");
            }
            e.inject_fault(f, count);
          },
          "kind"_a,
          "count"_a = 1)
      .def("enable_trace", &Engine::enable_trace, "capacity"_a)
      .def(
          "trace_events",
          [](Engine& e, bool clear) {
            uint64_t dropped = 0;
            auto ev = e.trace_events(clear, &dropped);
            return trace_dict(ev, dropped);
          },
          "clear"_a = false)
      .def("mark", &Engine::mark, "layer"_a, "tag"_a = 0)
      .def("hold", &Engine::hold, "on"_a)
      .def("set_read_delay_us", &Engine::set_read_delay_us, "us"_a);

  m.def(
      "sha256",
      [](const nb::bytes& b, bool portable) {
        hebrus::Digest d = hebrus::sha256(
            reinterpret_cast<const uint8_t*>(b.c_str()), b.size(), portable);
        return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      "data"_a,
      "portable"_a = false);
  m.def(
      "gather_rows",
      &hebrus::gather_rows,
      "engine"_a,
      "table"_a,
      "row_ids"_a,
      "rows_per_page"_a,
      "row_bytes"_a,
      "header_bytes"_a = 0,
      "owner"_a = 0,
      "generation"_a = 0,
      "layer"_a = -1);
  m.def(
      "create_arena",
      &hebrus::create_arena,
      "engine"_a,
      "part_bytes"_a,
      "rows"_a,
      "expand"_a = std::vector<uint8_t>{});
  m.def(
      "resolve_records",
      &hebrus::resolve_records,
      "engine"_a,
      "table"_a,
      "indices"_a,
      "owner"_a = 0,
      "generation"_a = 0,
      "layer"_a = -1);
  m.def(
      "release_after",
      &hebrus::release_after,
      "engine"_a,
      "value"_a,
      "lease"_a);
  m.def("sha256_backend", &hebrus::sha256_backend);
  m.def("backends", &hebrus::compiled_backends);
  // GPU-event streaming path (ops_metal.h): off unless turned on, which
  // hebrus_mlx does only for a machine profile where it passed.
  m.def("gpu_events_compiled", &hebrus::gpu_events_compiled);
  m.def("gpu_events_enabled", &hebrus::gpu_events_enabled);
  m.def("set_gpu_events", &hebrus::set_gpu_events, "on"_a);
  m.def("check_gpu_event_errors", &hebrus::check_gpu_event_errors);
  m.def(
      "mark_after",
      &hebrus::mark_after,
      "engine"_a,
      "value"_a,
      "layer"_a,
      "tag"_a = 0);
  // The engine trace's clock.
  m.def("trace_clock_ns", &hebrus::now_ns);
  m.def("load_tickets", &hebrus::load_tickets, "engine"_a, "tickets"_a);
  m.def(
      "gather_records",
      &hebrus::gather_records,
      "engine"_a,
      "table"_a,
      "indices"_a,
      "owner"_a = 0,
      "generation"_a = 0,
      "layer"_a = -1);
  m.def(
      "prefetch_records",
      &hebrus::prefetch_records,
      "engine"_a,
      "table"_a,
      "indices"_a,
      "priority"_a = 1,
      "confidence"_a = 1.0,
      "exact"_a = false,
      "owner"_a = 0,
      "generation"_a = 0,
      "layer"_a = -1);

  // Prefill sweep ring (sweep.h).
  nb::class_<hebrus::SweepRing>(m, "SweepRing")
      .def(
          nb::new_([](std::shared_ptr<Engine> engine, int table, const std::string& path,
                      std::vector<uint64_t> part_bytes, std::vector<uint8_t> expand,
                      uint32_t span, uint32_t slots, int threads) {
            return std::make_shared<hebrus::SweepRing>(
                std::move(engine), table, path, std::move(part_bytes),
                std::move(expand), span, slots, threads);
          }),
          "engine"_a, "table"_a, "path"_a, "part_bytes"_a, "expand"_a, "span"_a,
          "slots"_a = 2, "threads"_a = 4)
      .def("parts", &hebrus::SweepRing::parts)
      .def_prop_ro("bytes", &hebrus::SweepRing::bytes)
      .def("counters", [](const hebrus::SweepRing& r) {
        nb::dict d;
        d["sweeps"] = r.sweeps();
        d["read_bytes"] = r.read_bytes();
        d["wait_ns"] = r.wait_ns();
        return d;
      })
      .def("inject_digest_fault", &hebrus::SweepRing::inject_digest_fault, "count"_a = 1)
      .def("close", &hebrus::SweepRing::close);
  m.def("sweep_issue", &hebrus::sweep_issue, "ring"_a, "dep"_a, "slot"_a, "first"_a);
  m.def("sweep_wait", &hebrus::sweep_wait, "ring"_a, "value"_a, "slot"_a, "first"_a);
}
