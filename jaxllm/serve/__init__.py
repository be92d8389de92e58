"""jaxllm.serve: an OpenAI-compatible HTTP server with continuous batching (`python -m jaxllm.serve`).

  app.py        the HTTP layer (Starlette): endpoints, server-sent events, errors; no device code
  protocol.py   request bodies validated into jaxllm's terms, response and error shapes
  scheduler.py  the engine thread: a bounded queue, slot assignment with prefix reuse, the decode loop
  slots.py      the batched DecodeState of N slots and the compiled programs that prefill one slot
  metrics.py    counters and histograms as Prometheus text, the XLA compile counter
  cli.py        the command line

docs/server.md describes the API, the metrics and the slot design.
"""
