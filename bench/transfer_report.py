"""The transfer benchmarks' tables and plots: ``bench transfer``'s
(:func:`render_table`, :func:`plot_record`) and what the host transfer
benchmarks (``transfer-sglang``, ``transfer-vllm``) render with
(:func:`host_rows_table`, :func:`plot_kinds`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from layerlift.bench.thread_cpu import GROUPS as THREAD_GROUPS
from layerlift.bench.transfer_profile import PARTS as PROFILE_PARTS

__all__ = ["RAW_CHECKED", "RAW_LOAD", "RAW_PUT", "bar_groups", "host_rows_table", "plot_kinds",
           "plot_record", "render_table"]

RAW_LOAD, RAW_PUT = "raw ranged d4", "raw put"  # the host transfer benchmarks' raw rows
RAW_CHECKED = "raw ranged d4 + check"  # the raw read with LayerLift's check, nothing else


def _q(x: dict[str, float]) -> str:
    return f"{x['min']:.2f}/{x['median']:.2f}/{x['max']:.2f}"


def _cores(case: dict[str, Any], key: str, mode: str) -> str:
    """The median cores busy of ``mode`` (``-`` in a record from before they were kept)."""
    spread = case.get(key, {}).get(mode)
    return "-" if spread is None else f"{spread['median']:.2f}"


def _mode_rows(record: dict[str, Any], kind: str, ratios: list[str]) -> list[str]:
    """One table of ``kind`` (``loads``, ``offloads``): a row per link, case and
    mode, its GB/s, its ``ratios`` (record keys, headed by what follows the
    kind) and its cores, the process's and the machine's."""
    heads = [r.removeprefix(kind).strip() for r in ratios]
    lines = ["| link | case | mode | GB/s | " + " | ".join(heads) + " | cores | machine |",
             "|---|---|---|---|" + "---|" * (len(ratios) + 2)]
    for link, cases in record["links"].items():
        for case, c in cases.items():
            for mode, g in c[kind].items():
                cells = [_q(g), *(_q(c[r][mode]) for r in ratios),
                         _cores(c, f"{kind} cores", mode),
                         _cores(c, f"{kind} machine cores", mode)]
                lines.append(f"| {link} | {case} | {mode} | " + " | ".join(cells) + " |")
    return lines


def _thread_rows(record: dict[str, Any]) -> list[str]:
    """Where each row's process cores went, by kind of thread (medians; the
    rows that kept them: none in a record from before they were)."""
    rows = [(link, case, kind, row, t)
            for link, cases in record["links"].items() for case, c in cases.items()
            for kind in ("loads", "offloads") for row, t in c.get(f"{kind} threads", {}).items()]
    if not rows:
        return []
    lines = ["Where the process's cores go (median cores by kind of thread: `store calls`: "
             "LayerLift's threads that each run one blocking call of Mooncake's client; "
             "`native`: threads Python did not start, Mooncake's transfer engine's own; "
             "`main`: the main thread; `python`: every other Python thread, LayerLift's "
             "lanes (its checksums, copies and call lists) and the raw rows' pool; "
             "`ended`: threads that ended during the step)", "",
             "| link | case | kind | row | " + " | ".join(THREAD_GROUPS) + " |",
             "|---|---|---|---|" + "---|" * len(THREAD_GROUPS)]
    for link, case, kind, row, t in rows:
        cells = [f"{t[g]['median']:.2f}" if g in t else "-" for g in THREAD_GROUPS]
        lines.append(f"| {link} | {case} | {kind} | {row} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def render_table(record: dict[str, Any]) -> str:
    """The results page's tables: GB/s and ratios per link and case, then the profile."""
    lines = ["Loads (GB/s of page bytes, min/median/max; `/ ranged`: to the raw ranged "
             "read at the same depth, per-repeat ratios)", ""]
    lines += _mode_rows(record, "loads", ["loads / ranged", "loads / whole"])
    lines += ["", "Offloads (`/ raw put`: per-repeat ratios)", ""]
    lines += _mode_rows(record, "offloads", ["offloads / raw put"])
    lines += ["", "`cores`: this process's CPU time over the wall time, median (every "
              "thread, the store's transfer threads included; on loopback the storage "
              "node's too, it is in the process; over a namespace link it is not); "
              "`machine`: the cores busy on the whole machine meanwhile, every process "
              "and the kernel's own work (a namespace link's storage node, veth and "
              "`tbf`), median (`/proc/stat`; `-` where it was not kept)."]
    lines += ["", "Where the time goes (one run at depth 1, ms; `python`: the rest of the wall "
              "time; `overlapped`: the staged offload's puts run beside its staging, so its "
              "parts add up to more than the wall time; the ring offload's snapshot "
              "checksums each slice as it copies it: its CRC is in `copy`)", "", "| link | case | run | wall | " + " | ".join(PROFILE_PARTS)
              + " | python µs/slice |", "|---|---|---|---|" + "---|" * (len(PROFILE_PARTS) + 1)]
    for link, cases in record["links"].items():
        for case, c in cases.items():
            for run, p in c["profile"].items():
                over = p.get("overlapped", False)
                cells = " | ".join("-" if over and k == "python" else f"{p['ms'][k]:.1f}"
                                   for k in PROFILE_PARTS)
                per_slice = "-" if over else f"{p['python_us_per_slice']:.2f}"
                lines.append(f"| {link} | {case} | {run}{' (overlapped)' if over else ''} | "
                             f"{p['wall_ms']:.1f} | {cells} | {per_slice} |")
    lines += ["", f"{record.get('layout', '')}; {record.get('timing', '')}."]
    return "\n".join(lines)


def bar_groups(ax: Any, record: dict[str, Any], kind: str) -> None:
    """On ``ax``, the median GB/s of every row of ``kind`` (``loads`` or
    ``offloads``), one group of bars per link and case of ``record``; a row a
    case did not measure has no bar there."""
    groups = [(link, case, c) for link, cases in record["links"].items()
              for case, c in cases.items()]
    rows = list(dict.fromkeys(row for _, _, c in groups for row in c[kind]))
    width = 0.8 / len(rows)
    for k, row in enumerate(rows):
        ax.bar([i + k * width for i in range(len(groups))],
               [c[kind][row]["median"] if row in c[kind] else 0.0 for _, _, c in groups],
               width, label=row)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))],
                  [f"{link.replace('mooncake-tcp-', '')}\n{case}" for link, case, _ in groups],
                  fontsize=7)
    ax.set_ylabel("GB/s (median)")


def plot_kinds(record: dict[str, Any], path: str, kinds: Sequence[str],
               title: Callable[[str], str]) -> None:
    """One axis per kind of ``kinds`` (``loads``, ``offloads``) with its
    :func:`bar_groups`, titled ``title(kind)``, saved as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sum(len(cases) for cases in record["links"].values())
    fig, axes = plt.subplots(1, len(kinds), figsize=(max(6, 2.0 * groups) * len(kinds), 4),
                             squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        bar_groups(ax, record, kind)
        ax.set_title(title(kind))
        ax.legend(fontsize=7, ncol=2 if len(kinds) == 1 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_record(record: dict[str, Any], path: str) -> None:
    """Median GB/s of every load mode, one group per link and case."""
    plot_kinds(record, path, ["loads"],
               lambda kind: "Loads: LayerLift's staged transfer against raw Mooncake reads")


def host_rows_table(record: dict[str, Any], *, host: str,
                    paired: Callable[[dict[str, Any], str, str], dict[str, float] | None],
                    not_measured_in: Callable[[str, str], bool]) -> str:
    """The hosts' transfer tables (``transfer-sglang``, ``transfer-vllm``):
    loads, then offloads, per link and case, each row's GB/s, its ratio to
    the raw row and ``paired(case, kind, row)`` (its ratio to ``host``'s own
    path, or None); a row a case did not measure is listed under ``kind``
    where ``not_measured_in(kind, row)``, with the reason."""
    lines: list[str] = []
    for kind, ratio in (("loads", "loads / raw"), ("offloads", "offloads / raw")):
        base = RAW_LOAD if kind == "loads" else RAW_PUT
        lines += [f"{kind.capitalize()} (GB/s min/median/max; `/ raw`: to `{base}` of the "
                  "same round, per-repeat ratios)", "",
                  f"| link | case | row | GB/s | / raw | / {host} | cores | machine |",
                  "|---|---|---|---|---|---|---|---|"]
        for link, cases in record["links"].items():
            for case, c in cases.items():
                for row, g in c[kind].items():
                    vs = paired(c, kind, row)
                    lines.append(f"| {link} | {case} | {row} | {_q(g)} | {_q(c[ratio][row])} | "
                                 f"{'' if vs is None else _q(vs)} | "
                                 f"{_cores(c, kind + ' cores', row)} | "
                                 f"{_cores(c, kind + ' machine cores', row)} |")
                for row, why in c.get("not measured", {}).items():
                    if not_measured_in(kind, row):
                        lines.append(f"| {link} | {case} | {row} | not measured: {why} "
                                     "| | | | |")
        lines.append("")
    lines.append("`cores`: the process's CPU time over the wall time, median; `machine`: "
                 "the cores busy on the whole machine meanwhile, every process and the "
                 "kernel's own work, median (`/proc/stat`; `-` where it was not kept).")
    lines.append("")
    lines += _thread_rows(record)
    lines.append(f"{record.get('layout', '')}; {record.get('timing', '')}.")
    return "\n".join(lines)
