"""Output of the TTFT benchmark: terminal table, Markdown report, PNG plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "EFF_ABOVE_1", "HEADER", "STRATEGIES", "format_markdown", "format_table",
           "table_notes", "write_plot"]

STRATEGIES = ("recompute", "barrier", "overlap")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


COLUMNS = ("link", "preset", "P", "S", "B", "recomp ms", "barrier ms", "overlap ms",
           "p90 b/o ms", "load ms", "compute ms", "a/c", "bound ms", "fwd start b/o ms",
           "model ms", "eff", "eff pair", "eff model", "speedup", "restored", "computed",
           "max KL", "ok")


def _row(p: dict[str, Any]) -> list[str]:
    t, t9, fs = p["ttft_s"], p["ttft_p90_s"], p["forward_start_s"]
    ok = p["kl_ok"] and p["restore_ok"]
    return [p["link"], p["preset"], str(p["prefix_tokens"]), str(p["suffix_tokens"]),
            str(p["batch"]), _ms(t["recompute"]), _ms(t["barrier"]), _ms(t["overlap"]),
            f"{_ms(t9['barrier'])}/{_ms(t9['overlap'])}", _ms(p["load_s"]),
            _ms(p["compute_s"]), _f(p["load_compute_ratio"]), _ms(p["bound_s"]),
            f"{_ms(fs['barrier'])}/{_ms(fs['overlap'])}", _ms(p["model_overlap_s"]),
            _f(p["efficiency"]), _f(p["efficiency_paired"]), _f(p["efficiency_model"]),
            _f(p["speedup"]), str(p["restored_tokens"]), str(p["computed_tokens"]),
            f"{p['max_kl']:.1e}", "yes" if ok else "NO"]


HEADER = ("TTFT = time to first token (from the prefill call to the next token's "
          "distribution), p50 over the measured repeats, in ms. P = prefix tokens (restored), "
          "S = suffix tokens (computed), B = batch size; every column is explained in "
          "docs/guide/benchmarks.md.")
EFF_ABOVE_1 = (
    "eff above 1 means the overlap came in below the bound. The bound is the performance "
    "model's estimate from the run's own per-layer profile, not a hard floor: it charges the "
    "barrier run's fixed overhead (lookup, PREPARE, issuing, hand-offs, logits: T_barrier - its "
    "load - Σc) in full, and the overlap run hides part of that behind the forward. Where the "
    "room T_barrier - bound is a few ms (on loopback, where the reads and the forward share "
    "the CPU cores), that and the run-to-run noise move eff far from 1 either way; eff pair "
    "(the median over repeats of the same ratio) is the steadier figure.")


def behind_note(p: dict[str, Any]) -> str | None:
    """One line for a point whose overlap came in behind its barrier on a
    link whose reads run on this machine's cores (not an emulated NIC): why,
    with the point's own load and forward times; None otherwise."""
    t = p["ttft_s"]
    if str(p["link"]).startswith("emulated") or t["overlap"] <= t["barrier"]:
        return None
    load, compute = p.get("load_s"), p.get("compute_s")
    alone = (f" (the load alone {_ms(load)} ms, the forward alone {_ms(compute)} ms)"
             if load is not None and compute is not None else "")
    busy = p.get("machine_cores") or {}
    over, barrier, cpus = busy.get("overlap"), busy.get("barrier"), p.get("machine_cpus")
    machine = (f"; the machine at {over:.1f} of its {cpus} cores in the overlap runs, "
               f"{barrier:.1f} in the barrier's" if over is not None and barrier is not None
               else "")
    return (f"note: {p['link']} P={p['prefix_tokens']} B={p['batch']}: overlap "
            f"{_ms(t['overlap'])} ms is behind the barrier's {_ms(t['barrier'])} ms: here "
            f"Mooncake's reads and the forward run on the same CPU cores{alone}{machine}, so "
            "a layer's read slows the layer computing beside it instead of hiding behind it "
            "(the emulated rows model a NIC that costs no core).")


def table_notes(points: Sequence[dict[str, Any]]) -> list[str]:
    """Notes printed under the table: one line per point whose overlap is
    behind its barrier on a link sharing the cores (:func:`behind_note`),
    one per point whose eff is above 1 (its room in ms), then
    :data:`EFF_ABOVE_1` once, if any eff is."""
    behind = [n for n in map(behind_note, points) if n is not None]
    notes = []
    for p in points:
        eff = p.get("efficiency")
        if eff is not None and eff > 1:
            t = p["ttft_s"]
            notes.append(
                f"note: {p['link']} P={p['prefix_tokens']} B={p['batch']}: eff {eff:.2f} > 1: "
                f"overlap {_ms(t['overlap'])} ms < bound {_ms(p['bound_s'])} ms; the room "
                f"T_barrier - bound is {_ms(t['barrier'] - p['bound_s'])} ms.")
    return [*behind, *notes, EFF_ABOVE_1] if notes else behind


def format_table(points: Sequence[dict[str, Any]]) -> str:
    rows = [list(COLUMNS)] + [_row(p) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(points: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = ["# LayerLift TTFT benchmark", "",
           f"- command: `{meta['command']}`",
           f"- machine: {meta['cores']} CPU core(s), device `{meta['device']}`, "
           f"torch threads {meta['torch_threads']}; wall time {meta['wall_s']:.0f} s",
           f"- TTFT p50 over {meta['repeats']} repeats after {meta['warmup']} warm-up; "
           "strategies in an order rotated per repeat, on the same prompts",
           "- link `mooncake-tcp-netns RATE`: real Mooncake TCP between namespace hosts "
           "(master, storage node, engines) across a link the kernel throttles to RATE "
           "(the hosts still share this machine's cores)",
           "- link `mooncake-tcp-loopback`: real Mooncake transfers over loopback TCP "
           "(they share the CPU cores with the forward); `emulated:…`: a modeled NIC "
           "(real bytes, no CPU cost)",
           "- load/compute: per-layer profile of the barrier run; bound = overhead + "
           "max(Σa + c_last, a_0 + Σc), overhead = T_barrier − Σa − Σc; "
           "eff = (T_barrier − T_overlap)/(T_barrier − bound)",
           f"- {HEADER}", "",
           "| " + " | ".join(COLUMNS) + " |",
           "|" + "|".join("---" for _ in COLUMNS) + "|"]
    out += ["| " + " | ".join(_row(p)) + " |" for p in points]
    notes = table_notes(points)
    if notes:
        out += ["", *(f"- {n.removeprefix('note: ')}" for n in notes)]
    return "\n".join(out) + "\n"


BOUND_NOTE = ("* bound: the performance model's lowest TTFT for an overlap of this run's "
              "per-layer loads and computes, overhead + max(Σa + c_last, a_0 + Σc) "
              "(docs/design.md §5)")


def _settings(points: Sequence[dict[str, Any]]) -> tuple[str, list[str]]:
    """The settings every point shares, for the title, and the names of the
    ones that vary (preset, S, B), for the legend."""
    keys = (("preset", "preset {}"), ("suffix_tokens", "suffix {} tokens"), ("batch", "batch {}"))
    shared = [fmt.format(points[0][k]) for k, fmt in keys
              if len({p[k] for p in points}) == 1]
    varying = [k for k, _ in keys if len({p[k] for p in points}) > 1]
    return ", ".join(shared), varying


def write_plot(points: Sequence[dict[str, Any]], path: str) -> None:
    """TTFT p50 against the prefix, one panel per link: the three strategies
    and the bound. Settings shared by every point go in the title, only the
    varying ones into the legend; fonts >= 9 pt at the saved size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(p["link"] for p in points))
    shared, varying = _settings(points)
    fmts = {"preset": "{}", "suffix_tokens": "S={}", "batch": "B={}"}
    with plt.rc_context({"font.size": 10, "legend.fontsize": 9, "axes.titlesize": 11,
                         "xtick.labelsize": 9, "ytick.labelsize": 9}):
        fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4.6), squeeze=False)
        colors = {"recompute": "tab:gray", "barrier": "tab:red", "overlap": "tab:blue",
                  "bound": "tab:green"}
        styles = ["-", "--", ":", "-."]
        for ax, link in zip(axes[0], links, strict=True):
            mine = [p for p in points if p["link"] == link]
            groups = list(dict.fromkeys(tuple(p[k] for k in varying) for p in mine))
            for gi, g in enumerate(groups):
                pts = sorted((p for p in mine if tuple(p[k] for k in varying) == g),
                             key=lambda p: p["prefix_tokens"])
                x = [p["prefix_tokens"] for p in pts]
                tag = " ".join(fmts[k].format(v) for k, v in zip(varying, g, strict=True))
                tag = f" ({tag})" if tag else ""
                ls = styles[gi % len(styles)]
                for s in STRATEGIES:
                    ax.plot(x, [1e3 * p["ttft_s"][s] for p in pts], ls, marker="o",
                            color=colors[s], label=f"{s}{tag}")
                ax.plot(x, [1e3 * p["bound_s"] for p in pts], ls, marker="x",
                        color=colors["bound"], alpha=0.7, label=f"bound{tag} *")
            ticks = sorted({p["prefix_tokens"] for p in mine})
            ax.set_title(f"{link} (a modelled NIC)" if link.startswith("emulated:") else link)
            ax.set_xlabel("prefix tokens (restored)")
            ax.set_ylabel("TTFT p50 (ms)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_yscale("log")  # recompute dwarfs the restores on a linear axis
            ax.grid(True, alpha=0.3)
            ax.legend(loc="upper left")
        fig.suptitle(f"Time to first token (TTFT), {shared}" if shared
                     else "Time to first token (TTFT)")
        fig.text(0.5, 0.01, BOUND_NOTE, ha="center", va="bottom", fontsize=9, wrap=True)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
