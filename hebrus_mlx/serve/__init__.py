"""The OpenAI- and Anthropic-compatible HTTP server behind `hebrus-mlx server` (the verb's command
line is hebrus_mlx/commands/server.py).

- app: the routes (App), request bodies read, checked, rendered and tokenized off the event loop;
- worker: the thread that owns the model and runs the queued jobs, one at a time or batched;
- sampling: a request's sampling fields as the worker's Sampling, its grammar processor;
- output: the model's text as the APIs' parts (stop sequences, think blocks, tool calls);
- api_fields, openai_api, responses_api, anthropic_api: each API's fields and response shapes;
- prep_process: big requests rendered and tokenized in a child process.
"""
