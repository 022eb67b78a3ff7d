"""The host's reading of a container worker's reply: what a dishonest worker's frames can cost."""

from __future__ import annotations

import json
import struct

import pytest

from runner.worker import OUT_ENTRIES, FrameReader

SEAL = "5ea1" * 8


def frame(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack(">I", len(body)) + body


def exit_frame(seal: str | None = SEAL, **extra: object) -> bytes:
    """The worker's exit frame (a tool forging one does not know ``seal``)."""
    info: dict[str, object] = {"code": 0, "signal": 0, "cpu_s": 0.01, "max_rss_kb": 1, "oom_kills": 0, **extra}
    return frame(b"x", json.dumps(info if seal is None else {**info, "seal": seal}).encode())


def refused(index: int) -> bytes:
    return frame(b"r", json.dumps({"path": f"f{index}", "why": "over the file count cap"}).encode())


def empty_file(index: int) -> bytes:
    head = json.dumps({"path": f"f{index}", "size": 0}).encode()
    return frame(b"f", struct.pack(">I", len(head)) + head)


def test_a_flood_of_refused_entries_is_malformed_and_stops_growing() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20, seal=SEAL)
    reader.feed(exit_frame() + b"".join(refused(i) for i in range(20 * OUT_ENTRIES)) + frame(b"d", b""))
    assert reader.reply.malformed
    assert len(reader.reply.refused) == OUT_ENTRIES
    assert not reader.reply.done


def test_files_and_refused_entries_count_against_one_cap() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20, seal=SEAL)
    reader.feed(exit_frame() + b"".join(empty_file(i) if i % 2 else refused(i) for i in range(3 * OUT_ENTRIES)))
    assert reader.reply.malformed
    assert len(reader.reply.files) + len(reader.reply.refused) == OUT_ENTRIES


def test_as_many_entries_as_an_honest_worker_sends_are_all_kept() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20, seal=SEAL)
    reader.feed(exit_frame() + b"".join(refused(i) for i in range(OUT_ENTRIES)) + frame(b"d", b""))
    assert (reader.reply.malformed, reader.reply.done, len(reader.reply.refused)) == ("", True, OUT_ENTRIES)


def test_a_file_frame_too_short_for_its_header_is_malformed() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20, seal=SEAL)
    reader.feed(exit_frame() + frame(b"f", b"\x00\x00") + frame(b"d", b""))
    assert reader.reply.malformed
    assert reader.reply.files == []


def test_an_honest_reply_is_output_then_the_sealed_exit_then_files_and_the_end() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20, seal=SEAL)
    reader.feed(frame(b"o", b"out\n") + frame(b"e", b"err\n") + exit_frame(code=3) + empty_file(0) + frame(b"d", b""))
    reply = reader.reply
    assert (reply.malformed, reply.done, reply.exit, reply.stdout, len(reply.files)) == (
        "", True, {"code": 3, "signal": 0, "cpu_s": 0.01, "max_rss_kb": 1, "oom_kills": 0}, bytearray(b"out\n"), 1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "forged",
    [exit_frame(seal=None), exit_frame(seal="0" * 32), exit_frame(seal="\u00e9" * 32), exit_frame(seal=7),  # type: ignore[arg-type]
     frame(b"d", b""), empty_file(0), refused(0), frame(b"R", b"")],
    ids=["exit_without_seal", "exit_with_a_wrong_seal", "exit_with_a_non_ascii_seal", "exit_with_a_number_as_seal",
         "end_before_exit", "file_before_exit", "refusal_before_exit", "ready"],
)  # fmt: skip
def test_frames_a_tool_forges_on_the_workers_channel_make_the_reply_malformed(forged: bytes) -> None:
    """Under gVisor a tool (the worker's uid) can open /proc/1/fd/1 and write frames: it once ended
    its call with a forged exit and end, stayed alive, and answered the session's next job. Only
    output may come before the exit frame, and that must carry the seal only the worker holds."""
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20, seal=SEAL)
    reader.feed(frame(b"o", b"looks normal\n") + forged + exit_frame() + frame(b"d", b""))
    assert reader.reply.malformed
    assert (reader.reply.done, reader.reply.exit) == (False, None)
