// hebrus_mlx._ext's bindings, one registration function per component;
// module.cpp calls them in order. The module shares MLX's nanobind domain so
// mx.array crosses the boundary without copies.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "engine.h"

namespace hebrus::bind {

namespace nb = nanobind;

// error_codes() and the StreamError translator.
void register_errors(nb::module_& m);
// Engine: stores, record tables, tickets, counters, memory; backends().
nb::class_<Engine> register_engine(nb::module_& m);
// The engine's event trace: Engine.enable_trace/trace_events/mark and the
// mark_after graph op (trace.h, trace_ops.h).
void register_trace(nb::module_& m, nb::class_<Engine>& engine);
// Graph ops that wait on the engine (ops.h): gather, resolve, prefetch, ...
void register_ops(nb::module_& m);
// The prefill sweep ring (sweep.h).
void register_sweep(nb::module_& m);
// The GPU-event streaming switch (ops_metal.h).
void register_gpu_events(nb::module_& m);
// SHA-256 and XXH3-128 (sha256.h, xxh3.h); also the whole of
// hebrus_mlx._hash, the MLX-free module the artifact writers use.
void register_hash(nb::module_& m);

// The expected digest of a record from the `digest` (SHA-256, 32 bytes) and
// `fast_digest` (XXH3-128, 16 bytes) arguments; at most one may be given.
RecordCheck to_check(
    const std::optional<nb::bytes>& digest,
    const std::optional<nb::bytes>& fast_digest, const char* field);

} // namespace hebrus::bind
