"""Verdicts, the printed table, the JSON file and the PNG chart."""

import json
import os

LAYERS = (("kda_layer", "KDA layer"), ("kda_attention", "KDA attention branch"), ("dsa_layer", "DSA layer"),
          ("dsa_attention", "DSA attention branch"), ("dsa_indexer", "DSA indexer"), ("moe_block", "MoE block"))


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


def verdicts(results):
    """Per arm: ok | WRONG (...) | NOT APPLIED (...) | changing numerics (...)."""
    out = {}
    for label, arm in results["arms"].items():
        if label == "stock":
            out[label] = "reference"
            continue
        checks = results["correctness"].get(label, {})
        bad = [name for name, c in checks.items()
               if not (c["outputs_bitwise"] and c["final_state_bitwise"] and c.get("tokens_match") is not False
                       and c.get("timed_tokens_match") is not False)]
        token_bad = [name for name, c in checks.items()
                     if c.get("tokens_match") is False or c.get("timed_tokens_match") is False]
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


def _cell(results, label, entry, scale=1.0, fmt="{:.3f}"):
    if entry is None:
        return "-"
    text = f"{fmt.format(entry['median'] * scale)} [{fmt.format(entry['min'] * scale)}-{fmt.format(entry['max'] * scale)}]"
    return text + _speedup(results, label, entry)


def table(results):
    labels = list(results["arms"])
    m, b = results["model"], results["bytes_per_token"]
    lines = [
        f"glm53-patches bench {results['date']}  device={results['device']['backend']} "
        f"({results['device'].get('device_name', '')})  mlx {results['device']['mlx']}  mlx-vlm {results['device']['mlx_vlm']}",
        f"model: {m['preset']} {m['layers']} layers ({m['kda_layers']} KDA + {m['dsa_layers']} DSA), "
        f"hidden {m['hidden_size']}, {m['experts']} experts/layer (top-{m['top_k']}), {m['dtype']}; {m['note']}",
        f"weights read per decode token {b['weights'] / 1e9:.3f} GB (KDA state {b.get('kda_state', 0) / 1e6:.1f} MB read+written)",
    ]
    if "bandwidth" in results:
        bw, fl = results["bandwidth"], results["floor_ms"]
        lines.append(f"floor: {fl['copy']:.3f} ms at the copy's {bw['copy_GBps']:.0f} GB/s; "
                     f"{fl['matvec']:.3f} ms at the 8-bit matvec's {bw['matvec_GBps']:.0f} GB/s")
    lines.append("cells: median [min-max of round medians], speedup vs stock (stock/arm)")
    rows = [("", labels)]
    for ctx, entry in results.get("decode", {}).items():
        rows.append((f"decode ctx {ctx} ms/token", [_cell(results, l, entry["arms"].get(l)) for l in labels]))
    for name, entry in layer_entries(results):
        rows.append((f"{name} ms", [_cell(results, l, entry["arms"].get(l)) for l in labels]))
    for length, entry in results.get("prefill", {}).items():
        cells = []
        for l in labels:
            e = entry["arms"].get(l)
            if e is None:
                cells.append("untimed")
                continue
            c = f"{e['tokens_per_s']:.1f} [{e['tokens_per_s_min']:.1f}-{e['tokens_per_s_max']:.1f}]"
            cells.append(c + _speedup(results, l, e, entry.get("ratio_base", "stock")))
        rows.append((f"prefill {length} tok/s", cells))
    graph = results.get("graph_primitives", {}).get("decode_step")
    if graph:
        rows.append((f"primitives/decode step (ctx {graph['context']})",
                     [f"{graph[l]['total']} ({graph[l]['not_views']} not views)" if l in graph else "-" for l in labels]))
    if results.get("decode"):
        ctx, entry = max(results["decode"].items(), key=lambda kv: int(kv[0]))
        rows.append((f"peak memory decode {ctx} GB", [f"{entry['arms'][l]['peak_memory'] / 1e9:.2f}" for l in labels]))
        if "floor_ms" in results:
            rows.append((f"x copy floor, decode {ctx}",
                         [f"{entry['arms'][l]['median'] / results['floor_ms']['copy']:.1f}x" for l in labels]))
    rows.append(("check vs stock", [results["verdicts"].get(l, "-") for l in labels]))
    widths = [max(len(r[0]) for r in rows)] + [max(len(r[1][i]) for r in rows) for i in range(len(labels))]
    for name, cells in rows:
        lines.append("  ".join([name.ljust(widths[0])] + [c.ljust(w) for c, w in zip(cells, widths[1:])]).rstrip())
    for note in results.get("notes", []) + [f"skipped: {s}" for s in results.get("skipped", [])]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def write_png(results, path):
    """Bar charts (median, min-max whiskers) per measurement; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no PNG written"
    panels = [(f"decode ctx {c} (ms/token)", e) for c, e in results.get("decode", {}).items()]
    panels += [(f"{n} (ms)", e) for n, e in layer_entries(results)]
    panels += [(f"prefill {n} (ms)", e) for n, e in results.get("prefill", {}).items()]
    if not panels:
        return "nothing measured: no PNG written"
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, entry) in zip(axes.flat, panels):
        labels = [l for l in results["arms"] if l in entry["arms"]]
        med = [entry["arms"][l]["median"] for l in labels]
        err = [[m - entry["arms"][l]["min"] for m, l in zip(med, labels)],
               [entry["arms"][l]["max"] - m for m, l in zip(med, labels)]]
        colors = ["tab:gray" if l == "stock" else ("tab:green" if is_valid(results, l) else "tab:red") for l in labels]
        ax.bar(range(len(labels)), med, yerr=[[max(e, 0) for e in err[0]], [max(e, 0) for e in err[1]]],
               color=colors, capsize=3)
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=7)
        ax.set_title(title, fontsize=9)
        if title.startswith("decode") and "floor_ms" in results:
            ax.axhline(results["floor_ms"]["copy"], color="tab:blue", linestyle="--", linewidth=1, label="copy floor")
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    m = results["model"]
    fig.suptitle(f"glm53-patches bench {results['date']} {results['device']['backend']}: {m['preset']} "
                 f"{m['layers']} layers, {m['experts']} experts, {m['dtype']} (red: wrong answer)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
