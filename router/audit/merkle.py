"""RFC 6962 / RFC 9162 Merkle trees over the audit log: the incremental tree state the log keeps as it
appends (`CompactRange`), tree heads (`root_of`), and inclusion and consistency proofs with their verifiers.

Every hash is a raw 32-byte SHA-256 digest; hex belongs to the JSON edges (`CompactRange.to_json`)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "EMPTY_ROOT",
    "CompactRange",
    "MerkleTree",
    "consistency_proof",
    "inclusion_proof",
    "leaf_hash",
    "node_hash",
    "root_of",
    "verify_consistency",
    "verify_inclusion",
]

_sha256 = hashlib.sha256
_HEX64 = re.compile(r"[0-9a-f]{64}")

EMPTY_ROOT = _sha256(b"").digest()
"""MTH of the empty log: SHA-256 of the empty string."""


def leaf_hash(data: bytes) -> bytes:
    """The leaf hash of one log entry: SHA-256(0x00 || data)."""
    return _sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """The hash of an interior node: SHA-256(0x01 || left || right)."""
    return _sha256(b"\x01" + left + right).digest()


class CompactRange:
    """The incremental Merkle tree state of a log of ``size`` leaves: the roots of its perfect subtrees,
    one per set bit of ``size``, largest (leftmost) first. Enough to append and to compute the tree head
    without keeping the leaves."""

    __slots__ = ("hashes", "size")

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"compact range size must be a non-negative integer, not {size!r}")
        if len(hashes) != size.bit_count():
            raise ValueError(
                f"a compact range of size {size} holds {size.bit_count()} hashes (one per set bit), not {len(hashes)}"
            )
        if any(not isinstance(h, bytes) or len(h) != 32 for h in hashes):
            raise ValueError("compact range hashes must be 32-byte SHA-256 digests")
        self.size = size
        self.hashes = list(hashes)

    def append(self, leaf: bytes) -> None:
        """Add the next leaf hash (`leaf_hash` of the entry); amortised one node hash per call."""
        if len(leaf) != 32:
            raise ValueError(f"a leaf hash is 32 bytes, not {len(leaf)}")
        hashes, size = self.hashes, self.size
        self.size = size + 1
        # Each trailing set bit of the old size is a perfect subtree of the new leaf's height: merge them.
        while size & 1:
            leaf = _sha256(b"\x01" + hashes.pop() + leaf).digest()
            size >>= 1
        hashes.append(leaf)

    def root(self) -> bytes:
        """The RFC 6962 Merkle Tree Hash of the whole log (`EMPTY_ROOT` when it is empty)."""
        hashes = self.hashes
        if not hashes:
            return EMPTY_ROOT
        root = hashes[-1]
        for i in range(len(hashes) - 2, -1, -1):
            root = _sha256(b"\x01" + hashes[i] + root).digest()
        return root

    def copy(self) -> CompactRange:
        """An independent copy (appending to it leaves this one as it is)."""
        clone = CompactRange.__new__(CompactRange)
        clone.size, clone.hashes = self.size, self.hashes.copy()
        return clone

    def to_json(self) -> dict[str, Any]:
        """``{"size": n, "hashes": [hex, ...]}``, as `from_json` reads it back."""
        return {"size": self.size, "hashes": [h.hex() for h in self.hashes]}

    @classmethod
    def from_json(cls, document: Any) -> CompactRange:
        """Read `to_json`'s form back; raises `ValueError` saying what is wrong with a malformed one."""
        if not isinstance(document, dict) or set(document) != {"size", "hashes"}:
            raise ValueError(f"a compact range is a JSON object with exactly 'size' and 'hashes', not {document!r}")
        size, hashes = document["size"], document["hashes"]
        if not isinstance(hashes, list):
            raise ValueError(f"compact range 'hashes' must be a list, not {type(hashes).__name__}")
        for h in hashes:
            if not isinstance(h, str) or not _HEX64.fullmatch(h):
                raise ValueError(f"compact range hash {h!r} is not 64 lowercase hex characters")
        return cls(size, [bytes.fromhex(h) for h in hashes])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompactRange):
            return NotImplemented
        return self.size == other.size and self.hashes == other.hashes

    __hash__ = None  # type: ignore[assignment]  # mutable: equal ranges stop being equal after an append

    def __repr__(self) -> str:
        return f"CompactRange(size={self.size}, root={self.root().hex()})"


def _split(n: int) -> int:
    """The largest power of two below ``n`` (n >= 2): the size of the left subtree in RFC 6962."""
    return 1 << ((n - 1).bit_length() - 1)


def _mth(leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
    """MTH of ``leaves[lo:hi]``, hashing each node once, level by level."""
    level = list(leaves[lo:hi])
    if not level:
        return EMPTY_ROOT
    while len(level) > 1:
        # Pairing left to right and carrying an odd last node up unchanged builds exactly the RFC 6962
        # tree (left subtree = the largest power of two), without recursion.
        odd = level[-1] if len(level) & 1 else None
        pairs = iter(level)
        level = [_sha256(b"\x01" + a + b).digest() for a, b in zip(pairs, pairs, strict=False)]
        if odd is not None:
            level.append(odd)
    return level[0]


def root_of(leaves: Sequence[bytes]) -> bytes:
    """The RFC 6962 Merkle Tree Hash of a list of leaf hashes."""
    return _mth(leaves, 0, len(leaves))


class MerkleTree:
    """The whole RFC 6962 tree of the first ``size`` leaf hashes, every level kept: built with about one
    node hash per leaf, once, after which each inclusion proof is log2(size) lookups. What proving many
    events at once needs (an export proves each of its events: hashing the log for each one made an
    export of N events from a log of L cost N x L hashes). Each level is one bytes object of 32-byte
    hashes: the whole tree of a million events takes 64 MB.

    ``prefix``: the tree state (`CompactRange`) of leaves the caller no longer holds (a log's segments
    that retention deleted, whose signed tombstone keeps that state); ``leaves`` then start after them,
    at index ``prefix.size``. Every leaf after the prefix can be proven: each node of its audit path that
    lies wholly inside the prefix is one of the prefix's perfect subtrees (an aligned subtree inside
    ``[0, prefix.size)`` that does not hold the leaf is never part of a larger one that does)."""

    __slots__ = ("_compact", "_first", "_levels", "size")

    def __init__(self, leaves: Sequence[bytes], size: int | None = None, *, prefix: CompactRange | None = None) -> None:
        first = prefix.size if prefix is not None else 0
        size = first + len(leaves) if size is None else size
        if not first <= size <= first + len(leaves):
            raise ValueError(f"no tree of size {size} over {first} retired and {len(leaves)} held leaves")
        held = size - first
        level = b"".join(leaves[:held])
        if len(level) != 32 * held or any(len(leaf) != 32 for leaf in leaves[:held]):
            raise ValueError("leaf hashes are 32-byte SHA-256 digests")
        # The prefix's perfect subtrees by height: bit h of its size set means one of 2^h leaves.
        heights = [h for h in range(first.bit_length() - 1, -1, -1) if first >> h & 1]
        self._compact = dict(zip(heights, prefix.hashes if prefix is not None else (), strict=True))
        self._first = first
        self._levels = [level]
        height, end = 0, size  # ``end``: the number of leaves the nodes of this level cover
        while (end - 1) >> height if end else False:
            # As `_mth` builds it: pairs left to right (two adjacent hashes are one 64-byte slice), an
            # odd last node carried up unchanged. So the node at height h, index j is the MTH of leaves
            # j*2^h .. (j+1)*2^h - 1, or up to the tree's end. A level is kept from the node holding the
            # prefix's end on (index first >> h); when that index is odd, its left sibling lies wholly in
            # the prefix: the prefix's subtree of this height, put in front so pairs stay aligned.
            if first >> height & 1:
                level = self._compact[height] + level
            count = len(level) // 32
            parent = b"".join([_sha256(b"\x01" + level[i : i + 64]).digest() for i in range(0, 64 * (count // 2), 64)])
            level = parent + level[-32:] if count & 1 else parent
            height += 1
            self._levels.append(level)
        self.size = size

    def root(self) -> bytes:
        """The tree head (`EMPTY_ROOT` for no leaves)."""
        if not self.size:
            return EMPTY_ROOT
        if self.size == self._first:  # nothing held: the prefix's own root
            return CompactRange(self._first, list(self._compact.values())).root()
        return self._levels[-1][:32]

    def _node(self, lo: int, hi: int) -> bytes:
        """MTH of leaves ``lo``..``hi`` - 1, a subtree the proof walk names: ``lo`` is a multiple of its
        width (the power of two at or above ``hi - lo``), and ``hi`` is ``lo`` plus that width, or the end."""
        height = (hi - lo - 1).bit_length()
        index = lo >> height
        start = self._first >> height
        if index < start:  # wholly inside the prefix: one of its perfect subtrees (see the class docstring)
            return self._compact[height]
        at = 32 * (index - start)
        return self._levels[height][at : at + 32]

    def inclusion_proof(self, index: int) -> list[bytes]:
        """The RFC 9162 §2.1.3.1 inclusion proof (audit path) of leaf ``index`` (0-based), deepest sibling
        first. A leaf inside the ``prefix`` cannot be proven (its leaves are gone): `ValueError`."""
        if not 0 <= index < self.size:
            raise ValueError(f"no leaf {index} in a tree of size {self.size}")
        if index < self._first:
            raise ValueError(f"leaf {index} is in the prefix of {self._first} leaves this tree no longer holds")
        path: list[bytes] = []
        lo, hi, m = 0, self.size, index
        while hi - lo > 1:
            k = _split(hi - lo)
            if m < k:
                path.append(self._node(lo + k, hi))
                hi = lo + k
            else:
                path.append(self._node(lo, lo + k))
                lo, m = lo + k, m - k
        path.reverse()  # built from the root down; the proof lists the leaf's sibling first
        return path


def inclusion_proof(leaves: Sequence[bytes], index: int, size: int) -> list[bytes]:
    """The RFC 9162 §2.1.3.1 inclusion proof (audit path) of leaf ``index`` (0-based) in the tree of the
    first ``size`` leaf hashes, deepest sibling first. O(size); for many proofs of one tree, build a
    `MerkleTree` once."""
    if not 0 <= index < size <= len(leaves):
        raise ValueError(f"no leaf {index} in a tree of size {size} over {len(leaves)} leaves")
    return MerkleTree(leaves, size).inclusion_proof(index)


def consistency_proof(leaves: Sequence[bytes], old_size: int, new_size: int) -> list[bytes]:
    """The RFC 9162 §2.1.4.1 consistency proof that the tree of the first ``old_size`` leaf hashes is a
    prefix of the tree of the first ``new_size``. Empty when ``old_size`` is 0 or equals ``new_size``."""
    if not 0 <= old_size <= new_size <= len(leaves):
        raise ValueError(f"no consistency proof from size {old_size} to {new_size} over {len(leaves)} leaves")
    if old_size in (0, new_size):
        return []
    path: list[bytes] = []
    lo, hi, m, whole = 0, new_size, old_size, True
    while m != hi - lo:
        k = _split(hi - lo)
        if m <= k:
            path.append(_mth(leaves, lo + k, hi))
            hi = lo + k
        else:
            path.append(_mth(leaves, lo, lo + k))
            lo, m, whole = lo + k, m - k, False
    if not whole:
        # The old tree's root is not itself a node of the proof's path: the verifier needs this subtree.
        path.append(_mth(leaves, lo, hi))
    path.reverse()
    return path


def _well_formed(proof: Sequence[bytes]) -> bool:
    return all(isinstance(p, bytes) and len(p) == 32 for p in proof)


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> bool:
    """Whether ``proof`` shows leaf hash ``leaf`` at ``index`` in the tree of ``size`` leaves whose head is
    ``root`` (RFC 9162 §2.1.3.2). Never raises on a malformed proof. The root does not commit to the size:
    take ``size`` and ``root`` together from one signed checkpoint."""
    if not 0 <= index < size or not _well_formed(proof):
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = _sha256(b"\x01" + p + r).digest()
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = _sha256(b"\x01" + r + p).digest()
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> bool:
    """Whether ``proof`` shows the tree of ``old_size`` leaves with head ``old_root`` is a prefix of the tree
    of ``new_size`` leaves with head ``new_root`` (RFC 9162 §2.1.4.2). Equal sizes need equal roots and an
    empty proof; growth from size 0 needs ``old_root == EMPTY_ROOT`` and an empty proof."""
    if not 0 <= old_size <= new_size or not _well_formed(proof):
        return False
    if old_size == new_size:
        return not proof and old_root == new_root
    if old_size == 0:
        return not proof and old_root == EMPTY_ROOT
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)  # a power of two: the old root is itself a node on the path
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = _sha256(b"\x01" + c + fr).digest()
            sr = _sha256(b"\x01" + c + sr).digest()
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = _sha256(b"\x01" + sr + c).digest()
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == old_root and sr == new_root
