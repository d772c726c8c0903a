"""Verdicts, the printed table, the JSON file and the PNG chart."""

import json
import os
import re
import textwrap

LAYERS = (("kda_layer", "KDA layer"), ("kda_attention", "KDA attention branch"), ("dsa_layer", "DSA layer"),
          ("dsa_attention", "DSA attention branch"), ("dsa_indexer", "DSA indexer"), ("moe_block", "MoE block"))


# greedy tokens compared with stock's: the check's pass, every timed run, every pipelined run
TOKEN_CHECKS = ("tokens_match", "timed_tokens_match", "pipelined_tokens_match")


def layer_entries(results):
    """(row name, entry) for every layer measurement; keys are ``name`` or ``name@context``."""
    layers = results.get("layers", {})
    out = []
    for key, name in LAYERS:
        for entry_key, entry in layers.items():
            if entry_key == key or entry_key.startswith(key + "@"):
                ctx = f" ctx {entry['context']}" if "context" in entry else ""
                out.append((f"{name}{ctx}", entry))
    return out


def _token_failures(checks):
    return [name for name, c in checks.items() if False in (c.get(k) for k in TOKEN_CHECKS)]


def _failed_checks(checks):
    """The checks whose outputs, final state or greedy tokens were not stock's."""
    tokens = _token_failures(checks)
    return [name for name, c in checks.items() if not (c["outputs_bitwise"] and c["final_state_bitwise"])
            or name in tokens]


def verdicts(results):
    """Per arm: ok | WRONG (...) | NOT APPLIED (...) | changing numerics (...)."""
    out = {}
    for label, arm in results["arms"].items():
        if label == "stock":
            out[label] = "reference"
            continue
        checks = results["correctness"].get(label, {})
        token_bad = _token_failures(checks)
        bad = _failed_checks(checks)
        if arm.get("applied") is False:
            out[label] = f"NOT APPLIED: {', '.join(arm.get('not_applied', {}))} (reasons: arms.{label}.not_applied)"
        elif arm["numerics"] == "exact" and bad:
            out[label] = "WRONG: differs from stock in " + ", ".join(bad)
        elif arm["numerics"] != "exact":
            diff = max((c["max_abs_diff"] for c in checks.values()), default=0.0)
            compared = any(c.get("tokens_match") is not None for c in checks.values())
            out[label] = f"changing numerics: max |diff| {diff:.3g}" + (
                f", greedy tokens differ in {', '.join(token_bad)}" if token_bad
                else ", same greedy tokens" if compared else ", no greedy tokens compared")
        elif arm["patches"] and not any(k.split(".")[1] == "hits" for k in arm.get("counters", {})):
            out[label] = "ok (bit-identical) but NO fast-path hit was counted"
        else:
            out[label] = "ok (bit-identical)"
        if arm.get("forced_despite_drift"):
            out[label] += " [forced despite drift]"
    return out


def _flag(results, label):
    v = results.get("verdicts", {}).get(label, "")
    if v.startswith("changing numerics"):
        return "TOKENS DIFFER"
    return "NOT APPLIED" if v.startswith("NOT APPLIED") else "WRONG"


def is_valid(results, label):
    """Stock, exact arms that matched, and numerics-changing arms that kept stock's greedy tokens."""
    v = results.get("verdicts", {}).get(label, "")
    return label == "stock" or v.startswith("ok") or (v.startswith("changing numerics") and "differ" not in v)


def write_json(results, path):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)


def _speedup(results, label, entry, base="stock"):
    """' 1.23x' against stock (or ' 1.23x vs first' where stock was untimed); a flag if invalid."""
    if label == base:
        return ""
    if not is_valid(results, label):
        return f" {_flag(results, label)}"
    if base == "stock":
        return f" {entry['ratio_vs_stock']:.2f}x"
    return f" {entry['ratio_vs_first_arm']:.2f}x vs first"


WIDTH = 120  # the printed table's columns


def _num(x):
    """About four significant digits: 1231, 185.5, 71.36, 3.312, 0.984."""
    for limit, digits in ((1000, 0), (100, 1), (10, 2)):
        if abs(x) >= limit:
            return f"{x:.{digits}f}"
    return f"{x:.3f}"


def _cell(results, label, entry, base="stock"):
    if entry is None:
        return "-"
    return f"{_num(entry['median'])} [{_num(entry['min'])}-{_num(entry['max'])}]" + _speedup(results, label, entry, base)


def _rate_cell(results, label, entry, base="stock"):
    """tokens/s: median [slowest-fastest round], speedup."""
    if entry is None:
        return "untimed"
    return (f"{_num(entry['tokens_per_s'])} [{_num(entry['tokens_per_s_min'])}-{_num(entry['tokens_per_s_max'])}]"
            + _speedup(results, label, entry, base))


def _blocks(results):
    """(title, [(column header, {arm: cell})]) in the order printed."""
    labels = list(results["arms"])
    blocks = []
    for ctx, entry in results.get("decode", {}).items():
        arms = entry["arms"]
        columns = [("ms/token", {l: _cell(results, l, arms.get(l)) for l in labels})]
        title = f"decode at a {ctx}-token context, ms per token"
        if any("pipelined" in a for a in arms.values()):
            piped = {l: arms[l]["pipelined"] for l in labels if "pipelined" in arms.get(l, {})}
            columns += [("pipelined ms/token", {l: _cell(results, l, e["ms_per_token"] | _ratios(e))
                                                for l, e in piped.items()}),
                        ("tok/s", {l: _num(e["tokens_per_s"]) for l, e in piped.items()})]
            columns += [(name, {l: _num(e[key]["median"]) for l, e in piped.items()})
                        for name, key in (("build", "build_ms"), ("async_eval", "async_eval_ms"), ("wait", "wait_ms"))]
            title += (": synchronous steps (build, then mx.eval) and mlx-vlm's pipelined loop (step n+1 built and "
                      "async_eval'd before step n's token is read); build, async_eval, wait: the thread's ms per "
                      "pipelined step")
        blocks.append((title, columns))
    blocks += _verify_blocks(results, labels)
    layers = [(name, {l: _cell(results, l, e["arms"].get(l)) for l in labels}) for name, e in layer_entries(results)]
    if layers:
        blocks.append(("one layer or block alone, ms per step", layers))
    prefill = []
    for length, entry in results.get("prefill", {}).items():
        base = entry.get("ratio_base", "stock")
        prefill.append((f"{length}" if length.isdigit() else length,
                        {l: _rate_cell(results, l, entry["arms"].get(l), base) for l in labels}))
    if prefill:
        blocks.append(("prefill, tokens/s, of a prompt of N tokens (the model, or one layer @N)", prefill))
    other = []
    graph = results.get("graph_primitives", {}).get("decode_step")
    if graph:
        other.append((f"primitives/step ctx {graph['context']}",
                      {l: f"{graph[l]['total']} ({graph[l]['not_views']} not views)" for l in labels if l in graph}))
    if results.get("decode"):
        ctx, entry = max(results["decode"].items(), key=lambda kv: int(kv[0]))
        other.append((f"peak GB decode {ctx}", {l: f"{e['peak_memory'] / 1e9:.2f}" for l, e in entry["arms"].items()}))
        if "floor_ms" in results:
            floor = results["floor_ms"]["copy"]
            other.append((f"x copy floor {ctx}", {l: f"{e['median'] / floor:.1f}x" for l, e in entry["arms"].items()}))
    if other:
        blocks.append(("decode step: graph primitives (deterministic), peak memory, time over the copy floor", other))
    blocks.append(("check vs stock", [("verdict", {l: results["verdicts"].get(l, "-") for l in labels})]))
    return blocks


def verify_costs(results):
    """{context: {arm: {block: ms}}} of the verify section, and each arm's cost of one extra token in a block
    as a fraction of its own single-token step: ``(t_L - t_1) / ((L - 1) * t_1)``, at the largest L."""
    table = {}
    for entry in results.get("verify", {}).values():
        for label, arm in entry["arms"].items():
            table.setdefault(entry["context"], {}).setdefault(label, {})[entry["block"]] = arm["median"]
    costs = {}
    for context, arms in table.items():
        for label, ms in arms.items():
            largest = max(ms)
            if 1 in ms and largest > 1:
                costs.setdefault(context, {})[label] = (ms[largest] - ms[1]) / ((largest - 1) * ms[1])
    return table, costs


def _verify_blocks(results, labels):
    table, costs = verify_costs(results)
    blocks = []
    for context, arms in table.items():
        sizes = sorted({size for ms in arms.values() for size in ms})
        entries = {e["block"]: e for e in results["verify"].values() if e["context"] == context}
        columns = [(f"L={size} ms", {l: _cell(results, l, entries[size]["arms"].get(l)) for l in labels})
                   for size in sizes]
        columns += [(f"L={size} build", {l: _num(e["build_ms"]["median"]) for l, e in entries[size]["arms"].items()
                                          if "build_ms" in e}) for size in sizes]
        top = sizes[-1]
        if 1 in sizes and top > 1:
            columns.append((f"L={top} / own L=1", {l: f"{ms[top] / ms[1]:.2f}x" for l, ms in arms.items()
                                                    if 1 in ms and top in ms}))
            columns.append(("extra token, x step", {l: f"{c:.2f}" for l, c in costs.get(context, {}).items()}))
        columns += [(f"tok/s, {size} a round", {l: _num(size * 1000 / ms[size]) for l, ms in arms.items() if size in ms})
                    for size in sizes]
        blocks.append((f"speculative verify blocks at a {context}-token context: ms per block of L tokens "
                       "(the bonus token and L - 1 drafts, then a commit); build: the ms of it spent building the graph "
                       "(the commit before, the forward), before its evaluation; extra token: each token past the "
                       "first, as a fraction of the arm's own single-token step; tok/s, n a round: the rate when every "
                       "round yields n tokens from an n-token block (all drafts accepted; the drafter's own time left "
                       "out)", columns))
    return blocks


def _ratios(entry):
    return {k: v for k, v in entry.items() if k.startswith("ratio_vs_")}


def _arm_lines(label, width=30, indent=""):
    """A long ``a+b+c`` arm name on several lines, broken after a ``+``."""
    lines = [""]
    for part in re.findall(r"[^+]+\+?", label) or [label]:
        if lines[-1].strip() and len(lines[-1]) + len(part) > width:
            lines.append(indent)
        lines[-1] += part
    return lines


def _render(title, columns, labels, width=WIDTH):
    """Arms as rows; the columns in as many side-by-side chunks as fit ``width``;
    a column wider than the room left is wrapped."""
    names = {l: _arm_lines(l, indent="  ") for l in labels}
    name_w = max(len("arm"), *(len(line) for lines in names.values() for line in lines))
    room = width - name_w - 2
    sized = [(h, cells, min(room, max(len(h), *(len(cells.get(l, "-")) for l in labels)))) for h, cells in columns]
    chunks, used = [[]], name_w
    for column in sized:
        if chunks[-1] and used + 2 + column[2] > width:
            chunks.append([])
            used = name_w
        chunks[-1].append(column)
        used += 2 + column[2]
    lines = textwrap.wrap(title, width)
    for n, chunk in enumerate(chunks):
        lines += [""] if n else []
        rows = [(["arm"], [h for h, _, _ in chunk])]
        rows += [(names[l], [cells.get(l, "-") for _, cells, _ in chunk]) for l in labels]
        for name, cells in rows:
            parts = [name] + [textwrap.wrap(c, w) or [""] for c, (_, _, w) in zip(cells, chunk)]
            for i in range(max(len(p) for p in parts)):
                texts = [(p[i] if i < len(p) else "").ljust(w) for p, w in zip(parts, [name_w] + [w for *_, w in chunk])]
                lines.append("  ".join(texts).rstrip())
    return lines


def _wrap(line):
    return textwrap.wrap(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def table(results):
    labels = list(results["arms"])
    m, b, d = results["model"], results["bytes_per_token"], results["device"]
    head = [
        f"glm53-patches bench {results['date']}  device={d['backend']} ({d.get('device_name', '')})  "
        f"mlx {d['mlx']}  mlx-vlm {d['mlx_vlm']}" + (f"  {d['os']}" if d.get("os") else ""),
        f"model: {m['preset']}" + (f" {m['checkpoint']}" if m.get("checkpoint") else "")
        + f" {m['layers']} layers ({m['kda_layers']} KDA + {m['dsa_layers']} DSA), "
        f"hidden {m['hidden_size']}, {m['experts']} experts/layer (top-{m['top_k']}), {m['dtype']}; {m['note']}",
        f"weights read per decode token {b['weights'] / 1e9:.3f} GB (KDA state {b.get('kda_state', 0) / 1e6:.1f} MB read+written)",
    ]
    if "bandwidth" in results:
        bw, fl = results["bandwidth"], results["floor_ms"]
        head.append(f"floor: {fl['copy']:.3f} ms at the copy's {bw['copy_GBps']:.0f} GB/s; "
                    f"{fl['matvec']:.3f} ms at the 8-bit matvec's {bw['matvec_GBps']:.0f} GB/s")
    head.append("cells: median [min-max of round medians], speedup vs stock (stock/arm); WRONG, TOKENS DIFFER or "
                "NOT APPLIED instead of the speedup where the check failed")
    lines = [wrapped for line in head for wrapped in _wrap(line)]
    for title, columns in _blocks(results):
        lines += [""] + _render(title, columns, labels)
    notes = list(results.get("notes", []))
    for ctx, entry in results.get("decode", {}).items():
        differ = [l for l, e in entry["arms"].items() if e.get("pipelined", {}).get("tokens_match_synchronous") is False]
        if differ:
            notes.append(f"decode {ctx}: the pipelined loop's greedy tokens differ from the synchronous steps' "
                         f"in {', '.join(differ)}")
    lines.append("")
    for note in notes + [f"skipped: {s}" for s in results.get("skipped", [])]:
        lines += _wrap(f"note: {note}")
    return "\n".join(lines)


def _panels(results):
    """(title, kind, entry) per PNG panel: kind 'ms' or 'rate' (one bar per arm),
    'decode' (synchronous and pipelined bars) or 'thread' (the pipelined step's split)."""
    panels = []
    for ctx, entry in results.get("decode", {}).items():
        piped = any("pipelined" in a for a in entry["arms"].values())
        panels.append((f"decode ctx {ctx}: ms/token" + (", synchronous | pipelined" if piped else ""),
                       "decode" if piped else "ms", entry))
        if piped:
            panels.append((f"decode ctx {ctx}: the thread per pipelined step (ms)", "thread", entry))
    panels += [(f"{n} (ms)", "ms", e) for n, e in layer_entries(results)]
    panels += [(f"prefill {n} (tokens/s)", "rate", e) for n, e in results.get("prefill", {}).items()]
    return panels


def _bar_note(results, label, entry, base):
    """The text at a bar's end: the speedup, or the check's flag."""
    if label == base or entry is None:
        return ""
    if not is_valid(results, label):
        return _flag(results, label)
    ratio = entry.get("ratio_vs_stock", entry.get("ratio_vs_first_arm"))
    return f"{ratio:.2f}x" if ratio else ""


def _hbars(ax, ys, values, lows, highs, colors, notes, height, **style):
    ax.barh(ys, values, height=height, color=colors, xerr=[[max(v - lo, 0) for v, lo in zip(values, lows)],
                                                            [max(hi - v, 0) for v, hi in zip(values, highs)]],
            error_kw={"capsize": 2, "linewidth": 0.8}, **style)
    for y, hi, note in zip(ys, highs, notes):
        if note:
            ax.text(hi, y, f" {note}", va="center", fontsize=6.5)


PIPELINED = dict(alpha=0.45, hatch="///", edgecolor="black", linewidth=0.4)
THREAD = (("build_ms", "build", "tab:blue"), ("async_eval_ms", "in async_eval", "tab:orange"),
          ("wait_ms", "waiting in .item()", "tab:purple"))


def _legend(pipelined):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color="tab:gray", label="stock"), Patch(color="tab:green", label="exact, or same tokens"),
               Patch(color="tab:red", label="wrong answer / not applied")]
    if pipelined:
        handles += [Patch(facecolor="tab:green", label="pipelined loop", **PIPELINED)]
        handles += [Patch(color=color, label=name) for _, name, color in THREAD]
        handles += [Patch(fill=False, edgecolor="black", label="pipelined ms/token")]
    handles += [Line2D([], [], color="tab:gray", linestyle=":", label="stock's median (or the first arm's)"),
                Line2D([], [], color="tab:blue", linestyle="--", label="copy floor")]
    return handles


def write_png(results, path):
    """Horizontal bars per measurement, one row per arm (named on every panel): median,
    whiskers from the slowest to the fastest round, the speedup at the bar's end;
    None, or why no PNG was written (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no PNG written"
    panels = _panels(results)
    if not panels:
        return "nothing measured: no PNG written"
    labels = list(results["arms"])
    ys = list(range(len(labels)))
    colors = ["tab:gray" if l == "stock" else ("tab:green" if is_valid(results, l) else "tab:red") for l in labels]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    names = ["\n".join(_arm_lines(l)) for l in labels]
    arms_in = max(1.5, sum(0.12 + 0.2 * (n.count("\n") + 1) for n in names))  # inches for the bars of a panel
    m, fig_w = results["model"], 5.6 * cols
    heading = textwrap.wrap(
        f"glm53-patches bench {results['date']} {results['device']['backend']}: {m['preset']} "
        + (f"{m['checkpoint']} " if m.get("checkpoint") else "")
        + f"{m['layers']} layers, {m['experts']} experts, {m['dtype']}. Bars: medians; whiskers: the slowest "
        "and fastest round; at the bar's end: stock/arm", int(fig_w * 12))  # about 12 characters of 10 points an inch
    handles = _legend(any(kind == "thread" for _, kind, _ in panels))
    ncol = min(len(handles), int(fig_w / 1.6))
    legend_at = 0.15 + 0.2 * len(heading)  # inches from the top
    header = legend_at + 0.05 + 0.2 * -(-len(handles) // ncol)
    fig_h = (1.1 + arms_in) * rows + header
    fig, axes = plt.subplots(rows, cols, figsize=(fig_w, fig_h), squeeze=False)
    for ax, (title, kind, entry) in zip(axes.flat, panels):
        arms, base = entry["arms"], entry.get("ratio_base", "stock")
        get = lambda l, key, inner=None: (arms[l][inner] if inner else arms[l])[key] if l in arms else 0  # noqa: E731
        if kind in ("ms", "decode"):
            offset, height = (0.2, 0.4) if kind == "decode" else (0, 0.7)
            _hbars(ax, [y - offset for y in ys], [get(l, "median") for l in labels], [get(l, "min") for l in labels],
                   [get(l, "max") for l in labels], colors,
                   [_bar_note(results, l, arms.get(l), base) for l in labels], height)
        if kind == "decode":
            piped = [arms[l]["pipelined"] if "pipelined" in arms.get(l, {}) else None for l in labels]
            ms = [p["ms_per_token"] if p else {"median": 0, "min": 0, "max": 0} for p in piped]
            _hbars(ax, [y + 0.2 for y in ys], [m["median"] for m in ms], [m["min"] for m in ms],
                   [m["max"] for m in ms], colors, [_bar_note(results, l, p, base) for l, p in zip(labels, piped)],
                   0.4, **PIPELINED)
        if kind == "thread":
            left = [0.0] * len(labels)
            for key, _, color in THREAD:
                width = [arms[l]["pipelined"][key]["median"] if "pipelined" in arms.get(l, {}) else 0 for l in labels]
                ax.barh(ys, width, left=left, height=0.7, color=color)
                left = [a + b for a, b in zip(left, width)]
            step = [arms[l]["pipelined"]["ms_per_token"]["median"] if "pipelined" in arms.get(l, {}) else 0
                    for l in labels]
            ax.barh(ys, step, height=0.7, fill=False, edgecolor="black", linewidth=0.8)
        if kind == "rate":
            rate = lambda l, key: arms[l][key] if l in arms else 0  # noqa: E731
            _hbars(ax, ys, [rate(l, "tokens_per_s") for l in labels], [rate(l, "tokens_per_s_min") for l in labels],
                   [rate(l, "tokens_per_s_max") for l in labels], colors,
                   [_bar_note(results, l, arms.get(l), base) if l in arms else "untimed" for l in labels], 0.7)
        if kind in ("ms", "decode", "rate") and base in arms:
            key = "tokens_per_s" if kind == "rate" else "median"
            ax.axvline(arms[base][key], color="tab:gray", linestyle=":", linewidth=1)
        if kind in ("decode", "ms") and title.startswith("decode") and "floor_ms" in results:
            ax.axvline(results["floor_ms"]["copy"], color="tab:blue", linestyle="--", linewidth=1)
        ax.set_yticks(ys, names, fontsize=8)
        ax.invert_yaxis()  # the first arm on top, as in the table
        ax.tick_params(axis="x", labelsize=7)
        ax.margins(x=0.18)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", linewidth=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # fig.text, not suptitle: tight_layout would make room for a suptitle a second time
    fig.text(0.5, 1 - 0.1 / fig_h, "\n".join(heading), fontsize=10, ha="center", va="top")
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - legend_at / fig_h))
    fig.tight_layout(rect=(0, 0, 1, 1 - header / fig_h))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_report(results, path):
    """A Markdown file to share: machine, OS, versions, the model, arms, figures, exactness."""
    d, m = results["device"], results["model"]
    memory = next((int(d[k]) for k in ("memory_size", "total_memory") if str(d.get(k, "")).isdigit()), None)
    rows = [("date", results["date"]),
            ("machine", ", ".join(str(x) for x in (d.get("machine"), d.get("device_name") or d.get("processor"),
                                                   f"{memory / 2**30:.0f} GiB" if memory else None) if x)),
            ("OS", d.get("os", "?")), ("Python", d.get("python", "?")), ("backend", d["backend"]),
            ("mlx / mlx-vlm / glm53-patches", f"{d['mlx']} / {d['mlx_vlm']} / {d.get('glm53_patches', '?')}"),
            ("model", f"{m['preset']}" + (f" `{m['checkpoint']}`" if m.get("checkpoint") else "")
             + f": {m['layers']} layers ({m['kda_layers']} KDA + {m['dsa_layers']} DSA), hidden {m['hidden_size']}, "
               f"{m['experts']} experts (top-{m['top_k']}), {m['dtype']}, quantization {json.dumps(m.get('quantization'))}"),
            ("command", " ".join(_private(a) for a in results.get("command", results.get("argv", []))))]
    lines = ["# glm53-patches bench report", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    lines += ["", "## Arms and exactness against stock", "", "| arm | patches | numerics | check |", "|---|---|---|---|"]
    for label, arm in results["arms"].items():
        lines.append(f"| {label} | {', '.join(arm['patches']) or '-'} | {arm['numerics']} | "
                     f"{results['verdicts'].get(label, '-')} |")
    lines += ["", "## Figures", "", "```text", table(results), "```", "",
              "## The figures as data", "", "```json", _compact_json(summary(results)), "```", ""]
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _compact_json(data):
    """One line per top-level key, floats to 4 significant digits: pasteable into an issue."""
    def rounded(x):
        if isinstance(x, float):
            return float(f"{x:.4g}")
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        return [rounded(v) for v in x] if isinstance(x, list) else x

    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(rounded(v), separators=(',', ':'))}"
                                for k, v in data.items()) + "\n}"


def _private(arg):
    """A command-line word without the home folder's name."""
    home = os.path.expanduser("~")
    return arg.replace(home, "~") if home not in ("", "/") else arg


def summary(results):
    """The medians of every figure, per arm, and each check's outcome: small enough to paste."""
    def medians(entry):
        out = {"median": entry["median"], "min": entry["min"], "max": entry["max"]}
        out.update({k: v for k, v in entry.items() if k.startswith(("ratio_vs_", "tokens_per_s"))})
        return out

    decode = {}
    for ctx, entry in results.get("decode", {}).items():
        decode[ctx] = {}
        for label, arm in entry["arms"].items():
            row = decode[ctx][label] = {"ms_per_token": medians(arm)}
            if "build_ms" in arm:
                row["build_ms"] = arm["build_ms"]["median"]
            if "pipelined" in arm:
                p = arm["pipelined"]
                row["pipelined"] = {"ms_per_token": medians(p["ms_per_token"]), "tokens_per_s": p["tokens_per_s"],
                                    **{k: p[k]["median"] for k in ("build_ms", "async_eval_ms", "wait_ms")}}
    checks = {label: {name: name not in _failed_checks(c) for name in c}
              for label, c in results.get("correctness", {}).items()}
    return {"schema": "glm53-bench-summary/1", "device": results["device"],
            "model": {k: v for k, v in results["model"].items() if k != "active_memory_after_build"},
            "arms": {l: {"patches": a["patches"], "numerics": a["numerics"], "applied": a.get("applied"),
                         "verdict": results["verdicts"].get(l), "counters": a.get("counters", {})}
                     for l, a in results["arms"].items()},
            "floor_ms": results.get("floor_ms"), "bytes_per_token": results["bytes_per_token"]["weights"],
            "decode": decode,
            "layers": {k: {l: medians(a) for l, a in e["arms"].items()} for k, e in results.get("layers", {}).items()},
            "prefill": {k: {l: medians(a) for l, a in e["arms"].items()} for k, e in results.get("prefill", {}).items()},
            "graph_primitives": {l: g["total"] for l, g in results.get("graph_primitives", {}).get("decode_step", {}).items()
                                 if isinstance(g, dict)},
            "checks_passed": checks, "skipped": results.get("skipped", [])}
