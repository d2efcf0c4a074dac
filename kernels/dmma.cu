// FP64 rung: float64 products on the tensor cores' DMMA units (`mma.sync` with f64 operands).
//
// What it changes, and why. `fast` computes float64 on the FMA lanes, which on an H100 run doubles at half the
// 67 TFLOP/s of the DMMA units, and an FMA lane does one multiply-add per instruction where a DMMA m16n8k8 does 1024
// for a warp: `fast` spends its issue slots and its shared-memory bandwidth on feeding FMAs and reaches 0.37-0.51
// of cuBLAS DGEMM, which uses the DMMA units. This kernel keeps `fast`'s pipeline and hands the arithmetic to DMMA:
//   - a block computes a BM x BN tile of C with (BM / WM) x (BN / 32) warps, each a WM x 32 tile held in registers;
//   - tiles of A (BM x BK) and B (BK x BN) travel global -> shared with cp.async, STAGES deep, one barrier a step;
//   - MMA_K picks the instruction, sm_90's m16n8k8 or m16n8k16 (the service runs m16n8k8, the form cuBLAS's own
//     DGEMM kernel uses). sm_80's m8n8k4, a quarter of m16n8k8's work an instruction, reached half of cuBLAS here
//     (docs/tensor-cores.md).
//
// C transposed, so that shared memory hands the instruction its registers as they are. A DMMA.16x8x8 reads its
// A operand from four consecutive register pairs, (a0, a1, a2, a3) = rows g and g + 8 at k slot t, then the same
// rows at slot t + 4, for lane (g, t) = (lane / 4, lane % 4), and its B operand (b0, b1) = column g at slots t and
// t + 4. A 16-byte load from a row-major tile brings two neighbours of one row; fed A and B as they are, every
// fragment had to be reassembled, and the compiler spent ten moves a DMMA on it (ptxas's machine code: 319 moves
// and 32 DMMAs a 16-deep step, two and a half times cuBLAS's instructions). So each warp computes C^T = B^T A^T:
// the instruction's A operand comes from B's tile, whose rows hold neighbouring columns of C, and its B operand
// from A's tile, whose rows hold neighbouring k. The instruction's rows g and g + 8 are C's columns 2g and 2g + 1,
// its columns C's rows, and lane t takes the tile's k 2t and 2t + 1 (4t .. 4t + 3 for m16n8k16) as its slots
// t and t + 4 (t + 8, t + 12): the order of the terms of a sum does not matter, as long as A and B agree. Then
// (a0, a1) is one 16-byte load of B's row 2t, (a2, a3) one of row 2t + 1, and (b0, b1) one of A's row g.
//
// Shared memory is swizzled per 16-byte unit so that the eight lanes of a quarter warp, which a 16-byte load
// serves together, touch every bank once. A's rows (16 doubles, 128 bytes, all 32 banks): a quarter warp reads
// rows g = 0, 1 at units t (Q = MMA_K / 4 doubles a lane: Q / 2 units from unit Q t / 2), so odd rows have their
// units XORed with 4 (m16n8k8) or 1 (m16n8k16). B's rows: a quarter warp reads two units of each of four rows
// Q t + q, which XORing their units with 2 x (row / Q mod 4) puts on four different pairs of unit positions.
//
// Edges: a copy of an element outside A or B reads nothing and writes zeros (cp.async with source size 0), so
// partial tiles multiply as if padded; only the stores are guarded. VEC copies 16 bytes (two doubles) at a time,
// when K and N are even (every row then starts on 16 bytes); otherwise one double at a time.
//
// Launched with (BM / WM) * (BN / 32) * 32 threads, a 1-D grid of one block per tile of C (in tile_order.cuh's
// order), and dmma_smem_bytes<...>() bytes of dynamic shared memory.

#include "async_copy.cuh"
#include "tile_order.cuh"

// Blocks of `threads` resident on an SM: a lane holds WM x 32 / 32 accumulators, 128 registers for WM = 64, so 256
// threads take the register file, and two blocks of 128 share it (each then waits at its barriers while the other
// computes).
__host__ __device__ constexpr int dmma_blocks_per_sm(int threads) { return threads <= 128 ? 2 : 1; }

template <int BM, int BN, int BK, int STAGES>
__host__ __device__ constexpr int dmma_smem_bytes() {
    return STAGES * (BM + BN) * BK * static_cast<int>(sizeof(double));
}

constexpr int DMMA_WN = 32;  // columns of a warp's tile: two 16-column tiles of the instruction's rows

// Index of A's tile element (row, col) in shared memory: 16-byte units of odd rows XORed with 4 (Q = 2) or 1 (Q = 4).
template <int BK, int Q>
__device__ __forceinline__ int a_offset(int row, int col) {
    constexpr int FLIP = Q == 2 ? 4 : 1;
    return row * BK + ((((col >> 1) ^ ((row & 1) * FLIP)) << 1) | (col & 1));
}

// Index of B's tile element (k, col) in a BN-wide tile: 16-byte units XORed with 2 x (k / Q mod 4).
template <int BN, int Q>
__device__ __forceinline__ int b_offset(int k, int col) {
    return k * BN + ((((col >> 1) ^ (((k / Q) & 3) << 1)) << 1) | (col & 1));
}

// d (rows g, g + 8 of a 16 x 8 tile; columns 2t, 2t + 1) += a (16 x 8: a[2 i + h] = row g + 8 h, slot t + 4 i)
// * b (8 x 8: b[i] = slot t + 4 i, column g)
__device__ __forceinline__ void dmma_m16n8k8(double (&d)[4], const double (&a)[4], const double (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
                 : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}

// the same, 16 deep: a (16 x 16, a[2 i + h] for i = 0..3), b (16 x 8, b[i] for i = 0..3)
__device__ __forceinline__ void dmma_m16n8k16(double (&d)[4], const double (&a)[8], const double (&b)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, "
        "{%12, %13, %14, %15}, {%0, %1, %2, %3};"
        : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]),
          "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

template <int MMA_K>
__device__ __forceinline__ void dmma(double (&d)[4], const double (&a)[MMA_K / 2], const double (&b)[MMA_K / 4]) {
    if constexpr (MMA_K == 16) {
        dmma_m16n8k16(d, a, b);
    } else {
        dmma_m16n8k8(d, a, b);
    }
}

template <int BM, int BN, int BK, int WM, int STAGES, bool VEC, int MMA_K>
__global__ void __launch_bounds__((BM / WM) * (BN / DMMA_WN) * 32, dmma_blocks_per_sm((BM / WM) * (BN / DMMA_WN) * 32))
    matmul_dmma(const double* __restrict__ A, const double* __restrict__ B, double* __restrict__ C, int M, int N,
                int K) {
    constexpr int WARPS_N = BN / DMMA_WN;
    constexpr int NT = (BM / WM) * WARPS_N * 32;
    constexpr int W = VEC ? 2 : 1;                   // doubles per copy
    constexpr int Q = MMA_K / 4;                     // k of a slice per lane
    constexpr int A_STAGE = BM * BK;
    constexpr int B_STAGE = BK * BN;
    constexpr int A_COPIES = A_STAGE / W / NT;       // per thread and stage
    constexpr int B_COPIES = B_STAGE / W / NT;
    constexpr int MI = WM / 8;                       // 8-row tiles of C in a warp's: the instruction's columns
    constexpr int NJ = DMMA_WN / 16;                 // 16-column tiles of C in it: the instruction's rows
    static_assert(MMA_K == 8 || MMA_K == 16, "the instructions are m16n8k8 and m16n8k16");
    static_assert(A_STAGE / W % NT == 0 && B_STAGE / W % NT == 0, "copies divide evenly among the threads");
    static_assert(WM % 8 == 0 && BM % WM == 0 && BN % DMMA_WN == 0 && BK % 16 == 0, "warps tile the block");

    extern __shared__ __align__(16) unsigned char shared_raw[];
    double* const As = reinterpret_cast<double*>(shared_raw);  // [STAGES][BM][BK], swizzled
    double* const Bs = As + STAGES * A_STAGE;                   // [STAGES][BK][BN], swizzled

    int tile_m, tile_n;
    tile_of(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, tile_m, tile_n);
    const int m0 = tile_m * BM, n0 = tile_n * BN;
    const int tid = threadIdx.x;

    // Copy `stage` from the tile of k that starts at k0. A thread's copies of A are the units at row a_row + i *
    // A_ROW_STEP, column a_col, so consecutive threads read consecutive bytes of a row; likewise for B. The bases
    // and strides are fixed for the whole loop, so a copy costs one address and a cp.async.
    constexpr int A_ROW_STEP = NT / (BK / W), B_ROW_STEP = NT / (BN / W);
    static_assert(NT % (BK / W) == 0 && NT % (BN / W) == 0, "rows of copies divide the threads");
    static_assert(A_ROW_STEP % 2 == 0, "a thread's rows of copies of A share a swizzle");
    const int a_row = tid / (BK / W), a_col = tid % (BK / W) * W;
    const int b_row = tid / (BN / W), b_col = tid % (BN / W) * W;
    unsigned a_rows_in = 0;  // bit i: row a_row + i * A_ROW_STEP lies inside A
#pragma unroll
    for (int i = 0; i < A_COPIES; ++i) a_rows_in |= unsigned(m0 + a_row + i * A_ROW_STEP < M) << i;
    const bool b_col_in = n0 + b_col < N;
    const double* const a_src = A + static_cast<size_t>(a_rows_in & 1u ? m0 + a_row : 0) * K + a_col;
    const double* const b_src = B + static_cast<size_t>(b_row) * N + (b_col_in ? n0 + b_col : 0);
    const size_t a_stride = static_cast<size_t>(A_ROW_STEP) * K, b_stride = static_cast<size_t>(B_ROW_STEP) * N;
    const int a_dst = a_offset<BK, Q>(a_row, a_col);
    // Guarded only in the blocks and steps that hold elements to skip (copy_guarded_at_edges, as in fast.cu).
    auto copy_tile = [&](bool guarded, int stage, int k0) {
#pragma unroll
        for (int i = 0; i < A_COPIES; ++i) {
            const bool in = (a_rows_in >> i & 1u) && k0 + a_col < K;
            const double* src = a_src + k0 + i * a_stride;
            copy_async<W * 8>(As + stage * A_STAGE + a_dst + i * A_ROW_STEP * BK, guarded && !in ? A : src, guarded,
                              in);
        }
#pragma unroll
        for (int i = 0; i < B_COPIES; ++i) {
            const bool in = b_col_in && k0 + b_row + i * B_ROW_STEP < K;
            const double* src = b_src + static_cast<size_t>(k0) * N + i * b_stride;
            copy_async<W * 8>(Bs + stage * B_STAGE + b_offset<BN, Q>(b_row + i * B_ROW_STEP, b_col),
                              guarded && !in ? B : src, guarded, in);
        }
    };
    const bool edge_block = m0 + BM > M || n0 + BN > N;
    auto issue_tile = [&](int stage, int step) { copy_guarded_at_edges<BK>(edge_block, K, stage, step, copy_tile); };

    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int wm = (warp / WARPS_N) * WM;  // the warp's tile within the block's
    const int wn = (warp % WARPS_N) * DMMA_WN;
    // Where this lane's fragments lie in a stage: A's row wm + g (then every 8 rows), k Q t .. Q t + Q - 1 of each
    // slice, in Q / 2 units; B's rows Q t .. Q t + Q - 1 of each slice, columns wn + 2g, + 1 (then every 16 columns).
    // The swizzles repeat every 8 rows of A, every 4 Q rows of B and every 8 units of a row of B, so the offsets
    // of a stage's first fragments serve the others.
    constexpr int SLICES = BK / MMA_K;
    int a_lane[SLICES][Q / 2];
#pragma unroll
    for (int slice = 0; slice < SLICES; ++slice) {
#pragma unroll
        for (int u = 0; u < Q / 2; ++u) a_lane[slice][u] = a_offset<BK, Q>(wm + g, MMA_K * slice + Q * t + 2 * u);
    }
    const int b_lane = b_offset<BN, Q>(Q * t, wn + 2 * g);

    double acc[NJ][MI][4] = {};  // acc[j][i]: the instruction's 16 x 8 tile of C^T at columns wn + 16 j, rows wm + 8 i

    pipelined_k_loop<STAGES>((K + BK - 1) / BK, issue_tile, [&](int stage) {
        // the stage in slices of MMA_K of K; the swizzles repeat within a slice's rows of B and units of A
#pragma unroll
        for (int slice = 0; slice < SLICES; ++slice) {
            const double* as = As + stage * A_STAGE;
            const double* bs = Bs + stage * B_STAGE + MMA_K * slice * BN + b_lane;
            double a_op[NJ][2 * Q];  // from B: a_op[j][2 q + h] = B[Q t + q][wn + 16 j + 2 g + h]
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
#pragma unroll
                for (int q = 0; q < Q; ++q) {
                    // the swizzle of a column 16 j further is the same, XORed below the 16 (8 units)
                    const double2 pair = *reinterpret_cast<const double2*>(bs + q * BN + 16 * j);
                    a_op[j][2 * q] = pair.x, a_op[j][2 * q + 1] = pair.y;
                }
            }
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                double b_op[Q];  // from A: b_op[q] = A[wm + 8 i + g][Q t + q]
#pragma unroll
                for (int u = 0; u < Q / 2; ++u) {
                    const double2 pair = *reinterpret_cast<const double2*>(as + a_lane[slice][u] + 8 * i * BK);
                    b_op[2 * u] = pair.x, b_op[2 * u + 1] = pair.y;
                }
#pragma unroll
                for (int j = 0; j < NJ; ++j) dmma<MMA_K>(acc[j][i], a_op[j], b_op);
            }
        }
    });

    // Epilogue: acc[j][i] holds C[r][c] for rows r = wm + 8 i + 2t + e and columns c = wn + 16 j + 2g + h at index
    // e + 2 h: the two columns of a row are neighbours, one aligned 16-byte store when N is even (VEC).
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int row = m0 + wm + 8 * i + 2 * t + e;
            if (row >= M) continue;
            double* c_row = C + static_cast<size_t>(row) * N;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int col = n0 + wn + 16 * j + 2 * g;
                if (VEC) {
                    if (col < N) *reinterpret_cast<double2*>(c_row + col) = make_double2(acc[j][i][e], acc[j][i][e + 2]);
                } else {
                    if (col < N) c_row[col] = acc[j][i][e];
                    if (col + 1 < N) c_row[col + 1] = acc[j][i][e + 2];
                }
            }
        }
    }
}
