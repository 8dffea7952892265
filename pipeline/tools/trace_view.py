"""`pipeline trace`: look at one request's trace from a JSON-lines span file, without a tracing backend.

Services write the file with `OTEL_TRACES_EXPORTER=jsonl PIPELINE_TRACE_FILE=path` (see
`pipeline.runtime.telemetry`). The command prints the trace as a waterfall: one line per span, indented under its
parent, with its service, start offset, duration and a bar scaled to the trace's time; `--png` draws the
same with matplotlib. A batch that a request rode in lives in the trace of the batch's first request and
links to every member's span; the waterfall of another member shows that batch (and the stage's spans under
it) beneath the member's span that it links to, marked `↗`.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel

from pipeline.runtime.settings_cli import ProcessSettings, option, process_settings

#: Attributes worth a glance beside a span's name.
_SHOWN = {
    "pipeline.batch.size": "batch",
    "pipeline.request_id": "id",
    "server.address": "peer",
    "rpc.grpc.status_code": "code",
    "pipeline.step.skip_reason": "skipped",
    "pipeline.cache.hit": "cache hit",
}


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the waterfall: a span, its depth, and whether it was reached through a link."""

    span: dict[str, Any]
    depth: int
    linked: bool = False

    @property
    def start(self) -> int:
        return int(self.span["start_ns"])

    @property
    def end(self) -> int:
        return int(self.span["end_ns"] or self.span["start_ns"])


def load_spans(path: Path) -> list[dict[str, Any]]:
    """Every span in a JSON-lines file (lines that do not parse, e.g. a torn last line, are skipped)."""
    spans = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "trace_id" in record and "span_id" in record:
                spans.append(record)
    return spans


def pick_trace(spans: Sequence[dict[str, Any]], trace_id: str | None = None) -> str:
    """The trace to show: `trace_id` (a prefix will do), else the one whose root started last."""
    if trace_id:
        wanted = trace_id.lower().removeprefix("0x")
        found = sorted({s["trace_id"] for s in spans if s["trace_id"].startswith(wanted)})
        if not found:
            raise LookupError(f"no trace {trace_id} in the file")
        if len(found) > 1:
            raise LookupError(f"{trace_id} matches {len(found)} traces: {', '.join(found[:5])} ...")
        return found[0]
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s.get("parent_span_id") not in ids]
    if not roots:
        raise LookupError("the file holds no spans")
    return max(roots, key=lambda s: s["start_ns"])["trace_id"]


def waterfall(spans: Sequence[dict[str, Any]], trace_id: str) -> list[Row]:
    """The rows of one trace, depth first in start order, with the spans of other traces that link to its
    spans (the batches its requests rode in) inlined."""
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    linking: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        children[span.get("parent_span_id")].append(span)
        if span["trace_id"] != trace_id:
            for link in span.get("links", ()):
                linking[link["span_id"]].append(span)
    for kids in (*children.values(), *linking.values()):
        kids.sort(key=lambda s: s["start_ns"])
    rows: list[Row] = []
    shown: set[str] = set()

    def visit(span: dict[str, Any], depth: int, linked: bool) -> None:
        if span["span_id"] in shown:
            return
        shown.add(span["span_id"])
        rows.append(Row(span, depth, linked))
        for child in children.get(span["span_id"], ()):
            visit(child, depth + 1, linked)
        for batch in linking.get(span["span_id"], ()):
            visit(batch, depth + 1, True)

    members = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in members}
    for root in sorted(
        (s for s in members if s.get("parent_span_id") not in ids), key=lambda s: s["start_ns"]
    ):
        visit(root, 0, False)
    return rows


def _label(row: Row) -> str:
    span = row.span
    extras = [
        f"{short}={span['attributes'][key]}"
        for key, short in _SHOWN.items()
        if span["attributes"].get(key) not in (None, "")
    ]
    if span.get("status") == "ERROR":
        extras.append(f"ERROR {span.get('status_message') or ''}".strip())
    text = ("↗ " if row.linked else "") + span["name"]
    return text + (f"  [{', '.join(extras)}]" if extras else "")


def format_waterfall(rows: Sequence[Row], trace_id: str, *, width: int = 40) -> str:
    """The waterfall as text: offset and duration in ms, service, indented name, a bar on a common scale."""
    if not rows:
        return f"trace {trace_id}: no spans"
    t0 = min(r.start for r in rows)
    total = max(max(r.end for r in rows) - t0, 1)
    services = sorted({r.span.get("service", "") for r in rows})
    service_width = max(len(s) for s in services) if services else 0
    lines = [
        f"trace {trace_id}: {len(rows)} spans, {len(services)} services ({', '.join(services)}), "
        f"{total / 1e6:.2f} ms",
        f"{'start ms':>9} {'dur ms':>8}  {'service':<{service_width}}  span",
    ]
    for row in rows:
        begin = int((row.start - t0) / total * width)
        length = max(1, round((row.end - row.start) / total * width))
        bar = " " * begin + "█" * min(length, width - begin if width > begin else 1)
        lines.append(
            f"{(row.start - t0) / 1e6:>9.2f} {(row.end - row.start) / 1e6:>8.2f}  "
            f"{row.span.get('service', ''):<{service_width}}  |{bar:<{width}}| {'  ' * row.depth}{_label(row)}"
        )
    return "\n".join(lines)


def render_png(rows: Sequence[Row], trace_id: str, path: Path) -> None:
    """Draw the waterfall as horizontal bars, one colour per service (matplotlib, imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r.start for r in rows)
    services = sorted({r.span.get("service", "") for r in rows})
    colours = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(services)}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
    for i, row in enumerate(rows):
        service = row.span.get("service", "")
        ax.barh(
            i,
            (row.end - row.start) / 1e6,
            left=(row.start - t0) / 1e6,
            color=colours[service],
            hatch="//" if row.linked else None,
            edgecolor="red" if row.span.get("status") == "ERROR" else None,
        )
    ax.set_yticks(range(len(rows)), ["  " * r.depth + _label(r) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the trace began")
    ax.set_title(f"trace {trace_id}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[s]) for s in services]
    ax.legend(handles, services, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class TraceChoice(BaseModel):
    """`pipeline trace`'s file, the trace of it shown, and how."""

    file: Annotated[
        Path, option("file", parse=Path, help="JSON-lines span file (PIPELINE_TRACE_FILE of the services)")
    ]
    trace_id: Annotated[
        str | None,
        option("--trace-id", exclusive="which", help="the trace to show (hex; a unique prefix will do)"),
    ] = None
    last: Annotated[
        bool,
        option("--last", action="store_true", exclusive="which", help="the most recent trace (the default)"),
    ] = False
    png: Annotated[
        Path | None,
        option("--png", parse=Path, help="also draw the waterfall to this PNG file (needs matplotlib)"),
    ] = None
    width: Annotated[int, option("--width", parse=int, help="width of the bars, in characters")] = 40


#: `pipeline trace`'s settings.
TraceSettings = process_settings("TraceSettings", (TraceChoice,))


def run_trace_command(settings: ProcessSettings) -> int:
    """`pipeline trace FILE [--trace-id ID | --last] [--png out.png]`."""
    choice = settings.group(TraceChoice)
    try:
        spans = load_spans(choice.file)
        trace_id = pick_trace(spans, choice.trace_id)
    except (OSError, LookupError) as err:
        print(f"pipeline trace: {err}", file=sys.stderr)
        return 1
    rows = waterfall(spans, trace_id)
    print(format_waterfall(rows, trace_id, width=max(10, choice.width)))
    if choice.png is not None:
        render_png(rows, trace_id, choice.png)
        print(f"wrote {choice.png}")
    return 0
