// Tensor-core rung 1: warp-level `mma.sync` in TF32, BF16 and FP16, and int8 into exact int32 sums, from swizzled
// shared memory. Every instruction here exists from compute capability 8.0 on, so this is the tensor-core rung of
// GPUs other than Hopper too (kernels/tensorcore.py compiles it for the device's own generation).
//
// What it changes over `fast`, and why. `fast` multiplies on the FMA lanes, one multiply-add per lane and
// instruction. `mma.sync` gives the same product to the tensor cores a warp at a time: one m16n8k16 (BF16, FP16)
// is 2,048 multiply-adds, one m16n8k8 (TF32) 1,024, with float32 sums. What stays: a block computes a 128 x BN
// tile of C with 8 warps (2 x 4, each 64 x BN/4) and STAGES tiles in flight through cp.async, one barrier a step.
// What is new:
//   - Operands arrive K-major in the compute type (kernels/operands.cu converts them: A as it is, B transposed to
//     N x K, rows padded to 16 bytes), the layout `mma.sync`'s row.col form reads; a tile row is 128 bytes of K.
//   - Fragments are read with `ldmatrix`, which loads four 8 x 16-byte matrices across a warp in one instruction
//     and hands each lane exactly the elements the instruction wants from it. Read straight, eight rows of 128
//     bytes would all fall on the same banks; the copies store each row's 16-byte units XORed with the row's low
//     three bits, so the eight rows an ldmatrix reads lie in eight different bank groups.
//   - The four kinds share every byte of this: per 32 bytes of K, one instruction takes four registers of A and
//     two of B whether they hold 8 16-bit values, 4 TF32 ones or 16 int8 ones (m16n8k32: each register four int8 of
//     K where the 16-bit kinds hold two), and ldmatrix, working in bytes, fills them alike. Only the instruction's
//     types and K differ, and int8's sums and C are int32 (k * 128 * 128 must fit: the host checks).
//   - The edge of K: a copy takes only the bytes before K and fills the rest of its 16-byte unit with zeros (the
//     padding of a converted row holds whatever memory held), and rows past M or N are zero-filled whole.
//
// On Hopper `mma.sync` is the legacy path: `wgmma` (kernels/wgmma.cu) issues the tensor cores at about twice its
// rate. docs/tensor-cores.md has the prediction and the measurement.
//
// Launched with 256 threads, a 1-D grid of one block per tile of C (in tile_order.cuh's order), and
// mma_smem_bytes<...>() bytes of dynamic shared memory.

#include "async_copy.cuh"
#include "tile_order.cuh"

typedef unsigned int u32;

enum MmaKind { MMA_BF16 = 0, MMA_FP16 = 1, MMA_TF32 = 2, MMA_S8 = 3 };

// The sums' and C's type: int32 for int8 operands, float32 otherwise.
template <int KIND> struct MmaSum { typedef float type; };
template <> struct MmaSum<MMA_S8> { typedef int type; };

constexpr int MMA_BM = 128;
constexpr int MMA_ROW_BYTES = 128;  // K per tile row: 64 16-bit values, 32 TF32 or 128 int8
constexpr int MMA_WARPS_M = 2, MMA_WARPS_N = 4;
constexpr int MMA_THREADS = 32 * MMA_WARPS_M * MMA_WARPS_N;
constexpr int UNITS = MMA_ROW_BYTES / 16;  // 16-byte units in a tile row

template <int BN, int STAGES>
__host__ __device__ constexpr int mma_smem_bytes() {
    return STAGES * (MMA_BM + BN) * MMA_ROW_BYTES;
}

// Byte offset of 16-byte unit `unit` of row `row` in a tile: units XORed with the row's low three bits.
__device__ __forceinline__ u32 swizzled(int row, int unit) {
    return row * MMA_ROW_BYTES + ((unit ^ (row & 7)) << 4);
}

__device__ __forceinline__ void load_matrices(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// c (16 x 8 sums: c[0..1] row g, c[2..3] row g + 8) += a (16 x 32 bytes of K) * b (32 bytes of K x 8)
template <int KIND>
__device__ __forceinline__ void mma(typename MmaSum<KIND>::type (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (KIND == MMA_S8) {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else if constexpr (KIND == MMA_BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else if constexpr (KIND == MMA_FP16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// A: M x K, Bt: N x K, each row `ld` elements of ELEMENT_BYTES (a multiple of 16 bytes); C: M x N float32 (int32
// for int8).
template <int KIND, int BN, int STAGES>
__global__ void __launch_bounds__(MMA_THREADS, 1)
    matmul_mma(const unsigned char* __restrict__ A, const unsigned char* __restrict__ Bt,
               typename MmaSum<KIND>::type* __restrict__ C, int M, int N, int K, int ld) {
    using Sum = typename MmaSum<KIND>::type;
    constexpr int ELEMENT_BYTES = KIND == MMA_TF32 ? 4 : KIND == MMA_S8 ? 1 : 2;
    constexpr int A_BYTES = MMA_BM * MMA_ROW_BYTES;
    constexpr int STAGE_BYTES = (MMA_BM + BN) * MMA_ROW_BYTES;
    constexpr int WM = MMA_BM / MMA_WARPS_M, WN = BN / MMA_WARPS_N;
    constexpr int FM = WM / 16, FN = WN / 8;  // 16 x 8 blocks of a warp's tile
    constexpr int A_COPIES = MMA_BM * UNITS / MMA_THREADS;
    constexpr int B_COPIES = BN * UNITS / MMA_THREADS;
    static_assert(FN % 2 == 0, "one ldmatrix.x4 reads B for two blocks of 8 columns");

    extern __shared__ __align__(128) unsigned char shared[];
    const u32 shared_base = shared_address(shared);

    int tile_m, tile_n;
    tile_of(blockIdx.x, (M + MMA_BM - 1) / MMA_BM, (N + BN - 1) / BN, tile_m, tile_n);
    const int m0 = tile_m * MMA_BM, n0 = tile_n * BN;
    const int tid = threadIdx.x;
    const size_t row_bytes = static_cast<size_t>(ld) * ELEMENT_BYTES;
    const int k_bytes = K * ELEMENT_BYTES;

    // Copy i of a thread is unit (tid + i * THREADS) of the tile, row-major: eight threads read one 128-byte row.
    auto issue_tile = [&](int stage, int step) {
        const int byte0 = step * MMA_ROW_BYTES;
        unsigned char* const tile = shared + stage * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < A_COPIES + B_COPIES; ++i) {
            const bool is_a = i < A_COPIES;
            const int copy = is_a ? tid + i * MMA_THREADS : tid + (i - A_COPIES) * MMA_THREADS;
            const int row = copy / UNITS, unit = copy % UNITS;
            const int first = is_a ? m0 + row : n0 + row;
            const int byte = byte0 + unit * 16;
            const int bytes = (first < (is_a ? M : N)) ? max(0, min(16, k_bytes - byte)) : 0;
            const unsigned char* src = is_a ? A : Bt;
            if (bytes > 0) src += first * row_bytes + byte;
            copy_async_prefix(tile + (is_a ? 0 : A_BYTES) + swizzled(row, unit), src, bytes);
        }
    };

    const int warp = tid / 32, lane = tid % 32;
    const int wm = (warp / MMA_WARPS_N) * WM, wn = (warp % MMA_WARPS_N) * WN;
    // The row and 16-byte unit (of the two a step reads) whose address this lane gives ldmatrix: for A, matrices
    // 0-3 are rows 0-7 / 8-15 of the first unit, then of the second; for B, rows 0-7 of both units, then rows 8-15.
    const int a_row = wm + (lane & 15), a_unit = lane >> 4;
    const int b_row = wn + (lane & 7) + ((lane >> 4) << 3), b_unit = (lane >> 3) & 1;

    Sum acc[FM][FN][4] = {};

    pipelined_k_loop<STAGES>((k_bytes + MMA_ROW_BYTES - 1) / MMA_ROW_BYTES, issue_tile, [&](int stage) {
        const u32 a_tile = shared_base + stage * STAGE_BYTES;
        const u32 b_tile = a_tile + A_BYTES;
#pragma unroll
        for (int ks = 0; ks < UNITS / 2; ++ks) {  // 32 bytes of K a step
            u32 a[FM][4], b[FN][2];
#pragma unroll
            for (int i = 0; i < FM; ++i) load_matrices(a[i], a_tile + swizzled(a_row + 16 * i, 2 * ks + a_unit));
#pragma unroll
            for (int j = 0; j < FN; j += 2) {
                u32 r[4];
                load_matrices(r, b_tile + swizzled(b_row + 8 * j, 2 * ks + b_unit));
                b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < FM; ++i) {
#pragma unroll
                for (int j = 0; j < FN; ++j) mma<KIND>(acc[i][j], a[i], b[j][0], b[j][1]);
            }
        }
    });

    // Epilogue: block (i, j) holds C[wm + 16 i + g + 8 h][wn + 8 j + 2 t + e] in acc[i][j][2 h + e].
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < FM; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm + 16 * i + g + 8 * h;
            if (row >= M) continue;
            Sum* c_row = C + static_cast<size_t>(row) * N;
#pragma unroll
            for (int j = 0; j < FN; ++j) {
                const int col = n0 + wn + 8 * j + 2 * t;
                if (col < N) c_row[col] = acc[i][j][2 * h];
                if (col + 1 < N) c_row[col + 1] = acc[i][j][2 * h + 1];
            }
        }
    }
}
