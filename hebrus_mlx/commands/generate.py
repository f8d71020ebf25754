"""`hebrus-mlx generate` (like mlx_lm.generate): the verb's command line over the library in
hebrus_mlx/generate.py; the flags it shares with chat and server are verb_flags.py's."""

import sys

import mlx.core as mx

from ..errors import UsageError
from ..generate import context_limit, generate
from ..pipeline import launched as pipeline_launched
from ..sample_utils import make_sampler
from .cli_args import read_prompt
from .verb_flags import build_parser, check_args, draft_kwargs, load_from_args, sampling_from_args, trace_kwargs


def main(argv=None) -> int:
    """`hebrus-mlx generate`; typed errors propagate to `cli.run` (one line, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args)
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise UsageError("--prompt", "the prompt is empty")
    if args.seed is not None:
        mx.random.seed(args.seed)
    if pipeline_launched():
        from ..loading.hub import resolve_model
        from .verb_flags import load_or_serve

        pipe, model, tokenizer = load_or_serve(resolve_model(args.model), args)
        if pipe is None:
            return 0  # a serving rank: rank 0 prints
    else:
        model, tokenizer = load_from_args(args)
    extra = {}
    if args.prompt_cache_file is not None:
        from ..cache_prompt import load_for_generate

        if args.system_prompt is not None:
            raise UsageError(
                "--system-prompt", "with --prompt-cache-file the system prompt is in the file (give it to cache-prompt)"
            )
        extra["prompt_cache"], ids = load_for_generate(
            args.prompt_cache_file, model, tokenizer, prompt, args.ignore_chat_template
        )
        limit = context_limit(model)
        held = extra["prompt_cache"].offset
        if limit is not None and held + len(ids) + args.max_tokens > limit:
            raise UsageError(
                "--max-tokens",
                f"{held} cached + {len(ids)} prompt + {args.max_tokens} tokens exceed the model context {limit}",
            )
    elif args.ignore_chat_template or tokenizer.chat_template is None:
        ids = tokenizer.encode(prompt)
    else:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    sampler = make_sampler(
        **sampling_from_args(args),
        # as mlx_lm.generate: XTC never excludes a newline or a stop token
        xtc_special_tokens=tokenizer.encode("\n") + sorted(tokenizer.stop_token_ids),
    )
    text = generate(
        model,
        tokenizer,
        ids,
        verbose=args.verbose,
        max_tokens=args.max_tokens,
        sampler=sampler,
        prefill_step_size=args.prefill_step_size,
        **trace_kwargs(args),
        **draft_kwargs(args),
        **extra,
    )
    if not args.verbose:
        print(text, flush=True)
    if pipeline_launched():
        from ..pipeline.ranks import finish

        finish(model, verbose=args.verbose)  # last: the launcher ends rank 0 once a peer exits
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("generate", main))
