"""Benchmark report (the `bench` part of the design): reads the JSONL files `hicache bench` writes and
produces a Markdown table of the arms side by side, with ratios against the first arm, and three plots:
TTFT per round, hit rate per tier per round (stacked, one panel per arm, against the ideal), TTFT CDF.
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt
import numpy as np

from hicache.cache import TIERS
from hicache.errors import UserError

logger = logging.getLogger(__name__)

PLOTS = ("ttft_per_round.png", "hit_rate_per_round.png", "ttft_cdf.png")
TIER_COLORS = {"device": "#1f77b4", "host": "#ff7f0e", "storage": "#2ca02c", "unknown": "#9e9e9e"}


@dataclass
class ArmResult:
    summary: dict
    requests: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.summary["arm"])


def load_results(paths: Sequence[str | pathlib.Path]) -> list[ArmResult]:
    """Every arm of every file, in order. An arm name used in more than one file is prefixed with its
    file's stem, so arms of separate runs stay apart."""
    loaded: list[tuple[str, ArmResult]] = []
    for path in map(pathlib.Path, paths):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror}") from None
        pending: dict[str, list[dict]] = {}
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{number}: not JSON") from None
            if row.get("type") == "request":
                pending.setdefault(row["arm"], []).append(row)
            elif row.get("type") == "summary":
                loaded.append((path.stem, ArmResult(row, pending.pop(row["arm"], []))))
    if not loaded:
        raise UserError(f"no summary rows in {', '.join(map(str, paths))}")
    names = [result.name for _, result in loaded]
    for stem, result in loaded:
        if names.count(result.name) > 1:
            result.summary = {**result.summary, "arm": f"{stem}:{result.name}"}
    return [result for _, result in loaded]


# ---- the table -------------------------------------------------------------------------------------


def _key(key: str) -> Callable[[dict], object]:
    return lambda s: s.get(key)


def _tier(tier: str) -> Callable[[dict], object]:
    return lambda s: (s.get("hit_rate_by_tier") or {}).get(tier)


def _mib(key: str) -> Callable[[dict], object]:
    return lambda s: s[key] / 2**20 if isinstance(s.get(key), (int, float)) else None


def _hit_vs_ideal(s: dict) -> object:
    hit, ideal = s.get("hit_rate"), s.get("ideal_hit_rate")
    return hit / ideal if hit is not None and ideal else None


# (label, value of a summary, unit); the unit selects the formatting.
ROWS: tuple[tuple[str, Callable[[dict], object], str], ...] = (
    ("requests completed", _key("completed"), "int"),
    ("requests failed", _key("failed"), "int"),
    ("duration", _key("duration_s"), "s"),
    *[
        (f"{label} {stat}", _key(f"{prefix}_{stat}_s"), "ms")
        for prefix, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E latency"))
        for stat in ("mean", "median", "p99")
    ],
    ("input throughput", _key("input_throughput"), "tok/s"),
    ("output throughput", _key("output_throughput"), "tok/s"),
    ("request throughput", _key("request_throughput"), "req/s"),
    ("hit rate", _key("hit_rate"), "%"),
    ("ideal hit rate", _key("ideal_hit_rate"), "%"),
    ("hit rate / ideal", _hit_vs_ideal, "%"),
    *[(f"{tier} hit rate", _tier(tier), "%") for tier in TIERS],
    ("draft acceptance rate", _key("spec_acceptance_rate"), "%"),  # n/a without speculative decoding
    ("P/D: prompt tokens transferred", _key("transferred_tokens"), "int"),
    ("P/D: KV bytes transferred", _mib("kv_bytes_transferred"), "MiB"),
)


def _format(value: object, unit: str) -> str:
    if value is None:
        return "n/a"
    assert isinstance(value, (int, float))
    if unit == "int":
        return f"{int(value)}"
    if unit == "ms":
        return f"{value * 1e3:.1f} ms"
    if unit == "%":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:.1f} {unit}"


def _ratio(value: object, base: object) -> str:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or not base:
        return "—"
    return f"{value / base:.2f}x"


def markdown_table(summaries: Sequence[dict]) -> str:
    """Arms side by side, then one ratio column per later arm against the first."""
    names = [str(s["arm"]) for s in summaries]
    header = ["metric", *names, *[f"{name} / {names[0]}" for name in names[1:]]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|"]
    for label, get, unit in ROWS:
        values = [get(s) for s in summaries]
        cells = [_format(v, unit) for v in values] + [_ratio(v, values[0]) for v in values[1:]]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def per_round_table(summaries: Sequence[dict]) -> str:
    """Per round and arm: requests, TTFT mean and hit rate against the ideal."""
    header = ["round"] + [f"{s['arm']}: TTFT mean / hit / ideal" for s in summaries]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([" ---: "] * len(header)) + "|"]
    rounds = sorted({r["round"] for s in summaries for r in s.get("per_round", [])})
    for rnd in rounds:
        cells = [str(rnd)]
        for s in summaries:
            row = next((r for r in s.get("per_round", []) if r["round"] == rnd), None)
            if row is None:
                cells.append("—")
                continue
            cells.append(
                f"{_format(row.get('ttft_mean_s'), 'ms')} / {_format(row.get('hit_rate'), '%')}"
                f" / {_format(row.get('ideal_hit_rate'), '%')}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the plots -------------------------------------------------------------------------------------


def plot_ttft_per_round(summaries: Sequence[dict], path: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in summaries:
        rows = [r for r in s.get("per_round", []) if r.get("ttft_mean_s") is not None]
        rounds = [r["round"] for r in rows]
        line = ax.plot(rounds, [r["ttft_mean_s"] * 1e3 for r in rows], marker="o", label=f"{s['arm']} (mean)")[0]
        ax.plot(
            rounds,
            [r["ttft_p99_s"] * 1e3 for r in rows],
            linestyle=":",
            color=line.get_color(),
            label=f"{s['arm']} (p99)",
        )
    ax.set_xlabel("round (turn of the conversation)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token per round")
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hit_rate_per_round(summaries: Sequence[dict], path: pathlib.Path) -> None:
    """One panel per arm: per round, the hit rate stacked by tier (gray where the server does not say
    which tier), and the ideal hit rate as a black line: the ceiling."""
    n = len(summaries)
    cols = min(n, 3)
    rows_n = -(-n // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.6 * rows_n), sharey=True, squeeze=False)
    for ax, s in zip(axes.flat, summaries):
        per_round = s.get("per_round", [])
        rounds = np.array([r["round"] for r in per_round])
        bottom = np.zeros(len(per_round))
        tiers_known = any(v is not None for r in per_round for v in (r.get("hit_rate_by_tier") or {}).values())
        parts = TIERS if tiers_known else ("unknown",)
        for tier in parts:
            if tier == "unknown":
                values = np.array([r.get("hit_rate") or 0.0 for r in per_round])
            else:
                values = np.array([(r.get("hit_rate_by_tier") or {}).get(tier) or 0.0 for r in per_round])
            label = "cached (tier not reported)" if tier == "unknown" else f"{tier} hit"
            ax.bar(rounds, values * 100, bottom=bottom * 100, color=TIER_COLORS[tier], label=label, width=0.8)
            bottom += values
        ideal = [(r["round"], r["ideal_hit_rate"] * 100) for r in per_round if r.get("ideal_hit_rate") is not None]
        if ideal:
            ax.plot(
                *zip(*ideal),
                color="black",
                marker="_",
                markersize=14,
                linestyle="--",
                linewidth=1,
                label="ideal (infinite cache)",
            )
        ax.set_title(str(s["arm"]), fontsize="medium")
        ax.set_xlabel("round")
        ax.set_ylim(0, 105)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("prompt tokens from cache (%)")
    # One legend for all panels, between the title and the plots, so it never hides a bar.
    handles: dict[str, object] = {}
    for ax in axes.flat[:n]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    # Title and legend take a fixed height in inches, whatever the number of panel rows.
    height = fig.get_figheight()
    fig.suptitle("Cache hit rate per round, by tier, against the ideal", y=1 - 0.08 / height)
    fig.legend(
        handles.values(),
        handles.keys(),
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.4 / height),
        ncol=len(handles),
        fontsize="small",
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / height))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft_cdf(results: Sequence[ArmResult], path: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for result in results:
        ttfts = np.sort(
            [r["ttft_s"] for r in result.requests if r.get("error") is None and r.get("ttft_s") is not None]
        )
        if not ttfts.size:
            logger.info("arm %s has no request rows; left out of the TTFT CDF", result.name)
            continue
        # Starts at 0 at the fastest request, so the curve reads as "fraction at or below x".
        xs = np.concatenate([ttfts[:1], ttfts]) * 1e3
        ys = np.arange(ttfts.size + 1) / ttfts.size
        ax.step(xs, ys, where="post", label=result.name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(paths: Sequence[str | pathlib.Path], out_dir: str | pathlib.Path) -> str:
    """Writes report.md and the plots into `out_dir`; returns the Markdown table."""
    results = load_results(paths)
    summaries = [r.summary for r in results]
    out = pathlib.Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out}: {exc.strerror}") from None
    plot_ttft_per_round(summaries, out / PLOTS[0])
    plot_hit_rate_per_round(summaries, out / PLOTS[1])
    plot_ttft_cdf(results, out / PLOTS[2])
    table = markdown_table(summaries)
    first = summaries[0]
    document = "\n\n".join(
        [
            "# hicache bench report",
            f"Dataset `{first.get('dataset')}`, endpoint `{first.get('endpoint')}`, sources: "
            + ", ".join(f"`{p}`" for p in paths)
            + ". Ratios are against the first arm. The ideal hit rate is what an infinite cache could "
            "serve on this exact traffic (see `hicache/bench/metrics.py`).",
            table,
            "## Per round",
            per_round_table(summaries),
            *[f"![{name}]({name})" for name in PLOTS],
        ]
    )
    (out / "report.md").write_text(document + "\n", encoding="utf-8")
    logger.info("report written to %s", out)
    return table
