"""Serving: the embedded engine and the server around it (layer 3; imports `online_spec`, `collector`).

- `engine`       `Engine.step`: one speculative round (draft K -> verify once -> accept -> commit ->
                 capture), continuous batching over KV-cache slots; `requests` its inputs and
                 outputs; `head_swap` installs a new head between rounds; `cuda_graphs` on a GPU
                 (`cuda_prefill`: prompts as chunk graph replays), captured at server start
- `calibrate`    the engine's own round times -> the cost policy's round-time model
- `server`       `SpecServer`: engine thread (`server_loop`), metrics, drift monitor
                 (`server_drift`), control endpoint; `server_app` its HTTP face and `online-spec serve`
                 (`api` request schemas, `server_detok` incremental detokenization)
- `control`      the control endpoint (swap, rollback, info, set adaptive config; token-checked);
                 `swap` validates and loads a head checkpoint; `swap_cli` `online-spec swap|rollback|status`
- `head_bank`    per traffic tag, the head that drafted best on it; swapped back in when the tag returns
- `sglang_*`     the same loop on an SGLang server: plugin, capture hook, adaptive policy, swap client

Where a token goes: `Engine.step` verifies it and commits it; the round's `CaptureRecord`
(online_spec/capture.py) goes to the capture publisher (collector/publisher.py) and on to the
trainer; a head the trainer publishes comes back through `control` -> `swap` -> `Engine.swap_head`
and drafts the next round. docs/architecture.md walks the whole path.
"""
