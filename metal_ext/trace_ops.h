// Graph-side markers for the engine trace (trace.h): an identity op that
// records a timestamp when the CPU stream reaches it, so per-layer compute
// spans can be drawn without a host sync (AFN-019).
#pragma once

#include <memory>

#include "engine.h"
#include "mlx/ops.h"

namespace hebrus {

namespace mx = mlx::core;

// `value` unchanged; when evaluated (after its producer), adds a mark event
// (layer, tag) to the engine trace. No cost beyond one branch if the trace
// is off.
mx::array mark_after(
    std::shared_ptr<Engine> engine, const mx::array& value, int layer, int tag);

} // namespace hebrus
