"""Defects a review reproduced against the real writer and the real CLI, each kept as a test: a
restarted writer given forged files, verification without the public key, retention on unsigned
manifest fields, `prove` and `export` on an unsigned checkpoint, a crash inside retention, a deleted active
segment."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from router.audit import AuditEvent, line_hash, timestamp
from router.audit.checkpoint import Checkpoint, SigningKey
from router.audit.export import verify_export
from router.audit.factory import anchor_path
from router.audit.jsonl import JsonlAuditLog, LogOptions
from router.audit.layout import LogLayout, lines
from router.audit.merkle import CompactRange
from router.errors import AuditError

STOCKADE = str(Path(sys.executable).parent / "stockade")
N = 40


def event(n: int, stamp: str | None = None) -> AuditEvent:
    return AuditEvent.model_validate({
        "decision_id": f"d-{n}", "timestamp": stamp or timestamp(), "kind": "decision", "outcome": "allow",
        "agent": "agent-1", "tool": "echo", "session_id": "s-1",
    })  # fmt: skip


class Log:
    """A real log as the router keeps it: 1,500-byte segments, checkpoints at each seal and on
    close, published, the writer's anchor beside its key."""

    def __init__(self, root: Path, **changes: object) -> None:
        self.root = root
        self.key_path = root / "keys" / "audit.key"
        self.path = root / "log" / "audit.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.key = SigningKey.load_or_create(self.key_path)
        settings = {"signer": self.key, "checkpoint_interval_s": 3600, "checkpoint_every": 1000,
                    "publish_dir": root / "pub", "segment_max_bytes": 1500,
                    "anchor": anchor_path(self.key_path, self.path), **changes}  # fmt: skip
        self.options = LogOptions(**settings)  # type: ignore[arg-type]
        self.layout = LogLayout(self.path)

    def fill(self, numbers: range, stamp: str | Callable[[int], str] | None = None) -> None:
        async def run() -> None:
            log = JsonlAuditLog(self.path, options=self.options)
            try:
                for n in numbers:
                    await log.append(event(n, stamp(n) if callable(stamp) else stamp))
            finally:
                await log.aclose()

        asyncio.run(run())

    def cli(self, *args: str, key: Path | None = None, publish: bool = True) -> tuple[int, str, str]:
        env = {**os.environ, "STOCKADE_AUDIT__PATH": str(self.path),
               "STOCKADE_AUDIT__SIGNING_KEY": str(key or self.key_path), "HOME": str(self.root / "home")}  # fmt: skip
        if publish:
            env["STOCKADE_AUDIT__PUBLISH_DIR"] = str(self.root / "pub")
        done = subprocess.run([STOCKADE, "audit", *args, "--path", str(self.path)], capture_output=True, text=True,
                              env=env, timeout=120, check=False)  # fmt: skip
        return done.returncode, done.stdout, done.stderr

    @property
    def segments(self) -> Path:
        return self.layout.segments_dir


def rechain_active(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Edit lines of the active segment and re-chain every later one (no key needed)."""
    out: list[bytes] = []
    prev: str | None = None
    for _, original in lines(path):
        line = edit(original)
        if prev is not None:
            at = line.index(b'"prev_hash":"') + 13
            line = line[:at] + prev.encode() + line[at + 64 :]
        out.append(line)
        prev = line_hash(line).hex()
    path.write_bytes(b"\n".join(out) + b"\n")


def chained_after(last: bytes) -> bytes:
    """The next event as someone without the key writes it: ``last`` (seq 40) as seq 41, chained onto it."""
    extra = last.replace(b'"seq":40,', b'"seq":41,')
    at = extra.index(b'"prev_hash":"') + 13
    return extra[:at] + line_hash(last).hex().encode() + extra[at + 64 :]


def add_unsigned_checkpoint(log: Log) -> None:
    """A checkpoint over every line the log holds now (41), following its last, its signature zeros."""
    tree = CompactRange()
    for part in log.layout.parts():
        if part.kind in ("sealed", "active"):
            for _, line in lines(part.path):
                tree.append(line_hash(line))
    last = log.layout.read_checkpoints()[-1]
    fake = last.model_copy(update={"root": tree.root().hex(), "size": tree.size, "prev": last.digest(),
                                   "signature": base64.b64encode(bytes(64)).decode()})  # fmt: skip
    with log.layout.checkpoints.open("ab") as handle:
        handle.write(fake.signed_text() + b"\n")


def deny_38(line: bytes) -> bytes:
    return line.replace(b'"outcome":"allow"', b'"outcome":"deny"') if b'"seq":38,' in line else line


# -- F1: a restarted writer must not sign history forged while it was stopped ------------------


def test_a_restarted_writer_refuses_to_sign_an_active_segment_rewritten_under_a_checkpoint(tmp_path: Path) -> None:
    """Router stopped; event 38 of the active segment is rewritten and 39..40 re-chained; the
    checkpoints, the publish directory and the anchor are left alone. The restarted writer once
    signed checkpoints over the forged tree, and `prove` handed out a proof of the forged event
    that passes the signature and inclusion checks. Now every append is refused (the call denied),
    saying why, and nothing more is signed."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    rechain_active(log.path, deny_38)
    signed = log.layout.checkpoints.read_bytes()
    published = sorted(p.name for p in (tmp_path / "pub").iterdir())
    anchor = log.options.anchor
    assert anchor is not None
    anchored = anchor.read_bytes()
    with pytest.raises(AuditError, match=r"do not hold the history checkpoint 40 .*will not sign"):
        log.fill(range(N + 1, N + 3))
    assert log.layout.checkpoints.read_bytes() == signed
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == published
    assert anchor.read_bytes() == anchored
    assert b'"seq":41,' not in log.path.read_bytes()

    async def probe() -> str | None:
        writer = JsonlAuditLog(log.path, options=log.options)
        try:
            return await writer.check()
        finally:
            await writer.aclose()

    assert "will not sign" in (asyncio.run(probe()) or "")
    assert log.layout.checkpoints.read_bytes() == signed  # nor at shutdown
    code, _, err = log.cli("prove", "--seq", "38", "--json")
    assert code != 0, err  # no checkpoint covers the forged event
    code, out, _ = log.cli("verify")
    assert code == 1
    assert "BROKEN" in out


def test_a_restarted_writer_refuses_when_the_files_disagree_with_its_anchor_alone(tmp_path: Path) -> None:
    """The same rewrite, the checkpoints file rolled back to before it too: the anchor (kept beside
    the key) is put back for verification, and the writer refuses to go on."""
    log = Log(tmp_path, publish_dir=None)
    log.fill(range(1, N + 1))
    rechain_active(log.path, deny_38)
    kept = [line for line in log.layout.checkpoints.read_bytes().splitlines(keepends=True)
            if Checkpoint.model_validate_json(line).size < 38]  # fmt: skip
    log.layout.checkpoints.write_bytes(b"".join(kept))
    log.layout.state.unlink(missing_ok=True)
    with pytest.raises(AuditError, match="checkpoint 40"):
        log.fill(range(N + 1, N + 2))
    assert max(c.size for c in log.layout.read_checkpoints()) == N  # the anchor, put back
    code, out, _ = log.cli("verify", publish=False)
    assert code == 1
    assert "BROKEN" in out


# -- F3: without the public key, nothing signed may pass unchecked -----------------------------


def test_verify_without_a_public_key_refuses_a_log_with_any_signed_part(tmp_path: Path) -> None:
    """The auditor has no public key (its settings name a key elsewhere). The attacker deletes the
    checkpoints file, deletes a sealed segment and puts an unsigned tombstone in its place: verify
    once said OK, the events "retired under signed tombstones". Now any signed part (a manifest, a
    tombstone, the publish directory) unchecked is exit 2; with the key the forgery is BROKEN."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    nokey = tmp_path / "elsewhere" / "audit.key"
    assert log.cli("verify", key=nokey, publish=False)[0] == 2
    log.layout.checkpoints.unlink()
    name = "000000000006-000000000010"
    manifest = json.loads((log.segments / f"{name}.manifest.json").read_text())
    tomb = {k: manifest[k] for k in ("first_seq", "last_seq", "bytes", "sha256", "last_hash", "tree", "checkpoint")}
    tomb.update(log="stockade", time="2026-01-01T00:00:00Z", key_id="0" * 16, signature="", reason="retention")
    (log.segments / f"{name}.tombstone.json").write_text(json.dumps(tomb))
    for suffix in ("jsonl", "manifest.json"):
        (log.segments / f"{name}.{suffix}").unlink()
    for publish in (False, True):
        code, out, err = log.cli("verify", key=nokey, publish=publish)
        assert code == 2, out
        assert "no public key" in err
        assert "signed tombstones" not in out
    # Only the tombstones left (every manifest gone): still refused; so is the publish directory alone.
    for manifest_path in log.segments.glob("*.manifest.json"):
        manifest_path.unlink()
    assert log.cli("verify", key=nokey, publish=False)[0] == 2
    for part in log.segments.iterdir():
        part.unlink()
    log.segments.rmdir()
    assert log.cli("verify", key=nokey, publish=True)[0] == 2
    assert log.cli("verify")[0] == 1  # with the key: the log as left is broken


# -- F2: retention goes by what is signed and checked, never the manifest's unsigned fields -----


def test_retention_never_retires_a_segment_on_an_edited_manifest_or_segment(tmp_path: Path) -> None:
    """Segments written minutes ago; the attacker (no key) sets their manifests' unsigned
    ``last_time`` to 2001, or rewrites a segment's timestamps to 2001 with its manifest's sha256
    and size to match. Retention once deleted them under tombstones signed with the real key, and
    verify said OK. Now they stay, nothing is signed over them, and verify names the edit."""
    log = Log(tmp_path, retention_days=30)
    log.fill(range(1, N + 1))
    manifests = sorted(log.segments.glob("*.manifest.json"))
    for path in manifests[:3]:
        document = json.loads(path.read_text())
        document["last_time"] = "2001-01-01T00:00:00.000000Z"
        path.write_text(json.dumps(document))
    fourth = manifests[3]
    segment = fourth.with_name(fourth.name.replace(".manifest.json", ".jsonl"))
    old = b"\n".join(line[:at] + b"2001-01-01" + line[at + 10 :]
                     for _, line in lines(segment) for at in [line.index(b'"timestamp":"') + 13]) + b"\n"  # fmt: skip
    segment.write_bytes(old)
    document = json.loads(fourth.read_text())
    document.update(bytes=len(old), sha256=hashlib.sha256(old).hexdigest(), last_time="2001-01-01")
    fourth.write_text(json.dumps(document))
    sealed = sorted(p.name for p in log.segments.glob("*.jsonl"))
    log.fill(range(N + 1, N + 10))  # restart, appends, seals: retention runs
    assert sorted(log.segments.glob("*.tombstone.json")) == []
    assert set(sealed) <= {p.name for p in log.segments.glob("*.jsonl")}
    code, out, _ = log.cli("verify")
    assert code == 1, out
    assert "at seq 1:" in out, out
    assert "manifest was edited" in out, out


# -- F6: `prove` proves only against a checkpoint the public key verifies ------------------------


def test_prove_never_proves_against_a_checkpoint_the_key_does_not_verify(tmp_path: Path) -> None:
    """Event 38 rewritten, the active segment re-chained plus one event, and a checkpoint at size
    41 over the forged tree appended to the log's own file, its signature zeros. `prove` once
    printed the forged line with a valid audit path against it, exit 0. Now it takes the latest
    checkpoint the public key verifies (40), which the files no longer reach: exit 1, no proof."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    code, out, err = log.cli("prove", "--seq", "38", "--json")
    assert code == 0, err
    assert Checkpoint.model_validate(json.loads(out)["checkpoint"]).verify(log.key.verify_key)
    rechain_active(log.path, deny_38)
    forged = [line for _, line in lines(log.path)]
    extra = chained_after(forged[-1])
    log.path.write_bytes(b"\n".join([*forged, extra]) + b"\n")
    add_unsigned_checkpoint(log)
    code, out, err = log.cli("prove", "--seq", "38", "--json")
    assert code == 1, out
    assert out == "", out
    assert "does not match" in err


# -- F5: a retirement cut short between the tombstone and the deletion --------------------------


def test_a_retirement_cut_short_after_its_tombstone_verifies_and_is_finished_at_the_next_start(
    tmp_path: Path,
) -> None:
    """Retention writes a segment's tombstone, then deletes the segment: a crash between the two
    leaves both (here: the segment and its manifest put back as they were). Verify once said
    BROKEN ("events 13..10 are missing") until the next seal. Now it is OK, and the next start
    deletes the segment."""
    Log(tmp_path).fill(range(1, 13), "2020-01-01T10:00:00.000000Z")  # kept: no retention yet
    log = Log(tmp_path, retention_days=30)
    saved = {p.name: p.read_bytes() for p in log.segments.iterdir()}
    log.fill(range(13, 20))  # today: the first append seals 2020's last segment, retention retires them all
    tombstones = [p.name.removesuffix(".tombstone.json") for p in log.segments.glob("*.tombstone.json")]
    last = max(name for name in tombstones if f"{name}.jsonl" in saved)  # one sealed before this run
    for suffix in ("jsonl", "manifest.json"):
        (log.segments / f"{last}.{suffix}").write_bytes(saved[f"{last}.{suffix}"])
    code, out, _ = log.cli("verify")
    assert code == 0, out
    assert "OK" in out, out
    log.fill(range(20, 21))  # the next start finishes the retirement
    assert not (log.segments / f"{last}.jsonl").exists()
    assert not (log.segments / f"{last}.manifest.json").exists()
    assert (log.segments / f"{last}.tombstone.json").exists()
    code, out, _ = log.cli("verify")
    assert code == 0, out
    assert "OK" in out, out
    # A tombstone that does not record the segment beside it is named, and nothing is deleted.
    (log.segments / f"{last}.jsonl").write_bytes(saved[f"{last}.jsonl"].replace(b'"allow"', b'"deny!"', 1))
    (log.segments / f"{last}.manifest.json").write_bytes(saved[f"{last}.manifest.json"])
    assert log.cli("verify")[0] == 1
    log.fill(range(21, 22))
    assert (log.segments / f"{last}.jsonl").exists()


# -- F4: a deleted active segment is a verdict (BROKEN), not "no audit log" ---------------------


def test_verify_names_a_deleted_active_segment_as_broken(tmp_path: Path) -> None:
    """The active segment (events 36..40, under the shutdown checkpoint) deleted while the router
    is stopped: verify once exited 2 "no audit log at …" (with --json, not JSON). Now exit 1,
    BROKEN at seq 36, in text and JSON; a path with no log at all is still exit 2."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    log.path.unlink()
    code, out, _ = log.cli("verify")
    assert code == 1, out
    assert "BROKEN" in out, out
    assert "at seq 36" in out, out
    code, out, _ = log.cli("verify", "--json")
    report = json.loads(out)
    assert code == 1
    assert report["ok"] is False
    assert report["broken_seq"] == 36
    done = subprocess.run([STOCKADE, "audit", "verify", "--path", str(tmp_path / "none" / "audit.jsonl")],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "HOME": str(tmp_path / "home")})  # fmt: skip
    assert done.returncode == 2
    assert "no audit log" in done.stderr


def test_export_never_proves_against_a_checkpoint_the_key_does_not_verify(tmp_path: Path) -> None:
    """One event appended (chained) to the active segment by someone with the volume but not the
    key, and a checkpoint at size 41 over it, its signature zeros. `export` once proved every event
    against that checkpoint: the export then failed its recipient's check with the real public
    key, and carried the forged event. Now it proves against the latest checkpoint the key
    verifies (40), leaves event 41 out (counted), and the export verifies."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    held = [line for _, line in lines(log.path)]
    extra = chained_after(held[-1])
    with log.path.open("ab") as handle:
        handle.write(extra + b"\n")
    add_unsigned_checkpoint(log)
    target = tmp_path / "export.jsonl"
    code, out, err = log.cli("export", "--output", str(target), "--json")
    assert code == 0, err
    done = json.loads(out)
    assert (done["checkpoint_size"], done["last_seq"], done["left_out"]) == (N, N, 1)
    assert done["signed_selection"] is True
    assert extra not in target.read_bytes()
    check = verify_export(target, log.key.verify_key)
    assert (check.ok, check.problem, check.events, check.checkpoint_size) == (True, "", N, N)
    # An auditor's key that signed none of them: nothing to prove against, exit 1, nothing written.
    other = SigningKey.load_or_create(tmp_path / "other" / "audit.key")
    code, out, err = log.cli("export", "--output", str(tmp_path / "none.jsonl"),
                             "--public-key", str(tmp_path / "other" / "audit.key.pub"))  # fmt: skip
    assert (code, other.key_id != log.key.key_id) == (1, True), out + err
    assert "signed by the log's public key" in err
    assert not (tmp_path / "none.jsonl").exists()


def test_verify_names_a_checkpoint_removed_from_the_start_of_the_checkpoints_file(tmp_path: Path) -> None:
    """The checkpoints file is only appended to, so its first checkpoint follows none. Deleting
    that line once left verify saying OK with no word of it (each later one still named the one
    before it); now the first one's ``prev`` shows the removal in a note. Not a failure: the later
    roots still cover every event, and a file the writer put back from its anchor after a loss
    starts the same way (and that loss is on record)."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    code, out, err = log.cli("verify", publish=False)
    assert code == 0, out + err
    kept = log.layout.checkpoints.read_bytes().splitlines(keepends=True)
    assert len(kept) >= 3
    log.layout.checkpoints.write_bytes(b"".join(kept[1:]))
    for publish in (False, True):
        code, out, err = log.cli("verify", "--json", publish=publish)
        assert code == 0, out + err
        notes = " ".join(json.loads(out)["notes"])
        assert "its first checkpoint" in notes, notes
        assert "removed from the start" in notes, notes


def test_verify_says_when_the_active_segment_ends_in_an_unfinished_line(tmp_path: Path) -> None:
    """A write cut short (a crash mid-line) leaves bytes no event owns; verify once said OK with
    no word of them. It is still OK (never acknowledged, no event was lost), with a note naming
    the bytes; the next writer sets them aside, and the note goes."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    with log.path.open("ab") as handle:
        handle.write(b'{"seq":41,"prev_hash":"0123')
    code, out, err = log.cli("verify", "--json")
    assert code == 0, out + err
    notes = json.loads(out)["notes"]
    assert any("ends in 27 bytes of an unfinished line after seq 40" in note for note in notes), notes
    log.fill(range(N + 1, N + 2))
    code, out, err = log.cli("verify", "--json")
    assert code == 0, out + err
    assert json.loads(out)["events"] == N + 2  # the event appended, and the note of the bytes set aside
    assert not any("unfinished line" in note for note in json.loads(out)["notes"])


def test_a_checkpoints_file_the_writer_put_back_from_its_anchor_verifies(tmp_path: Path) -> None:
    """The checkpoints file lost; the restarted writer puts its anchor back (and records the loss).
    The file then starts with a checkpoint that names another: verify says so in a note and stays
    OK, as it did before the first-checkpoint rule, which once failed such a log for good."""
    log = Log(tmp_path)
    log.fill(range(1, N + 1))
    log.layout.checkpoints.unlink()
    log.fill(range(N + 1, N + 3))
    code, out, err = log.cli("verify", "--json")
    assert code == 0, out + err
    assert any("its first checkpoint" in note for note in json.loads(out)["notes"])
    lost = [json.loads(line) for _, line in lines(log.path) if b"audit.checkpoints_lost" in line]
    assert [e["result"]["size"] for e in lost] == [N]
