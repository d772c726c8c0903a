"""Pool ``probe_verify_layers.py --interleave`` runs: each block length's ratio to the first, per round.

Every process's rounds time one block of each length in turn, so a ratio within a round is free of the
machine's drift; pooling processes of one package gives the figure, their spread how far to trust it.
Rounds where some length took more than 1.5x its own median are listed ("slow rounds"), not dropped.

  python pool_interleaved.py --arm ARM_PREFIX FILE.json [FILE.json ...]
"""

import argparse
import json
import statistics
from pathlib import Path


def rounds(path, arm):
    """{length: [ms per round]} for the first arm in ``path`` whose label starts with ``arm``."""
    data = json.loads(Path(path).read_text())
    labels = sorted({key.rsplit("|", 1)[0] for key in data["whole"] if key.startswith(arm)})
    if not labels:
        raise SystemExit(f"{path}: no arm starting with {arm!r}")
    return {n: [sum(parts) for parts in data["whole"][f"{labels[0]}|{n}"]["blocks"]] for n in data["blocks"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arm", required=True, help="label prefix, e.g. stock or compiled_kda_decode")
    p.add_argument("files", nargs="+")
    args = p.parse_args()
    ratios, times = {}, {}
    for path in args.files:
        ms = rounds(path, args.arm)
        first, *rest = ms
        count = len(ms[first])
        medians = {n: statistics.median(v) for n, v in ms.items()}
        slow = [i + 1 for i in range(count) if any(ms[n][i] > 1.5 * medians[n] for n in ms)]
        own = {}
        for n in rest:
            per_round = [ms[n][i] / ms[first][i] for i in range(count)]
            ratios.setdefault(n, []).extend(per_round)
            own[n] = statistics.median(per_round)
        for n, v in ms.items():
            times.setdefault(n, []).extend(v)
        print(f"{path}: {count} rounds; L/L={first}, median per round: "
              + ", ".join(f"L={n} {r:.3f}" for n, r in own.items()) + f"; slow rounds {slow or 'none'}")
    first = min(times)
    print(f"pooled, {len(ratios[max(ratios)])} rounds of {len(args.files)} processes:")
    for n, r in ratios.items():
        q1, q2, q3 = statistics.quantiles(r, n=4)
        print(f"  L={n} / L={first}: median {q2:.3f}, quartiles {q1:.3f}-{q3:.3f}, range {min(r):.3f}-{max(r):.3f}")
    pooled = {n: statistics.median(v) for n, v in times.items()}
    print("  median ms: " + ", ".join(f"L={n} {v:.2f}" for n, v in pooled.items()))
    last = max(pooled)
    extra = (pooled[last] - pooled[first]) / (last - first)
    print(f"  each extra token: {extra:.2f} ms, {extra / pooled[first]:.3f} of L={first}")
    print("  every draft accepted, the drafter left out: "
          + ", ".join(f"{n} a round {n / pooled[n] * 1e3:.1f} tok/s" for n in pooled))


if __name__ == "__main__":
    main()
