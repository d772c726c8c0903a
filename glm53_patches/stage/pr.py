"""PR.md: the pull request text, from PATCH.md, verify records, bench results and the staging run."""

import json
import re
from pathlib import Path
from typing import Dict, List, Tuple

from .. import verify_records
from .source import StageError

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench-results"


def sections(markdown: str) -> List[Tuple[str, str]]:
    """[(heading, body)] of the ``##`` sections of a markdown text."""
    found, heading, body = [], None, []
    for line in markdown.splitlines():
        match = re.match(r"^##\s+(.*?)\s*$", line)
        if match:
            if heading is not None:
                found.append((heading, "\n".join(body).strip()))
            heading, body = match.group(1), []
        elif heading is not None:
            body.append(line)
    if heading is not None:
        found.append((heading, "\n".join(body).strip()))
    return found


def pick(markdown: str, wanted: str, where: str) -> Tuple[str, str]:
    """The section whose heading starts with ``wanted`` (case-insensitive)."""
    for heading, body in sections(markdown):
        if heading.lower().startswith(wanted.lower()):
            return heading, body
    raise StageError(f"{where}: PATCH.md has no section starting with {wanted!r}")


def _demote(body: str) -> str:
    """Headings inside a picked section go one level down."""
    return re.sub(r"^(#{3,})", r"#\1", body, flags=re.M)


def verify_lines(name: str) -> List[str]:
    """Every `glm53-patches verify` record of this patch on this machine."""
    lines = []
    for key, result in sorted(verify_records.load().items()):
        patch, backend, mlx, mlx_vlm = (key.split("|") + ["", "", ""])[:4]
        if patch != name:
            continue
        verdict = "exact" if result.get("passed") else f"FAILED (max |diff| {result.get('max_abs_diff')})"
        lines.append(
            f"- {result.get('date', 'undated')}, {backend}, {mlx}, {mlx_vlm}: **{verdict}**, "
            f"{result.get('cases')} cases in {result.get('seconds')} s; {result.get('detail', '')}"
        )
    return lines


def bench_lines(name: str, folder: Path = None) -> List[str]:
    """Results from bench-results/*.json that have an arm running this patch alone."""
    folder = BENCH_DIR if folder is None else folder
    lines = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            lines.append(f"- `{path.name}`: unreadable ({exc})")
            continue
        arms = results.get("arms", {}) if isinstance(results, dict) else {}
        labels = [label for label, arm in arms.items() if isinstance(arm, dict) and arm.get("patches") == [name]]
        if not labels:
            continue
        label = labels[0]
        device, model, arm_state = results.get("device", {}), results.get("model", {}), arms[label]
        hits = {k.rsplit(".", 1)[1]: v for k, v in arm_state.get("counters", {}).items() if ".hits." in k}
        lines.append(
            f"- `bench-results/{path.name}` ({results.get('date', 'undated')}): {device.get('backend')} "
            f"{device.get('device_name', '')}, mlx {device.get('mlx')}, mlx-vlm {device.get('mlx_vlm')}; model "
            f"{model.get('preset')} {model.get('layers')} layers, hidden {model.get('hidden_size')}, "
            f"{model.get('dtype')}; verdict: {results.get('verdicts', {}).get(label, 'none')}; "
            f"fast-path hits: {', '.join(f'{k} {v}' for k, v in sorted(hits.items())) or 'none'}"
        )
        measured = [(f"decode at context {c}", e, "ms/token") for c, e in results.get("decode", {}).items()]
        measured += [(key, e, e.get("unit", "ms")) for key, e in results.get("layers", {}).items()]
        for what, entry, unit in measured:
            stock, arm = entry.get("arms", {}).get("stock"), entry.get("arms", {}).get(label)
            if stock and arm:  # medians of rounds, in the file's unit (bench writes ms)
                lines.append(
                    f"  - {what}: stock {stock['median']:.3f} {unit}, patched {arm['median']:.3f} {unit} "
                    f"({arm.get('ratio_vs_stock', 0):.2f}x; patched range {arm['min']:.3f}-{arm['max']:.3f}"
                    + (f"; {entry['rounds']} rounds x {entry['steps']} steps" if "rounds" in entry and "steps" in entry else "")
                    + ")"
                )
    return lines


def render(described, patch, result: Dict) -> str:
    """The PR text for one staged (patch, upstream tree)."""
    markdown = (described.folder / "PATCH.md").read_text(encoding="utf-8")
    title = described.title
    diff = result["diff"]
    out = [f"# {title}", "", patch.summary, ""]
    if described.switch:
        out += [
            f"Opt-in: `{described.switch}=1` turns it on; unset (the default), mlx-vlm runs exactly "
            "today's code.",
            "",
        ]
    out += [
        f"Staged against mlx-vlm {result['pin']} ({result['tree_source']}) on {result['date']}. "
        f"Diff: {len(diff['files'])} files, +{diff['added']}/-{diff['removed']} lines "
        f"({diff['lines']} lines, {diff['bytes']} bytes of `PATCH.diff`).",
        "",
    ]
    out += [f"- `{path}` ({status})" for path, status in diff["files"].items()]
    out += [""]
    if result.get("drift"):
        out += [
            "**Note:** this tree differs from every mlx-vlm release the patch was verified against in: "
            + ", ".join(f"`{target}`" for target in result["drift"]) + ".",
            "",
        ]
    for heading, wanted in described.pr_sections:
        out += [f"## {heading}", ""]
        for name in wanted:
            _, body = pick(markdown, name, described.name)
            out += [_demote(body), ""]

    out += ["## Exactness evidence", ""]
    tests = result.get("tests") or {}
    if tests:
        out.append(
            f"- Tests added (`{', '.join(described.tests.values())}`): {tests.get('passed', 0)} passed, "
            f"{len(tests.get('failed', []))} failed, {tests.get('counts', {}).get('skipped', 0)} skipped in "
            f"{tests.get('seconds')} s on {result['backend']} (mlx {result['mlx']}), in the patched tree."
        )
    equivalence = result.get("equivalence") or {}
    if equivalence.get("cases"):
        tokens = ", ".join(f"{c} {n} tokens" for c, n in equivalence["tokens"].items())
        on = "bit-identical to" if all(equivalence["staged_equals_stock"].values()) else "DIFFERENT from"
        off = "bit-identical to" if all(equivalence["off_equals_stock"].values()) else "DIFFERENT from"
        plugin = "the same, bit for bit, as" if all(equivalence["staged_equals_plugin"].values()) else "DIFFERENT from"
        if described.equivalence == "warm-cold":
            out.append(
                f"- Greedy decoding of a small random-weight glm5_next checkpoint ({tokens}) from a prompt cache "
                f"written to and read back from a `DiskBlockStore` entry, in the patched tree: with the switch on "
                f"the logits are {on} the cold run that never left memory ({equivalence['served']} entries "
                f"took the new path), with it off (stock APC) {off} it, and {plugin} the glm53-patches plugin's "
                f"copy of this code on the released mlx-vlm {result['pin']}."
            )
        else:
            out.append(
                f"- Greedy decoding of a small random-weight glm5_next checkpoint ({tokens}), in the patched tree: "
                f"with the switch on the logits are {on} today's code ({equivalence['served']} calls took the new "
                f"path), with it off {off} today's code, and {plugin} the glm53-patches plugin running this code "
                f"on the released mlx-vlm {result['pin']}."
            )
    records = verify_lines(described.name)
    out += records or [
        "- No `glm53-patches verify` record on this machine yet (GPU backends are verified on the user's "
        "machine with `glm53-patches verify " + described.name + "`)."
    ]
    out += ["", "## Measured effect (benchmarks)", ""]
    out += bench_lines(described.name) or ["No `bench-results/*.json` with this patch alone yet."]
    out += [
        "",
        "---",
        f"Generated by `glm53-patches stage {described.name}` from the glm53-patches plugin "
        f"(`{described.package}`), which runs the same code in released mlx-vlm versions. "
        "The sections above are taken from its PATCH.md and may name the plugin's own switches and counters.",
        "",
    ]
    return "\n".join(out)
