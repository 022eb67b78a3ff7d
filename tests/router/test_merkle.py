"""The RFC 6962 / RFC 9162 Merkle tree: published Certificate Transparency vectors, a naive recursive
reference built from the RFC's definitions, and exhaustive tampering of proofs."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.audit.merkle import (
    EMPTY_ROOT,
    CompactRange,
    MerkleTree,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    root_of,
    verify_consistency,
    verify_inclusion,
)

# The eight leaf inputs and the roots of their first 1..8 leaves, from the CT test suites
# (google/trillian merkle/log_verifier_test.go; certificate-transparency python/ct/crypto/merkle_test.py).
CT_LEAVES = [
    b"",
    b"\x00",
    b"\x10",
    b"\x20\x21",
    b"\x30\x31",
    b"\x40\x41\x42\x43",
    b"\x50\x51\x52\x53\x54\x55\x56\x57",
    b"\x60\x61\x62\x63\x64\x65\x66\x67\x68\x69\x6a\x6b\x6c\x6d\x6e\x6f",
]
CT_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
# (0-based index, tree size, audit path) and (old size, new size, proof), from the same trillian file.
CT_INCLUSION = [
    (0, 1, []),
    (
        0,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        5,
        8,
        [
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (
        1,
        5,
        [
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
]
CT_CONSISTENCY = [
    (1, 1, []),
    (
        1,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        6,
        8,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (
        2,
        5,
        [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
]
CT_HASHES = [leaf_hash(d) for d in CT_LEAVES]

N = 40
LEAVES = [hashlib.sha256(b"leaf %d" % i).digest() for i in range(2 * N)]


# The reference: RFC 6962 §2.1's recursive definitions, transcribed literally.
def naive_mth(d: list[bytes]) -> bytes:
    if not d:
        return hashlib.sha256(b"").digest()
    if len(d) == 1:
        return d[0]
    k = 1
    while k * 2 < len(d):
        k *= 2
    return hashlib.sha256(b"\x01" + naive_mth(d[:k]) + naive_mth(d[k:])).digest()


def naive_path(m: int, d: list[bytes]) -> list[bytes]:
    if len(d) == 1:
        return []
    k = 1
    while k * 2 < len(d):
        k *= 2
    if m < k:
        return [*naive_path(m, d[:k]), naive_mth(d[k:])]
    return [*naive_path(m - k, d[k:]), naive_mth(d[:k])]


def naive_subproof(m: int, d: list[bytes], whole: bool) -> list[bytes]:
    if m == len(d):
        return [] if whole else [naive_mth(d)]
    k = 1
    while k * 2 < len(d):
        k *= 2
    if m <= k:
        return [*naive_subproof(m, d[:k], whole), naive_mth(d[k:])]
    return [*naive_subproof(m - k, d[k:], False), naive_mth(d[:k])]


ROOTS = [naive_mth(LEAVES[:n]) for n in range(2 * N + 1)]
HONEST = {(a, b): consistency_proof(LEAVES, a, b) for b in range(2 * N + 1) for a in range(b + 1)}


def flips(proof: list[bytes], every_bit: bool) -> list[list[bytes]]:
    """Copies of ``proof`` with one bit flipped: every bit, or one bit in each byte (varying its position)."""
    out = []
    for e, element in enumerate(proof):
        for bit in range(256) if every_bit else range((e % 8), 256, 8):
            changed = bytearray(element)
            changed[bit // 8] ^= 1 << (bit % 8)
            out.append([*proof[:e], bytes(changed), *proof[e + 1 :]])
    return out


def test_hashes_match_the_published_values() -> None:
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert leaf_hash(b"").hex() == CT_ROOTS[0]
    assert leaf_hash(b"\x00").hex() == "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"
    assert node_hash(CT_HASHES[0], CT_HASHES[1]).hex() == CT_ROOTS[1]


def test_ct_roots_for_sizes_1_to_8() -> None:
    compact = CompactRange()
    assert compact.root() == root_of([]) == EMPTY_ROOT
    for n, expected in enumerate(CT_ROOTS, start=1):
        compact.append(CT_HASHES[n - 1])
        assert compact.size == n
        assert compact.root().hex() == root_of(CT_HASHES[:n]).hex() == naive_mth(CT_HASHES[:n]).hex() == expected
    assert compact.root().hex() == "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"


@pytest.mark.parametrize(("index", "size", "path"), CT_INCLUSION)
def test_ct_inclusion_proofs(index: int, size: int, path: list[str]) -> None:
    proof = inclusion_proof(CT_HASHES, index, size)
    assert [p.hex() for p in proof] == path
    assert verify_inclusion(CT_HASHES[index], index, size, proof, bytes.fromhex(CT_ROOTS[size - 1]))


@pytest.mark.parametrize(("old", "new", "path"), CT_CONSISTENCY)
def test_ct_consistency_proofs(old: int, new: int, path: list[str]) -> None:
    proof = consistency_proof(CT_HASHES, old, new)
    assert [p.hex() for p in proof] == path
    assert verify_consistency(old, new, bytes.fromhex(CT_ROOTS[old - 1]), bytes.fromhex(CT_ROOTS[new - 1]), proof)


def test_compact_range_root_at_every_size_up_to_80() -> None:
    compact = CompactRange()
    for n in range(2 * N + 1):
        assert compact.size == n
        assert compact.root() == ROOTS[n] == root_of(LEAVES[:n])
        if n < 2 * N:
            compact.append(LEAVES[n])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=70))
def test_compact_range_root_is_the_mth_at_every_size(entries: list[bytes]) -> None:
    hashes = [leaf_hash(e) for e in entries]
    compact = CompactRange()
    for n, h in enumerate(hashes, start=1):
        before = compact.copy()
        compact.append(h)
        assert compact.size == n
        assert len(compact.hashes) == n.bit_count()
        assert compact.root() == naive_mth(hashes[:n]) == root_of(hashes[:n])
        assert before.size == n - 1  # copies are independent
    assert CompactRange.from_json(compact.to_json()) == compact


def test_compact_range_json_round_trip_and_validation() -> None:
    compact = CompactRange()
    for h in LEAVES[:11]:
        compact.append(h)
    document = compact.to_json()
    assert document == {"size": 11, "hashes": [h.hex() for h in compact.hashes]}
    resumed = CompactRange.from_json(document)
    resumed.append(LEAVES[11])
    assert resumed.root() == ROOTS[12]
    bad: list[Any] = [
        {"size": 11, "hashes": document["hashes"][:2]},
        {"size": 12, "hashes": document["hashes"]},
        {"size": -1, "hashes": []},
        {"size": True, "hashes": [document["hashes"][0]]},
        {"size": 11, "hashes": [*document["hashes"][:2], "ab" * 31]},
        {"size": 11, "hashes": [*document["hashes"][:2], document["hashes"][2].upper()]},
        {"size": 11, "hashes": [*document["hashes"][:2], "zz" * 32]},
        {"size": 11, "hashes": "".join(document["hashes"])},
        {"size": 11},
        {"size": 11, "hashes": document["hashes"], "extra": 1},
        [11, document["hashes"]],
    ]
    for malformed in bad:
        with pytest.raises(ValueError, match="compact range"):
            CompactRange.from_json(malformed)
    with pytest.raises(ValueError, match="32 bytes"):
        compact.append(b"short")


def test_every_inclusion_proof_verifies_and_no_tampering_gets_through() -> None:
    got_through = checked = 0
    for n in range(1, N + 1):
        for i in range(n):
            proof = inclusion_proof(LEAVES, i, n)
            assert proof == naive_path(i, LEAVES[:n])
            assert verify_inclusion(LEAVES[i], i, n, proof, ROOTS[n])
            wrong = [(LEAVES[i], i, n, bad, ROOTS[n]) for bad in flips(proof, every_bit=n <= 8)]
            wrong += [(LEAVES[i], j, n, proof, ROOTS[n]) for j in range(-1, n + 2) if j != i]
            # A wrong size with that size's own root, and (as CT's suite does) size*2 and size//2 with this root.
            wrong += [(LEAVES[i], i, m, proof, ROOTS[m]) for m in range(2 * N + 1) if m != n]
            wrong += [(LEAVES[i], i, m, proof, ROOTS[n]) for m in (2 * n, n // 2) if m != n]
            wrong += [(LEAVES[i], i, n, proof, r) for r in (ROOTS[n - 1], ROOTS[n + 1], EMPTY_ROOT)]
            truncated = [proof[:-1]] if proof else []
            wrong += [(LEAVES[i], i, n, bad, ROOTS[n]) for bad in ([*proof, ROOTS[n]], [b"", *proof], *truncated)]
            wrong += [(LEAVES[i + 1], i, n, proof, ROOTS[n])]
            for args in wrong:
                checked += 1
                got_through += verify_inclusion(*args)
    assert checked > 100_000
    assert got_through == 0


def test_every_consistency_proof_verifies_and_no_tampering_gets_through() -> None:
    got_through = checked = 0
    for n in range(N + 1):
        for m in range(n + 1):
            proof = HONEST[m, n]
            assert proof == ([] if m in (0, n) else naive_subproof(m, LEAVES[:n], True))
            assert verify_consistency(m, n, ROOTS[m], ROOTS[n], proof)
            if m in (0, n):
                continue  # the empty proof: only the roots can be wrong, checked below
            wrong = [(m, n, ROOTS[m], ROOTS[n], bad) for bad in flips(proof, every_bit=n <= 8)]
            # Other sizes with their own roots, unless the claim is true and this is its honest proof.
            wrong += [
                (a, b, ROOTS[a], ROOTS[b], proof)
                for a in range(1, 2 * N + 1)
                for b in range(a, 2 * N + 1)
                if (a, b) != (m, n) and (a in (m, n) or b in (m, n)) and proof != HONEST[a, b]
            ]
            wrong += [(a, b, ROOTS[m], ROOTS[n], proof) for a, b in ((m - 1, n), (m + 1, n), (m ^ 2, n), (m, 2 * n))]
            wrong += [(m, n, ROOTS[m], r, proof) for r in (ROOTS[n - 1], ROOTS[n + 1], ROOTS[m])]
            wrong += [(m, n, r, ROOTS[n], proof) for r in (ROOTS[m - 1], ROOTS[m + 1], ROOTS[n])]
            wrong += [(m, n, ROOTS[n], ROOTS[m], proof), (n, m, ROOTS[n], ROOTS[m], proof)]
            wrong += [(m, n, ROOTS[m], ROOTS[n], bad) for bad in ([], proof[:-1], [*proof, ROOTS[m]], [b"", *proof])]
            wrong += [(m, n, ROOTS[m], ROOTS[n], [proof[0], *proof])]
            for args in wrong:
                checked += 1
                got_through += verify_consistency(*args)
    assert checked > 100_000
    assert got_through == 0


def test_trivial_consistency_needs_matching_roots_and_an_empty_proof() -> None:
    assert verify_consistency(0, 0, EMPTY_ROOT, EMPTY_ROOT, [])
    assert verify_consistency(0, 5, EMPTY_ROOT, ROOTS[5], [])
    assert verify_consistency(5, 5, ROOTS[5], ROOTS[5], [])
    assert not verify_consistency(5, 5, ROOTS[5], ROOTS[6], [])
    assert not verify_consistency(5, 5, ROOTS[5], ROOTS[5], [ROOTS[5]])
    assert not verify_consistency(0, 5, ROOTS[1], ROOTS[5], [])
    assert not verify_consistency(0, 5, EMPTY_ROOT, ROOTS[5], [EMPTY_ROOT])
    assert not verify_consistency(6, 5, ROOTS[6], ROOTS[5], [])
    assert not verify_consistency(-1, 5, EMPTY_ROOT, ROOTS[5], [])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_single_bit_flips_fail(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 2 * N))
    i = data.draw(st.integers(0, n - 1))
    m = data.draw(st.integers(1, n - 1))

    def flip(proof: list[bytes]) -> list[bytes]:
        e = data.draw(st.integers(0, len(proof) - 1))
        bit = data.draw(st.integers(0, 255))
        changed = bytearray(proof[e])
        changed[bit // 8] ^= 1 << (bit % 8)
        return [*proof[:e], bytes(changed), *proof[e + 1 :]]

    path = inclusion_proof(LEAVES, i, n)
    assert verify_inclusion(LEAVES[i], i, n, path, ROOTS[n])
    assert not verify_inclusion(LEAVES[i], i, n, flip(path), ROOTS[n])
    proof = consistency_proof(LEAVES, m, n)
    assert verify_consistency(m, n, ROOTS[m], ROOTS[n], proof)
    assert not verify_consistency(m, n, ROOTS[m], ROOTS[n], flip(proof))


def test_the_root_alone_does_not_fix_the_size() -> None:
    # RFC 6962 roots do not commit to the tree size: a size-3 path also checks out as size 4 against the
    # size-3 root. Verifiers must take size and root together from one signed checkpoint.
    proof = inclusion_proof(LEAVES, 0, 3)
    assert verify_inclusion(LEAVES[0], 0, 4, proof, ROOTS[3])
    assert not verify_inclusion(LEAVES[0], 0, 4, proof, ROOTS[4])


def test_bad_arguments() -> None:
    for index, size in ((0, 0), (3, 3), (-1, 3), (0, 2 * N + 1)):
        with pytest.raises(ValueError, match="no leaf"):
            inclusion_proof(LEAVES, index, size)
        assert not verify_inclusion(LEAVES[0], index, size, [], ROOTS[1])
    for old, new in ((3, 2), (-1, 2), (2, 2 * N + 1)):
        with pytest.raises(ValueError, match="no consistency proof"):
            consistency_proof(LEAVES, old, new)
    proof = inclusion_proof(LEAVES, 3, 7)
    assert not verify_inclusion(LEAVES[3], 3, 7, [*proof[:-1], proof[-1][:31]], ROOTS[7])
    assert not verify_consistency(3, 7, ROOTS[3], ROOTS[7], [p[:31] for p in consistency_proof(LEAVES, 3, 7)])


def test_large_log_proofs() -> None:
    leaves = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(5000)]
    compact = CompactRange()
    for h in leaves:
        compact.append(h)
    root = compact.root()
    assert root == root_of(leaves)
    for index in (0, 1, 2047, 2048, 4095, 4999):
        assert verify_inclusion(leaves[index], index, 5000, inclusion_proof(leaves, index, 5000), root)
    for old in (1, 2048, 3000, 4999):
        old_root = root_of(leaves[:old])
        assert verify_consistency(old, 5000, old_root, root, consistency_proof(leaves, old, 5000))


def test_one_tree_proves_every_leaf_of_a_large_log() -> None:
    """What an export does: one `MerkleTree`, then a proof per event (each a few lookups). Every proof
    of every size up to N is the reference path; at 5,000 leaves every proof verifies, and a sample
    is the reference too."""
    for n in range(1, N + 1):
        tree = MerkleTree(LEAVES, n)
        assert tree.root() == ROOTS[n]
        assert [tree.inclusion_proof(i) for i in range(n)] == [naive_path(i, LEAVES[:n]) for i in range(n)]
    assert MerkleTree([]).root() == EMPTY_ROOT
    leaves = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(5000)]
    tree = MerkleTree(leaves)
    root = root_of(leaves)
    assert tree.root() == root
    failed = [i for i in range(5000) if not verify_inclusion(leaves[i], i, 5000, tree.inclusion_proof(i), root)]
    assert failed == []
    for index in (0, 1, 2047, 2048, 4095, 4096, 4999):
        assert tree.inclusion_proof(index) == naive_path(index, leaves)
    for bad in (-1, 5000):
        with pytest.raises(ValueError, match="no leaf"):
            tree.inclusion_proof(bad)
    with pytest.raises(ValueError, match="no tree of size"):
        MerkleTree(leaves, 5001)


def test_a_tree_resumed_from_a_compact_range_proves_every_leaf_after_it() -> None:
    """After retention deleted the first leaves, the tree state its tombstone kept (a compact range)
    stands for them: the root and every later leaf's proof are the whole tree's."""
    leaves = [leaf_hash(str(i).encode()) for i in range(70)]
    for size in (1, 2, 5, 8, 33, 70):
        whole = MerkleTree(leaves[:size])
        for retired in range(size + 1):
            prefix = CompactRange()
            for leaf in leaves[:retired]:
                prefix.append(leaf)
            resumed = MerkleTree(leaves[retired:size], prefix=prefix)
            assert resumed.root() == whole.root() == root_of(leaves[:size])
            for index in range(retired, size):
                assert resumed.inclusion_proof(index) == whole.inclusion_proof(index)
            for index in range(retired):
                with pytest.raises(ValueError, match="prefix"):
                    resumed.inclusion_proof(index)
