"""Benchmark outputs: a results JSON, a Markdown table and two PNG plots, written into one folder.

    results.json    settings, command line, machine, library versions, summaries and every per-prompt record
    results.md      the summary table (also printed)
    speedup.png     decode speedup over `ar` by dataset and method
    acceptance.png  acceptance-length histogram per dataset (share of rounds), one bar series per method
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .metrics import BASELINE, PLAIN, Summary
from .runner import Record

VERSIONED_PACKAGES = ("flashdraft", "torch", "transformers", "accelerate", "dflash")
PLOTS_INSTALL = "pip install 'flashdraft[bench]' (or pip install matplotlib)"


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"the benchmark's plots need matplotlib: {PLOTS_INSTALL}") from None


def machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for package in VERSIONED_PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def write_results(
    path: Path,
    summaries: Sequence[Summary],
    records: Sequence[Record],
    settings: dict,
    device: torch.device,
    command: str,
) -> None:
    results = {
        "command": command,
        "settings": settings,
        "machine": machine(device),
        "versions": versions(),
        "summary": [summary.to_dict() for summary in summaries],
        "records": [record.to_dict() for record in records],
    }
    path.write_text(json.dumps(results, indent=1) + "\n")


def markdown_table(summaries: Sequence[Summary]) -> str:
    """The summary table; the column "differs from llama.cpp" only where llama.cpp's plain decoding ran."""
    llama_cpp = any(s.differs_from_llama_cpp is not None for s in summaries)
    header = (
        f"| dataset | method | prompts | output tokens | decode tok/s | speedup over {BASELINE} | median "
        f"| speedup over {PLAIN} | median | TTFT ms | tau | tokens by source | differs from ar |"
        + (" differs from llama.cpp |" if llama_cpp else "") + "\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|" + ("---:|" if llama_cpp else "") + "\n"
    )
    rows = []
    for s in summaries:
        speedups = " | ".join(f"{value:.2f}x" if value is not None else "n/a" for value in (
            s.speedup, s.median_speedup, s.speedup_over_plain, s.median_speedup_over_plain))
        differs = "n/a (sampling)" if s.differs_from_ar is None else str(s.differs_from_ar)
        if llama_cpp:
            differs += f" | {s.differs_from_llama_cpp if s.differs_from_llama_cpp is not None else 'n/a'}"
        rows.append(
            f"| {s.dataset} | {s.method} | {s.prompts} | {s.output_tokens:.1f} | {s.decode_tokens_per_second:.1f} "
            f"| {speedups} | {1000 * s.time_to_first_token:.0f} | {s.tau:.2f} | {_shares(s.token_shares)} "
            f"| {differs} |"
        )
    return header + "\n".join(rows) + "\n"


def _shares(shares: dict[str, float]) -> str:
    """"lookup 41%, dflash 3%, target 56%"; "n/a" for a method that does not say."""
    return ", ".join(f"{source} {100 * share:.0f}%" for source, share in shares.items()) or "n/a"


def _grouped(summaries: Sequence[Summary]) -> tuple[list[str], list[str]]:
    """Datasets, and the methods other than the baseline, in order of first appearance."""
    datasets = list(dict.fromkeys(s.dataset for s in summaries))
    methods = list(dict.fromkeys(s.method for s in summaries if s.method != BASELINE))
    return datasets, methods


def plot_speedup(summaries: Sequence[Summary], path: Path) -> None:
    from matplotlib.figure import Figure

    datasets, methods = _grouped(summaries)
    speedups = {(s.dataset, s.method): s.speedup or 0.0 for s in summaries}
    figure = Figure(figsize=(max(6.0, 1.6 * len(datasets) * max(1, len(methods)) / 2), 4.0), layout="constrained")
    axes = figure.subplots()
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        positions = [d + (i - (len(methods) - 1) / 2) * width for d in range(len(datasets))]
        axes.bar(positions, [speedups.get((dataset, method), 0.0) for dataset in datasets], width, label=method)
    axes.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{BASELINE} (1.0x)")
    axes.set_xticks(range(len(datasets)), datasets)
    axes.set_ylabel(f"decode speedup over {BASELINE}")
    axes.set_title("Speedup by dataset and method")
    axes.legend(fontsize="small")
    figure.savefig(path, dpi=120)


def plot_acceptance(summaries: Sequence[Summary], path: Path) -> None:
    from matplotlib.figure import Figure

    datasets, methods = _grouped(summaries)
    by_key = {(s.dataset, s.method): s for s in summaries}
    figure = Figure(figsize=(6.0, 2.8 * len(datasets)), layout="constrained")
    axes_list = figure.subplots(len(datasets), 1, squeeze=False)[:, 0]
    longest = max((max(s.acceptance_histogram, default=1) for s in summaries), default=1)
    width = 0.8 / max(1, len(methods))
    for axes, dataset in zip(axes_list, datasets):
        for i, method in enumerate(methods):
            summary = by_key.get((dataset, method))
            if summary is None or not summary.acceptance_histogram:
                continue
            rounds = sum(summary.acceptance_histogram.values())
            lengths = range(1, longest + 1)
            shares = [summary.acceptance_histogram.get(length, 0) / rounds for length in lengths]
            positions = [length + (i - (len(methods) - 1) / 2) * width for length in lengths]
            axes.bar(positions, shares, width, label=f"{method} (tau {summary.tau:.2f})")
        axes.set_title(dataset)
        axes.set_xlabel("acceptance length (tokens per target forward)")
        axes.set_ylabel("share of rounds")
        axes.set_xticks(range(1, longest + 1))
        if axes.get_legend_handles_labels()[0]:  # methods without per-round lengths (llama.cpp's) draw no bars
            axes.legend(fontsize="small")
    figure.savefig(path, dpi=120)


def write_report(
    output_dir: Path,
    summaries: Sequence[Summary],
    records: Sequence[Record],
    settings: dict,
    device: torch.device,
    command: str,
) -> dict[str, Path]:
    """Write every output into `output_dir`; returns their paths by kind."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": output_dir / "results.json",
        "markdown": output_dir / "results.md",
        "speedup": output_dir / "speedup.png",
        "acceptance": output_dir / "acceptance.png",
    }
    write_results(paths["json"], summaries, records, settings, device, command)
    paths["markdown"].write_text(markdown_table(summaries))
    plot_speedup(summaries, paths["speedup"])
    plot_acceptance(summaries, paths["acceptance"])
    return paths
