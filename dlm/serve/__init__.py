"""`dlm serve`: an OpenAI-compatible HTTP server over the sampler contract, and the playground page.

    engine.py    the models and how requests run on them (no web framework): one thread per request for
                 the diffusion and speculative samplers; for AR, one batching thread per model that runs
                 every active request's next token in one forward (continuous batching)
    protocol.py  OpenAI request parsing and validation, error objects, response and chunk bodies
    app.py       the FastAPI app: routes, admission (concurrency, queue, 429), auth, body cap, SSE
    loadtest.py  `python -m dlm.serve.loadtest`: throughput and latency at several concurrencies
    static/      the playground: one page of plain HTML/JS/CSS, no CDN

FastAPI and uvicorn (the `serve` extra) are imported by app.py only; nothing else in dlm imports it.
docs/serve.md documents the endpoints, the extra fields, the chat template and the batching.
"""
