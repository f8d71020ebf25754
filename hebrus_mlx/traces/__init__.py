"""Route traces (issue 11, AFN-021): capture what the native router chose during real decoding,
replay it as prefill to prove the labels, export a dataset for external trainers, and measure
history/router-reuse controls and an expert-cache simulator on it.

The native router is never changed by any of this: traces are read-only observations.
Token IDs in a trace are sensitive data (they are usually reversible to text).
"""

from .schema import SCHEMA_VERSION, Identity, TraceError

__all__ = ["SCHEMA_VERSION", "Identity", "TraceError"]
