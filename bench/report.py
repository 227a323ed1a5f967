"""Figures and plots of serving sessions (`session.SessionResult`): per phase, over time, adaptation.

In: session results (requests, rounds, swaps, alerts). Out: plain dicts (JSON-ready) and PNGs.
Conventions: `accept_len` = drafts accepted per request per verify round, bonus excluded (the
project's); `accept_length` = tokens committed per request per verify round, bonus included
(SGLang's). Tokens/s of a phase = completion tokens of its requests / wall time from its
first submission to its last token. TPOT = (last token - first token) / (tokens - 1) per request.

    figs = session_figures(result)            # {"overall": {...}, "phases": {...}, "timeline": {...}, ...}
    plot_session(result, figs, "out/")        # accept_len_tokens_per_s.png, k_per_slot.png
    write_rounds(result, "out/rounds.jsonl.gz")  # every round, for `online-spec drift replay --trace`
"""

from __future__ import annotations

import math
from pathlib import Path

from bench.session import SessionResult
from bench.traffic import CANCELLED
from online_spec.controller.replay import TraceRecorder


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))
    return xs[i]


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def request_phases(result: SessionResult) -> dict[str, str]:
    return {r.request_id: r.phase for r in result.requests if r.request_id}


def phase_order(result: SessionResult) -> list[str]:
    out: list[str] = []
    for r in result.requests:
        if not out or out[-1] != r.phase:
            out.append(r.phase)
    return out


def _block(reqs, rounds_acc: list[int], verify_rounds: int) -> dict:
    ok = [r for r in reqs if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    span = (max(r.t_last for r in ok) - min(r.t_submit for r in ok)) if ok else 0.0
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    acc = _mean(rounds_acc)
    cancelled = sum(r.error == CANCELLED for r in reqs)
    return {"requests": len(reqs), "failed": len(reqs) - len(ok) - cancelled, "cancelled_at_deadline": cancelled,
            "completion_tokens": tokens,
            "wall_s": span, "tokens_per_s": tokens / span if span > 0 else None,
            "accept_len": acc, "accept_length": None if acc is None else acc + 1.0,
            "verify_request_rounds": verify_rounds,
            "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99)}


def session_figures(result: SessionResult, bin_s: float = 10.0) -> dict:
    """Per-phase and overall figures, a binned timeline, swaps, alerts and adaptation."""
    rid_phase = request_phases(result)
    acc_by_phase: dict[str, list[int]] = {}
    for rd in result.rounds:
        if rd["num_steps"] == 0:
            continue
        for rid, a in zip(rd["request_ids"], rd["accepted"]):
            acc_by_phase.setdefault(rid_phase.get(rid, "?"), []).append(a)
    phases = {}
    for name in phase_order(result):
        reqs = [r for r in result.requests if r.phase == name]
        phases[name] = _block(reqs, acc_by_phase.get(name, []), len(acc_by_phase.get(name, [])))
    all_acc = [a for v in acc_by_phase.values() for a in v]
    figs = {"name": result.name, "duration_s": result.t1 - result.t0, "overall": _block(result.requests, all_acc, len(all_acc)),
            "phases": phases, "timeline": timeline(result, bin_s),
            "swaps": [{"t_s": s["t"] - result.t0, "from": s["from"], "to": s["to"], "rollback": s["rollback"]}
                      for s in result.swaps],
            "alerts": [{**a, "t_s": a["t"] - result.t0} for a in result.alerts],
            "adaptation": adaptation(result), "trainer": result.trainer, "policy_log": result.policy_log}
    return figs


def write_rounds(result: SessionResult, path: str | Path) -> int:
    """Every verify round of the session as a JSON line in `online-spec drift replay`'s trace format
    (batch_size, accepted, num_steps, request_ids, tags, head_version, the request's phase, the time
    since the start), gzip'd when the name ends in .gz: the drift monitor's settings can be tried on
    the session's own traffic offline. Rounds of plain decode (K = 0) are kept (the detector skips
    them). Returns the number of rounds written."""
    rid_phase = request_phases(result)
    with TraceRecorder.open(path) as rec:
        for rd in result.rounds:
            ids = [str(r) for r in rd["request_ids"]]
            rec.record(rd["batch_size"], rd["accepted"], num_steps=rd["num_steps"], request_ids=ids,
                       tags=[str(t or "") for t in rd["tags"]], head_version=rd["head_version"],
                       phase=rid_phase.get(ids[0], "") if ids else "", t_s=round(rd["t"] - result.t0, 4))
    return len(result.rounds)


def timeline(result: SessionResult, bin_s: float) -> dict:
    """Rounds binned by time: committed tokens/s, mean accept_len, K per batch-size slot."""
    nbins = max(1, math.ceil((result.t1 - result.t0) / bin_s))
    tok = [0] * nbins
    acc: list[list[int]] = [[] for _ in range(nbins)]
    k_slot: dict[str, list] = {}
    for rd in result.rounds:
        i = min(nbins - 1, int((rd["t"] - result.t0) / bin_s))
        tok[i] += rd["committed"]
        if rd["num_steps"] > 0:
            acc[i].extend(rd["accepted"])
        k_slot.setdefault(str(rd["batch_size"]), []).append([rd["t"] - result.t0, rd["num_steps"]])
    return {"bin_s": bin_s, "t_s": [(i + 0.5) * bin_s for i in range(nbins)],
            "tokens_per_s": [t / bin_s for t in tok], "accept_len": [_mean(a) for a in acc],
            "num_steps_per_slot": {k: _thin(v, 400) for k, v in sorted(k_slot.items(), key=lambda kv: int(kv[0]))}}


def _thin(points: list, n: int) -> list:
    if len(points) <= n:
        return points
    step = len(points) / n
    return [points[int(i * step)] for i in range(n)]


def adaptation(result: SessionResult, window: int = 32) -> list[dict]:
    """After each phase change: time and tokens until the first head swap, and until the phase's
    rolling accept_len (last `window` request-rounds) first reaches 90 % of its final level
    (the mean of the phase's last quarter); None where it never did."""
    rid_phase = request_phases(result)
    starts: dict[str, float] = {}
    for r in result.requests:
        starts.setdefault(r.phase, r.t_submit)
    names = phase_order(result)
    out = []
    for prev, name in zip(names, names[1:]):
        t0 = starts[name]
        seq = [(rd["t"], a, rd["committed"]) for rd in result.rounds if rd["num_steps"] > 0 and rd["t"] >= t0
               for rid, a in zip(rd["request_ids"], rd["accepted"]) if rid_phase.get(rid) == name]
        tokens_after = [(rd["t"], rd["committed"]) for rd in result.rounds if rd["t"] >= t0]
        swap = next((s for s in result.swaps if s["t"] >= t0 and not s["rollback"]), None)
        final = _mean(a for _, a, _ in seq[-max(1, len(seq) // 4):]) if seq else None
        t_adapt = None
        if seq and final and final > 0:
            for i in range(min(window, len(seq)), len(seq) + 1):
                if sum(a for _, a, _ in seq[i - min(window, len(seq)):i]) / min(window, len(seq)) >= 0.9 * final:
                    t_adapt = seq[i - 1][0]
                    break

        def tokens_until(t):
            return None if t is None else sum(c for tt, c in tokens_after if tt <= t)

        out.append({"shift": f"{prev}->{name}", "t_shift_s": t0 - result.t0,
                    "time_to_first_swap_s": None if swap is None else swap["t"] - t0,
                    "tokens_to_first_swap": tokens_until(None if swap is None else swap["t"]),
                    "final_accept_len": final,
                    "time_to_adapt_s": None if t_adapt is None else t_adapt - t0,
                    "tokens_to_adapt": tokens_until(t_adapt)})
    return out


def plot_session(result: SessionResult, figs: dict, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Two PNGs: accept_len and tokens/s over time (swap and alert markers), K per slot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tl = figs["timeline"]
    starts = {}
    for r in result.requests:
        starts.setdefault(r.phase, r.t_submit - result.t0)

    def marks(ax):
        swaps = [s for s in figs["swaps"] if not s["rollback"]]
        rollbacks = [s for s in figs["swaps"] if s["rollback"]]
        for i, s in enumerate(swaps):
            ax.axvline(s["t_s"], color="green", ls="--", lw=1, label="swap" if i == 0 else None)
        for i, s in enumerate(rollbacks):
            ax.axvline(s["t_s"], color="purple", ls="-.", lw=1, label="rollback" if i == 0 else None)
        for i, a in enumerate(figs["alerts"]):
            ax.axvline(a["t_s"], color="red", ls=":", lw=1, label="drift alert" if i == 0 else None)
        for name, t in starts.items():
            ax.axvline(t, color="gray", lw=0.5)
            ax.text(t, ax.get_ylim()[1], f" {name}", va="top", fontsize=8, color="gray")

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a1.plot(tl["t_s"], [x if x is not None else float("nan") for x in tl["accept_len"]], marker=".")
    a1.set_ylabel("accept_len (drafts, no bonus)")
    marks(a1)
    if figs["swaps"] or figs["alerts"]:
        a1.legend(loc="upper left", fontsize=8)
    a2.plot(tl["t_s"], tl["tokens_per_s"], marker=".", color="tab:orange")
    a2.set_ylabel("tokens/s")
    a2.set_xlabel("time (s)")
    marks(a2)
    fig.suptitle(f"{result.name}: acceptance and throughput")
    p1 = out_dir / f"{prefix}accept_len_tokens_per_s.png"
    fig.savefig(p1, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 3.5))
    for slot, pts in tl["num_steps_per_slot"].items():
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=f"batch {slot}")
    ax.set_ylabel("K (draft steps)")
    ax.set_xlabel("time (s)")
    marks(ax)
    if tl["num_steps_per_slot"]:
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{result.name}: K per batch-size slot")
    p2 = out_dir / f"{prefix}k_per_slot.png"
    fig.savefig(p2, dpi=100)
    plt.close(fig)
    return [p1, p2]
