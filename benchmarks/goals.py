"""Where the read and loader speed goals stand, from the benchmarks' own JSON.

    python benchmarks/goals.py [--results benchmarks/results] [--docs docs/_static]

Reads what ``bench_read.py``, ``bench_loader.py`` and ``bench_scale.py`` (both stacks) last
wrote and sets each goal beside the figure its run measured and, where the run measured one,
the limit beside it: what a reader doing only the unavoidable part (zstd alone on the same
frames, zstd plus the row sort, the names' strings alone) reached on the same machine in the
same run. A goal whose limit also misses it is bounded by that machine or stack, not by
deltacells' code. Writes ``results/goals.json`` and the docs' table
``docs/_static/bench_goals.md``; runs nothing and types no figure in: every number comes
from the JSON files, with the machine and date of the run that measured it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_scale import size_near

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def _source(name: str, run: dict) -> str:
    m = run["machine"]
    packages = m.get("packages", {})
    cpu = f"{m['cpu']} {m['cpu_id']}" if m.get("cpu_id") else m["cpu"]
    return (f"{name} ({cpu}, Python {m['python']}, pandas {packages.get('pandas')}, "
            f"{m.get('date', 'undated')})")  # fmt: skip


def _goal(goal: str, target: float, measured: float | None, unit: str, source: str, *,
          higher_is_better: bool = True, rounds: list[float] | None = None,
          limit: float | None = None, limit_what: str | None = None,
          extra: float | None = None, extra_target: float | None = None,
          extra_unit: str = "") -> dict:  # fmt: skip
    """One goal's row: met when the measured figure (and ``extra``, a second condition such as
    peak memory, at most ``extra_target``) is on the goal's side of ``target``."""

    def meets(value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= target if higher_is_better else value <= target

    met = meets(measured)
    if met and extra is not None and extra_target is not None:
        met = extra <= extra_target
    return {
        "goal": goal, "target": target, "unit": unit, "higher_is_better": higher_is_better,
        "measured": measured,
        "rounds": rounds, "extra": extra, "extra_target": extra_target,
        "extra_unit": extra_unit, "met": met, "limit": limit, "limit_what": limit_what,
        "limit_meets_goal": meets(limit), "source": source,
    }  # fmt: skip


def read_goals(run: dict) -> list[dict]:
    """``to_memory()`` and the random reads against zstd alone on the same frames, and
    ``to_memory()`` against uncompressed h5ad."""
    source = _source("read.json", run)
    floor, local = run["zstd_floor"], run["local"]
    default = floor["deltacells"]
    h5ad = local["anndata_h5ad_backed"]["to_memory_s"]
    rows = [
        _goal("to_memory(), canonical CSR in source order: >= 0.8x zstd alone", 0.8,
              default["to_memory_vs_zstd"], "x zstd", source,
              rounds=default.get("to_memory_vs_zstd_rounds"),
              limit=default["to_memory_s"] / default["decode_stored_order_fresh_s"],
              limit_what="the stored-order decode into fresh buffers (no sort), x zstd"),
        _goal("to_memory(): >= 2x uncompressed h5ad", 2.0,
              h5ad / local["deltacells"]["to_memory_s"], "x h5ad", source,
              limit=h5ad / default["to_memory_s"],
              limit_what="zstd alone on every frame, x h5ad"),
    ]  # fmt: skip
    for key, layout in (("deltacells", "default layout"),
                        ("deltacells_n_chunks_512", "512-chunk layout")):  # fmt: skip
        layer = floor.get(key)
        if layer is not None:
            rows.append(_goal(f"4,096 random cells, {layout}: >= 0.8x zstd alone", 0.8,
                              layer["random_4096_reused_vs_zstd"], "x zstd", source,
                              rounds=layer.get("random_4096_reused_vs_zstd_rounds")))  # fmt: skip
    return rows


def loader_goals(run: dict) -> list[dict]:
    """The default loader (source gene order, sorted rows) against annbatch, paired rounds."""
    source = _source("loader.json", run)
    mine = run["vs_annbatch"]["deltacells"]
    floor = run.get("sort_floor", {})
    return [
        _goal("Loader, first epoch: >= 3x annbatch", 3.0, mine["paired_speed_ratio"],
              "x annbatch", source, rounds=mine.get("paired_speed_ratio_rounds")),
        _goal("Loader, later epochs: >= 3x annbatch", 3.0, mine["paired_steady_speed_ratio"],
              "x annbatch", source, rounds=mine.get("paired_steady_speed_ratio_rounds"),
              limit=floor.get("zstd_sort_vs_annbatch_steady"),
              limit_what="zstd alone plus the row sort alone, x annbatch's later epochs"),
        _goal("Loader peak RSS: <= annbatch's", 1.0, mine["rss_ratio"], "x annbatch", source,
              higher_is_better=False),
    ]  # fmt: skip


def scale_goals(run: dict, name: str) -> list[dict]:
    """Opening an atlas with read_deltacells in a fresh process (the median process)."""
    source = _source(name, run)
    rows = []
    ten = size_near(run, 1e7)
    if ten is not None:
        names = ten["open_fresh"]["names"]
        # The strings' limit is that of pandas 2's index of Python strings; pandas 3 builds
        # an Arrow-backed one, which the limit does not measure.
        pandas = run["machine"].get("packages", {}).get("pandas") or "0"
        limit = ten.get("names_limit") if int(pandas.split(".")[0]) < 3 else None
        rows.append(_goal("10M cells open with obs names: <= 0.5 s", 0.5, names["s"], "s",
                          source, higher_is_better=False, rounds=names.get("s_all"),
                          limit=None if limit is None else limit["s"],
                          limit_what="making the 10M names' Python strings alone, s"))  # fmt: skip
    hundred = size_near(run, 1e8)
    # With obs names as strings the 100M goal cannot be met by any pandas index (its strings
    # alone pass 1 GB); bench_scale's own table gives that figure for comparison.
    step = None if hundred is None else hundred["open_fresh"].get("positions")
    if step is not None:
        rows.append(_goal('100M cells open (obs_names="positions"): <= 2 s and 1 GB', 2.0,
                          step["s"], "s", source, higher_is_better=False,
                          rounds=step.get("s_all"), extra=step["process_peak_rss_mb"],
                          extra_target=1024.0, extra_unit="MB peak"))  # fmt: skip
    return rows


def goals(results: Path) -> list[dict]:
    rows = []
    for name, make in (("read.json", read_goals), ("loader.json", loader_goals)):
        run = _load(results, name)
        if run is not None:
            rows += make(run)
    for name in ("scale.json", "scale_py312.json"):
        run = _load(results, name)
        if run is not None:
            rows += scale_goals(run, name)
    return rows


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "not measured"
    # Three decimals: a ratio of 2.9990 must not print as a met 3.00.
    return f"{value:.3f} {unit}"


def table(rows: list[dict]) -> str:
    lines = ["| goal | measured (median) | rounds | met | limit measured beside it | "
             "limit meets the goal | run |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        measured = _figure(r["measured"], r["unit"])
        if r["extra"] is not None:
            measured += f", {r['extra']:,.0f} {r['extra_unit']}"
        spread = (f"{min(r['rounds']):.3f}-{max(r['rounds']):.3f}"
                  if r["rounds"] else "")  # fmt: skip
        limit = ("" if r["limit"] is None
                 else f"{r['limit']:.3f}: {r['limit_what']}")  # fmt: skip
        limit_met = {None: "", True: "yes", False: "no"}[r["limit_meets_goal"]]
        met = {None: "not measured", True: "**met**", False: "missed"}[r["met"]]
        lines.append(f"| {r['goal']} | {measured} | {spread} | {met} | {limit} | {limit_met} "
                     f"| {r['source']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "_static")
    parser.add_argument("--out", type=Path, help="the JSON (default: RESULTS/goals.json)")
    args = parser.parse_args()
    rows = goals(args.results)
    out = args.out or args.results / "goals.json"
    out.write_text(json.dumps({"goals": rows}, indent=1))
    args.docs.mkdir(parents=True, exist_ok=True)
    (args.docs / "bench_goals.md").write_text(table(rows))
    for r in rows:
        state = {None: "not measured", True: "met", False: "missed"}[r["met"]]
        print(f"{state:>12}  {r['goal']}: {_figure(r['measured'], r['unit'])}")


if __name__ == "__main__":
    main()
