"""Everything that measures or demonstrates online-spec; the product packages never import it.

The top layer of the house: it drives the engine (`serving`), the stream (`collector`) and the
trainer (`trainer`) from outside, the way an operator would.

- `online-spec bench NAME` (each module: `add_arguments(parser)`, `run(args) -> int`, a JSON report)
  - `engine`        engine throughput, verify/draft cost ratios, lossless check
  - `server`        concurrent streaming clients: TTFT, TPOT, tokens/s
  - `swap`          live head swaps under load: stall, failures, lossless
  - `drift_alerts`  stationary chat then code: false alerts, rounds to alert, W&B read-back
  - `collector`     capture stream throughput, drops, serving overhead
  - `distill`       distillation throughput, held-out and real accept lengths
  - `controller`    static K vs SGLang's EMA policy vs the cost policy
  - `e2e`           plain vs static head vs SGLang adaptive vs online-spec on a drifting trace
                    (`e2e_figures`: its return and ceiling figures, `ceiling_capture`)
  - `adapt`         a chat -> code shift: served tokens until the online head nears an in-domain head
- the demo's harness: `trace` (drifting traces of real ShareGPT / HumanEval text), `traffic`
  (streaming HTTP clients replaying a trace; `sse_event`, every client's reader of streamed lines), `session` (server + trainer + traffic in one run),
  `report` (summary, figures, plots), `heads` (which head a `--head` value names), `demo`
  (`online-spec demo`), `demo_trainer` (the trainer child process of a session)
- shared: `common` (machine description, timing, the JSON report writer, `--quick` flags),
  `lossless` (references the lossless checks compare against)
- `results/`: the raw JSON behind docs/results.md
"""
