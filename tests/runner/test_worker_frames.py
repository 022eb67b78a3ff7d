"""The host's reading of a container worker's reply: what a dishonest worker's frames can cost."""

from __future__ import annotations

import json
import struct

from runner.worker import OUT_ENTRIES, FrameReader


def frame(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack(">I", len(body)) + body


def refused(index: int) -> bytes:
    return frame(b"r", json.dumps({"path": f"f{index}", "why": "over the file count cap"}).encode())


def empty_file(index: int) -> bytes:
    head = json.dumps({"path": f"f{index}", "size": 0}).encode()
    return frame(b"f", struct.pack(">I", len(head)) + head)


def test_a_flood_of_refused_entries_is_malformed_and_stops_growing() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20)
    reader.feed(b"".join(refused(i) for i in range(20 * OUT_ENTRIES)) + frame(b"d", b""))
    assert reader.reply.malformed
    assert len(reader.reply.refused) == OUT_ENTRIES
    assert not reader.reply.done


def test_files_and_refused_entries_count_against_one_cap() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20)
    reader.feed(b"".join(empty_file(i) if i % 2 else refused(i) for i in range(3 * OUT_ENTRIES)))
    assert reader.reply.malformed
    assert len(reader.reply.files) + len(reader.reply.refused) == OUT_ENTRIES


def test_as_many_entries_as_an_honest_worker_sends_are_all_kept() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20)
    reader.feed(b"".join(refused(i) for i in range(OUT_ENTRIES)) + frame(b"d", b""))
    assert (reader.reply.malformed, reader.reply.done, len(reader.reply.refused)) == ("", True, OUT_ENTRIES)


def test_a_file_frame_too_short_for_its_header_is_malformed() -> None:
    reader = FrameReader(output_cap=1 << 20, file_cap_bytes=1 << 20)
    reader.feed(frame(b"f", b"\x00\x00") + frame(b"d", b""))
    assert reader.reply.malformed
    assert reader.reply.files == []
