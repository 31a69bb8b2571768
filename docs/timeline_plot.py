"""Draw an mpitrain timeline (the file MPITRAIN_TIMELINE names) as a PNG.

    python docs/timeline_plot.py timeline.json timeline.png --from-ms 2700 --to-ms 2900

One row per tensor that was busy in the window, in the order they got busy;
time runs left to right. This is how docs/timeline.png was
made; Perfetto or chrome://tracing show the same file interactively.
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)

COLORS = {"NEGOTIATE": "#d9d9d9", "MEMCPY_IN_FUSION_BUFFER": "#f28e2b",
          "MPI": "#59a14f", "MEMCPY_OUT_FUSION_BUFFER": "#b07aa1"}
OPERATION = "#4e79a7"


def spans(events):
    """{row name: [(activity, start ms, end ms, depth)]} and the rows' ready marks."""
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "process_name" and e["pid"]}
    open_spans = {pid: [] for pid in rows}
    found = {name: [] for name in rows.values()}
    marks = {name: [] for name in rows.values()}
    for event in events:
        pid = event.get("pid")
        if pid not in rows:
            continue
        if event["ph"] == "B":
            open_spans[pid].append((event["name"], event["ts"] / 1000))
        elif event["ph"] == "E":
            name, start = open_spans[pid].pop()
            found[rows[pid]].append((name, start, event["ts"] / 1000,
                                     len(open_spans[pid])))
        elif event["ph"] == "i":
            marks[rows[pid]].append(event["ts"] / 1000)
    return found, marks


def color(activity):
    for prefix, value in COLORS.items():
        if activity.startswith(prefix):
            return value
    return OPERATION


def draw(events, path, start, end):
    found, marks = spans(events)
    first = {name: min(a for _, a, b, _ in items if b > start and a < end)
             for name, items in found.items()
             if any(b > start and a < end for _, a, b, _ in items)}
    busy = sorted(first, key=first.get)             # in the order they got busy
    figure, axes = plt.subplots(figsize=(11, 0.22 * len(busy) + 1.9))
    for row, name in enumerate(busy):
        for activity, a, b, depth in sorted(found[name], key=lambda span: span[3]):
            if b > start and a < end:
                height = 0.8 if depth == 0 else 0.5
                axes.barh(row, b - a, left=a - start, height=height,
                          color=color(activity), edgecolor="none")
        ticks = [t - start for t in marks[name] if start <= t <= end]
        axes.plot(ticks, [row] * len(ticks), "k|", markersize=6)
    axes.set_yticks(range(len(busy)), busy, fontsize=6)
    axes.invert_yaxis()
    axes.set_xlim(0, end - start)
    axes.set_xlabel(f"ms after {start:g} ms (since the timeline started)")
    legend = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
              (COLORS["NEGOTIATE"], OPERATION, COLORS["MEMCPY_IN_FUSION_BUFFER"],
               COLORS["MPI"], COLORS["MEMCPY_OUT_FUSION_BUFFER"])]
    figure.legend(legend, ["negotiation", "operation", "copy into fusion buffer",
                           "MPI call", "copy out of fusion buffer"],
                  loc="lower center", ncol=5, fontsize=7, frameon=False)
    legend_inches = 0.35
    figure.tight_layout(rect=(0, legend_inches / figure.get_figheight(), 1, 1))
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("timeline")
    parser.add_argument("png")
    parser.add_argument("--from-ms", type=float, default=0.0)
    parser.add_argument("--to-ms", type=float, default=float("inf"))
    args = parser.parse_args()
    events = json.load(open(args.timeline))
    end = min(args.to_ms, max(e.get("ts", 0) for e in events) / 1000)
    draw(events, args.png, args.from_ms, end)


if __name__ == "__main__":
    main()
