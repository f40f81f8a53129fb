"""Output of the TTFT benchmark: terminal table, Markdown report, PNG plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "STRATEGIES", "format_markdown", "format_table", "write_plot"]

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
           "eff = (T_barrier − T_overlap)/(T_barrier − bound)", "",
           "| " + " | ".join(COLUMNS) + " |",
           "|" + "|".join("---" for _ in COLUMNS) + "|"]
    out += ["| " + " | ".join(_row(p)) + " |" for p in points]
    return "\n".join(out) + "\n"


def write_plot(points: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(p["link"] for p in points))
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    colors = {"recompute": "tab:gray", "barrier": "tab:red", "overlap": "tab:blue",
              "bound": "tab:green"}
    styles = ["-", "--", ":", "-."]
    for ax, link in zip(axes[0], links, strict=True):
        mine = [p for p in points if p["link"] == link]
        groups = list(dict.fromkeys((p["preset"], p["suffix_tokens"], p["batch"]) for p in mine))
        for gi, g in enumerate(groups):
            pts = sorted((p for p in mine if (p["preset"], p["suffix_tokens"], p["batch"]) == g),
                         key=lambda p: p["prefix_tokens"])
            x = [p["prefix_tokens"] for p in pts]
            tag = f"{g[0]} S={g[1]} B={g[2]}"
            ls = styles[gi % len(styles)]
            for s in STRATEGIES:
                ax.plot(x, [1e3 * p["ttft_s"][s] for p in pts], ls, marker="o",
                        color=colors[s], label=f"{s} ({tag})")
            ax.plot(x, [1e3 * p["bound_s"] for p in pts], ls, marker="x", color=colors["bound"],
                    alpha=0.7, label=f"bound ({tag})")
        ax.set_title(f"link: {link}")
        ax.set_xlabel("prefix tokens (restored)")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # recompute dwarfs the restores on a linear axis
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


