"""The product's typed errors: one base class for every failure caused by input (an artifact's
bytes, a config, a tokenizer, a prompt, a flag) rather than by a bug.

Each error names the field that failed (`field`, a dotted name such as ``ple.rows`` or
``--max-tokens``) and says why (`message`); the CLI prints exactly ``field: message`` as one line
and exits 2. Anything that is not a HebrusError is a bug and propagates with its traceback.
No imports: CPU-only admission (AFN-004) uses this module.
"""


class HebrusError(Exception):
    """``HebrusError(field, message)``; ``Subclass(message)`` takes the class's `default_field`."""

    default_field = "input"

    def __init__(self, field: str, message: str = None):
        if message is None:
            field, message = self.default_field, field
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        # Rebuilt as it is, whatever a subclass's __init__ takes: the server's prep process
        # sends its typed errors back pickled.
        return (_rebuild, (self.__class__, self.args, self.__dict__))


def _rebuild(cls, args, state):
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class UsageError(HebrusError, ValueError):
    """A bad command-line or API argument; `field` names the flag or parameter."""

    default_field = "arguments"


class NonFiniteError(HebrusError, RuntimeError):
    """A step computed NaN or infinity where a finite value is published (AFN-010); `field` names
    what (``logits``). The sequence was rolled back to before the step."""

    default_field = "logits"


class GenerationError(HebrusError, ValueError):
    """Bad generation input (empty prompt, prompt beyond the context, bad arguments)."""

    default_field = "prompt"


# Why a quantized KV cache is refused, in mlx-lm's flags (--kv-bits, ...) and generate_step's keywords
# (kv_bits, ...) alike.
KV_QUANT_UNSUPPORTED = (
    "a quantized KV cache is not supported (QSA's indexer selects keys by exact scores; "
    "quantizing them would change which keys it picks)"
)
