"""Summary table and plot of ``tools/bench_migration.py``'s JSON records (no torch needed).

The table gives, per model and transition, each method's median seconds, the link limit, and the ratios: DCP save +
load on disk / direct (b/a; b'/a with the files read from the device, not the page cache), on tmpfs (c/a), DCP load
only / direct (e/a; e'/a from the device), gather + broadcast / direct (d/a),
direct / link limit (a/link), direct's point-to-point phase / link limit (p2p/lk) and direct / the link limit with
the local copies beside it (a/host, see ``host_limit_seconds`` in ``bench_migration.py``); then direct's measured peak
memory growth against its bound (MiB). The plot is a log-scale bar chart of seconds per method per transition, one
panel per model.

    .venv/bin/python tools/plot_migration.py bench_results/migration.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

METHODS = ("direct", "dcp_disk", "dcp_disk_cold", "dcp_tmpfs", "dcp_load", "dcp_load_cold", "gather_bcast")


def summary(records: list[dict[str, Any]]) -> str:
    rows = {}
    for r in records:
        rows.setdefault((r["model"], r["transition"]), {})[r["method"]] = r
    disk_cold, load_cold = "b'/a", "e'/a"
    head = (
        f"{'model':11s} {'transition':10s} {'direct':>7s} {'dcp_dsk':>7s} {'dsk_cld':>7s} {'dcp_tmp':>7s} "
        f"{'dcp_ld':>7s} {'ld_cld':>7s} {'gath_bc':>7s} {'link':>6s} | {'b/a':>5s} {disk_cold:>5s} "
        f"{'c/a':>5s} {'e/a':>5s} {load_cold:>5s} {'d/a':>5s} {'a/link':>6s} "
        f"{'p2p/lk':>6s} {'a/host':>6s} | {'mem MiB':>7s} {'bound':>6s} {'exact':>5s}"
    )
    lines = [head, "-" * len(head)]
    nan = float("nan")
    for (model, name), by in rows.items():
        a = by.get("direct", {})
        secs = {m: by[m]["seconds"] if m in by else nan for m in METHODS}
        link = next(iter(by.values()))["link_limit_seconds"] or nan
        host = next(iter(by.values())).get("host_limit_seconds") or nan
        base = secs["direct"]
        p2p = a.get("phases", {}).get("p2p", nan)
        grown, bound = (a.get(k, nan) / 2**20 for k in ("peak_extra_bytes_measured", "memory_bound_bytes"))
        exact = all(r["bit_exact"] for r in by.values())
        lines.append(
            f"{model:11s} {name:10s} {base:7.3f} {secs['dcp_disk']:7.3f} {secs['dcp_disk_cold']:7.3f} "
            f"{secs['dcp_tmpfs']:7.3f} {secs['dcp_load']:7.3f} {secs['dcp_load_cold']:7.3f} "
            f"{secs['gather_bcast']:7.3f} {link:6.3f} | {secs['dcp_disk'] / base:5.1f} "
            f"{secs['dcp_disk_cold'] / base:5.1f} {secs['dcp_tmpfs'] / base:5.1f} {secs['dcp_load'] / base:5.1f} "
            f"{secs['dcp_load_cold'] / base:5.1f} {secs['gather_bcast'] / base:5.1f} "
            f"{base / link:6.2f} {p2p / link:6.2f} {base / host:6.2f} | {grown:7.1f} {bound:6.1f} {str(exact):>5s}"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    series = (*METHODS, "link limit")
    width = 0.8 / len(series)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in records if r["model"] == model]
        names = list(dict.fromkeys(r["transition"] for r in mine))
        for k, method in enumerate(series):
            heights = []
            for name in names:
                rec = [r for r in mine if r["transition"] == name]
                if method == "link limit":
                    heights.append(rec[0]["link_limit_seconds"] or float("nan"))
                else:
                    heights.append(next((r["seconds"] for r in rec if r["method"] == method), float("nan")))
            ax.bar(
                [i + (k - (len(series) - 1) / 2) * width for i in range(len(names))],
                heights,
                width,
                label=method,
            )
        ax.set_xticks(range(len(names)), names)
        ax.set_yscale("log")
        ax.set_title(f"{model}, {mine[0]['state_bytes'] / 2**30:.2f} GiB state")
        ax.set_xlabel("transition (r dp_replicate, s dp_shard, t tp)")
        ax.set_ylabel("seconds (log)")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(series), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default="bench_results/migration.json")
    args = parser.parse_args()
    path = Path(args.results)
    records = json.loads(path.read_text())
    plot(records, path.with_suffix(".png"))
    print(summary(records))
    print(f"plot: {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
