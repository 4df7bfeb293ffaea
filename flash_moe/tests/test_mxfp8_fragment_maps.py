"""CPU check of the MXFP8 kernel's index maps (moe_gemm_consumer_mxfp8.cuh, namespace kperm).

The kernel feeds wgmma's register operand with weight rows dequantized from one 16-byte e4m3
load per row and k-block, which works only if the bf16 token operand is stored with K
permuted inside each 64-block and fragment rows are mapped to weight rows as below. This test
replays the wgmma A-fragment semantics (lane l of warp w: a0 = row 16w + l/4, k = 2(l%4)+{0,1};
a1 = row + 8; a2 = k + 8; a3 = row + 8, k + 8) on integers and checks D == W @ X^T exactly.
The three formulas are copies of the C++ ones; keep them in sync.
"""

import random


def physical(logical):  # kperm::physical
    return 16 * ((logical >> 2) & 3) + 8 * ((logical & 3) >> 1) + 2 * (logical >> 4) + (logical & 1)


def pair_column(r):  # kperm::pair_column
    return 16 * (r >> 4) + 2 * (r & 7) + ((r >> 3) & 1)


def gate_up_row(r):  # kperm::gate_up_row
    return 16 * (r & 3) + 4 * (r >> 4) + 2 * ((r >> 2) & 1) + ((r >> 3) & 1)


def test_maps_are_permutations_and_pair_up():
    for f in (physical, pair_column, gate_up_row):
        assert sorted(f(i) for i in range(64)) == list(range(64))
    for r in range(64):
        assert physical(gate_up_row(r)) == pair_column(r)  # h column the gate/up epilogue writes
    for w in range(4):
        for i in range(8):
            assert pair_column(16 * w + i + 8) == pair_column(16 * w + i) + 1  # one bf16x2 store


def _fragment_gemm(W, Xp, row_map, n_tokens):
    """D[r][t] as the kernel computes it for one m64 block and one 64-wide k-block."""
    D = [[0] * n_tokens for _ in range(64)]
    for w in range(4):
        for lane in range(32):
            i, cq = lane >> 2, lane & 3
            rows = (16 * w + i, 16 * w + i + 8)
            loads = [W[row_map(r)][16 * cq:16 * cq + 16] for r in rows]  # the thread's 16-byte loads
            for s in range(4):  # k16 step s reads bytes 4s..4s+3 of each load
                frag = {(rows[0], 2 * cq): loads[0][4 * s], (rows[0], 2 * cq + 1): loads[0][4 * s + 1],
                        (rows[1], 2 * cq): loads[1][4 * s], (rows[1], 2 * cq + 1): loads[1][4 * s + 1],
                        (rows[0], 2 * cq + 8): loads[0][4 * s + 2], (rows[0], 2 * cq + 9): loads[0][4 * s + 3],
                        (rows[1], 2 * cq + 8): loads[1][4 * s + 2], (rows[1], 2 * cq + 9): loads[1][4 * s + 3]}
                for (r, k), a in frag.items():
                    for t in range(n_tokens):
                        D[r][t] += a * Xp[t][16 * s + k]
    return D


def test_fragments_compute_the_mapped_rows():
    rng = random.Random(0)
    n = 12
    W = [[rng.randint(-8, 8) for _ in range(64)] for _ in range(64)]
    X = [[rng.randint(-8, 8) for _ in range(64)] for _ in range(n)]
    Xp = [[0] * 64 for _ in range(n)]  # the token operand as stored: K permuted
    for t in range(n):
        for L in range(64):
            Xp[t][physical(L)] = X[t][L]
    for row_map in (gate_up_row, pair_column):  # gate/up and down
        D = _fragment_gemm(W, Xp, row_map, n)
        for r in range(64):
            for t in range(n):
                assert D[r][t] == sum(W[row_map(r)][L] * X[t][L] for L in range(64)), (row_map.__name__, r, t)
