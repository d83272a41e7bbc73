"""The network benchmark's report: its vocabulary (link rates, configurations), the
speed-ups, the Markdown tables and the SVG plot, from the sweep's runs.

``network.py`` runs the sweep and calls ``add_speedups``, ``render_markdown`` and
``render_svg``; ``figures.py`` reads rates and names here. Standard library only.
"""

import math
import os
import re
import statistics
import sys
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
from netns import SUBNET  # noqa: E402
from tfgc.apps.plots import Panel, fmt_bytes  # noqa: E402  (stdlib only)

STOCK = "stock"
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)bit$")


def rate_bps(rate):
    """'100mbit' -> 1e8 (bits per second, tc's decimal units)."""
    m = _RATE_RE.match(rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: use tc's syntax, e.g. 100mbit, 1gbit, 10gbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


def rate_label(rate):
    """'100mbit' (or 1e8) -> '100 Mbit/s'."""
    bps = rate if isinstance(rate, (int, float)) else rate_bps(rate)
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def split_config(config):
    """'qsgd:levels=7@allgather' -> ('qsgd:levels=7', 'allgather'); no '@': 'auto'.

    The communication may end in options, e.g. 'onebit@reduce_scatter:overlap_mb=0'
    (``split_options`` reads them).
    """
    if config == STOCK:
        return None, None
    spec, sep, comm = config.rpartition("@")
    if not sep:
        spec, comm = config, "auto"
    if not spec or not comm:
        raise ValueError(f"configuration {config!r}: expected SPEC@COMMUNICATION, "
                         "e.g. 'qsgd:levels=7@allgather'")
    return spec, comm


OPTIONS = {"bucket_mb": ("bucket_bytes", 1), "overlap_mb": ("overlap_bytes", 0)}


def split_options(comm):
    """'reduce_scatter:bucket_mb=4,overlap_mb=0' ->
    ('reduce_scatter', {'bucket_bytes': 4 << 20, 'overlap_bytes': 0}).

    ``bucket_mb``: the strategy's ``bucket_bytes`` in MiB (at least 1);
    ``overlap_mb``: its ``overlap_bytes`` in MiB (0: one bucket, no overlap).
    """
    comm, sep, rest = comm.partition(":")
    options = {}
    for item in rest.split(",") if sep else []:
        key, eq, value = item.partition("=")
        if key not in OPTIONS or not eq or not value.isdigit() or int(value) < OPTIONS[key][1]:
            raise ValueError(f"communication {comm + sep + rest!r}: options are "
                             "':bucket_mb=M' (M >= 1) and ':overlap_mb=M' (M >= 0), "
                             "joined by ','")
        options[OPTIONS[key][0]] = int(value) << 20
    return comm, options


def add_speedups(runs, combined=False):
    """Each run's speed-up against stock at the same (model, rate, N, round of
    ``--repeats``), and its overlap figures against the same configuration at the
    sweep's fastest rate in the same round (its compute floor): ``wire_ms``, the
    slowest worker's bytes per step at the link's rate; ``floor_ms``; ``vs_max`` =
    step / max(floor, wire), 1 when communication hides entirely behind computation or
    the reverse; ``vs_sum`` = step / (floor + wire), 1 when they do not overlap at all.
    ``combined``: runs of ``combine_rounds``, whose speed-ups are the rounds' (kept)
    and whose floor is the combined run at the fastest rate, whatever round stands
    for it."""
    def round_of(r):
        return None if combined else r.get("round")

    stock = {(r["model"], r["rate"], r["workers"], round_of(r)): r for r in runs
             if r["config"] == STOCK and r.get("status") == "ok"}
    for r in runs if not combined else ():
        base = stock.get((r["model"], r["rate"], r["workers"], round_of(r)))
        if r.get("status") == "ok" and base:
            r["speedup"] = base["median_ms"] / r["median_ms"]
    ok = [r for r in runs if r.get("status") == "ok" and r.get("kind", "main") == "main"]
    fastest = {}
    for r in ok:
        key = (r["model"], r["workers"], r["config"], round_of(r))
        if key not in fastest or rate_bps(r["rate"]) > rate_bps(fastest[key]["rate"]):
            fastest[key] = r
    for r in ok:
        floor = fastest[(r["model"], r["workers"], r["config"], round_of(r))]
        if floor is r or "veth_tx_per_step_max" not in r:
            continue
        wire = 1000.0 * 8 * r["veth_tx_per_step_max"] / rate_bps(r["rate"])
        r.update(wire_ms=wire, floor_ms=floor["median_ms"],
                 vs_max=r["median_ms"] / max(floor["median_ms"], wire),
                 vs_sum=r["median_ms"] / (floor["median_ms"] + wire))


def combine_rounds(runs):
    """The runs of a sweep of several rounds (``--repeats``) as one run per (model,
    rate, N, configuration), in the order of their first rounds: the round whose median
    step is the median of the rounds' (the lower of the middle two for an even count)
    stands for them, with ``median_ms`` the rounds' median, ``speedup`` the median of
    the rounds' own speed-ups, and ``rounds_ms`` each round's median step ("failed";
    None: not run, the sweep cut short); the overlap figures are computed again from
    the combined steps. A run without rounds comes back as it is; a setting failed in
    every round, as its first failure."""
    groups, order = {}, []
    for r in runs:
        if "round" not in r:
            order.append(r)
            continue
        key = (r["model"], r["rate"], r["workers"], r["config"])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(r)
    if not groups:
        return list(runs)
    combined = []
    for item in order:
        if isinstance(item, dict):
            combined.append(item)
            continue
        rounds = groups[item]
        ok = sorted((r for r in rounds if r.get("status") == "ok"),
                    key=lambda r: r["median_ms"])
        if not ok:
            combined.append(next((r for r in rounds if r.get("status")), rounds[0]))
            continue
        run = dict(ok[(len(ok) - 1) // 2])
        run["median_ms"] = statistics.median(r["median_ms"] for r in ok)
        run["rounds_ms"] = [r["median_ms"] if r.get("status") == "ok"
                            else "failed" if r.get("status") else None for r in rounds]
        speedups = [r["speedup"] for r in ok if r.get("speedup")]
        run.pop("speedup", None)
        if speedups:
            run["speedup"] = statistics.median(speedups)
        for field in ("wire_ms", "floor_ms", "vs_max", "vs_sum"):
            run.pop(field, None)
        combined.append(run)
    add_speedups(combined, combined=True)
    return combined


def auto_against_fixed(runs):
    """For each ``auto`` configuration at each (model, N, rate): the fastest other
    tfgc configuration (by median step; stock is not one) and auto's step over the
    fastest's, where the sweep has rounds the median over rounds of each round's own
    ratio (against that round's fastest; only rounds in which every setting ran).
    [(model, N, rate, auto config, fastest config, ratio)]."""
    def is_auto(config):
        return config != STOCK and split_config(config)[0].split(":")[0] == "auto"

    ok = [r for r in runs if r.get("status") == "ok" and r.get("kind", "main") == "main"]
    combined = combine_rounds(ok)
    out = []
    for a in (r for r in combined if is_auto(r["config"])):
        others = [r for r in combined
                  if (r["model"], r["workers"], r["rate"]) == (a["model"], a["workers"],
                                                               a["rate"])
                  and r["config"] != STOCK and not is_auto(r["config"])]
        if not others:
            continue
        fastest = min(others, key=lambda r: r["median_ms"])
        ratios = []
        for round_ in sorted({r["round"] for r in ok if "round" in r}) or [None]:
            def step(config, round_=round_):
                return next((r["median_ms"] for r in ok if r["config"] == config
                             and r.get("round") == round_
                             and (r["model"], r["workers"], r["rate"])
                             == (a["model"], a["workers"], a["rate"])), None)
            mine = step(a["config"])
            theirs = [step(r["config"]) for r in others]
            if mine and all(theirs):  # a round whose fastest failed says nothing
                ratios.append(mine / min(theirs))
        if ratios:
            out.append((a["model"], a["workers"], a["rate"], a["config"], fastest["config"],
                        statistics.median(ratios)))
    return out


def fmt_ms(ms):
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}"


BUSY_SHARE = 0.25  # other processes took more than this share of the cores: flagged


def _busy(run):
    return bool(run) and run.get("status") == "ok" and \
        run["other_cpu_cores"] > BUSY_SHARE * (os.cpu_count() or 1)


def _find(runs, model, rate, n, config, kinds=("main",)):
    for r in runs:
        if (r["model"], r["rate"], r["workers"], r["config"]) == (model, rate, n, config) \
                and r["kind"] in kinds and r.get("status"):
            return r
    return None


def _table(header, align, rows):
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _failed_row(cells_runs, ncols):
    """If every run of a row failed for one reason: a row that says so, else None."""
    done = [r for r in cells_runs if r is not None]
    if done and all(r["status"] == "failed" for r in done):
        reasons = list(dict.fromkeys(r["reason"].replace(" (not run again)", "")
                                     for r in done))
        if len(reasons) == 1:
            return [f"failed: {_cell(reasons[0])}"] + ["–"] * (ncols - 1)
    return None


def _cell(text):
    return text.replace("|", "\\|")


def _config_rows(configs, cells_for, ncols, fill):
    """One row per configuration: its name, then ``fill(its runs)``, or why it failed."""
    rows = []
    for c in configs:
        cell_runs = cells_for(c)
        failed = _failed_row(cell_runs, ncols)
        rows.append([f"`{c}`"] + (failed if failed else fill(cell_runs)))
    return rows


def render_markdown(report, args):
    raw = report["runs"]
    runs = combine_rounds(raw)
    ok = [r for r in runs if r.get("status") == "ok"]
    repeats = getattr(args, "repeats", 1)
    configs = [STOCK] + args.configs
    rates = sorted(args.rates, key=rate_bps, reverse=True)  # fastest first
    fast, slow = rates[0], rates[-1]
    lines = ["# Bandwidth-limited cluster: step time and bytes on the wire", ""]
    lines += _common.run_header(report)
    lines.append(f"Links: `{report['link']}`. Workers at {SUBNET}.1..N, one network "
                 "namespace each.  ")
    datasets = sorted({r["dataset"] for r in ok})
    notes = sorted({r["dataset_note"] for r in ok if r.get("dataset_note")})
    models_desc = []
    for m in args.models:
        r = next((x for x in ok if x["model"] == m), None)
        if r:
            arch = " (784-2048-2048-10)" if m == "wide_mlp" else ""
            models_desc.append(f"{m}{arch}: {r['params']:,} parameters, "
                               f"{fmt_bytes(r['dense_bytes'])} of gradients")
    lines.append(f"Data: {', '.join(datasets) or '–'}"
                 + (" (real)" if datasets == ["fashion_mnist"] else "")
                 + (f" ({'; '.join(notes)})" if notes else "")
                 + f", batch {args.batch_size} per worker, momentum SGD (plain SGD with a "
                 "compressor that applies the momentum itself: dgc, momentum=m). "
                 + "; ".join(models_desc) + ".  ")
    lines.append(f"Step time: median of worker 0's {args.steps} timed batches after "
                 f"{args.warmup} warm-up batches"
                 + (f"; the median of {repeats} rounds' (at each rate every configuration "
                    "once a round, round after round)" if repeats > 1 else "")
                 + ". Speed-up: stock median / this median at the same model, rate and N"
                 + (" (each round's, then their median)" if repeats > 1 else "")
                 + ". Bytes: per worker and step, MB = 10^6 bytes. "
                 "`veth sent`: the worker's link counter (tx_bytes of its veth, mean over "
                 "workers), everything on the wire; `strategy`: "
                 "`compression_stats()` sent_bytes (for stock: the ring formula "
                 "2(N-1)/N x gradient bytes).")
    if any(c.split("@")[0].split(":")[0] == "auto" for c in args.configs):
        if getattr(args, "auto_plan", "first") == "settled":
            settle = report["auto_settle"]
            lines.append("`auto`: the plan it keeps once training leaves its critical regimes, "
                         f"low rank included ({settle['steps']} steps under "
                         "`AutoPlanCallback` before the warm-up: intervals of "
                         f"{settle['every']} steps, every regime ended at the second "
                         "interval's end), listed below.")
        else:
            lines.append("`auto`: its first plan (made at the first step; quantizers only, "
                         "as without `AutoPlanCallback`), listed below.")
    lines.append("")

    groups = list(dict.fromkeys((r["model"], r["workers"]) for r in runs if r["kind"] == "main"))
    for model, n in groups:
        lines += [f"## {model}, {n} workers", ""]
        header = ["configuration"] + [f"{rate_label(r)} ms" for r in rates]
        if len(rates) > 1:
            header.append(f"compute floor ({rate_label(fast)}) / {rate_label(slow)}")
        header += [f"speed-up {rate_label(r)}" for r in rates]
        flagged = []

        def times(cell_runs):
            row = []
            for r in cell_runs:
                row.append("–" if r is None else
                           fmt_ms(r["median_ms"]) + ("†" if _busy(r) else "")
                           if r["status"] == "ok" else "failed")
                flagged.append(_busy(r))
            if len(rates) > 1:
                f_, s_ = cell_runs[0], cell_runs[-1]
                if f_ and s_ and f_["status"] == s_["status"] == "ok":
                    row.append(f"{fmt_ms(f_['median_ms'])} / {fmt_ms(s_['median_ms'])} ms "
                               f"({100 * f_['median_ms'] / s_['median_ms']:.0f} %)")
                else:
                    row.append("–")
            for r in cell_runs:
                row.append(f"{r['speedup']:.2f}×" if r and r.get("speedup") else "–")
            return row

        at_rates = lambda c: [_find(runs, model, r, n, c) for r in rates]  # noqa: E731
        rows = _config_rows(configs, at_rates, len(header) - 1, times)
        lines += _table(header, ["l"] + ["r"] * (len(header) - 1), rows)
        lines.append("")
        if any(flagged):
            lines += [f"† other processes took more than {BUSY_SHARE:.0%} of the "
                      f"{os.cpu_count()} cores during the timed steps (`other_cpu_cores` in "
                      "the JSON): that figure is slowed by load that is not the benchmark's.", ""]

        slower = [r for r in rates if r != fast]
        if slower:
            lines += [f"Overlap: each setting's step against its compute floor (its own step "
                      f"at {rate_label(fast)}) and its wire time (the busiest worker's veth "
                      "bytes per step at the link's rate): step / max(floor, wire) is 1 when "
                      "one hides the other entirely, step / (floor + wire) is 1 when they do "
                      "not overlap at all.", ""]
            header = ["configuration", "link", "step ms", "floor ms", "wire ms",
                      "max(floor, wire)", "floor + wire", "step / max", "step / sum"]
            rows = []
            for c in configs:
                for rate in slower:
                    r = _find(runs, model, rate, n, c)
                    if not r or "vs_max" not in r:
                        continue
                    rows.append([f"`{c}`", rate_label(rate), fmt_ms(r["median_ms"]),
                                 fmt_ms(r["floor_ms"]), fmt_ms(r["wire_ms"]),
                                 fmt_ms(max(r["floor_ms"], r["wire_ms"])),
                                 fmt_ms(r["floor_ms"] + r["wire_ms"]),
                                 f"{r['vs_max']:.2f}", f"{r['vs_sum']:.2f}"])
            if rows:
                lines += _table(header, ["l", "l"] + ["r"] * 7, rows)
                lines.append("")

        header = ["configuration"] + [f"veth sent {rate_label(r)}" for r in rates] + \
                 ["strategy sent", "veth / strategy", "dense ring"]

        def sent(cell_runs):
            row = ["–" if r is None else
                   fmt_bytes(r["veth_tx_per_step"]) if r["status"] == "ok" else "failed"
                   for r in cell_runs]
            ref = next((r for r in cell_runs if r and r["status"] == "ok"), None)
            if ref:
                strat = ref["strategy_sent_per_step"]
                row += [fmt_bytes(strat) + (" (formula)" if ref["config"] == STOCK else ""),
                        f"{ref['veth_tx_per_step'] / strat:.2f}" if strat else "–",
                        fmt_bytes(ref["dense_sent_per_step"])]
            else:
                row += ["–"] * 3
            return row

        rows = _config_rows(configs, at_rates, len(header) - 1, sent)
        lines += _table(header, ["l"] + ["r"] * (len(header) - 1), rows)
        lines.append("")

    # Bytes vs N, at the bytes rate, from every run there (main or bytes sweep).
    ns = sorted({r["workers"] for r in runs if r["rate"] == args.bytes_rate})
    if len(ns) > 1 or args.bytes_workers:
        for model in args.models:
            lines += [f"## Bytes per worker per step vs N: {model}, {rate_label(args.bytes_rate)}",
                      "", "veth sent / strategy's figure; timed steps: "
                      f"{args.bytes_steps} (bytes sweep) or {args.steps} (step-time sweep).", ""]
            header = ["configuration"] + [f"N={n}" for n in ns]

            def per_n(cell_runs):
                return ["–" if r is None else "failed" if r["status"] != "ok" else
                        f"{fmt_bytes(r['veth_tx_per_step'])} / "
                        f"{fmt_bytes(r['strategy_sent_per_step'])}" for r in cell_runs]

            rows = _config_rows(
                configs, lambda c, model=model: [
                    _find(runs, model, args.bytes_rate, n, c, ("main", "bytes")) for n in ns],
                len(header) - 1, per_n)
            lines += _table(header, ["l"] + ["r"] * len(ns), rows)
            lines.append("")

    against = auto_against_fixed(raw)
    if against:
        lines += ["## `auto` against the fastest fixed setting", "",
                  "auto's step over that of the fastest other tfgc configuration of the "
                  "same model, N and rate"
                  + (" (each round's fastest, then the median over rounds)" if repeats > 1
                     else "") + ".", ""]
        rows = [[f"`{cfg}`", model, str(n), rate_label(rate), f"`{fastest}`", f"{ratio:.2f}"]
                for model, n, rate, cfg, fastest, ratio in against]
        lines += _table(["configuration", "model", "N", "link", "fastest fixed", "ratio"],
                        ["l", "l", "r", "l", "l", "r"], rows)
        lines.append("")
    rounds = [r for r in ok if len(r.get("rounds_ms") or ()) > 1]
    if rounds:
        lines += ["## Each round's median step", ""]
        rows = [[f"`{r['config']}`", r["model"], str(r["workers"]), rate_label(r["rate"]),
                 ", ".join("not run" if t is None else t if isinstance(t, str) else fmt_ms(t)
                           for t in r["rounds_ms"])]
                for r in rounds]
        lines += _table(["configuration", "model", "N", "link", "ms, round by round"],
                        ["l", "l", "r", "l", "l"], rows)
        lines.append("")

    planned = [r for r in raw if r.get("status") == "ok" and r.get("plan")]
    if planned:
        # What compressor="auto" sent each gradient as: labels counted, largest first.
        lines += ["## What `auto` planned", ""]
        for r in planned:
            counts = {}
            for entry in r["plan"]:
                label = entry.split("=", 1)[1].split("@")[0]
                counts[label] = counts.get(label, 0) + 1
            kinds = ", ".join(f"{label} x{k}" for label, k in
                              sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
            pace = r.get("plan_pace")
            sets = r.get("plan_sets", 1)
            shared = (f" (of which {pace[3] * 1e3:.1f} ms the other sets' communication)"
                      if pace and len(pace) > 3 and pace[3] else "")
            weighed = ("" if not pace else
                       " Weighed by the steps that ran" + (" (the set reduced last)" if sets > 1
                                                           else "")
                       + f": compute {pace[0] * 1e3:.1f} ms{shared} + "
                       f"{pace[1]:.2f} x the predicted communication, {pace[2]:g} more "
                       "steps for a whole low-rank budget.")
            back = r.get("auto_went_back")
            if back:  # the settle went back to a plan whose steps ran faster
                weighed += (f" The settle went back {back} time{'s' if back > 1 else ''} "
                            "to a plan that had run faster than the planner's later "
                            "choice.")
            apart = f" in {sets} sets (a plan each)" if sets > 1 else ""
            lines.append(f"- `{r['config']}`, {r['model']}, {r['workers']} workers, "
                         f"{rate_label(r['rate'])}"
                         + (f" (round {r['round'] + 1})" if "round" in r else "")
                         + f": {len(r['plan'])} gradients planned"
                         f"{apart}: {kinds}.{weighed} Figures: {r['plan_figures']}")
        lines.append("")

    lines += render_pins(raw)

    failures = [r for r in raw if r.get("status") == "failed"]
    if failures:
        lines += ["## Failed runs", ""]
        for r in failures:
            lines.append(f"- `{r['config']}`, {r['model']}, N={r['workers']}, {r['rate']}"
                         + (f" (round {r['round'] + 1})" if "round" in r else "")
                         + f": failed: {r['reason']}")
        lines.append("")
    missing = [r for r in raw if not r.get("status")]
    if missing:
        lines.append(f"{len(missing)} planned run(s) did not happen (interrupted).")
        lines.append("")
    return "\n".join(lines)


def pin_summary(rows):
    """``--auto_pins``' rows of one run, by label in the order first run: the passes'
    medians, their mean, the predicted communication (the mean of the passes', which
    differ where the link was measured again between them), the step less that, and
    the labels the plan sent (a row with no finite step is left out). Then the pairs
    of labels, counted as ``order`` (the predictions order them as their mean steps
    ran), ``close`` (their passes' ranges overlap, or their predictions are equal: too
    close to order) or ``out`` (out of order)."""
    by = {}
    for row in rows:
        if math.isfinite(row["median_ms"]):
            by.setdefault(row["pin"], []).append(row)
    table = []
    for label, runs in by.items():
        medians = [r["median_ms"] for r in sorted(runs, key=lambda r: r["pass"])]
        step = sum(medians) / len(medians)
        predicted = sum(r["predicted_ms"] for r in runs) / len(runs)
        table.append({"pin": label, "passes": medians, "step": step, "predicted": predicted,
                      "rest": step - predicted, "labels": runs[-1]["labels"],
                      "more_steps": runs[-1].get("more_steps")})
    counts = {"order": 0, "close": 0, "out": 0}
    for i, a in enumerate(table):
        for b in table[i + 1:]:
            overlap = (min(a["passes"]) <= max(b["passes"])
                       and min(b["passes"]) <= max(a["passes"]))
            if overlap or round(a["predicted"], 6) == round(b["predicted"], 6):
                counts["close"] += 1
            elif (b["step"] > a["step"]) == (b["predicted"] > a["predicted"]):
                counts["order"] += 1
            else:
                counts["out"] += 1
    return table, counts


def render_pins(raw):
    """The ``--auto_pins`` section, or no lines."""
    pinned = [r for r in raw if r.get("status") == "ok" and r.get("pins")]
    if not pinned:
        return []
    lines = ["## Plans pinned by hand: measured step against the predicted communication",
             "",
             "After `auto`'s own plan, the same cluster pinned each label on every gradient "
             "(`pin_plan`; `own`: the plan the run timed, pinned by name), in two passes, "
             "the second in reverse order. Step: the median of each pass's timed steps; "
             "predicted: "
             "`Plan.step_seconds()` summed over the step's sets of gradients (codec CPU, "
             "wire and latency). Step less predicted is what the planner's model takes as "
             "compute: the same for every plan where its prices are right (less where "
             "communication overlaps compute). More steps: what the planner's prior "
             "(`low_rank_steps` times the share of the low-rank budget a set's plan "
             "uses, the most of the sets') says its low-rank and top-k error costs in "
             "steps; quantizers count in the error budget instead. Gradients a label "
             "does not take go as float32.", ""]
    for r in pinned:
        table, counts = pin_summary(r["pins"])
        lines += [f"### `{r['config']}`, {r['model']}, {r['workers']} workers, "
                  f"{rate_label(r['rate'])}"
                  + (f" (round {r['round'] + 1})" if "round" in r else ""), ""]
        rows = []
        for t in sorted(table, key=lambda t: t["step"]):
            sent = ", ".join(f"{label} x{k}" for label, k in
                             sorted(t["labels"].items(), key=lambda kv: (-kv[1], kv[0])))
            more = t["more_steps"]
            rows.append([f"`{t['pin']}`", ", ".join(fmt_ms(m) for m in t["passes"]),
                         fmt_ms(t["step"]), fmt_ms(t["predicted"]), fmt_ms(t["rest"]),
                         "" if more is None else f"{more:.0%}", sent])
        lines += _table(["pinned", "step ms by pass", "step ms", "predicted ms",
                         "step - predicted", "more steps (prior)", "sent as"],
                        ["l", "r", "r", "r", "r", "r", "l"], rows)
        rests = [t["rest"] for t in table]
        pairs = sum(counts.values())
        lines += ["", f"Of the {pairs} pairs of plans, the predictions order {counts['order']} "
                  f"as their steps ran and {counts['out']} the other way; in "
                  f"{counts['close']} the two plans' passes overlap (or their predictions "
                  f"are equal), too close to order. Step less predicted: "
                  f"from {fmt_ms(min(rests))} to {fmt_ms(max(rests))} ms."
                  + own_against_fastest(table)
                  + (f" The pins stopped early: {r['pins_failed']}."
                     if r.get("pins_failed") else ""), ""]
    return lines


def lossless_ms(row):
    """A ``pin_summary`` row's step times one plus its prior's extra steps: its time
    per step of a plan that loses nothing (None where the prior is not known)."""
    more = row.get("more_steps")
    return None if more is None else row["step"] * (1.0 + more)


def own_against_fastest(table):
    """A sentence: ``own``'s time per lossless step against the fastest pinned
    label's ("" where ``own`` or the priors are missing)."""
    timed = {t["pin"]: lossless_ms(t) for t in table if lossless_ms(t) is not None}
    others = {pin: ms for pin, ms in timed.items() if pin != "own"}
    if "own" not in timed or not others:
        return ""
    fastest = min(others, key=lambda pin: (others[pin], pin))
    return (f" Per step of a lossless plan (step x (1 + more steps)): `own` "
            f"{fmt_ms(timed['own'])} ms, {timed['own'] / others[fastest]:.2f}x the "
            f"fastest label pinned everywhere, `{fastest}` ({fmt_ms(others[fastest])} ms).")


PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22", "#393b79", "#637939"]


DASHES = ["", "6,3", "2,3", "8,3,2,3", "1,2"]


def _nice_max(v):
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * exp >= v:
            return m * exp
    return 10 * exp


def render_svg(report, args):
    """Per model: speed-up vs link rate, and bytes per worker per step vs N."""
    runs = [r for r in combine_rounds(report["runs"]) if r.get("status") == "ok"]
    configs = [STOCK] + args.configs
    color = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(configs)}
    pw, ph, left, gap, top = 420, 260, 80, 130, 50
    row_h = ph + 100
    width = left + 2 * pw + gap + 30
    body = []
    models = [m for m in args.models if any(r["model"] == m for r in runs)] or args.models[:1]
    for mi, model in enumerate(models):
        y0 = top + mi * row_h
        # Panel 1: speed-up vs link rate (log x), one line per config, dash per N.
        mine = [r for r in runs if r["model"] == model and r["kind"] == "main"]
        rates = sorted({rate_bps(r["rate"]) for r in mine} or {1e8, 1e10})
        xlim = (rates[0] / 2, rates[-1] * 2)
        sp = [r["speedup"] for r in mine if r.get("speedup")]
        ymax = _nice_max(max(sp + [1.0]) * 1.08)
        p = Panel(body, left, y0, pw, ph, xlim, (0, ymax), xlog=True)
        step = _nice_max(ymax / 6)
        yt = [(i * step, f"{i * step:g}×") for i in range(int(ymax / step + 1e-9) + 1)]
        xt = [(b, rate_label(b)) for b in rates]
        ns = sorted({r["workers"] for r in mine})
        p.frame(f"{model}: speed-up vs stock"
                + (f", N={ns[0]}" if len(ns) == 1 else ", N: " + " ".join(map(str, ns))),
                "link rate (log scale)", "speed-up (stock = 1×)", xt, yt)
        y1 = p.py(1.0)
        body.append(f'<line x1="{left}" y1="{y1:.1f}" x2="{left + pw}" y2="{y1:.1f}" '
                    'stroke="#000" stroke-width="1" stroke-dasharray="4,4"/>')
        stock = {(r["rate"], r["workers"]): r for r in mine if r["config"] == STOCK}
        for ni, n in enumerate(ns):
            for c in configs:
                got = sorted(((rate_bps(r["rate"]), r["speedup"]), _busy(r) or _busy(
                    stock.get((r["rate"], n)))) for r in mine
                    if r["config"] == c and r["workers"] == n and r.get("speedup"))
                if got:
                    p.series([pt for pt, _ in got], color[c], DASHES[ni % len(DASHES)],
                             ringed=[i for i, (_, busy) in enumerate(got) if busy])
        # Panel 2: bytes per worker per step vs N (log-log).
        at = [r for r in runs if r["model"] == model and r["rate"] == args.bytes_rate]
        nvals = sorted({r["workers"] for r in at}) or [2, 4, 8]
        vals = [r[k] for r in at for k in ("veth_tx_per_step", "strategy_sent_per_step")
                if r.get(k) and r[k] > 0]
        lo = 10 ** math.floor(math.log10(min(vals))) if vals else 1e3
        hi = 10 ** math.ceil(math.log10(max(vals))) if vals else 1e8
        if hi <= lo:
            hi = lo * 10
        x0 = left + pw + gap
        q = Panel(body, x0, y0, pw, ph, (nvals[0] / 1.3, nvals[-1] * 1.3), (lo, hi),
                   xlog=True, ylog=True)
        yt = [(10 ** e, fmt_bytes(10 ** e).replace(".0", ""))
              for e in range(int(math.log10(lo)), int(math.log10(hi)) + 1)]
        q.frame(f"{model}: bytes per worker per step, {rate_label(args.bytes_rate)}",
                "workers N (log scale)", "bytes sent per worker per step",
                [(n, str(n)) for n in nvals], yt)
        for c in configs:
            mine_c = sorted(((r["workers"], r) for r in at if r["config"] == c),
                            key=lambda t: t[0])
            veth = [(n, r["veth_tx_per_step"]) for n, r in mine_c if r["veth_tx_per_step"] > 0]
            strat = [(n, r["strategy_sent_per_step"]) for n, r in mine_c
                     if r["strategy_sent_per_step"] and r["strategy_sent_per_step"] > 0]
            if veth:
                q.series(veth, color[c])
                # (bytes do not depend on the CPU load: no rings here)
            if strat:
                q.series(strat, color[c], "4,3", hollow=True)

    # Legend below the panels: colours per configuration, then line styles.
    ly = top + len(models) * row_h - 20
    legend = []
    for i, c in enumerate(configs):
        col, rowi = i % 2, i // 2
        x, y = left + col * (pw + gap), ly + rowi * 20
        legend.append(f'<line x1="{x}" y1="{y - 4}" x2="{x + 28}" y2="{y - 4}" '
                      f'stroke="{color[c]}" stroke-width="3"/>')
        label = c if any(r["config"] == c for r in runs) else f"{c} (no data: failed)"
        legend.append(f'<text x="{x + 36}" y="{y}">{escape(label)}</text>')
    ly += ((len(configs) + 1) // 2) * 20 + 10
    notes = ["left: median step time of stock / of the configuration at the same rate and N; "
             "dashed black line = stock",
             "right: solid, filled = veth tx_bytes per worker (measured); dashed, hollow = "
             "the strategy's sent_bytes (stock: ring formula)"]
    if any(_busy(r) for r in runs):
        notes.append(f"grey ring: stock's or the configuration's step time was measured while "
                     f"other processes took more than {BUSY_SHARE:.0%} of the cores (noisy)")
    all_ns = sorted({r["workers"] for r in runs if r["kind"] == "main"})
    if len(all_ns) > 1:
        notes.append("left, line style per N: " + ", ".join(
            f"N={n} {'solid' if not DASHES[i % len(DASHES)] else 'dash ' + DASHES[i % len(DASHES)]}"
            for i, n in enumerate(all_ns)))
    for i, text in enumerate(notes):
        legend.append(f'<text x="{left}" y="{ly + i * 18}" fill="#444">{escape(text)}</text>')
    height = ly + len(notes) * 18 + 10
    title = (f"tfgc over shaped links ({report['started']}"
             + ("" if report["complete"] else ", incomplete") + ")")
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{left}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    return "\n".join(head + body + legend + ["</svg>", ""])
