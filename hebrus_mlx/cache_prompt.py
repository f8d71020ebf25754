"""Prompts cached in a file (the library of `hebrus-mlx cache-prompt`, commands/cache_prompt.py):
prefill a prompt once and save the sequence state, like `mlx_lm.cache_prompt`; `hebrus-mlx
generate --prompt-cache-file FILE --prompt TEXT` then continues from it without prefilling it again.

As in mlx-lm, with a chat template the cached prompt is the start of a user message and the
generate prompt its continuation: the file holds the template's tokens up to the end of the cached
text (the message left open), and generate appends the continuation's text and the tokens the
template writes after it (end of turn, generation prompt). Both sides are tokenized by provenance
(AFN-006): the caller's text stays DATA. With --ignore-chat-template both are plain text.

The file is mlx-lm's prompt-cache layout bound to the artifact (prompt_cache.py): another model,
dtype or layer layout is refused with the field named. Its metadata also records the token IDs and
whether the chat template was used (a continuation in the other mode is refused). An existing file
is replaced only with --overwrite, a symlink never.
"""

from .errors import UsageError
from .prompt_cache import PromptCacheFileError, load_prompt_cache
from .text.chat_template import DATA

TEMPLATE_KEY = "chat_template"  # "1": the cached prompt opens a user message; "0": plain text


def _last_data(pieces, text: str, where: str) -> int:
    """The index of the last DATA piece, which must be the user's `text` (as the template wrote it)."""
    k = max((i for i, (kind, _) in enumerate(pieces) if kind == DATA), default=None)
    if k is None or pieces[k][1].strip() != text.strip():
        raise UsageError(
            where,
            "the chat template does not end the user message with its text, so it cannot be "
            "continued; use --ignore-chat-template",
        )
    return k


def _messages(text: str, system):
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


def cached_prompt_ids(tok, prompt: str, system=None, chat_template: bool = True):
    """The IDs `cache-prompt` prefills: the template's tokens through the end of `prompt` (the user
    message left open), or the plain text."""
    if not chat_template:
        return tok.encode(prompt)
    pieces = tok.render_chat(_messages(prompt, system), add_generation_prompt=False).pieces()
    return tok.encode_segments(pieces[: _last_data(pieces, prompt, "--prompt") + 1])


def continuation_ids(tok, prompt: str, chat_template: bool = True):
    """The IDs generate appends to a cached prompt: `prompt`'s text, then what the template writes
    after a user message (end of turn, generation prompt)."""
    if not chat_template:
        return tok.encode(prompt, add_special_tokens=False)
    pieces = tok.render_chat(_messages(prompt, None), add_generation_prompt=True).pieces()
    return tok.encode_segments(pieces[_last_data(pieces, prompt, "--prompt") :])


def load_for_generate(path, model, tok, prompt: str, ignore_chat_template: bool):
    """(cache, IDs to feed after it) for `generate --prompt-cache-file`."""
    try:
        cache, meta = load_prompt_cache(path, model, return_metadata=True)
    except PromptCacheFileError as e:
        raise UsageError("--prompt-cache-file", f"{e.field}: {e.message}") from None
    templated = meta.get(TEMPLATE_KEY) == "1"
    if templated and (ignore_chat_template or tok.chat_template is None):
        raise UsageError("--ignore-chat-template", "the cache file was made with the chat template")
    if not templated and not ignore_chat_template and tok.chat_template is not None:
        raise UsageError("--prompt-cache-file", "the file was made with --ignore-chat-template; pass it here too")
    return cache, continuation_ids(tok, prompt, templated)
