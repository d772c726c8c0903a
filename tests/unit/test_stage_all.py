"""`glm53-patches stage --all`: one row per patch and pin.

In a file of its own so that pytest-xdist (``--dist loadfile``) runs it beside
test_stage.py's per-patch cases instead of after them.
"""

import json

from glm53_patches import stage
from test_stage import DESCRIBED, PINS


def test_stage_all_prints_a_row_per_patch_and_pin(releases, cache, tmp_path, capsys):
    code = stage.main(["--all", "--no-run", "--out", str(tmp_path), "--cache", str(cache)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = [line.split() for line in printed.splitlines()[1:] if line and not line.startswith("wrote")]
    for name in DESCRIBED:
        mine = [row for row in rows if row[0] == name]
        assert [row[1] for row in mine] == PINS and all(row[2] == "applies" for row in mine)
        for row, pin in zip(mine, PINS):
            folder = tmp_path / name / f"mlx-vlm-{pin}"
            diff = (folder / "PATCH.diff").read_text()
            assert {f.name for f in folder.iterdir()} == {"PATCH.diff", "stage.json"}  # no tests ran: no evidence
            assert row[3:5] == [str(len(diff.splitlines())), str(len(diff.encode()))]
    for name, patch in stage.stageable().items():
        if name not in DESCRIBED:
            assert [row[1:3] for row in rows if row[0] == name] == [["-", "-"]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary) == len(DESCRIBED) * len(PINS) + len(stage.stageable()) - len(DESCRIBED)
