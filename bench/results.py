"""Tables and plots drawn from the benchmarks' JSON records, and ``docs/results.md``.

    layerlift bench report [--results bench/results] [--out docs/results.md] [--check]

One function per benchmark turns its record into a Markdown table (with a few
lines computed from the same numbers: ranges, worst cases), one draws its
plot. ``--markdown``/``--plot`` of every benchmark and the results page use
them, so the page is regenerated, never edited: ``--check`` (run by the
tests) fails when ``docs/results.md`` differs from what the JSON files give.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "build_page", "headline", "kind_of", "main", "plot", "render"]

Record = dict[str, Any]


def kind_of(record: Record) -> str:
    """The benchmark that wrote ``record``: its ``benchmark`` field, or (older
    records) recognised by shape. Raises ``ValueError`` for anything else."""
    if isinstance(record.get("benchmark"), str):
        return str(record["benchmark"])
    shapes = (("points", "ttft"), ("policies", "replay"), ("profiles", "sched"),
              ("grid", "overhead"), ("admitted_fraction", "pools"), ("links", "store"))
    for key, kind in shapes:
        if key in record:
            return kind
    raise ValueError(f"not a LayerLift benchmark record (keys: {sorted(record)[:8]})")


def _mm(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{1e3 * x:.{nd}f}"


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _span(xs: Sequence[float | None], nd: int = 2) -> str:
    got = [x for x in xs if x is not None]
    return "-" if not got else f"{min(got):.{nd}f} to {max(got):.{nd}f}"


def _ttft(r: Record) -> list[str]:
    pts = r["points"]
    head = ["link", "P", "S", "B", "recompute ms", "barrier ms", "overlap ms", "bound ms",
            "model ms", "eff (bound)", "eff (model)", "barrier/overlap", "restored", "max KL"]
    rows = [[p["link"], str(p["prefix_tokens"]), str(p["suffix_tokens"]), str(p["batch"]),
             _mm(p["ttft_s"]["recompute"]), _mm(p["ttft_s"]["barrier"]),
             _mm(p["ttft_s"]["overlap"]), _mm(p["bound_s"]), _mm(p["model_overlap_s"]),
             _f(p["efficiency"]), _f(p["efficiency_model"]), _f(p["speedup"]),
             str(p["restored_tokens"]), f"{p['max_kl']:.1e}"] for p in pts]
    out = [*_table(head, rows), ""]
    for link in dict.fromkeys(p["link"] for p in pts):
        mine = [p for p in pts if p["link"] == link]
        out.append(f"- `{link}`: overlap {_span([p['speedup'] for p in mine])}× the barrier's "
                   f"speed, eff (bound) {_span([p['efficiency'] for p in mine])}, eff (model) "
                   f"{_span([p['efficiency_model'] for p in mine])}")
    exact = all(p["kl_ok"] and p["restore_ok"] for p in pts)
    out.append(f"- every point restored its P tokens and matched the recompute: "
               f"{'yes' if exact else 'NO'} (max KL {max(p['max_kl'] for p in pts):.1e})")
    return out


def _replay(r: Record) -> list[str]:
    from layerlift.bench.replay import format_markdown

    return format_markdown(r).rstrip("\n").split("\n")


def _store(r: Record) -> list[str]:
    d = r.get("depth", 4)
    head = ["link", "page", "piece KiB", "whole GB/s", "d1 GB/s", f"d{d} GB/s",
            "d1/whole", f"d{d}/whole"]

    def q(x: dict[str, float]) -> str:
        return f"{x['min']:.2f}/{x['median']:.2f}/{x['max']:.2f}"

    rows = []
    for link, pages in r["links"].items():
        for page, p in pages.items():
            g = p["gbps"]
            rows.append([link, page, f"{p['layer_piece_bytes'] / 1024:.0f}", q(g["whole"]),
                         q(g["ranged d1"]), q(g[f"ranged d{d}"]), q(p["ranged d1 / whole"]),
                         q(p[f"ranged d{d} / whole"])])
    note = (f"min/median/max over the repeats; ratios are per-repeat (paired). "
            f"{r.get('layout', '')}; {r.get('timing', '')}.")
    return [*_table(head, rows), "", note]


def _sched(r: Record) -> list[str]:
    head = ["Σa/Σc", "load ms", "compute ms", "barrier ms", "overlap ms", "model ms",
            "eff (model)", "eff (strict)"]
    rows = [[_f(p["load_compute_ratio"], 1), _mm(p["load_s"]), _mm(p["compute_s"]),
             _mm(p["barrier_s"]), _mm(p["overlap_s"]), _mm(p["model_s"]),
             _f(p["efficiency_model"]), _f(p["efficiency_strict"], 3)] for p in r["profiles"]]
    note = ("eff (model) charges the barrier's fixed overhead to the model too; "
            "eff (strict) compares with the bare recurrence.")
    return [*_table(head, rows), "", note]


def _overhead(r: Record) -> list[str]:
    head = ["layers", "batch", "mode", "forward without µs", "with µs", "µs per layer"]
    rows = [[str(g["layers"]), str(g["batch"]), g["mode"], f"{g['forward_without_us']:.0f}",
             f"{g['forward_with_us']:.0f}", f"{g['per_layer_overhead_us']:.1f}"]
            for g in r["grid"]]
    return [*_table(head, rows), "",
            f"- worst per-layer overhead, fetch issued to wait returned: "
            f"{r['per_layer_overhead_us']:.0f} µs (target < 50 µs)",
            f"- worst wait when the data already landed: {r['wait_overhead_us']:.0f} µs",
            f"- stress case, one job per request per layer: "
            f"{r['per_request_jobs_overhead_us']:.0f} µs"]


def _pools(r: Record) -> list[str]:
    a = r["admitted_fraction"]
    names = {"unified": "unified tri-pool (boundaries move)",
             "static": "static split, proportional to the mean demand",
             "static_default": "static split, library default"}
    rows = [[label, _f(a["by_phase"][k]["phase1"]), _f(a["by_phase"][k]["phase2"]), _f(a[k])]
            for k, label in names.items()]
    out = [*_table(["pool", "phase 1", "phase 2", "overall"], rows), ""]
    by = a.get("by_total_mib", {})
    out.append("- by pool size: " + "; ".join(
        f"{mib} MiB {v['unified']:.2f} vs {v['static']:.2f}" for mib, v in by.items()))
    ops = r["alloc_ops_per_s"]
    for pool, comps in ops.items():
        out.append(f"- alloc+free, {pool}: " + ", ".join(
            f"{c} {v['single'] / 1e3:.0f} k ops/s" for c, v in comps.items()))
    return out


def _integrity(r: Record) -> list[str]:
    impl = r.get("crc_implementation", "zlib")
    crcs = r["crc"]
    if impl.startswith(("crc32c", "awscrt")):  # format l3: CRC-32C, CRC-32's speeds beside it
        isal = any("isal_crc32_gbps" in c for c in crcs)
        pkg = any("crc32c_package_gbps" in c for c in crcs)
        head = ["slice KiB", f"CRC-32C verify GB/s ({impl})",
                *(["crc32c package CRC-32C GB/s"] if pkg else []),
                *(["ISA-L CRC-32 GB/s"] if isal else []), "zlib CRC-32 GB/s", "torch hash GB/s"]
        rows = [[f"{c['slice_bytes'] / 1024:.0f}", _f(c["crc_verify_gbps"]),
                 *([_f(c["crc32c_package_gbps"]) if "crc32c_package_gbps" in c else "-"]
                   if pkg else []),
                 *([_f(c["isal_crc32_gbps"]) if "isal_crc32_gbps" in c else "-"] if isal else []),
                 _f(c["zlib_crc32_gbps"]), _f(c["torch_hash_gbps"])] for c in crcs]
        note = ("CRC-32C is the objects' checksum (format l3); the other columns time the same "
                "loop with the crc32c package's CRC-32C (the fallback) and with the checksum of "
                "format l2 (CRC-32)")
    else:  # a record of format l2 (CRC-32)
        head = ["slice KiB", f"CRC-32 verify GB/s ({impl})", "zlib CRC-32 GB/s",
                "torch hash GB/s"]
        rows = [[f"{c['slice_bytes'] / 1024:.0f}", _f(c["crc_verify_gbps"]),
                 _f(c["zlib_verify_gbps"]) if "zlib_verify_gbps" in c else "-",
                 _f(c["torch_hash_gbps"])] for c in crcs]
        note = "both CRCs compute the same CRC-32"
    out = [*_table(head, rows), "",
           f"- per CPU thread ({r.get('cpus', '?')} cores here, zlib {r.get('zlib', '?')}), "
           f"{r.get('repeats', '?')} repeats; {note}"]
    m = r.get("mooncake_footer_read")
    if m:
        out.append(f"- Mooncake loopback, {m['objects']} objects of {m['layers']} layers: a "
                   f"restore reads {100 * m['design_overhead_per_restore']:.1f} % longer with "
                   f"the footers (one footer entry per layer would cost "
                   f"{100 * m['entry_per_layer_overhead']:.1f} %); bytes exact: "
                   f"{'yes' if m['bytes_exact'] else 'NO'}")
    return out


def _store_full(r: Record) -> list[str]:
    head = ["store / working set", "restored fraction", "of the ideal", "puts failed",
            "backed off", "max KL"]
    ideal = r["ideal"]
    rows = [["unbounded (ideal)", _f(ideal["restored_fraction"], 3), "1.00",
             str(ideal["puts_failed"]), str(ideal["backed_off"]),
             f"{ideal['max_kl_sampled']:.1e}"]]
    rows += [[_f(x["fraction_of_working_set"]), _f(x["restored_fraction"], 3),
              _f(x["of_ideal"]), str(x["puts_failed"]), str(x["backed_off"]),
              f"{x['max_kl_sampled']:.1e}"] for x in r["rows"]]
    return [*_table(head, rows), "",
            f"- {r['prompts']} prompts of {r['tokens']} tokens ({r['preset']}), "
            f"{r['requests']} requests, each on an emptied device: every hit is the store's; "
            f"working set {r['working_set_bytes'] / 2**20:.0f} MiB"]


def _fleet_grid(r: Record) -> list[str]:
    from layerlift.bench.fleet_grid import render as render_grid

    lines = render_grid(r).rstrip("\n").split("\n")
    # Its own page's title, command and per-setting images stay on its page;
    # what it says of the run (what is simulated, the load) comes along.
    body = lines[4:] if len(lines) > 4 and lines[0].startswith("# ") else lines
    return [("#" + line if line.startswith("## ") else line) for line in body
            if not line.startswith("![")]


def _plot_bars(path: str, title: str, labels: Sequence[str],
               series: Mapping[str, Sequence[float]], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(series))
    for i, (name, ys) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels,
                  fontsize=7)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_ttft(r: Record, path: str) -> None:
    from layerlift.bench.report import write_plot

    write_plot(r["points"], path)


def _plot_replay(r: Record, path: str) -> None:
    from layerlift.bench.replay import write_plot

    write_plot(r, path)


def _plot_store(r: Record, path: str) -> None:
    d = r.get("depth", 4)
    labels = [f"{link.replace('mooncake-tcp-', '')} p{page}"
              for link, pages in r["links"].items() for page in pages]
    series = {m: [p[f"ranged {m} / whole"]["median"] for pages in r["links"].values()
                  for p in pages.values()] for m in ("d1", f"d{d}")}
    _plot_bars(path, "Mooncake per-layer ranged reads / whole-object reads (median)",
               labels, series, "ranged / whole")


def _plot_sched(r: Record, path: str) -> None:
    labels = [f"a/c {p['load_compute_ratio']:.1f}" for p in r["profiles"]]
    series = {k: [1e3 * p[f"{k}_s"] for p in r["profiles"]]
              for k in ("barrier", "overlap", "model")}
    _plot_bars(path, "The scheduler alone: timed loads and computes", labels, series, "ms")


def _plot_overhead(r: Record, path: str) -> None:
    modes = list(dict.fromkeys(g["mode"] for g in r["grid"]))
    cells = list(dict.fromkeys((g["layers"], g["batch"]) for g in r["grid"]))
    by = {(g["layers"], g["batch"], g["mode"]): g["per_layer_overhead_us"] for g in r["grid"]}
    series = {m: [by.get((n, b, m), 0.0) for n, b in cells] for m in modes}
    _plot_bars(path, "Per-layer scheduling overhead", [f"{n} layers, batch {b}" for n, b in cells],
               series, "µs per layer")


def _plot_fleet_grid(r: Record, path: str) -> None:
    from layerlift.bench.fleet_grid import plot as plot_grid

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_grid(r, out.parent, f"{out.stem}-")


def _plot_integrity(r: Record, path: str) -> None:
    labels = [f"{c['slice_bytes'] // 1024} KiB" for c in r["crc"]]
    series = {"CRC-32 verify": [c["crc_verify_gbps"] for c in r["crc"]],
              "torch hash": [c["torch_hash_gbps"] for c in r["crc"]]}
    _plot_bars(path, "Checksum throughput per CPU thread", labels, series, "GB/s")


def _plot_store_full(r: Record, path: str) -> None:
    labels = ["ideal", *(f"{x['fraction_of_working_set']:.2f}" for x in r["rows"])]
    series = {"restored fraction": [r["ideal"]["restored_fraction"],
                                    *(x["restored_fraction"] for x in r["rows"])]}
    _plot_bars(path, "A store smaller than the working set", labels, series, "fraction")


def _plot_pools(r: Record, path: str) -> None:
    by = r["admitted_fraction"]["by_phase"]
    series = {k: [v["phase1"], v["phase2"]] for k, v in by.items()}
    _plot_bars(path, "Requests admitted without eviction (equal bytes)",
               ["phase 1 (FULL-heavy)", "phase 2 (SWA+MAMBA-heavy)"], series, "fraction")


KINDS: dict[str, tuple[str, Callable[[Record], list[str]], Callable[[Record, str], None]]] = {
    "ttft": ("TTFT: recompute, whole-batch barrier, per-layer overlap", _ttft, _plot_ttft),
    "replay": ("Conversation trace replay through the serving loop", _replay, _plot_replay),
    "sched": ("The load scheduler alone", _sched, _plot_sched),
    "overhead": ("Per-layer scheduling overhead", _overhead, _plot_overhead),
    "store": ("Mooncake per-layer ranged reads against whole-object reads", _store, _plot_store),
    "pools": ("Tri-pool admission", _pools, _plot_pools),
    "fleet-grid": ("Fleet grid (simulated instances behind routers)", _fleet_grid,
                   _plot_fleet_grid),
    "store-full": ("A store smaller than the working set", _store_full, _plot_store_full),
    "integrity": ("What end-to-end checksums cost", _integrity, _plot_integrity),
    "sglang": ("LayerLift inside SGLang, beside SGLang's own Mooncake linker",
               lambda r: _host_bench("sglang_bench").render(r).splitlines(),
               lambda r, p: _host_bench("sglang_bench").plot(r, p)),
    "transfer": ("The staged transfer against raw Mooncake reads and puts at a real size",
                 lambda r: _host_bench("transfer").render_table(r).splitlines(),
                 lambda r, p: _host_bench("transfer").plot_record(r, p)),
    "transfer-sglang": ("SGLang's two linkers' loads and offloads beside raw Mooncake at a real size",
                        lambda r: _host_bench("transfer_sglang").render_table(r).splitlines(),
                        lambda r, p: _host_bench("transfer_sglang").plot_record(r, p)),
    "transfer-vllm": ("LayerLift's vLLM worker's restores and saves beside raw Mooncake at a "
                      "real size",
                      lambda r: _host_bench("transfer_vllm").render_table(r).splitlines(),
                      lambda r, p: _host_bench("transfer_vllm").plot_record(r, p)),
    "vllm": ("TTFT inside vLLM: no connector, vLLM's MooncakeStoreConnector, LayerLiftConnector",
             lambda r: _host_bench("vllm_bench").render(r).splitlines(),
             lambda r, p: _host_bench("vllm_bench").plot(r, p)),
}


def _host_bench(name: str) -> Any:
    """A host benchmark's module (imported when its record is drawn: its
    tables and plots live beside the benchmark)."""
    return importlib.import_module(f"layerlift.bench.{name}")


def _generic(r: Record) -> list[str]:
    """A benchmark without a table of its own yet: its scalar figures."""
    rows: list[list[str]] = []

    def walk(prefix: str, x: object) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k not in ("benchmark", "meta"):
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, bool | int | float | str) and len(rows) < 60:
            rows.append([prefix, f"{x:.4g}" if isinstance(x, float) else str(x)])

    walk("", r)
    return _table(["figure", "value"], rows)


def _section(record: Record) -> tuple[str, Callable[[Record], list[str]]]:
    kind = kind_of(record)
    if kind in KINDS:
        return KINDS[kind][0], KINDS[kind][1]
    return f"`layerlift bench {kind}`", _generic


def render(record: Record) -> str:
    """The Markdown table (and computed summary lines) for one record; a
    benchmark without a renderer in ``KINDS`` gets its scalar figures."""
    return "\n".join(_section(record)[1](record))


def plot(record: Record, path: str) -> None:
    """Draw ``record``'s plot into ``path`` (PNG; needs matplotlib). Raises
    ``ValueError`` for a benchmark that has no plot in ``KINDS``."""
    kind = kind_of(record)
    if kind not in KINDS:
        raise ValueError(f"no plot for benchmark {kind!r}: add one to KINDS in bench/results.py")
    KINDS[kind][2](record, path)


def headline(record: Record, link_prefix: str = "emulated") -> str:
    """The README's headline: overlap's speed-up over the barrier on the links
    starting with ``link_prefix``, as ``MIN-MAX×`` (a TTFT record)."""
    pts = [p for p in record["points"] if p["link"].startswith(link_prefix)]
    if not pts:
        raise ValueError(f"no point on a link starting with {link_prefix!r}")
    return _span([p["speedup"] for p in pts]) + "×"


def build_page(results: Path) -> str:
    """``docs/results.md``: one section per benchmark record under ``results``
    (subfolders included), in the order of ``KINDS``, each kind's main run
    first, then by path; JSON files that are not benchmark records (inputs
    such as a calibration profile) are listed at the end."""
    records, others = [], []
    for p in sorted(results.rglob("*.json")):
        data = json.loads(p.read_text())
        try:
            kind_of(data)
        except ValueError:
            others.append(p)
            continue
        records.append((p, data))
    order = list(KINDS)

    def rank(kind: str) -> int:
        return order.index(kind) if kind in order else len(order)

    # Within a kind, the main run first (``ttft_quick``: what ``make bench`` writes).
    records.sort(key=lambda pr: (rank(kind_of(pr[1])), kind_of(pr[1]),
                                 pr[0].stem not in ("ttft_quick", kind_of(pr[1])),
                                 str(pr[0].relative_to(results))))
    out = ["# Results", "",
           "Generated from `bench/results/*.json` by `layerlift bench report`: do not edit; "
           "rerun a benchmark with `--json`, then the report. What the columns mean and "
           "how to read them: [design.md §5](design.md#5-performance-model) and "
           "[the benchmarks guide](guide/benchmarks.md).", ""]
    for path, rec in records:
        title, table = _section(rec)
        rel = path.relative_to(results)
        cmd = rec.get("meta", {}).get("command", "(command not recorded)")
        out += [f"## {title}: `{rel}`", "", f"`{cmd}`", ""]
        png = path.with_suffix(".png")
        if png.exists():
            out += [f"![{path.stem}](../bench/results/{rel.with_suffix('.png')})", ""]
        out += [*table(rec), ""]
    if others:
        out += ["## Other data files", "",
                *(f"- `{p.relative_to(results)}` (not a benchmark record)" for p in others), ""]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    from layerlift.bench.args import BenchParser

    ap = BenchParser("layerlift bench report", __doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path("bench/results"),
                    help="folder of benchmark JSON records (default: bench/results, relative "
                         "to the current directory: run it from the repository's root)")
    ap.add_argument("--out", type=Path, default=Path("docs/results.md"),
                    help="the page to write (default: docs/results.md)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if --out differs from what the JSON gives")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``layerlift bench report``: write (or ``--check``) the results page."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        ap.error(f"argument --results: there is no folder {str(args.results)!r} here, so "
                 f"there is no results page to {'check' if args.check else 'build'}; run it "
                 "from the repository's root or pass --results and --out")
    page = build_page(args.results)
    if args.check:
        if not args.out.exists():
            ap.error(f"argument --out: there is no page {str(args.out)!r} to check; run "
                     "`layerlift bench report` to write it, or pass --out")
        if args.out.read_text() != page:
            print(f"{args.out} is stale: run `layerlift bench report`")
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0
