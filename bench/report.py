"""Figures and plots of serving sessions (`session.SessionResult`): per phase, over time, adaptation.

In: session results (requests, rounds, swaps, alerts, the trainer's verdicts). Out: plain dicts
(JSON-ready) and PNGs. Conventions: `accept_len` = drafts accepted per request per verify round,
bonus excluded (the project's); `accept_length` = tokens committed per request per verify round,
bonus included (SGLang's). Tokens/s of a phase = completion tokens of its requests / wall time
from its first submission to its last token. TPOT = (last token - first token) / (tokens - 1)
per request. Times (`t_s`) count from the start of traffic: the start-up before it (model,
calibration, the trainer's start) is `startup_s`, apart from the `serving_s` after it.

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
    t0 = result.serve_t0
    figs = {"name": result.name, "duration_s": result.t1 - result.t0, "startup_s": t0 - result.t0,
            "serving_s": result.t1 - t0, "trace_lines": result.trace_lines,
            "skipped_lines": max(0, result.trace_lines - len(result.requests)),
            "overall": _block(result.requests, all_acc, len(all_acc)),
            "phases": phases, "timeline": timeline(result, bin_s),
            "swaps": [{"t_s": s["t"] - t0, "from": s["from"], "to": s["to"], "rollback": s["rollback"],
                       "bank": s.get("bank", False)}
                      for s in result.swaps],
            "alerts": [{**a, "t_s": a["t"] - t0} for a in result.alerts],
            "adaptation": adaptation(result), "returns": returns(result), "trainer": result.trainer,
            "policy_log": result.policy_log, "round_costs": round_costs(result),
            "cuda_graphs": result.server_info.get("cuda_graphs")}  # start-up warm-up, captures while serving
    return figs


def round_costs(result: SessionResult) -> dict:
    """Where a served round's wall time goes, by K: inside the engine's step (draft, of it the
    long draft-cache catch-ups, verify, admission: the new prompts' prefills, the rest: release,
    decision) and outside it (`gap`: from the end of one round to the start of the next, the
    server's own work between rounds: hooks, delivery, waiting for requests); `policy`: the step
    policy's calls on the engine's thread (`RoundStats.policy_s`, inside the others). Medians and means
    in ms over consecutive rounds (a mean above its median: rare long rounds); `busy_share`: the
    engine's steps' share of the serving wall time. `one_off`: seconds of the whole run spent in
    prefills, in long catch-ups, and in rounds that captured a CUDA graph (`capture_rounds_s`,
    their whole time), beside `rounds_s`, every round's time. A server whose speculative rounds
    cost far more than the engine alone spends on them shows here where.

    `by_batch_k`: the same rounds by batch size and shape ("B,K" for a chain of K, "B,K,topk,tokens"
    for a tree), so two configurations compare at equal batch: rounds, their mean round / draft /
    verify ms, committed tokens a round, tokens per second of round time (committed over the
    rounds' seconds, gaps left out) and `steady_tokens_per_s`, the same over draft + verify
    seconds of the rounds that admitted no request (a prefill lands on whichever shape runs then)."""
    rounds = [r for r in result.rounds if "draft_s" in r]
    if len(rounds) < 2:
        return {}
    by_k: dict[str, dict[str, list[float]]] = {}
    by_bk: dict[tuple[int, int], list[dict]] = {}
    for prev, r in zip(rounds, rounds[1:]):
        topk = r.get("topk", 1)
        shape = (r["num_steps"],) if topk <= 1 else (r["num_steps"], topk, r.get("num_draft_tokens", 0))
        by_bk.setdefault((r["batch_size"], *shape), []).append(r)
        parts = by_k.setdefault(str(r["num_steps"]), {"round": [], "draft": [], "catchup": [], "verify": [],
                                                      "admit": [], "other": [], "gap": [], "policy": []})
        parts["round"].append(r["total_s"])
        parts["draft"].append(r["draft_s"])
        parts["catchup"].append(r.get("catchup_s", 0.0))
        parts["verify"].append(r["verify_s"])
        parts["admit"].append(r.get("admit_s", 0.0))
        parts["other"].append(r["total_s"] - r["draft_s"] - r["verify_s"] - r.get("admit_s", 0.0))
        parts["gap"].append(max(0.0, r["t"] - prev["t"] - r["total_s"]))
        parts["policy"].append(r.get("policy_s", 0.0))
    out = {k: {"rounds": len(v["round"]),
               **{f"{n}_ms_{stat}": round(1e3 * fn(xs), 3) for n, xs in v.items()
                  for stat, fn in (("p50", lambda xs: percentile(xs, 50)), ("mean", _mean))}}
           for k, v in sorted(by_k.items(), key=lambda kv: int(kv[0]))}
    span = rounds[-1]["t"] - rounds[0]["t"] + rounds[0]["total_s"]
    one_off = {"rounds_s": sum(r["total_s"] for r in rounds), "prefill_s": sum(r.get("admit_s", 0.0) for r in rounds),
               "prefills": sum(r.get("admitted", 0) for r in rounds),
               "catchup_s": sum(r.get("catchup_s", 0.0) for r in rounds),
               "capture_rounds": sum(1 for r in rounds if r.get("captures")),
               "capture_rounds_s": sum(r["total_s"] for r in rounds if r.get("captures"))}
    by_batch_k = {}
    for key, rs in sorted(by_bk.items()):
        ms = {n: round(1e3 * _mean([r[f"{n}_s"] for r in rs]), 3) for n in ("total", "draft", "verify")}
        steady = [r for r in rs if not r.get("admitted")]
        steady_s = sum(r["draft_s"] + r["verify_s"] for r in steady)
        by_batch_k[",".join(map(str, key))] = {
            "rounds": len(rs), "round_ms_mean": ms["total"], "draft_ms_mean": ms["draft"],
            "verify_ms_mean": ms["verify"], "committed_mean": round(_mean([r["committed"] for r in rs]), 3),
            "tokens_per_s": round(sum(r["committed"] for r in rs) / max(sum(r["total_s"] for r in rs), 1e-12), 2),
            "steady_tokens_per_s": round(sum(r["committed"] for r in steady) / steady_s, 2) if steady_s > 0 else None}
    return {"by_k": out, "by_batch_k": by_batch_k,
            "busy_share": round(one_off["rounds_s"] / span, 4) if span > 0 else None,
            "one_off": {k: round(v, 3) if isinstance(v, float) else v for k, v in one_off.items()}}


RETURN_TOKENS = 500  # the return figure's window: the returning phase's first served tokens


def returns(result: SessionResult, tokens: int = RETURN_TOKENS) -> list[dict]:
    """For each phase that goes back to an earlier phase's traffic (the same set of request
    tags, another phase between them): its first-draft acceptance (the share of its request-
    rounds with K >= 1 whose first draft was accepted; unlike accept_len it does not move with
    the K the controller picks) over the rounds until `tokens` tokens were committed after it
    began (the rounds of its own requests only), beside the earlier phase's over all its
    rounds, and their ratio: whether what the head learnt in between cost the acceptance that
    traffic had. accept_len (bonus excluded) beside them."""
    rid_phase = request_phases(result)
    names = phase_order(result)
    tags = {n: frozenset(r.tag for r in result.requests if r.phase == n) for n in names}
    starts: dict[str, float] = {}
    for r in result.requests:
        starts.setdefault(r.phase, r.t_submit)
    out = []
    for j, name in enumerate(names):
        if j < 2 or tags[names[j - 1]] == tags[name] or name in names[:j]:
            continue  # not a return (a phase named twice is one phase to these figures)
        earlier = next((q for q in reversed(names[:j - 1]) if tags[q] == tags[name]), None)
        if earlier is None:
            continue
        before = [a for rd in result.rounds if rd["num_steps"] > 0
                  for rid, a in zip(rd["request_ids"], rd["accepted"]) if rid_phase.get(rid) == earlier]
        first, served = [], 0
        for rd in result.rounds:
            if rd["t"] < starts[name]:
                continue
            if served >= tokens:
                break
            served += rd["committed"]
            if rd["num_steps"] > 0:
                first += [a for rid, a in zip(rd["request_ids"], rd["accepted"]) if rid_phase.get(rid) == name]
        level, now = _mean([a > 0 for a in before]), _mean([a > 0 for a in first])
        out.append({"phase": name, "earlier": earlier, "tokens": tokens, "earlier_first_draft": level,
                    "first_draft_first_tokens": now, "earlier_accept_len": _mean(before),
                    "accept_len_first_tokens": _mean(first), "request_rounds": len(first),
                    "ratio": None if now is None or not level else now / level})
    return out


def why_no_swap(figs: dict) -> str | None:
    """Why a session with a trainer swapped no head, from the trainer's own verdicts; None when
    a head was swapped or no trainer ran."""
    watch = (figs.get("trainer") or {}).get("watch")
    if watch is None or any(not s["rollback"] for s in figs["swaps"]):
        return None
    if watch["gate_evaluations"]:
        return (f"no swap: the gate refused all {watch['gate_evaluations']} candidates "
                f"(last: {watch['last_gate']})")
    step = watch["step"]
    return ("no swap: the trainer never reached its first training step (too few rows captured?)" if not step else
            f"no swap: the trainer made {step} steps and no gate evaluation yet")


_ROUND_EXTRAS = ("committed", "topk", "num_draft_tokens", "ctx_len", "total_s", "draft_s", "verify_s", "catchup_s",
                 "admit_s", "admitted", "policy_s", "captures")


def write_rounds(result: SessionResult, path: str | Path) -> int:
    """Every verify round of the session as a JSON line in `online-spec drift replay`'s trace format
    (batch_size, accepted, num_steps, request_ids, tags, head_version, the request's phase, the time
    since the start), gzip'd when the name ends in .gz: the drift monitor's settings can be tried on
    the session's own traffic offline. Rounds of plain decode (K = 0) are kept (the detector skips
    them). Each line also carries the round's shape, context and times as `RoundLog` recorded them
    (`round_costs` reads them; replay ignores them). Returns the number of rounds written."""
    rid_phase = request_phases(result)
    with TraceRecorder.open(path) as rec:
        for rd in result.rounds:
            ids = [str(r) for r in rd["request_ids"]]
            rec.record(rd["batch_size"], rd["accepted"], num_steps=rd["num_steps"], request_ids=ids,
                       tags=[str(t or "") for t in rd["tags"]], head_version=rd["head_version"],
                       phase=rid_phase.get(ids[0], "") if ids else "", t_s=round(rd["t"] - result.serve_t0, 4),
                       **{k: rd[k] for k in _ROUND_EXTRAS if k in rd})
    return len(result.rounds)


def timeline(result: SessionResult, bin_s: float) -> dict:
    """Rounds binned by time from the start of traffic: committed tokens/s, mean accept_len, K
    per batch size."""
    t0 = result.serve_t0
    span = max(result.t1 - t0, 1e-9)
    nbins = max(1, round(span / bin_s))  # a last stretch shorter than half a bin joins the bin before it
    widths = [bin_s] * (nbins - 1) + [span - (nbins - 1) * bin_s]
    tok = [0] * nbins
    acc: list[list[int]] = [[] for _ in range(nbins)]
    k_slot: dict[str, list] = {}
    for rd in result.rounds:
        i = min(nbins - 1, max(0, int((rd["t"] - t0) / bin_s)))
        tok[i] += rd["committed"]
        if rd["num_steps"] > 0:
            acc[i].extend(rd["accepted"])
        k_slot.setdefault(str(rd["batch_size"]), []).append([rd["t"] - t0, rd["num_steps"]])
    return {"bin_s": bin_s, "t_s": [i * bin_s + w / 2 for i, w in enumerate(widths)],
            "tokens_per_s": [t / w for t, w in zip(tok, widths)], "accept_len": [_mean(a) for a in acc],
            "num_steps_per_slot": {k: _thin(v, 400) for k, v in sorted(k_slot.items(), key=lambda kv: int(kv[0]))}}


def _thin(points: list, n: int) -> list:
    if len(points) <= n:
        return points
    step = len(points) / n
    return [points[int(i * step)] for i in range(n)]


def adaptation(result: SessionResult, window: int = 32) -> list[dict]:
    """After each phase change: time and tokens until the first head swap within the new phase;
    and, only where a head was swapped in the phase and acceptance then rose, until the phase's
    rolling accept_len (last `window` request-rounds) first reaches 90 % of its final level (the
    mean of the phase's last quarter) after that swap. Otherwise `time_to_adapt_s` is None and
    `note` says why (no swap; acceptance did not rise: its first and final levels)."""
    rid_phase = request_phases(result)
    starts: dict[str, float] = {}
    for r in result.requests:
        starts.setdefault(r.phase, r.t_submit)
    names = phase_order(result)
    out = []
    for i, (prev, name) in enumerate(zip(names, names[1:])):
        t0, t_end = starts[name], starts[names[i + 2]] if i + 2 < len(names) else result.t1
        seq = [(rd["t"], a) for rd in result.rounds if rd["num_steps"] > 0 and rd["t"] >= t0
               for rid, a in zip(rd["request_ids"], rd["accepted"]) if rid_phase.get(rid) == name]
        tokens_after = [(rd["t"], rd["committed"]) for rd in result.rounds if rd["t"] >= t0]
        swap = next((s for s in result.swaps if t0 <= s["t"] < t_end and not s["rollback"]), None)
        first = _mean(a for _, a in seq[:window])
        final = _mean(a for _, a in seq[-max(1, len(seq) // 4):])
        t_adapt, note = None, ""
        if swap is None:
            note = "no head was swapped in this phase"
        elif first is None or final is None or final <= first:
            note = f"acceptance did not rise after the shift (first {_fmt(first)}, final {_fmt(final)})"
        else:
            w = min(window, len(seq))
            for j in range(w, len(seq) + 1):
                if seq[j - 1][0] >= swap["t"] and sum(a for _, a in seq[j - w:j]) / w >= 0.9 * final:
                    t_adapt = seq[j - 1][0]
                    break
            note = "" if t_adapt is not None else "never reached 90 % of the final level after the swap"

        def tokens_until(t):
            return None if t is None else sum(c for tt, c in tokens_after if tt <= t)

        out.append({"shift": f"{prev}->{name}", "t_shift_s": t0 - result.serve_t0,
                    "time_to_first_swap_s": None if swap is None else swap["t"] - t0,
                    "tokens_to_first_swap": tokens_until(None if swap is None else swap["t"]),
                    "first_accept_len": first, "final_accept_len": final,
                    "time_to_adapt_s": None if t_adapt is None else t_adapt - t0,
                    "tokens_to_adapt": tokens_until(t_adapt), "note": note})
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot_session(result: SessionResult, figs: dict, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Two PNGs: accept_len and tokens/s over time since traffic began (swaps, rollbacks, alerts,
    gate verdicts; why no head was swapped), and K per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tl = figs["timeline"]
    starts = {}
    for r in result.requests:
        starts.setdefault(r.phase, r.t_submit - result.serve_t0)
    xlabel = f"time since traffic began (s); start-up before it: {figs['startup_s']:.0f} s, not shown"

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

    keep = _from_first_traffic(tl)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a1.plot(keep(tl["t_s"]), [x if x is not None else float("nan") for x in keep(tl["accept_len"])], marker=".")
    a1.set_ylabel("accept_len (drafts, no bonus)")
    verdicts = [e for e in ((figs.get("trainer") or {}).get("watch") or {}).get("events", []) if e["kind"] == "gate"]
    if verdicts:  # each gate evaluation along the top: refused (x) or passed (^)
        top = a1.get_ylim()[1]
        for passed, marker, color, label in ((False, "x", "gray", "gate refused"), (True, "^", "green", "gate passed")):
            ts = [e["t_s"] for e in verdicts if (">=" in e["text"]) == passed]
            if ts:
                a1.plot(ts, [top] * len(ts), ls="none", marker=marker, color=color, ms=5, label=label, clip_on=False)
    marks(a1)
    if figs["swaps"] or figs["alerts"] or verdicts:
        a1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the plot, off the data
    reason = why_no_swap(figs)
    if reason:
        a1.text(0.99, 0.04, reason, transform=a1.transAxes, ha="right", va="bottom", fontsize=8, wrap=True,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "gray"})
    a2.plot(keep(tl["t_s"]), keep(tl["tokens_per_s"]), marker=".", color="tab:orange")
    a2.set_ylabel("tokens/s")
    a2.set_xlabel(xlabel)
    marks(a2)
    fig.suptitle(f"{result.name}: acceptance and throughput ({figs['serving_s']:.0f} s of serving)")
    fig.tight_layout()
    p1 = out_dir / f"{prefix}accept_len_tokens_per_s.png"
    fig.savefig(p1, dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 3.5))
    slots = [(b, pts) for b, pts in tl["num_steps_per_slot"].items() if pts]
    styles = ["-", "--", ":", "-."]
    for i, (b, pts) in enumerate(slots):
        off = (i - (len(slots) - 1) / 2) * K_OFFSET  # equal K at two batch sizes stays two lines
        ax.step([p[0] for p in pts], [p[1] + off for p in pts], where="post", ls=styles[i % len(styles)], lw=1.2,
                color=K_COLORS[i % len(K_COLORS)], label=f"b{b} (batch {b})")
    ax.set_ylabel("K (draft steps)")
    ax.set_xlabel(xlabel)
    marks(ax)
    if slots:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(f"{result.name}: K by batch size (lines offset by {K_OFFSET:g} per batch size to stay apart)")
    fig.tight_layout()
    p2 = out_dir / f"{prefix}k_per_slot.png"
    fig.savefig(p2, dpi=80)
    plt.close(fig)
    return [p1, p2]


K_OFFSET = 0.06
K_COLORS = ["tab:blue", "tab:orange", "black", "tab:cyan", "tab:olive", "tab:pink", "gold"]  # not the markers'


def _from_first_traffic(tl: dict):
    """Cut a timeline series before its first bin with committed tokens (no leading zeros)."""
    first = next((i for i, t in enumerate(tl["tokens_per_s"]) if t > 0), 0)
    return lambda xs: xs[first:]
