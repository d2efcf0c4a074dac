// FP64 rung: float64 products on the tensor cores' DMMA units (`mma.sync` with f64 operands).
//
// What it changes, and why. `fast` computes float64 on the FMA lanes, which on an H100 run doubles at the same
// 67 TFLOP/s peak as the DMMA units, but an FMA lane does one multiply-add per instruction and a DMMA m8n8k4 does
// 256 for a warp: `fast` spends its issue slots and its shared-memory bandwidth on feeding FMAs and reaches 0.37-0.51
// of cuBLAS DGEMM, which uses the DMMA units. This kernel keeps `fast`'s pipeline and hands the arithmetic to DMMA:
//   - a block computes a BM x BN tile of C with (BM / WM) x (BN / 32) warps, each a WM x 32 tile held in registers
//     as 8 x 8 blocks of the instruction's accumulator layout (two doubles a lane per block);
//   - tiles of A (BM x 16) and B (16 x BN) travel global -> shared with cp.async, STAGES deep, one barrier a step;
//   - MMA_K picks the instruction: m8n8k4 (sm_80's DMMA, an 8 x 8 x 4 block), or sm_90's m16n8k8 and m16n8k16,
//     which do 4 and 8 times its work from the same fragment positions, so the same loads feed all three.
//     Measured on the H100 (docs/tensor-cores.md): m8n8k4 reaches about 0.5 of cuBLAS DGEMM, the sm_90 forms 0.8;
//     the service runs m16n8k8, the form cuBLAS's own DGEMM kernel uses.
//
// Fragments in 16-byte loads. The instructions want, from lane (g, t) = (lane / 4, lane % 4), A[g][t + 4 s] and
// B[t + 4 s][g] for s = 0..3 of a 16-deep tile: doubles 4 apart along K, 8 apart along N, one 8-byte load each.
// But a product does not care in which order it takes K, nor which columns of B it puts in which block, as long
// as C's columns follow. So logical k = t + 4 s is read from the tile's column (row of B) 4 t + s, and the warp's
// 8 x 8 block j takes its logical column x from column 4 x + j of the warp's 32: a lane's A values are then four
// neighbours in a row, its B values four neighbours in each of four rows, and its outputs, columns 4 (2 t + e) + j,
// eight neighbours in a row. Every fragment is two 16-byte loads instead of four 8-byte ones.
//
// Shared memory is swizzled so that each 16-byte load of a quarter warp (8 lanes, 128 bytes) touches every bank
// once: A's rows (128 bytes, all 32 banks) have their 16-byte units XORed with the row's parity (the two rows a
// quarter warp reads), B's rows with bits 2 and 3 of the row mapped to 1 and 4 (the four rows it reads are 4 apart).
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

constexpr int DMMA_WN = 32;  // columns of a warp's tile: four 8 x 8 blocks, interleaved (see above)

// Index of A's tile element (row, col) in shared memory: 16-byte units of a row XORed with the row's parity.
template <int BK>
__device__ __forceinline__ int a_offset(int row, int col) {
    return row * BK + ((((col >> 1) ^ (row & 1)) << 1) | (col & 1));
}

// Index of B's tile element (k, col) in a BN-wide tile: 16-byte units XORed with bit 2 of k as 1, bit 3 as 4.
__device__ __forceinline__ int b_swizzle(int k) { return ((k >> 2) & 1) | ((k >> 1) & 4); }

template <int BN>
__device__ __forceinline__ int b_offset(int k, int col) {
    return k * BN + ((((col >> 1) ^ b_swizzle(k)) << 1) | (col & 1));
}

// c (8 x 8, rows g, columns 2t and 2t + 1) += a (8 x 4: A[g][t]) * b (4 x 8: B[t][g])
__device__ __forceinline__ void dmma_m8n8k4(double (&c)[2], double a, double b) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
                 : "+d"(c[0]), "+d"(c[1])
                 : "d"(a), "d"(b));
}

// top, bottom (the 8 x 8 blocks at rows g and g + 8) += a (16 x 8: a[i] = A[g + 8 (i % 2)][t + 4 (i / 2)])
// * b (8 x 8: b[i] = B[t + 4 i][g])
__device__ __forceinline__ void dmma_m16n8k8(double (&top)[2], double (&bottom)[2], const double* a, const double* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+d"(top[0]), "+d"(top[1]), "+d"(bottom[0]), "+d"(bottom[1])
                 : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}

// the same, 16 deep: a (16 x 16, a[i] as above for i = 0..7), b (16 x 8, b[i] for i = 0..3)
__device__ __forceinline__ void dmma_m16n8k16(double (&top)[2], double (&bottom)[2], const double (&a)[8],
                                              const double (&b)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, "
        "{%12, %13, %14, %15}, {%0, %1, %2, %3};"
        : "+d"(top[0]), "+d"(top[1]), "+d"(bottom[0]), "+d"(bottom[1])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]),
          "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

template <int BM, int BN, int BK, int WM, int STAGES, bool VEC, int MMA_K>
__global__ void __launch_bounds__((BM / WM) * (BN / DMMA_WN) * 32, dmma_blocks_per_sm((BM / WM) * (BN / DMMA_WN) * 32))
    matmul_dmma(const double* __restrict__ A, const double* __restrict__ B, double* __restrict__ C, int M, int N,
                int K) {
    constexpr int WARPS_N = BN / DMMA_WN;
    constexpr int NT = (BM / WM) * WARPS_N * 32;
    constexpr int W = VEC ? 2 : 1;                   // doubles per copy
    constexpr int A_STAGE = BM * BK;
    constexpr int B_STAGE = BK * BN;
    constexpr int A_COPIES = A_STAGE / W / NT;       // per thread and stage
    constexpr int B_COPIES = B_STAGE / W / NT;
    constexpr int PAIRS = WM / 16;                   // 16-row slabs of a warp's tile
    constexpr int FN = DMMA_WN / 8;                  // 8 x 8 blocks across it
    static_assert(A_STAGE / W % NT == 0 && B_STAGE / W % NT == 0, "copies divide evenly among the threads");
    static_assert(WM % 16 == 0 && BM % WM == 0 && BN % DMMA_WN == 0, "warps tile the block in 16 x 32 slabs");

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
    static_assert(NT % (BK / W) == 0 && NT % (BN / W) == 0 && A_ROW_STEP % 2 == 0, "rows of copies keep a swizzle");
    const int a_row = tid / (BK / W), a_col = tid % (BK / W) * W;
    const int b_row = tid / (BN / W), b_col = tid % (BN / W) * W;
    unsigned a_rows_in = 0;  // bit i: row a_row + i * A_ROW_STEP lies inside A
#pragma unroll
    for (int i = 0; i < A_COPIES; ++i) a_rows_in |= unsigned(m0 + a_row + i * A_ROW_STEP < M) << i;
    const bool b_col_in = n0 + b_col < N;
    const double* const a_src = A + static_cast<size_t>(a_rows_in & 1u ? m0 + a_row : 0) * K + a_col;
    const double* const b_src = B + static_cast<size_t>(b_row) * N + (b_col_in ? n0 + b_col : 0);
    const size_t a_stride = static_cast<size_t>(A_ROW_STEP) * K, b_stride = static_cast<size_t>(B_ROW_STEP) * N;
    const int a_dst = a_offset<BK>(a_row, a_col);
    // Only blocks on the bottom or right edge of C, and the last step when BK does not divide K, hold elements to
    // skip; every other step copies without a guard: one address and one cp.async a copy (as in fast.cu).
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
            const int k = b_row + i * B_ROW_STEP;
            const bool in = b_col_in && k0 + k < K;
            const double* src = b_src + static_cast<size_t>(k0) * N + i * b_stride;
            copy_async<W * 8>(Bs + stage * B_STAGE + b_offset<BN>(k, b_col), guarded && !in ? B : src, guarded, in);
        }
    };
    const bool edge_block = m0 + BM > M || n0 + BN > N;
    auto issue_tile = [&](int stage, int k0) {
        if (edge_block || k0 + BK > K) {
            copy_tile(true, stage, k0);
        } else {
            copy_tile(false, stage, k0);
        }
    };

    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int wm = (warp / WARPS_N) * WM;  // the warp's tile within the block's
    const int wn = (warp % WARPS_N) * DMMA_WN;
    // Where this lane's fragments lie in a stage: A's row g (then + 8, + 16, ...), columns 4t..4t+3; B's rows 4t..4t+3,
    // columns wn + 4g..4g+3. Each as two 16-byte units; the swizzle depends on the lane only, as every row the lane
    // reads has the parity of g (A) or bits 2-3 of 4t (B).
    const int a_lane = a_offset<BK>(wm + g, 4 * t);
    const int a_lane2 = a_offset<BK>(wm + g, 4 * t + 2);
    const int b_lane = b_offset<BN>(4 * t, wn + 4 * g);
    const int b_lane2 = b_offset<BN>(4 * t, wn + 4 * g + 2);

    double acc[2 * PAIRS][FN][2] = {};

    const int steps = (K + BK - 1) / BK;
    // As in fast.cu: a group is committed even when empty, so that the wait below counts right on the last steps.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) issue_tile(s, s * BK);
        copy_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        copy_async_wait<STAGES - 2>();
        __syncthreads();
        if (step + STAGES - 1 < steps) issue_tile((step + STAGES - 1) % STAGES, (step + STAGES - 1) * BK);
        copy_async_commit();

        // the stage in slices of 16 of K: the swizzles repeat every 16 rows of B and 8 units of a row of A
#pragma unroll
        for (int slice = 0; slice < BK / 16; ++slice) {
            const double* as = As + (step % STAGES) * A_STAGE + 16 * slice;
            const double* bs = Bs + (step % STAGES) * B_STAGE + 16 * slice * BN;
            double b[FN][4];  // b[j][s]: B[logical k t + 4 s][block j's column g]
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const double2 low = *reinterpret_cast<const double2*>(bs + s * BN + b_lane);
                const double2 high = *reinterpret_cast<const double2*>(bs + s * BN + b_lane2);
                b[0][s] = low.x, b[1][s] = low.y, b[2][s] = high.x, b[3][s] = high.y;
            }
#pragma unroll
            for (int p = 0; p < PAIRS; ++p) {
                // slab[h + 2 s]: A[row g + 8 h of the slab][logical k t + 4 s], the order m16n8k16 takes it in
                double slab[8];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = (16 * p + 8 * h) * BK;
                    const double2 low = *reinterpret_cast<const double2*>(as + row + a_lane);
                    const double2 high = *reinterpret_cast<const double2*>(as + row + a_lane2);
                    slab[h] = low.x, slab[h + 2] = low.y, slab[h + 4] = high.x, slab[h + 6] = high.y;
                }
                if constexpr (MMA_K == 16) {
#pragma unroll
                    for (int j = 0; j < FN; ++j) dmma_m16n8k16(acc[2 * p][j], acc[2 * p + 1][j], slab, b[j]);
                } else if constexpr (MMA_K == 8) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
#pragma unroll
                        for (int j = 0; j < FN; ++j)
                            dmma_m16n8k8(acc[2 * p][j], acc[2 * p + 1][j], slab + 4 * half, b[j] + 2 * half);
                    }
                } else {
                    static_assert(MMA_K == 4, "the instructions are m8n8k4, m16n8k8 and m16n8k16");
#pragma unroll
                    for (int s = 0; s < 4; ++s) {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
#pragma unroll
                            for (int j = 0; j < FN; ++j) dmma_m8n8k4(acc[2 * p + h][j], slab[h + 2 * s], b[j][s]);
                        }
                    }
                }
            }
        }
    }

    // Epilogue: acc[i][j][e] is C[wm + 8 i + g][wn + 4 (2 t + e) + j]: for each e, four neighbours j = 0..3. With
    // VEC, N is even, so each pair of them is one aligned 16-byte store, wholly inside C or wholly outside.
#pragma unroll
    for (int i = 0; i < 2 * PAIRS; ++i) {
        const int row = m0 + wm + 8 * i + g;
        if (row >= M) continue;
        double* c_row = C + static_cast<size_t>(row) * N;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = n0 + wn + 4 * (2 * t + e);
#pragma unroll
            for (int j = 0; j < FN; j += 2) {
                if (VEC) {
                    if (col + j < N) {
                        *reinterpret_cast<double2*>(c_row + col + j) = make_double2(acc[i][j][e], acc[i][j + 1][e]);
                    }
                } else {
                    if (col + j < N) c_row[col + j] = acc[i][j][e];
                    if (col + j + 1 < N) c_row[col + j + 1] = acc[i][j + 1][e];
                }
            }
        }
    }
}
