"""The pull request material of one staged patch: EVIDENCE.md and SUMMARY.md.

mlx and mlx-lm do not accept AI-written pull request descriptions, so stage
writes no description: EVIDENCE.md holds the facts (the diff, the staged
tests and their results, the equivalence check, the measurements of this
change from PATCH.md, each with its backend and hardware) and SUMMARY.md a
short factual draft from upstream.py's SUMMARY, for a person to rewrite.

Both are for an mlx-vlm maintainer, so the text written into them is checked
(``check``): no mention of the plugin, no first person, no run that did not
complete, and every `code` span names something in the diff or in the files
it changes.
"""

import platform
import re
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

from .source import StageError

PATCHES = Path(__file__).resolve().parents[1] / "patches"
FIRST_PERSON = re.compile(r"\b(I|[Mm]e|[Mm]y|[Mm]ine|[Ww]e|[Oo]urs?)\b")
NOT_A_RESULT = re.compile(r"did not finish|killed|crash|refused|timed out|not run|not timed|abandoned|skipped", re.I)
REWRITE = ("Draft for a person to rewrite in their own words before opening the pull request: mlx and "
           "mlx-lm do not accept AI-written descriptions. The facts it rests on are in EVIDENCE.md.")


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


def _cells(line: str) -> List[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _quoted(excerpt: str, body: str, where: str):
    """Refuse an excerpt that is not in the section: a table line must be the leading cells
    of one of its table lines (so a table may be cut after any column); other text, paragraph
    by paragraph, must occur in it (runs of whitespace compared as one space)."""
    rows = [_cells(line) for line in body.splitlines() if line.strip().startswith("|")]
    prose = " ".join(body.split())
    for paragraph in re.split(r"\n\s*\n", excerpt.strip()):
        for line in paragraph.splitlines() if paragraph.lstrip().startswith("|") else [paragraph]:
            if line.lstrip().startswith("|"):
                cells = _cells(line)
                found = any(row[:len(cells)] == cells for row in rows)
            else:
                found = " ".join(line.split()) in prose
            if not found:
                raise StageError(f"{where}: not in PATCH.md: {' '.join(line.split())[:120]!r}")


def measurements(described) -> List[Tuple[str, str, str]]:
    """[(label, PATCH.md heading, excerpt)] of upstream.py's MEASURED, each checked against PATCH.md."""
    markdown = (described.folder / "PATCH.md").read_text(encoding="utf-8")
    found = []
    for label, section, excerpt in described.measured:
        heading, body = pick(markdown, section, described.name)
        _quoted(excerpt, body, f"{described.name}: MEASURED ({heading})")
        found.append((label, heading, excerpt.strip()))
    return found


def check(described, diff: str, changed: Iterable[str]):
    """Refuse text for a maintainer that speaks of the plugin or of what is not in the change.

    ``changed``: the stock text of each file the diff changes.
    """
    known = diff + "\n".join(changed)
    others = sorted(p.name for p in PATCHES.iterdir() if (p / "__init__.py").is_file() and p.name not in diff)
    texts = [("SUMMARY", described.summary)] + [  # a label and its excerpt together
        (f"MEASURED ({section})", f"{label}\n{excerpt}") for label, section, excerpt in described.measured]
    for where, text in texts:
        where = f"{described.name}: {where}"
        problems = []
        if re.search("glm53", text, re.I):
            problems.append("names the plugin")
        problems += [f"first person ({m.group(0)!r})" for m in FIRST_PERSON.finditer(text)]
        if where.startswith(f"{described.name}: MEASURED"):
            problems += [f"a run without a result ({m.group(0)!r})" for m in NOT_A_RESULT.finditer(text)]
        problems += [f"`{span}` is in neither the diff nor the files it changes"
                     for span in re.findall(r"`([^`\n]+)`", text) if span not in known]
        problems += [f"names {name}, which is not in the diff" for name in others if re.search(rf"\b{name}\b", text)]
        if problems:
            raise StageError(f"{where}: {'; '.join(problems)}")
    measurements(described)


# -- EVIDENCE.md -------------------------------------------------------------------------------


def _per_file(diff: str) -> Dict[str, Tuple[int, int]]:
    """{path: (added, removed)} from a git-style diff."""
    counts, current = {}, None
    for line in diff.splitlines():
        if line.startswith("diff --git a/"):
            current = line.split(" b/", 1)[1]
            counts[current] = (0, 0)
        elif current and line.startswith("+") and not line.startswith("+++"):
            counts[current] = (counts[current][0] + 1, counts[current][1])
        elif current and line.startswith("-") and not line.startswith("---"):
            counts[current] = (counts[current][0], counts[current][1] + 1)
    return counts


def _backend(result: Dict) -> str:
    return {"cpu": "the CPU", "cuda": "CUDA", "metal": "Metal"}.get(result["backend"], result["backend"])


def _machine(result: Dict) -> str:
    return (f"{_backend(result)} backend, mlx {result['mlx']}, Python {platform.python_version()}, "
            f"{platform.system()} {platform.machine()}")


def _tests(described, result: Dict) -> List[str]:
    tests = result["tests"]
    counts = tests.get("counts", {})
    switch = f" with `{described.switch}` unset" if described.switch else ""
    out = [
        "## Staged tests",
        "",
        f"The tests this change adds ({', '.join(f'`{t}`' for t in described.tests.values())}), run with "
        f"pytest in the patched tree{switch}, on {_machine(result)}, in an interpreter whose import path "
        "holds the patched tree, the standard library and mlx-vlm's installed dependencies only: "
        f"**{tests.get('passed', 0)} passed, {len(tests.get('failed') or [])} failed, "
        f"{counts.get('skipped', 0)} skipped** in {tests.get('seconds')} s.",
        "",
        "| test | result |",
        "|---|---|",
    ]
    modules = [path[:-3].replace("/", ".") for path in described.tests.values()]
    for name, outcome in tests.get("outcomes", {}).items():  # "module[.Class]::test" -> "[Class::]test"
        module = next((m for m in modules if name.startswith(m)), "")
        out.append(f"| `{name[len(module):].lstrip('.:') if len(modules) == 1 else name}` | {outcome} |")
    return out + [""]


def _yes(flag) -> str:
    return "yes" if flag else "**no**"


def _equivalence(described, patch, result: Dict, checkpoints: Dict[str, str]) -> List[str]:
    eq = result["equivalence"]
    specs = eq.get("case_specs") or {}
    warm = described.equivalence == "warm-cold"
    out = ["## Equivalence check", ""]
    if warm:
        out += [
            "Greedy decoding of small random-weight glm5_next checkpoints in the patched tree: each prompt "
            "prefilled in two parts, with the cache after the first part written to a `DiskBlockStore` "
            "entry and read back before the second (switch on: the new entry format; off: the current one), "
            "compared bit for bit (the logits of every step) with the same prefill kept in memory.",
        ]
    else:
        out += [
            "Greedy decoding of small random-weight glm5_next checkpoints in the patched tree, with the switch "
            "on and with it off, compared bit for bit (the logits of every step) with the same run of the "
            f"unpatched mlx-vlm {result['pin']}.",
        ]
    out += ["", "Checkpoints: " + "; ".join(f"`{name}`: {text}" for name, text in checkpoints.items()) + ".", ""]
    reference = "in memory" if warm else "unpatched"
    columns = ["case", "checkpoint", "prompt tokens"] + (["restored after"] if warm else []) + [
        "steps", f"switch on = {reference}", f"switch off = {reference}"]
    exact = patch.numerics == "exact"
    if not exact:
        columns += ["max abs logit difference, switch on", "same greedy tokens"]
    out += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for case in eq["cases"]:
        spec = specs.get(case, {})
        row = [case, f"`{spec.get('checkpoint', '?')}`", ", ".join(map(str, spec.get("prompt_tokens", [])))]
        row += [str(spec.get("restored_after"))] if warm else []
        row += [str(eq["tokens"][case]), _yes(eq["staged_equals_stock"][case]), _yes(eq["off_equals_stock"].get(case))]
        if not exact:
            row += [f"{eq['max_abs_diff_vs_stock'].get(case, float('nan')):.3g}", _yes(eq["tokens_equal_stock"].get(case))]
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    path = f"`{described.fast_path.replace(':', '.')}`"
    if described.gpu_only and result["backend"] == "cpu":
        out.append(f"On the CPU the new path declines every call (its kernel is for GPUs): {path} was reached "
                   f"{eq['declined']} times and handed each call to the current code; so on this backend the "
                   "check shows that the switch leaves the CPU path unchanged, not the kernel.")
    else:
        out.append(f"With the switch on, {path} served {eq['served']} calls; with it off, {eq['served_when_off']}.")
    if not exact:
        out.append("Switched on, the outputs are not bit-identical by design (a numerics-changing change): "
                   "the quality measurements are below.")
    return out + [""]


def evidence(described, patch, result: Dict, diff: str, checkpoints: Dict[str, str]) -> str:
    """EVIDENCE.md for one staged (patch, tree)."""
    stats = result["diff"]
    out = [
        f"# Evidence: {described.title}",
        "",
        f"mlx-vlm {result['pin']} ({result['tree_source']}), staged on {result['date']}; tests and checks run on "
        f"{_machine(result)}. SUMMARY.md is a draft of the description, for a person to rewrite.",
        "",
        "## Diff",
        "",
        f"`PATCH.diff`: {len(stats['files'])} files, +{stats['added']}/-{stats['removed']} lines "
        f"({stats['lines']} lines, {stats['bytes']} bytes). `git apply --check`, then `git apply`, on a clean "
        f"git copy of mlx-vlm {result['pin']}'s `mlx_vlm/`: applied with no offset and no fuzz, and changed "
        "exactly these files:",
        "",
        "| file | status | added | removed |",
        "|---|---|---:|---:|",
    ]
    per_file = _per_file(diff)
    out += [f"| `{path}` | {status} | {per_file[path][0]} | {per_file[path][1]} |"
            for path, status in result["diff"]["files"].items()]
    out.append("")
    if result.get("drift"):
        out += ["Upstream code this change hooks or relies on differs in this tree from the releases it was "
                "checked on: " + ", ".join(f"`{target}`" for target in result["drift"]) + ".", ""]
    out += _tests(described, result)
    if result.get("equivalence"):
        out += _equivalence(described, patch, result, checkpoints)
    out += ["## Measurements", ""]
    found = measurements(described)
    if found:
        out += ["Recorded with the change (from its notes, not re-run by this stage run); each names its backend "
                "and hardware.", ""]
    for label, heading, excerpt in found:
        out += [f"**{label}**", "", excerpt, ""]
    if not found:
        out += ["None recorded for this change.", ""]
    return "\n".join(out)


# -- SUMMARY.md --------------------------------------------------------------------------------


def summary(described, patch, result: Dict) -> str:
    """SUMMARY.md: a short factual draft of the description, marked for a person to rewrite."""
    out = [f"# {described.title}", "", f"> {REWRITE}", "", described.summary, ""]
    if described.switch:
        out += [f"Off by default: `{described.switch}=1` turns it on; unset, mlx-vlm runs its current code.", ""]
    eq = result.get("equivalence") or {}
    if eq.get("cases"):
        reference = "the same prefill kept in memory" if described.equivalence == "warm-cold" else "the current code"
        cases = len(eq["cases"])
        differ = [c for c in eq["cases"] if not eq["staged_equals_stock"][c]]
        if not differ:
            checked = f"greedy decoding gave logits bit-identical to those of {reference} in all {cases} cases"
        else:
            same_tokens = sum(bool(eq["tokens_equal_stock"].get(c)) for c in eq["cases"])
            largest = max(eq["max_abs_diff_vs_stock"].get(c, float("nan")) for c in differ)
            checked = (f"the logits differed from those of {reference} in {len(differ)} of {cases} cases "
                       f"(largest difference {largest:.2g}), with the same greedy tokens in {same_tokens} of {cases}")
        if described.gpu_only and result["backend"] == "cpu":
            checked += " (the new path declines every call there)"
        off_same = sum(bool(v) for v in eq["off_equals_stock"].values())
        off = (f"logits bit-identical to those of {reference} in all {cases} cases" if off_same == cases
               else f"logits NOT bit-identical to those of {reference} in {cases - off_same} of {cases} cases")
        out += [f"Checked here on {_backend(result)} (mlx {result['mlx']}, mlx-vlm {result['pin']}): with the "
                f"switch on, {checked}; with it off, {off}.", ""]
    out += ["Files:", ""] + [f"- `{path}` ({status})" for path, status in result["diff"]["files"].items()] + [""]
    return "\n".join(out)
