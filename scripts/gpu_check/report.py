"""The check's report and the guard around each section.

`run_sections` runs the sections in order, each with `Context.deadline` = now + min(its budget, what is left of the
whole budget); a section whose share would be under MIN_SECTION_S is skipped with the reason. A section returns its
result dict (`passed`: bool, and whatever it measured); an exception becomes status "error" with the traceback's tail
and the partial result the section had checkpointed. `Report.save` rewrites report.json and summary.md atomically
after every section and every checkpoint.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

MIN_SECTION_S = 10.0  # a section with less time than this left is skipped, not started
TAIL = 3000  # characters of a traceback or a log kept in the report


def tail(text: str, limit: int = TAIL) -> str:
    return text if len(text) <= limit else "…" + text[-limit:]


@dataclass(frozen=True)
class Section:
    name: str
    budget_s: float                        # wall seconds on a GPU (the full run)
    quick_budget_s: float                  # wall seconds under --quick
    run: Callable[["Context"], dict]       # the section: its result dict, with "passed"
    summarise: Callable[[dict], list[str]]  # its result as markdown lines for summary.md
    shows: str                             # one line: what it proves or measures

    def budget(self, quick: bool) -> float:
        return self.quick_budget_s if quick else self.budget_s


@dataclass
class Context:
    """What a section gets: where it runs, how long it may take, and a way to save a partial result."""
    device: object                          # torch.device
    quick: bool
    out: Path
    deadline: float                         # time.monotonic() after which it starts nothing new
    report: "Report"
    name: str = ""
    options: dict = field(default_factory=dict)  # command-line extras (e.g. fast's --pairs)
    partial: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def checkpoint(self, result: dict) -> None:
        """Save `result` as the running section's partial result (kept if the section later raises or is killed)."""
        self.partial = result
        self.report.update(self.name, {"result": result})


class Report:
    """report.json and summary.md in `out`, rewritten on every change."""

    def __init__(self, out: Path, header: dict, sections: tuple[Section, ...]):
        self.out, self.sections = out, {s.name: s for s in sections}
        self.data = {**header, "sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    def update(self, name: str, entry: dict) -> None:
        self.data["sections"].setdefault(name, {}).update(entry)
        self.save()

    def save(self) -> None:
        _write(self.out / "report.json", json.dumps(self.data, indent=1, default=str) + "\n")
        _write(self.out / "summary.md", "\n".join(self.summary()) + "\n")

    def summary(self) -> list[str]:
        d = self.data
        lines = [f"# GPU check: {d['device'].get('name')} ({d['device']['type']}), {d['started']}", "",
                 f"torch {d['device']['torch']}, transformers {d['device']['transformers']}, "
                 f"{'quick, ' if d['quick'] else ''}budget {d['budget_s']:.0f} s, wall {d.get('elapsed_s', 0):.0f} s"
                 f"{'' if 'elapsed_s' in d else ' (still running or killed)'}", "",
                 "| section | status | seconds | budget s | what it shows |", "|---|---|---|---|---|"]
        for name, entry in d["sections"].items():
            lines.append(f"| {name} | {entry.get('status')} | {entry.get('seconds', 0):.1f} | "
                         f"{entry.get('budget_s', 0):.0f} | {self.sections[name].shows} |")
        if "verdict" in d:
            lines += ["", f"**Verdict:** {d['verdict']}"]
        for name, entry in d["sections"].items():
            lines += ["", f"## {name}: {entry.get('status')}", ""]
            if entry.get("reason"):
                lines.append(f"Skipped: {entry['reason']}")
            if entry.get("error"):
                lines += ["```", entry["error"], "```"]
            if entry.get("result"):
                try:
                    lines += self.sections[name].summarise(entry["result"])
                except Exception as err:  # noqa: BLE001 - a partial result may lack fields; say so, keep the rest
                    lines.append(f"(summary incomplete: {type(err).__name__}: {err})")
        return lines


def _write(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step (a kill never leaves half a file)."""
    temporary = path.with_name(path.name + ".part")
    temporary.write_text(text)
    os.replace(temporary, path)


def run_sections(report: Report, sections: tuple[Section, ...], budget_s: float, make_context) -> dict:
    """Run `sections` in order under one wall-time budget; returns {name: status}. `make_context(name, deadline)`
    gives each its Context."""
    start = time.monotonic()
    statuses = {}
    for section in sections:
        left = budget_s - (time.monotonic() - start)
        share = min(section.budget(report.data["quick"]), left)
        entry = {"budget_s": share, "seconds": 0.0}
        if share < MIN_SECTION_S:
            reason = f"{max(left, 0):.0f} s of the {budget_s:.0f} s budget left, under the {MIN_SECTION_S:.0f} s a " \
                     "section needs at least"
            report.update(section.name, {**entry, "status": "skipped", "reason": reason})
            statuses[section.name] = "skipped"
            print(f"[gpu_check] {section.name}: skipped ({reason})", flush=True)
            continue
        report.update(section.name, {**entry, "status": "running"})
        statuses[section.name] = run_one(report, section, make_context(section.name, time.monotonic() + share))
    report.data["elapsed_s"] = time.monotonic() - start
    report.save()
    return statuses


def run_one(report: Report, section: Section, context: Context) -> str:
    """One section, timed and guarded; its status ("passed", "failed" or "error")."""
    print(f"[gpu_check] {section.name}: started ({context.left():.0f} s)", flush=True)
    started = time.monotonic()
    try:
        result = section.run(context)
        status, extra = ("passed" if result.get("passed") else "failed"), {"result": result}
    except Exception:  # noqa: BLE001 - recorded; the next section still runs
        status, extra = "error", {"error": tail(traceback.format_exc()), "result": context.partial}
    seconds = time.monotonic() - started
    report.update(section.name, {"status": status, "seconds": seconds, **extra})
    print(f"[gpu_check] {section.name}: {status} in {seconds:.1f} s", flush=True)
    return status
