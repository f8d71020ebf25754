"""Loading must not hold two copies of the float weights the speed pass re-stores
(models/optimize.py: [in, out] copies, joined projections): the dict of loaded arrays used to keep
every original alive until load returned, a second copy at the load's peak (2.6 GiB at the real
geometry, docs/FULL_SCALE.md), left behind as freed heap in RSS."""

import mlx.core as mx
import mlx.nn as nn

from hebrus_mlx.loader import DEMO_DIR
from hebrus_mlx.loading.build_model import load_artifact_model


def _float_linear_bytes(model):
    return sum(
        m.weight.nbytes
        for _, m in model.named_modules()
        if type(m) is nn.Linear and mx.issubdtype(m.weight.dtype, mx.floating)
    )


def test_the_load_peak_holds_one_copy_of_the_restored_float_weights():
    mx.eval(mx.zeros(1))  # anything earlier in this process is settled before the peak is reset
    mx.reset_peak_memory()
    model = load_artifact_model(str(DEMO_DIR))
    above = mx.get_peak_memory() - mx.get_active_memory()
    restored = _float_linear_bytes(model)
    assert restored > 0
    # Before: the peak sat a whole copy of them (and more) above what the model holds.
    assert above < restored / 2, (above, restored)
