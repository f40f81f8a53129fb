"""What a replay's record says: each policy's summary of its served
requests (TTFT percentiles, queueing, tokens by source, the share within
the SLO), the Markdown table ``layerlift bench replay`` prints (and
``layerlift bench report`` puts on the results page), and the TTFT CDF.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerlift.engine.serve import Served

__all__ = ["format_markdown", "summary", "write_plot"]


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else 0.0


def summary(served: Sequence[Served], slo_s: float) -> dict[str, Any]:
    ttft = [s.ttft_s for s in served]
    tokens = {
        "device_hit": sum(s.result.device_hit_tokens for s in served),
        "restored": sum(s.result.restored_tokens for s in served),
        "computed": sum(s.result.computed_tokens for s in served),
    }
    total = sum(tokens.values())
    wall = max(s.finished for s in served) - min(s.submitted for s in served)
    return {
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "queue_p90_s": _pct([s.queue_s for s in served], 90),
        "within_slo_fraction": sum(t <= slo_s for t in ttft) / len(ttft),
        "served_from_cache_fraction": (tokens["device_hit"] + tokens["restored"]) / total,
        "tokens": tokens,
        # the arrival rate the trace offers (requests arrive open-loop): the
        # same for every policy that keeps up, not a measured capacity
        "offered_tokens_per_s": total / wall if wall > 0 else 0.0,
        "prompt_tokens_per_s": total / wall if wall > 0 else 0.0,  # old name, same value
        "served_s": wall,
    }


def format_markdown(out: dict[str, Any]) -> str:
    ideal = out["ideal_hit_fraction"]
    lines = [
        "| policy | TTFT p50 ms | p90 ms | p99 ms | queue p90 ms | within SLO | device hit | "
        "restored | computed | from cache | / ideal | offered tok/s | max KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in out["policies"].items():
        t = p["tokens"]
        frac = p["served_from_cache_fraction"]
        lines.append(
            f"| {name} | {p['ttft_p50_s'] * 1e3:.1f} | {p['ttft_p90_s'] * 1e3:.1f} | "
            f"{p['ttft_p99_s'] * 1e3:.1f} | {p['queue_p90_s'] * 1e3:.1f} | "
            f"{_f(p.get('within_slo_fraction'))} | {t['device_hit']} | "
            f"{t['restored']} | {t['computed']} | {frac:.3f} | {frac / ideal:.2f} | "
            f"{p.get('offered_tokens_per_s', p['prompt_tokens_per_s']):.0f} | "
            f"{out['details'][name]['max_kl']:.1e} |")
    s = out["scaling"]
    lines.append("")
    lines.append(
        f"{s['requests']} requests ({s['sample']}, seed {s['seed']}), blocks of "
        f"{s['block_tokens']} tokens (trace: {s['trace_block_tokens']}), clock x{s['time_scale']:g}"
        f" ({s['trace_span_s']:.0f} s of trace in {s['replay_span_s']:.1f} s), preset "
        f"{s['preset']}, pool {s['pool_bytes'] / 2**20:.1f} MiB = "
        f"{s['effective_pool_fraction']:.2f} of the working set; ideal hit fraction "
        f"{ideal:.3f}; KL over {out['kl_samples']} sampled requests per policy. Offered tok/s: "
        "the prompt tokens the trace offers per second of the replay (open-loop arrivals), "
        "not a measured capacity.")
    if s.get("pool_note"):
        lines.append(f"Note: {s['pool_note']}.")
    st, fl = out.get("setting"), out.get("fleet")
    if st is not None and fl is not None:
        sim = " (simulated)" if st["simulated"] else ""
        lines.append(
            f"Setting: {st['mode']}{sim}, {st['arch']}, profile {st['profile']}, token scale "
            f"{st['token_scale']}, link {', '.join(st['links'])}; {fl['instances']} instance(s), "
            f"router {fl['router']}; SLO: TTFT <= {fl['slo_ms']:g} ms.")
    for name, d in out["details"].items():
        hc, fc = d.get("host_cost") or {}, d.get("forward_clock")
        if hc:
            lines.append(
                f"`{name}`: host work charged for the bytes the token scale leaves out: "
                f"{hc['read_host_s']:.2f} s on {hc['read_bytes'] / 2**20:.1f} MiB read, "
                f"{hc['put_host_s']:.2f} s on {hc['put_bytes'] / 2**20:.1f} MiB put.")
        if fc:
            lines.append(
                f"`{name}`: forwards' wall time: {fc['modeled_s']:.2f} s modeled GPU, "
                f"{fc['waited_s']:.2f} s blocked on restores, {fc['host_s']:.2f} s host "
                f"({fc['forwards']:.0f} forwards).")
        if "prefetch_supported" in d and not d["prefetch_supported"]:
            lines.append(f"`{name}`: the engine has no cross-batch prefetch yet; "
                         "this row ran as plain overlap (prefetch_supported: false).")
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def write_plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, xs in out["ttft_s"].items():
        ys = np.sort(np.asarray(xs)) * 1e3
        ax.plot(ys, np.arange(1, len(ys) + 1) / len(ys), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, conversation trace replay")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
