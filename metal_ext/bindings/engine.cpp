#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <cstring>

#include "bindings.h"
#include "io_mtlio.h"
#include "ops.h"
#include "py_errors.h"

namespace hebrus::bind {

using namespace nb::literals;

namespace {

nb::dict counters_dict(const Counters& c) {
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
  for (auto [name, m] : {std::pair{"reads_by_store", &c.reads_by_store},
                         std::pair{"bytes_by_store", &c.bytes_by_store},
                         std::pair{"exposed_wait_ns_by_store", &c.exposed_wait_ns_by_store}}) {
    nb::dict by_store;
    for (auto& [store, n] : *m) {
      by_store[nb::int_(store)] = n;
    }
    d[name] = by_store;
  }
  d["latency_p50_ns"] = c.latency_p50_ns;
  d["latency_p95_ns"] = c.latency_p95_ns;
  d["latency_p99_ns"] = c.latency_p99_ns;
  d["latency_samples"] = c.latency_samples;
  return d;
}

nb::dict ticket_dict(const TicketInfo& i) {
  nb::dict d;
  static const char* states[] = {"pending", "ready", "failed"};
  static const char* kinds[] = {"hit", "joined", "miss"};
  d["state"] = states[int(i.state)];
  d["kind"] = kinds[int(i.kind)];
  d["error"] = error_name(i.error);
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
  d["has_digest"] = i.request.check.kind != Check::kNone;
  d["check"] = check_name(i.request.check.kind);
  d["deadline_ns"] = i.request.deadline_ns;
  d["confidence"] = i.request.confidence;
  return d;
}

nb::dict memory_dict(const MemoryInfo& mi) {
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
}

void check_size(const nb::bytes& b, size_t want, const char* field, const char* what) {
  if (b.size() != want) {
    throw StreamError(
        ErrorCode::kBadRequest,
        std::string(field) + ": " + what + " must be " + std::to_string(want) +
            " bytes, got " + std::to_string(b.size()));
  }
}

} // namespace

RecordCheck to_check(
    const std::optional<nb::bytes>& digest,
    const std::optional<nb::bytes>& fast_digest, const char* field) {
  RecordCheck c;
  if (digest && fast_digest) {
    throw StreamError(
        ErrorCode::kBadRequest,
        std::string(field) + ": give a SHA-256 digest or a fast (XXH3-128) digest, not both");
  }
  if (digest) {
    check_size(*digest, 32, field, "a SHA-256 digest");
    c.kind = Check::kSha256;
    std::memcpy(c.digest.data(), digest->c_str(), 32);
  } else if (fast_digest) {
    check_size(*fast_digest, 16, field, "an XXH3-128 digest");
    c.kind = Check::kXxh3;
    std::memcpy(c.digest.data(), fast_digest->c_str(), 16);
  }
  return c;
}

void register_errors(nb::module_& m) {
  register_stream_error_translator();
  // {code: name} of every engine error (engine.h HEBRUS_ERROR_CODES): the
  // Python classes are looked up by these names.
  m.def("error_codes", [] {
    nb::dict d;
#define HEBRUS_ERROR_ITEM(id, value, name) d[nb::int_(value)] = name;
    HEBRUS_ERROR_CODES(HEBRUS_ERROR_ITEM)
#undef HEBRUS_ERROR_ITEM
    return d;
  });
}

nb::class_<Engine> register_engine(nb::module_& m) {
  nb::class_<Engine> cls(m, "Engine");
  // Made by make_shared, never in place: every shared_ptr<Engine> the ops get
  // then shares this C++ owner (enable_shared_from_this), not a per-call one
  // whose deleter takes the GIL on an MLX stream thread (a clear_cache deadlock).
  cls.def(
         nb::new_([](int threads,
            uint64_t cache_bytes,
            bool direct,
            bool nocache,
            bool rdadvise,
            const std::string& policy,
            const std::string& backend) {
           return std::make_shared<Engine>(EngineOptions{
               .threads = threads, .cache_bytes = cache_bytes, .direct = direct, .nocache = nocache,
               .rdadvise = rdadvise, .policy = policy, .backend = backend,
               .allocate_slab = allocate_mlx_slab});
         }),
         "threads"_a = 4,
         "cache_bytes"_a = uint64_t(1) << 30,
         "direct"_a = true,
         "nocache"_a = false,
         "rdadvise"_a = false,
         "policy"_a = "lru",
         "backend"_a = "pread")
      .def_prop_ro("backend", [](Engine& e) { return e.options().backend; })
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
             std::optional<std::vector<nb::bytes>> fast_digests,
             int arena) {
            if (offsets.size() != lengths.size() ||
                (digests && digests->size() != offsets.size()) ||
                (fast_digests && fast_digests->size() != offsets.size())) {
              throw StreamError(
                  ErrorCode::kBadRequest,
                  "offsets/lengths/digests: must have equal lengths");
            }
            std::vector<TableRow> rows(offsets.size());
            for (size_t i = 0; i < rows.size(); ++i) {
              rows[i].offset = offsets[i];
              rows[i].length = lengths[i];
              rows[i].check = to_check(
                  digests ? std::optional<nb::bytes>((*digests)[i]) : std::nullopt,
                  fast_digests ? std::optional<nb::bytes>((*fast_digests)[i]) : std::nullopt,
                  fast_digests ? "fast_digests" : "digests");
            }
            return e.register_table(store, std::move(rows), arena);
          },
          "store"_a,
          "offsets"_a,
          "lengths"_a,
          "digests"_a = nb::none(),
          "fast_digests"_a = nb::none(),
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
             std::optional<nb::bytes> fast_digest,
             int arena) {
            Request r{
                .store = store, .offset = offset, .length = length, .priority = priority,
                .exact = exact, .owner = owner, .generation = generation, .layer = layer,
                .expert = expert, .deadline_ns = deadline_ns ? *deadline_ns : INT64_MAX,
                .confidence = confidence,
                .check = to_check(digest, fast_digest, fast_digest ? "fast_digest" : "digest"),
                .arena = arena};
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
          "fast_digest"_a = nb::none(),
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
      .def("set_staging", &Engine::set_staging, "arena"_a, "rows"_a)
      .def(
          "set_hint",
          [](Engine& e,
             int store,
             uint64_t offset,
             uint64_t length,
             double p_use,
             int arena,
             std::optional<nb::bytes> digest,
             std::optional<nb::bytes> fast_digest) {
            return e.set_hint(
                store, offset, length, p_use, arena,
                to_check(digest, fast_digest, fast_digest ? "fast_digest" : "digest"));
          },
          "store"_a,
          "offset"_a,
          "length"_a,
          "p_use"_a,
          "arena"_a = -1,
          "digest"_a = nb::none(),
          "fast_digest"_a = nb::none())
      .def("ticket_info", [](Engine& e, uint64_t t) { return ticket_dict(e.ticket_info(t)); },
           "ticket"_a)
      .def("counters", [](Engine& e) { return counters_dict(e.counters()); })
      .def("reset_counters", &Engine::reset_counters)
      .def("memory", [](Engine& e) { return memory_dict(e.memory()); })
      .def("close", &Engine::close, nb::call_guard<nb::gil_scoped_release>());
  m.def("backends", &compiled_backends);
  return cls;
}

} // namespace hebrus::bind
