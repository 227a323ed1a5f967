"""The figures of `bench e2e` about adaptation's targets, from its configurations' results:
the return to earlier traffic (`return_figures`, `--trace-shape return`) and the per-phase ceiling
of `--ceiling-heads` with the share of its gain online-spec took (`ceiling_figures`,
`ceiling_capture`), and how fast the machine ran each configuration (`verify_speed`, a
diagnostic), and one headline from several repeats (`median_headline`). bench/e2e.py runs the
configurations; its module doc defines the figures.
"""

from __future__ import annotations

import statistics


def ratio(a, b):
    return None if a is None or not b else a / b


def overhead_split(tps) -> dict | None:
    """`--overhead-split`'s three factors from each configuration's tokens/s (`tps(name)`, None
    where it did not run), whose product is online-spec over static: controller = cost_policy /
    static, capture = online_no_training / cost_policy, training = online_spec /
    online_no_training; None without the split's configurations."""
    if tps("cost_policy") is None or tps("online_no_training") is None:
        return None
    return {"controller": ratio(tps("cost_policy"), tps("static")),
            "capture": ratio(tps("online_no_training"), tps("cost_policy")),
            "training": ratio(tps("online_spec"), tps("online_no_training"))}


RETURN_TARGET = 0.95  # acceptance early in a return phase, over the earlier phase's level (issue 30)


def met_return(value: float | None) -> bool | None:
    return None if value is None else value >= RETURN_TARGET


def return_figures(configs: dict) -> dict:
    """The trace's first return to earlier traffic (`bench.report.returns`), per configuration:
    the return phase's accept_len over its first tokens against the earlier phase's accept_len;
    `ratio_online_spec` is online-spec's, the figure the target is about."""
    ret = configs["online_spec"]["returns"][0]
    per = {}
    for name, c in configs.items():
        mine = next((r for r in c.get("returns") or [] if r["phase"] == ret["phase"]), None)
        if mine is not None:
            per[name] = {k: mine[k] for k in ("earlier_first_draft", "first_draft_first_tokens", "earlier_accept_len",
                                              "accept_len_first_tokens", "request_rounds", "ratio")}
    online = per["online_spec"]["ratio"]
    static = (per.get("static") or {}).get("ratio")
    return {"phase": ret["phase"], "earlier": ret["earlier"], "tokens": ret["tokens"], "configs": per,
            "ratio_online_spec": online, "target": RETURN_TARGET, "met": met_return(online),
            # the static head cannot forget: its own ratio is what the two phases' prompts make of
            # acceptance, and online-spec's over it what adaptation cost (< 1) or kept
            "ratio_online_spec_over_static": ratio(online, static)}


CEILING_CAPTURE_TARGET = 0.8  # of the gain the ceiling had over static + SGLang adaptive (issue 30)


def capture(online: float, ref: float, ceiling: float) -> float | None:
    """(online - ref) / (ceiling - ref): the share of the ceiling's gain over the reference that
    online-spec took (1: all of it; < 0: slower than the reference); None where the ceiling has
    no gain to take."""
    return None if ceiling <= ref else (online - ref) / (ceiling - ref)


def ceiling_figures(configs: dict, bs1: dict | None, phases: list[str]) -> dict:
    """The per-phase ceiling of `--ceiling-heads` (module doc): the fastest head per phase among
    `cost_policy` (the static head) and the `ceiling_<head>` configurations, weighted by the
    adaptive configuration's tokens per phase; online-spec weighted alike, and the share of the
    ceiling's gain it took (`ceiling_capture`, overall and per phase); the best head's batch-1
    speedup over plain (without `bs1`, none)."""
    heads = ["cost_policy"] + [n for n in configs if n.startswith("ceiling_")]
    ref = configs["sglang_adaptive"]["phases"]
    online = configs["online_spec"]["phases"]
    best, ceiling_s, ref_s, online_s, tokens = {}, 0.0, 0.0, 0.0, 0
    for p in phases:
        rates = {h: (configs[h]["phases"].get(p) or {}).get("tokens_per_s") for h in heads}
        n, ref_tps = (ref.get(p) or {}).get("completion_tokens"), (ref.get(p) or {}).get("tokens_per_s")
        online_tps = (online.get(p) or {}).get("tokens_per_s")
        if not n or not ref_tps or not online_tps or not all(rates.values()):
            return {"error": f"phase {p!r} lacks tokens/s in some configuration: no ceiling"}
        h = max(rates, key=rates.get)
        best[p] = {"head": h, "tokens_per_s": rates[h],
                   "ceiling_capture": capture(online_tps, ref_tps, rates[h])}
        ceiling_s += n / rates[h]
        ref_s += n / ref_tps
        online_s += n / online_tps
        tokens += n
    out = {"best_per_phase": best, "tokens_per_s": tokens / ceiling_s,
           "static_sglang_adaptive_tokens_per_s": tokens / ref_s,
           "online_spec_tokens_per_s": tokens / online_s,
           "ceiling_capture": capture(tokens / online_s, tokens / ref_s, tokens / ceiling_s),
           "ceiling_capture_target": CEILING_CAPTURE_TARGET,
           "ceiling_vs_static_sglang_adaptive": ref_s / ceiling_s}
    if bs1:
        best_bs1 = max((n for n in bs1 if n.startswith("ceiling_")), key=lambda n: bs1[n]["tokens_per_s"] or 0)
        out |= {"bs1_best": best_bs1,
                "ceiling_speedup_vs_plain_bs1": ratio(bs1[best_bs1]["tokens_per_s"], bs1["plain"]["tokens_per_s"])}
    return out


def _pool(blocks: list[dict]) -> dict:
    """Tokens/s of several runs' blocks taken together: all their tokens over all their seconds."""
    tokens = [b.get("completion_tokens") for b in blocks]
    rates = [b.get("tokens_per_s") for b in blocks]
    if not all(tokens) or not all(rates):
        return {"completion_tokens": None, "tokens_per_s": None}
    return {"completion_tokens": sum(tokens), "tokens_per_s": sum(tokens) / sum(n / r for n, r in zip(tokens, rates))}


def pooled_figures(runs: list[dict], phases: list[str]) -> dict:
    """The repeats of `bench e2e --repeats` taken together: each configuration's tokens/s over all
    its repeats (overall and per phase: tokens over seconds), and online-spec's ratio and
    `ceiling` from those. With the odd repeats run in reverse order, a machine whose speed drifts
    steadily over the run slows each configuration's pooled figure alike, where one repeat's
    ratios carry the drift between its configurations."""
    names = [n for n in runs[0] if all(n in r for r in runs)]
    pooled = {n: {"overall": _pool([r[n]["overall"] for r in runs]),
                  "phases": {p: _pool([r[n]["phases"].get(p) or {} for r in runs]) for p in phases}}
              for n in names}
    tps = {n: c["overall"]["tokens_per_s"] for n, c in pooled.items()}
    out = {"repeats": len(runs), "tokens_per_s": tps,
           "per_phase_tokens_per_s": {p: {n: c["phases"][p]["tokens_per_s"] for n, c in pooled.items()}
                                      for p in phases},
           "speedup_vs_static_sglang_adaptive": ratio(tps.get("online_spec"), tps.get("sglang_adaptive")),
           "speedup_vs_static": ratio(tps.get("online_spec"), tps.get("static"))}
    if "online_spec" in pooled and "sglang_adaptive" in pooled and any(n.startswith("ceiling_") for n in pooled):
        out["ceiling"] = ceiling_figures(pooled, None, phases)
    split = overhead_split(tps.get)  # one run's factors move +-10 % on an H200: pooled, the repeats' together
    if split is not None:
        out["overhead_split"] = split
    return out


VERIFY_CELL_MIN_ROUNDS = 20  # a (batch, K) cell's rounds before its mean verify time is compared


def verify_speed(configs: dict, ref: str = "cost_policy") -> dict | None:
    """How fast the machine ran each configuration, read off the one forward no head changes: the
    target's verify of a batch of B requests at K + 1 tokens. Per configuration, the geometric mean
    over the (batch, K) cells it shares with `ref` (each with >= VERIFY_CELL_MIN_ROUNDS rounds in
    both; weighted by the fewer of the two counts) of ref's mean verify time over its own: 1.3 =
    this configuration's verifies ran 1.3x faster than ref's. `spread` (highest / lowest) above
    ~1.1 says the configurations' tokens/s differ by the machine's state as much as by what they
    do: a CPU that changes speed between configurations (on a 2-core EPYC the pulses spread up to
    1.37 in one run). A diagnostic, not a correction: a trainer beside the server slows its
    verifies for real. None without `ref`'s round costs."""
    import math

    cells = ((configs.get(ref) or {}).get("round_costs") or {}).get("by_batch_k") or {}
    base = {c: v for c, v in cells.items() if v["rounds"] >= VERIFY_CELL_MIN_ROUNDS and not c.endswith(",0")}
    if not base:
        return None
    speed, shared = {}, {}
    for name, cfg in configs.items():
        mine = (cfg.get("round_costs") or {}).get("by_batch_k") or {}
        num = den = 0.0
        n_cells = 0
        for cell, b in base.items():
            m = mine.get(cell)
            if m is None or m["rounds"] < VERIFY_CELL_MIN_ROUNDS or not m["verify_ms_mean"]:
                continue
            w = min(m["rounds"], b["rounds"])
            num += w * math.log(b["verify_ms_mean"] / m["verify_ms_mean"])
            den += w
            n_cells += 1
        if den:
            speed[name], shared[name] = round(math.exp(num / den), 4), n_cells
    return {"ref": ref, "by_config": speed, "cells": shared,
            "spread": round(max(speed.values()) / min(speed.values()), 4) if speed else None}


RATIOS = ("speedup_vs_static_sglang_adaptive", "speedup_vs_static", "speedup_vs_plain", "speedup_vs_plain_bs1_adapted",
          "speedup_vs_sglang_default_tree", "tree_vs_static")
TARGETS = {"speedup_vs_static_sglang_adaptive": 1.3, "speedup_vs_plain_bs1_adapted": 2.5}


def _median_tree(trees: list):
    """Element-wise median of same-shaped nested dicts of numbers (None where any is missing);
    anything else is taken from the first."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: _median_tree([t.get(k) if isinstance(t, dict) else None for t in trees]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        vals = [t for t in trees if isinstance(t, (int, float)) and not isinstance(t, bool)]
        return statistics.median(vals) if len(vals) == len(trees) else None
    return first


def median_headline(heads: list[dict]) -> dict:
    """One headline from several repeats: ratios, per-phase and overall figures by median;
    adaptation, swaps and alerts of the first repeat (each repeat's are in `repeats`)."""
    out = dict(heads[0])
    for k in RATIOS:
        vals = [h[k] for h in heads if h[k] is not None]
        out[k] = statistics.median(vals) if len(vals) == len(heads) else None
    out["per_phase"] = _median_tree([h["per_phase"] for h in heads])
    out["per_phase_ratios"] = _median_tree([h["per_phase_ratios"] for h in heads])
    if "overhead_split" in out:
        out["overhead_split"] = _median_tree([h["overhead_split"] for h in heads])
    if "ceiling" in out:
        out["ceiling"] = _median_tree([h["ceiling"] for h in heads])
    if "returns" in out:
        out["returns"] = _median_tree([h["returns"] for h in heads])
        out["returns"]["met"] = met_return(out["returns"]["ratio_online_spec"])
    out["overall"] = _median_tree([h["overall"] for h in heads])
    out["met"] = {k: (out[k] is not None and out[k] >= v) for k, v in TARGETS.items()}
    return out
