"""`online-spec train`: build the daemon from flags, run it until SIGTERM, close it.

    online-spec train --run-dir runs/trainer --capture-endpoint ipc:///tmp/online-spec/capture.sock \
        --control-run-dir runs/serve [--init-head DIR] [--wandb-mode offline]

Across N data-parallel ranks (`trainer/ranks.py`), started from the same one command
(`trainer/launch.py`; under torchrun each process is one rank):

    online-spec train --ranks 2 --device cuda --trainer-devices 1,2 --run-dir runs/trainer ...

Flags come from `DaemonConfig`, `GateConfig`, `DistillConfig` (prefix `--distill-`),
`LossConfig` (`--loss-`), `ReplayConfig` (`--replay-`), `SubscriberConfig` (`--capture-`),
`StarvationConfig` (`--starvation-`), `SeedConfig` (`--seed-`) and `RankConfig` (`--ranks`,
`--trainer-devices`, ...).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from collector.replay import ReplayConfig
from collector.subscriber import SubscriberConfig
from online_spec.config import add_config_args, config_from_args, config_to_dict
from online_spec.target import load_target
from online_spec.wandb_run import init_wandb
from serving.control import ControlClient
from online_spec.starvation import StarvationConfig
from trainer.daemon import DaemonConfig, TrainerDaemon, install_signal_handlers
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.launch import command_line, launch, world_from_env
from trainer.loss import LossConfig
from trainer.ranks import RankConfig, RankLoop, RankZeroDaemon, follower_distiller, rank_device
from trainer.seeds import SeedConfig
from trainer.starved_share import StarvedShare
from trainer.warm_up import warm_up

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, DaemonConfig)
    add_config_args(parser, GateConfig, prefix="gate_")
    add_config_args(parser, DistillConfig, prefix="distill_")
    add_config_args(parser, LossConfig, prefix="loss_")
    add_config_args(parser, ReplayConfig, prefix="replay_")
    add_config_args(parser, SubscriberConfig, prefix="capture_")
    add_config_args(parser, RankConfig)
    add_config_args(parser, StarvationConfig, prefix="starvation_")
    add_config_args(parser, SeedConfig, prefix="seed_")
    proc = parser.add_argument_group("process (where it connects, runs and logs)")
    proc.add_argument("--control-run-dir", type=Path, default=None, metavar="DIR",
                      help="the server's run directory (control endpoint + token); omit: train, never publish")
    proc.add_argument("--device", default="cpu", metavar="DEV", help="torch device of target and trainer (cuda: NCCL)")
    proc.add_argument("--target", default="", metavar="DIR",
                      help="the target: a Hugging Face model directory; empty = the packaged SmolLM2")
    proc.add_argument("--threads", type=int, default=1, metavar="N", help="torch CPU threads of the trainer")
    proc.add_argument("--nice", type=int, default=0, metavar="N",
                      help="raise its niceness by N (0-19): the server gets a contended core first")
    proc.add_argument("--nice-starved", type=int, default=-1, metavar="N",
                      help="while starved: +N niceness, not --nice (-1: never)")
    proc.add_argument("--max-steps", type=int, default=None, metavar="N", help="stop after N optimizer steps")
    proc.add_argument("--max-seconds", type=float, default=None, metavar="S", help="stop after S seconds")
    proc.add_argument("--wandb-mode", default="offline", metavar="MODE", help="offline (default), online or disabled")
    proc.add_argument("--wandb-project", default="online-spec", metavar="NAME", help="W&B project")
    proc.add_argument("--wandb-entity", default=None, metavar="NAME", help="W&B entity")


def build_daemon(args: argparse.Namespace, daemon_cls: type[TrainerDaemon] = TrainerDaemon,
                 target=None) -> TrainerDaemon:
    cfg = config_from_args(DaemonConfig, args)
    run_dir = Path(cfg.run_dir)
    replay = config_from_args(ReplayConfig, args, prefix="replay_",
                              **({} if hasattr(args, "replay_root") else {"root": str(run_dir / "replay")}))
    publisher = None
    if args.control_run_dir is not None:
        publisher = ControlClient.from_run_dir(args.control_run_dir)
    run = None
    if args.wandb_mode != "disabled":
        run = init_wandb(args.wandb_project, args.wandb_entity, run_dir / "wandb", mode=args.wandb_mode,
                         config={"daemon": config_to_dict(cfg)}, name="trainer")
    # the capture stream's default socket is the server's: in its run directory (--control-run-dir)
    sub_default = ({"run_dir": str(args.control_run_dir)} if args.control_run_dir is not None
                   and not hasattr(args, "capture_endpoint") and not hasattr(args, "capture_run_dir") else {})
    subscriber = config_from_args(SubscriberConfig, args, prefix="capture_", **sub_default)
    target = target if target is not None else load_target(getattr(args, "target", "") or None,
                                                           device=getattr(args, "device", "cpu"))
    daemon = daemon_cls(cfg, target, publisher, subscriber, replay, distill_config(args),
                        config_from_args(LossConfig, args, prefix="loss_"),
                        config_from_args(GateConfig, args, prefix="gate_"), wandb_run=run,
                        starvation_cfg=config_from_args(StarvationConfig, args, prefix="starvation_"),
                        seed_cfg=config_from_args(SeedConfig, args, prefix="seed_"))
    if getattr(args, "nice_starved", -1) >= 0:
        daemon.starvation_watch.share = StarvedShare(args.nice, args.nice_starved)
    return daemon


def distill_config(args: argparse.Namespace) -> DistillConfig:
    """The daemon's DistillConfig: a constant schedule unless --distill-schedule says otherwise."""
    return config_from_args(DistillConfig, args, prefix="distill_",
                            **({} if hasattr(args, "distill_schedule") else {"schedule": "constant"}))


def share_machine(args: argparse.Namespace) -> None:
    """The trainer process's share of the machine: its torch threads and its niceness."""
    if not 0 <= args.nice <= 19:
        raise SystemExit(f"--nice: must be in 0..19, got {args.nice}")
    if not -1 <= getattr(args, "nice_starved", -1) <= 19:
        raise SystemExit(f"--nice-starved: must be in -1..19, got {args.nice_starved}")
    torch.set_num_threads(args.threads)
    if args.nice:
        log.info("niceness %d", os.nice(args.nice))


def run(args: argparse.Namespace) -> int:
    ranks = config_from_args(RankConfig, args)
    rank, world = world_from_env()
    if world > 1 or (ranks.ranks == 1 and ranks.rank_journal):  # a rank; one alone when journaled
        return run_rank(args, ranks, rank, world)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    if ranks.ranks > 1:  # the launcher: this command again, once per rank
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return launch(command_line(parser, args), ranks.ranks, Path(config_from_args(DaemonConfig, args).run_dir),
                      ranks.rank_stop_grace_s)
    share_machine(args)
    daemon = build_daemon(args)
    install_signal_handlers(daemon)
    daemon.starvation_watch.follow_stops()
    log.info("warmed up: %s", warm_up(daemon))  # the first step's one-off costs before traffic (trainer/warm_up.py)
    try:
        summary = daemon.run(max_steps=args.max_steps, max_seconds=args.max_seconds)
        log.info("stopped: %s", {k: summary[k] for k in ("step", "live_version", "swaps", "rollbacks")})
    finally:
        if daemon.wandb is not None:
            daemon.wandb.finish()
    return 0


def run_rank(args: argparse.Namespace, ranks: RankConfig, rank: int, world: int) -> int:
    """One rank of a data-parallel trainer (`trainer/ranks.py`): rank 0 the daemon, the others a
    Distiller each; exits 0 when the ranks agreed to stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer[rank {rank}] %(message)s")
    if ranks.ranks != world:
        raise SystemExit(f"--ranks {ranks.ranks}, but this process was started as one of {world} ranks")
    share_machine(args)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(ranks, args.device, local_rank)
    target = load_target(args.target or None, device=device)
    daemon = None
    try:
        if rank == 0:
            daemon = build_daemon(args, RankZeroDaemon, target=target)
            distiller, daemon_cfg = daemon.distiller, daemon.cfg
        else:
            daemon_cfg = config_from_args(DaemonConfig, args)
            distiller = follower_distiller(daemon_cfg, target, distill_config(args),
                                           config_from_args(LossConfig, args, prefix="loss_"))
        loop = RankLoop(ranks, distiller, daemon, daemon_cfg)
        install_signal_handlers(loop)
        if daemon is not None:
            daemon.starvation_watch.follow_stops()
        summary = loop.run(max_steps=args.max_steps, max_seconds=args.max_seconds)
        log.info("stopped: %s", {k: summary[k] for k in ("step", "dropped_steps", "live_version", "swaps")
                                 if k in summary})
    finally:
        if daemon is not None and daemon.wandb is not None:
            daemon.wandb.finish()
    return 0
