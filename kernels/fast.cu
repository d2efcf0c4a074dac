// fast: the flagship. Warp tiling, a multi-stage cp.async pipeline, one barrier per step of k.
//
// What it changes over `blocktile2d`, and why each part is faster:
//
// 1. Copies overlap arithmetic. Tiles travel from global to shared memory with cp.async (sm_80+), which
//    writes shared memory without passing through registers and without stalling the issuing thread.
//    STAGES tiles are in flight: while the block multiplies tile t it is already fetching tiles t+1 ..
//    t+STAGES-1, so the latency of device memory (~600 ns) hides behind STAGES-1 steps of arithmetic
//    instead of being paid at every step. One barrier per step suffices (pipelined_k_loop in async_copy.cuh).
//
// 2. Warp tiling. The block is split into warps of WM x WN outputs, and inside a warp the 32 lanes form a
//    WTM x WTN grid; a lane owns TM x TN outputs, but as (TM/R) x (TN/R) sub-blocks of R x R (R = one
//    16-byte vector) spaced WTM*R rows and WTN*R columns apart. So at each k the lanes of a warp read one
//    contiguous run of WTM*R elements of A and one of WTN*R elements of B: every 16-byte shared-memory load
//    is conflict-free (blocktile2d's contiguous per-thread columns conflicted two ways), and a warp touches
//    only WM + WN elements per k, which keeps the shared-memory pipe far from its limit. With 8 x 8
//    outputs per lane there are 64 FFMA per 4 LDS.128: the issue slots go almost all to arithmetic.
//
// 3. A is stored transposed (As[k][m]), so a lane's R rows are one vector load. cp.async cannot transpose
//    a 16-byte vector, so A is copied element by element (4 or 8 bytes): BK consecutive lanes read BK
//    consecutive elements of a row of A (whole 32-byte sectors when BK*sizeof(T) >= 32), and rows of As are
//    padded by PAD elements so that those lanes, writing down a column of As, spread over the banks (at most
//    two to a bank for BK = 16, on writes that are a small part of the shared-memory traffic).
//    B keeps its layout and is copied 16 bytes at a time when VEC (N a multiple of 16 / sizeof(T)),
//    otherwise element by element.
//
// 4. Edges cost nothing in the inner loop: an out-of-range element is copied with source size 0, which
//    cp.async fills with zeros, so partial tiles multiply as if padded. Every thread runs every step and
//    reaches every barrier; only the final stores are guarded. Blocks wholly inside C copy their tiles
//    without any guard (all but the last step of k when BK does not divide K), which cuts the instructions
//    around the FFMA of each step (docs/kernels.md has the SASS counts and the timings).
//
// Registers: TM*TN accumulators plus the two fragments. __launch_bounds__ asks for two blocks per SM for
// float (a 128-register cap at 256 threads: 16 warps per SM to hide shared-memory latency); doubles take
// twice the registers, so they get one block per SM.

#include "async_copy.cuh"
#include "common.cuh"

template <typename T>
__host__ __device__ constexpr int fast_min_blocks(int threads) {
    return sizeof(T) == 4 ? (threads <= 512 ? 65536 / (threads * 128) : 1) : 1;
}

template <typename T, int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES, bool VEC>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, fast_min_blocks<T>((BM / WM) * (BN / WN) * 32))
    matmul_fast(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    constexpr int NT = (BM / WM) * (BN / WN) * 32;
    constexpr int R = 16 / sizeof(T);         // elements in one 16-byte vector
    constexpr int WTN = WN / TN;              // lanes along n in a warp
    constexpr int WTM = WM / TM;              // lanes along m
    constexpr int PAD = 4;                    // keeps rows 16-byte aligned and spreads the transposing writes
    constexpr int LDA = BM + PAD;
    constexpr int A_STAGE = BK * LDA;
    constexpr int B_STAGE = BK * BN;
    constexpr int BW = VEC ? R : 1;           // elements per copy of B
    constexpr int A_COPIES = BM * BK / NT;    // per thread and stage
    constexpr int B_COPIES = BK * BN / BW / NT;
    static_assert(WTM * WTN == 32, "a warp is 32 lanes");
    static_assert(TM % R == 0 && TN % R == 0, "a lane's outputs come in whole 16-byte vectors");
    static_assert((BM * BK) % NT == 0 && (BK * BN / BW) % NT == 0, "copies divide evenly among the threads");
    static_assert(NT % BK == 0 && NT % (BN / BW) == 0, "each thread copies one column of A and of B");
    using Vec = Chunk<T, R>;

    extern __shared__ __align__(16) unsigned char shared_raw[];
    T* const As = reinterpret_cast<T*>(shared_raw);  // [STAGES][BK][LDA], transposed
    T* const Bs = As + STAGES * A_STAGE;              // [STAGES][BK][BN]

    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * BM;
    const int n0 = blockIdx.x * BN;

    // Copy assignment, fixed for the whole loop so that a step only adds offsets to two pointers.
    // A: the thread copies column a_k of rows a_m + i*(NT/BK); consecutive threads take consecutive k, so
    // BK lanes read one run of a row. B: the thread copies columns b_n .. b_n+BW-1 of rows b_k + i*B_ROWS.
    constexpr int B_ROWS = NT / (BN / BW);
    const int a_k = tid % BK;
    const int a_m = tid / BK;
    const int b_k = tid / (BN / BW);
    const int b_n = (tid % (BN / BW)) * BW;
    unsigned a_rows_in = 0;  // bit i: row a_m + i*(NT/BK) lies inside A
#pragma unroll
    for (int i = 0; i < A_COPIES; ++i) a_rows_in |= unsigned(m0 + a_m + i * (NT / BK) < M) << i;
    const bool b_col_in = n0 + b_n < N;
    const T* a_src = A + (size_t)(a_rows_in & 1u ? m0 + a_m : 0) * K + a_k;
    const T* b_src = B + (size_t)b_k * N + (b_col_in ? n0 + b_n : 0);
    const size_t a_stride = (size_t)(NT / BK) * K;
    const size_t b_stride = (size_t)B_ROWS * N;
    T* const a_dst = As + a_k * LDA + a_m;
    T* const b_dst = Bs + b_k * BN + b_n;

    // Issue the copies of the tile that starts at k0 into `stage`. A guarded copy of an element outside A
    // (or B) reads nothing, and is given the matrix's first element as its address. copy_guarded_at_edges
    // guards only the blocks and steps that hold elements to skip. (With the guards everywhere, predicate and
    // address selects took a good part of a step's instructions.)
    auto load_tile = [&](bool guarded, int stage, int k0) {
        const bool a_k_in = k0 + a_k < K;
#pragma unroll
        for (int i = 0; i < A_COPIES; ++i) {
            const bool in = a_k_in && (a_rows_in >> i & 1u);
            const T* src = a_src + k0 + i * a_stride;
            copy_async<sizeof(T)>(a_dst + stage * A_STAGE + i * (NT / BK), guarded && !in ? A : src, guarded, in);
        }
#pragma unroll
        for (int i = 0; i < B_COPIES; ++i) {
            const bool in = b_col_in && k0 + b_k + i * B_ROWS < K;
            const T* src = b_src + (size_t)k0 * N + i * b_stride;
            copy_async<BW * sizeof(T)>(b_dst + stage * B_STAGE + i * B_ROWS * BN, guarded && !in ? B : src, guarded,
                                       in);
        }
    };
    const bool edge_block = m0 + BM > M || n0 + BN > N;
    auto issue_tile = [&](int stage, int step) { copy_guarded_at_edges<BK>(edge_block, K, stage, step, load_tile); };

    const int warp = tid / 32;
    const int lane = tid % 32;
    const int wm = (warp / (BN / WN)) * WM + (lane / WTN) * R;  // first row of this lane's first sub-block
    const int wn = (warp % (BN / WN)) * WN + (lane % WTN) * R;  // its first column

    T acc[TM][TN] = {};
    T a[TM];
    T b[TN];

    pipelined_k_loop<STAGES>((K + BK - 1) / BK, issue_tile, [&](int stage) {
        const T* as = As + stage * A_STAGE + wm;
        const T* bs = Bs + stage * B_STAGE + wn;
#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM / R; ++i)
                *reinterpret_cast<Vec*>(&a[i * R]) = *reinterpret_cast<const Vec*>(as + k * LDA + i * WTM * R);
#pragma unroll
            for (int j = 0; j < TN / R; ++j)
                *reinterpret_cast<Vec*>(&b[j * R]) = *reinterpret_cast<const Vec*>(bs + k * BN + j * WTN * R);
#pragma unroll
            for (int i = 0; i < TM; ++i) {
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
            }
        }
    });

    // Epilogue: sub-block (i / R, j / R) of this lane starts at row wm + (i / R) * WTM * R, column
    // wn + (j / R) * WTN * R. With VEC, N and every column here are multiples of R, so each vector is wholly
    // inside C or wholly outside.
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + wm + (i / R) * WTM * R + i % R;
        if (row >= M) continue;  // no barrier follows
        T* c_row = C + (size_t)row * N;
#pragma unroll
        for (int j = 0; j < TN; j += R) {
            const int col = n0 + wn + (j / R) * WTN * R;
            if (VEC) {
                if (col < N) *reinterpret_cast<Vec*>(c_row + col) = *reinterpret_cast<const Vec*>(&acc[i][j]);
            } else {
#pragma unroll
                for (int jj = 0; jj < R; ++jj)
                    if (col + jj < N) c_row[col + jj] = acc[i][j + jj];
            }
        }
    }
}
