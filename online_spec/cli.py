"""The `online-spec` command line.

Each subcommand lives with the component it drives and exposes `add_arguments(parser)` and
`run(args) -> int`; this module only routes. `online-spec bench NAME` routes to benchmarks the
same way. Run `online-spec --help` for the list.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help); modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-model": ("online_spec.target", "convert the SmolLM2 GGUF to a cached bf16 model"),
    "serve": ("serving.server_app", "serve the model over HTTP (OpenAI API, /generate, /metrics)"),
    "pretrain": ("trainer.pretrain", "build records, distill a head offline, evaluate, write a checkpoint"),
    "controller": ("online_spec.controller.replay", "adaptive step controller tools"),
    "drift": ("online_spec.drift_replay", "drift monitor tools: replay recorded rounds through the detector"),
    "swap": ("serving.swap_cli", "swap a head checkpoint into a running server (control endpoint)"),
    "rollback": ("serving.swap_cli", "roll a running server back to its previous head"),
    "status": ("serving.swap_cli", "a running server's head version, K per slot, acceptance, swaps"),
    "train": ("trainer.train_cli", "the sidecar trainer daemon: learn from the stream, publish heads"),
    "demo": ("bench.demo", "server + trainer + drifting traffic, live, with a report"),
}

BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("bench.engine", "engine throughput, verify/draft cost ratios, lossless check"),
    "server": ("bench.server", "64 concurrent streaming clients: TTFT, TPOT, tokens/s"),
    "distill": ("bench.distill", "distillation throughput, held-out and real accept lengths, speedup"),
    "collector": ("bench.collector", "capture stream throughput, drops and serving overhead"),
    "swap": ("bench.swap", "live head swaps under load: stall, failures, lossless"),
    "drift-alerts": ("bench.drift_alerts", "stationary ShareGPT then HumanEval: false alerts, rounds to alert, W&B read-back"),
    "cuts": ("bench.cuts", "the cost policy's in-round early stop and verify cut on vs off: do they pay here?"),
    "controller": ("bench.controller", "static K vs EMA vs cost-model policy, stationary and phase-change"),
    "e2e": ("bench.e2e", "plain vs static head vs SGLang adaptive vs online-spec on a drifting trace"),
    "adapt": ("bench.adapt", "ShareGPT -> HumanEval shift: served tokens until the online head nears an in-domain head"),
    "ranks": ("bench.ranks", "the trainer's steps/s and rows/s from 1 to N data-parallel ranks (DeepSpeed)"),
    "soak": ("bench.soak", "the real server for a long run: normal + hostile clients, swaps, trainer restarts; RSS, /metrics, lossless"),
}


MAX_USAGE_OPTIONS = 8  # a command with more flags shows "[options]" in its usage line; --help lists them


def _short_usage(parser: argparse.ArgumentParser) -> None:
    """Usage as "PROG [-h] [options] POSITIONALS" when the flags would fill screens of usage."""
    actions = parser._actions  # argparse exposes no public list of a parser's arguments
    if sum(bool(a.option_strings) for a in actions) > MAX_USAGE_OPTIONS:
        positionals = [a.metavar or a.dest for a in actions if not a.option_strings
                       and not isinstance(a, argparse._SubParsersAction)]
        parser.usage = " ".join(["%(prog)s [-h] [options]", *map(str, positionals)])


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="online-spec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
            _short_usage(p)
            p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="benchmarks writing JSON", description="benchmarks writing JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_text) in BENCHES.items():
        p = bsub.add_parser(name, help=help_text, description=help_text)
        if name == wanted_bench:
            importlib.import_module(module).add_arguments(p)
            _short_usage(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
