"""What the tests share that is not a fixture, imported as `support.<module>` (pyproject's
pytest `pythonpath` puts tests/ on sys.path; no test imports conftest):

- tiny_model: a tiny random model folder and its byte-level BPE tokenizer;
- servers: `ServerThread` (a real replica, optionally behind Envoy, in this process) and
  `tiny_settings`;
- serve_process: `textgen serve` (or the launcher) as a subprocess;
- replica_processes: replica and front-proxy subprocesses for the multi-replica tests;
- http_client: raw HTTP, SSE and TGI's response schemas for the HTTP faces;
- lora_adapters, quantized_checkpoints: adapters and pre-quantized checkpoints made in
  the test;
- tiers: the `server` tier (`server_fixture`), and the `gpu` skip.
"""
