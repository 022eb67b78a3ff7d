"""What a tool leaves in ``/out`` cannot break or bloat the collection of its outputs: a deep tree is
walked to the depth cap and no further, and refused entries are shortened and counted."""

from __future__ import annotations

import os
from pathlib import Path

from runner import OutputCaps, ResourceLimits, Verdict
from runner.files import Quarantine
from runner.worker import OUT_ENTRIES as MAX_REFUSED  # /out holds no more entries than this
from tests.containment.conftest import Runner

DEEP = """
import os
os.chdir("/out")
open("result.txt", "w").write("hello")
depth = 0
try:
    while depth < 1010:
        os.mkdir("d"); os.chdir("d"); depth += 1
except OSError:
    pass
print(depth)
"""

LONG_NAMES = """
import os
os.chdir("/out")
for i in range(15):
    name = chr(97 + i) * 250
    os.mkdir(name)
    os.chdir(name)
k = 0
try:
    while k < 2000:
        os.symlink("/etc/shadow", "%s%05d" % ("s" * 200, k)); k += 1
except OSError:
    pass
print(k)
"""


async def test_a_deep_out_tree_keeps_the_verdict_and_refuses_what_lies_too_deep(run: Runner) -> None:
    result = await run.py(DEEP, outputs=OutputCaps(), call_id="c-deep", limits=ResourceLimits(timeout_s=30))
    assert result.verdict is Verdict.OK, (result.detail, result.stderr[-500:])
    assert int(result.stdout) > 100
    assert [record.path for record in result.artifacts] == ["result.txt"]
    assert result.quarantine is not None
    assert (Path(result.quarantine) / "result.txt").read_text() == "hello"
    # One entry for the whole subtree below the cap, not one per level.
    assert len(result.refused) == 1, result.refused
    path, why = result.refused[0]
    assert path == "/".join(["d"] * 16)
    assert "deeper" in why


async def test_refused_out_entries_are_shortened(run: Runner) -> None:
    result = await run.py(LONG_NAMES, outputs=OutputCaps(), call_id="c-long", limits=ResourceLimits(timeout_s=30))
    assert result.verdict is Verdict.OK, (result.detail, result.stderr[-500:])
    assert int(result.stdout) > 500
    assert len(result.refused) > 500
    assert all(len(path) <= 200 and len(why) <= 200 for path, why in result.refused)
    assert len(result.refused) <= MAX_REFUSED + 1


def test_refused_entries_past_the_cap_are_only_counted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for k in range(MAX_REFUSED + 300):
        os.symlink("/etc/passwd", out / f"link{k:05d}")
    quarantine = Quarantine(tmp_path / "quarantine", "c-many", OutputCaps())
    quarantine.collect_tree(out)
    assert len(quarantine.refused) == MAX_REFUSED + 1
    assert quarantine.refused[-1] == ("...", "300 more refused entries not listed")
    assert not quarantine.records


PATH_TOO_LONG = """
import os
open("/out/keep.txt", "w").write("important")
os.chdir("/out")
for i in range(15):
    name = chr(97 + i) * 255
    os.mkdir(name)
    os.chdir(name)
open("f" * 255, "w").write("x")
print("made")
"""


async def test_an_out_path_too_long_for_the_host_is_refused_and_the_rest_kept(run: Runner) -> None:
    """Sixteen levels of 255-character names are a safe relative path, but no host path holds
    them under the quarantine: that one file is refused with the reason, the verdict and the
    other outputs come back."""
    result = await run.py(PATH_TOO_LONG, outputs=OutputCaps(), call_id="c-too-long")
    assert (result.verdict, result.stdout) == (Verdict.OK, b"made\n"), (result.detail, result.stderr[-500:])
    assert [record.path for record in result.artifacts] == ["keep.txt"]
    assert [why for _, why in result.refused] == ["path longer than 1024 bytes"]


async def test_an_output_the_host_cannot_store_is_refused_not_raised(run: Runner) -> None:
    """A second call of the same id finds its output's name taken in the quarantine: that output
    is refused with the reason (naming no host path); the call still has its verdict and stdout."""
    write = "open('/out/result.txt', 'w').write('hello'); print('wrote')"
    first = await run.py(write, outputs=OutputCaps(), call_id="c-same-id")
    again = await run.py(write, outputs=OutputCaps(), call_id="c-same-id")
    assert [record.path for record in first.artifacts] == ["result.txt"]
    assert (again.verdict, again.stdout, again.artifacts) == (Verdict.OK, b"wrote\n", ())
    assert again.refused == (("result.txt", "could not be stored: File exists"),)
