"""The real App over a scripted worker, on a free local port: server tests that need no model."""

import asyncio
import queue
import socket
import threading
import time
from contextlib import contextmanager


def scripted_worker(tok, emit):
    """A Worker stand-in: records each job's prompt IDs in `.seen`, then `emit(job)` answers it."""
    from hebrus_mlx.prompt_cache import PromptCache
    from hebrus_mlx.serve.worker import ServerDefaults

    class ScriptWorker:
        def __init__(self):
            self.tokenizer, self.defaults, self.context = tok, ServerDefaults(), 4096
            self.jobs, self.prompt_cache, self.model, self.busy = queue.Queue(), PromptCache(0), None, False
            self.seen = []
            threading.Thread(target=self._run, daemon=True).start()

        def _run(self):
            while (job := self.jobs.get()) is not None:
                self.seen.append(job.ids)
                emit(job)

        def cancel(self, job):
            job.cancel.set()

    return ScriptWorker()


@contextmanager
def serving(worker, name="scripted", **app_kwargs):
    """The port of an App over `worker` (App options: `app_kwargs`), served until the block ends
    (the worker and any prep process stop then)."""
    import uvicorn

    from hebrus_mlx.serve.app import App

    app = App(worker, name, **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app.app, log_level="warning", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        while not srv.started:
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        th.join(10)
        worker.jobs.put(None)
        if app.prep_process is not None:
            app.prep_process.stop()
            app.prep_process.join(10)


async def run_job(worker, ids, sampling, max_tokens, timeout=60):
    """(text, usage) of one request through a worker's queue, as the App submits it."""
    from hebrus_mlx.serve.worker import Job

    job = Job(ids, sampling, max_tokens, asyncio.get_running_loop(), asyncio.Queue())
    worker.jobs.put(job)
    return await job_text(job, timeout), job.usage


async def job_text(job, timeout=60):
    """The text of a queued job's events, up to its "done" (an error fails)."""
    text = ""
    while True:
        kind, value = await asyncio.wait_for(job.events.get(), timeout)
        if kind != "text":
            assert kind == "done", value
            return text
        text += value


def run_concurrently(fn, n, timeout):
    """`fn(i)` for i in range(n), each in a thread of its own, all started before any is awaited."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
