"""`online-spec swap | rollback | status`: drive a running server's control endpoint.

In: the run directory of `online-spec serve` (its control.endpoint and control.token files), or
`--endpoint` and `--token-file`. Out: the server's reply, as a short summary (or `--json`);
exit status 1 with the server's reason when it refuses.

    online-spec swap runs/heads/v3 [--run-dir runs/serve] [--version 3] [--digest SHA256]
    online-spec swap runs/heads/v3 --sglang --server http://127.0.0.1:30000   (an SGLang server)
    online-spec rollback [--run-dir runs/serve]
    online-spec status [--run-dir runs/serve] [--json]

The embedded server's commands need neither torch nor the model (serving/control_client.py):
they answer in a fraction of a second. `--sglang` reads the checkpoint here (torch), so it
imports the SGLang client only when asked.
"""

from __future__ import annotations

import argparse
import json
import sys

from serving.control_client import ControlClient, ControlError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    command = parser.prog.split()[-1]  # one module serves the three commands
    if command == "swap":
        parser.add_argument("dir", help="head checkpoint directory (SGLang layout, under the server's allowed roots)")
        parser.add_argument("--version", type=int, default=None, help="version to install as (default: its metadata)")
        parser.add_argument("--digest", default=None, help="expected sha256 of model.safetensors")
        parser.add_argument("--sglang", action="store_true",
                            help="the server is SGLang: push the head through its weight-update endpoints")
        parser.add_argument("--server", default=None, help="SGLang server URL, http://HOST:PORT (with --sglang)")
        parser.add_argument("--live-head", default=None,
                            help="with --sglang: the head directory the SGLang server started with (its draft "
                                 "vocabulary map stays live there); default: its speculative_draft_model_path")
    parser.add_argument("--run-dir", default="runs/serve", help="the server's run directory (default: runs/serve)")
    parser.add_argument("--endpoint", default=None, help="control endpoint (default: RUN_DIR/control.endpoint)")
    parser.add_argument("--token-file", default=None, help="control token file (default: RUN_DIR/control.token)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the reply (default: 60)")
    parser.add_argument("--json", action="store_true", help="print the whole reply as JSON")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "sglang", False):
        return run_sglang(args)
    try:
        client = ControlClient.from_run_dir(args.run_dir, args.endpoint, args.token_file, args.timeout)
    except OSError as e:
        print(f"error: cannot read the control endpoint or token ({e})", file=sys.stderr)
        return 1
    try:
        if args.command == "swap":
            result = client.swap_dir(args.dir, args.version, args.digest)
        elif args.command == "rollback":
            result = client.rollback()
        else:
            result = client.info()
    except ControlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str) if args.json else summarize(args.command, result))
    return 0


def run_sglang(args: argparse.Namespace) -> int:
    """`swap --sglang --server URL DIR`: SGLang's own `/update_weights_from_tensor` path (contract 4)."""
    import httpx  # only this command talks HTTP
    from serving.sglang_client import SglangSwapError, push_head_to_sglang  # reads the checkpoint: torch

    if not args.server:
        print("error: --sglang needs --server http://HOST:PORT", file=sys.stderr)
        return 1
    try:
        result = push_head_to_sglang(args.server, args.dir, timeout=args.timeout, live_head=args.live_head,
                                     weight_version=None if args.version is None else str(args.version))
    except (SglangSwapError, httpx.HTTPError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str) if args.json else
          f"pushed version {result.get('version')} to {args.server}: {result.get('message', '')}")
    return 0


def summarize(command: str, r: dict) -> str:
    if command in ("swap", "rollback"):
        what = "rolled back to" if r.get("rollback") else "swapped in"
        return (f"{what} version {r['version']} (previous {r['previous_version']}), landed={r['landed']}, "
                f"prepare {1000 * r['prepare_s']:.1f} ms, switch {1000 * r['land_s']:.1f} ms")
    st = (r.get("internal_states") or [{}])[0]
    ctl = r.get("control") or {}
    prev = ctl.get("previous") or {}

    def fmt(x):
        return "-" if x is None else f"{x:.3f}"
    return "\n".join([
        f"head version      {r.get('head_version')}  (previous {prev.get('version', '-')})",
        f"K per slot        {st.get('speculative_num_steps_per_slot') or st.get('speculative_num_steps_per_batch_size')}",
        f"accept length     {fmt(st.get('avg_spec_accept_length'))} recent, "
        f"{fmt(st.get('avg_spec_accept_length_lifetime'))} lifetime (bonus included)",
        f"requests          {r.get('running_requests')} running, {r.get('waiting_requests')} waiting",
        f"swaps             {ctl.get('swaps')} applied, {ctl.get('rollbacks')} rollbacks, {ctl.get('refused')} refused",
        f"control requests  {ctl.get('requests')} ({ctl.get('refused_requests')} refused for the token)",
    ])
