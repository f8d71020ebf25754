#include "trace_ops.h"
#include "ops.h"
#include "ops_metal.h"

namespace hebrus {

mx::array mark_after(
    std::shared_ptr<Engine> engine, const mx::array& value, int layer,
    int tag) {
  // A pass-through op: the task runs in stream order, i.e. once the
  // producer's task has run (on the GPU path: once the host sees the GPU past
  // the value; the GPU never waits for it, ops_metal.h).
  return mx::array(
      value.shape(),
      value.dtype(),
      std::make_shared<HostTaskPrimitive>(
          op_stream(), "HebrusMarkAfter", HostTaskPrimitive::Output::kPassThrough,
          [engine = std::move(engine), layer, tag](const HostTaskPrimitive::Arrays&,
                                                   HostTaskPrimitive::Arrays&) {
            return [engine, layer, tag]() { engine->mark(layer, tag); };
          }),
      {value});
}

} // namespace hebrus
