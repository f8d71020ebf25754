#include "trace_ops.h"
#include "ops_metal.h"

#include "mlx/backend/cpu/encoder.h"

namespace hebrus {

mx::array mark_after(
    std::shared_ptr<Engine> engine, const mx::array& value, int layer,
    int tag) {
  return mx::array(
      value.shape(),
      value.dtype(),
      std::make_shared<MarkAfter>(
          op_stream(), std::move(engine), layer, tag),
      {value});
}

void MarkAfter::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.copy_shared_buffer(inputs[0]);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  // The task runs in stream order, i.e. once the producer's task has run.
  enc.dispatch([engine = engine_, layer = layer_, tag = tag_, v = inputs[0]]() {
    engine->mark(layer, tag);
  });
}

void MarkAfter::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  // The mark is taken when the host sees the GPU past the value; the GPU
  // never waits for it (ops_metal.h).
  out.copy_shared_buffer(inputs[0]);
  eval_gpu_via_io(
      stream(), inputs, {},
      [engine = engine_, layer = layer_, tag = tag_]() { engine->mark(layer, tag); },
      false);
}

} // namespace hebrus
