// Tensor-core rung, TF32 from the operands as they lie: no pass over A or B before the product.
//
// What it changes, and why. wgmma.cu's TF32 instance reads A and B^T, K-major, written by kernels/operands.cu's
// passes (A rounded to TF32; B transposed and rounded). At 4096^3 on an H200 the product alone ran 1.01 of cuBLAS
// TF32 and the two passes took 0.076 ms of the call's 0.42, leaving it at 0.83 (docs/tensor-cores.md). This kernel
// reads both where they lie:
//   - The rounding is the copy engine's: a tensor map whose data type is TFLOAT32 rounds each float32 to TF32 as
//     TMA writes it into shared memory, to nearest, ties to even (tests/kernels/test_tensor_core_gpu.py holds it to
//     the passes' rounding, bit for bit). Without that type the tensor cores would truncate what they read, an error
//     of one sign that grows with k past TF32's bound.
//   - wgmma takes a TF32 operand from shared memory K-major only, which A's tile is as it lies and B's is not. But
//     its first operand may come from registers, in any layout. So a block computes a 128 x BN tile of
//     C^T = B^T A^T: B^T's fragments loaded by each consumer thread from B's tile (K rows of 128 columns of B) in
//     shared memory, A's tile (BN rows of A) the shared-memory operand, and the sums stored transposed, into C.
//
// B's tile lies in boxes of 32 columns (one 128-byte row of the swizzle for each k), its 16-byte units swizzled by
// the row (k % 8). Thread (g = lane / 4, t = lane % 4) of a warp loads the fragment's rows g and g + 8 as one 8-byte
// pair of B's columns n and n + 1 (for k = t and t + 4): which columns a warp's rows are is free (its sums' rows are
// then those columns of C), so they are chosen for the banks (`columns_of_b`).
//
// Each consumer loads a stage's fragments once its previous stage's products are done; the other consumer's products
// keep the tensor cores busy meanwhile (loading them earlier, into a second set of registers, was no faster:
// docs/tensor-cores.md). An operand whose rows are not whole 16-byte units, as TMA needs them, is copied first into
// padded rows (kernels/operands.cu), not transposed.

#include "async_copy.cuh"
#include "tile_order.cuh"
#include "wgmma_common.cuh"

constexpr int TF32_K = Operand<TF32>::tile_k;  // K per stage: 32
constexpr int TF32_MMAS = TF32_K / Operand<TF32>::mma_k;
constexpr int BOX_BYTES = TF32_K * ROW_BYTES;  // 32 columns of B by a stage's rows of K

// d = A (64 x 8, four TF32 registers a thread in wgmma's fragment layout) @ B (8 x 256, descriptor b, K-major) + d.
__device__ __forceinline__ void wgmma_tf32_registers(float (&d)[128], const u32 (&a)[4], u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {" WGMMA_D128 "}, "
                 "{%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
                 : WGMMA_F128
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Which of B's columns the fragment rows g and g + 8 of warp `warp` in consumer `consumer` are: n and n + 1, n in
// box `box` (of the block's four) at word 4 * unit + word of its row, before the swizzle. A quarter-warp's four
// threads read one row of B (one k) at units u and u + 4, which no two rows' swizzles (k ^ k' < 4) bring together,
// so a half-warp's sixteen 8-byte loads fall in 32 distinct banks.
struct ColumnsOfB {
    int box;
    int unit;
    int word;
    __device__ __forceinline__ int column() const { return 32 * box + 4 * unit + word; }
};

__device__ __forceinline__ ColumnsOfB columns_of_b(int consumer, int warp, int g) {
    ColumnsOfB at;
    at.box = 2 * consumer + warp / 2;
    at.unit = 2 * (warp % 2) + g / 4 + 4 * ((g / 2) % 2);
    at.word = 2 * (g % 2);
    return at;
}

// maps: the TMA tensor maps in global memory, 128 bytes each, both of TFLOAT32 elements: B (K rows of N, boxes of
// 32 x 32) and A (M rows of K, boxes of BN rows of 32), their rows whole 16-byte units (copied, padded, where the
// operands' own are not). C: M x N, row-major. Launched with THREADS threads, a 1-D grid of a block per 128 x BN
// tile of C^T (128 of N by BN of M), and `smem_bytes()` bytes of dynamic shared memory.
template <int BN, int STAGES>
__global__ void __launch_bounds__(THREADS, 1) matmul_wgmma_rows(const unsigned char* __restrict__ maps,
                                                                float* __restrict__ C, int M, int N, int K) {
    static_assert(BN == 256, "a consumer's 64 x 256 float32 sums are 128 registers a thread");
    constexpr int B_BYTES = BM * ROW_BYTES;  // B's tile: BM / 32 boxes
    constexpr int A_BYTES = BN * ROW_BYTES;
    constexpr int STAGE_BYTES = B_BYTES + A_BYTES;
    static_assert((BM / 32) * BOX_BYTES == B_BYTES, "B's boxes fill its part of a stage");

    extern __shared__ unsigned char shared_raw[];
    unsigned char* shared = aligned_tiles(shared_raw);
    u64* full = reinterpret_cast<u64*>(shared + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;

    int tile_n, tile_m;  // the tile of C^T: rows n0.. of N, columns m0.. of M
    tile_of(blockIdx.x, (N + BM - 1) / BM, (M + BN - 1) / BN, tile_n, tile_m);
    const int n0 = tile_n * BM, m0 = tile_m * BN;
    const int k_tiles = (K + TF32_K - 1) / TF32_K;
    const int warpgroup = threadIdx.x / 128;

    init_stage_barriers<STAGES>(full, empty, CONSUMERS * 128);

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) barrier_wait(&empty[s], ((kt / STAGES) - 1) & 1);
                unsigned char* stage = shared + s * STAGE_BYTES;
                barrier_expect_bytes(&full[s], STAGE_BYTES);
                const int k0 = kt * TF32_K;
                for (int box = 0; box < BM / 32; ++box)
                    tma_load(stage + box * BOX_BYTES, maps, &full[s], n0 + 32 * box, k0);
                tma_load(stage + B_BYTES, maps + TENSOR_MAP_BYTES, &full[s], k0, m0);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const ColumnsOfB at = columns_of_b(warpgroup - 1, warp, lane / 4);
    int fragment_at[2];  // where in a stage the pair of B's rows t + 4q (k % 8) lies
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int k = lane % 4 + 4 * q;
        fragment_at[q] = at.box * BOX_BYTES + k * ROW_BYTES + ((at.unit ^ k) << 4) + 4 * at.word;
    }

    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
    u32 fragments[TF32_MMAS][4];
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        barrier_wait(&full[s], (kt / STAGES) & 1);
        const unsigned char* stage = shared + s * STAGE_BYTES;
#pragma unroll
        for (int step = 0; step < TF32_MMAS; ++step) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                // a step is 8 rows of K: 8 * 128 bytes of each box
                const uint2 pair = *reinterpret_cast<const uint2*>(stage + fragment_at[q] + step * 8 * ROW_BYTES);
                fragments[step][2 * q] = pair.x;      // fragment row g: B's column n
                fragments[step][2 * q + 1] = pair.y;  // row g + 8: column n + 1
            }
        }
        const u64 a_tile = tile_descriptor(stage + B_BYTES);
        fence_registers(d);
        wgmma_fence();
#pragma unroll
        for (int step = 0; step < TF32_MMAS; ++step) wgmma_tf32_registers(d, fragments[step], a_tile + 2 * step);
        wgmma_commit();
        fence_registers(d);
        wgmma_wait<0>();
        fence_registers(d);
        barrier_arrive(&empty[s]);
    }

    // The sums' layout (wgmma_common.cuh's store_warpgroup_tile): lane l holds, for each 8 columns j of the tile (M
    // here), columns 8j + 2(l % 4) and the next, in its rows g (registers 4j, 4j + 1) and g + 8 (4j + 2, 4j + 3),
    // which are C's columns n and n + 1: so each register pair of a column is one 8-byte store into a row of C where
    // its rows start on 8 bytes (N even; n is, so n + 1 < N too).
    const int n = n0 + at.column();
    if (n >= N) return;
    const bool pairs = N % 2 == 0;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int v = 0; v < 2; ++v) {
            const int m = m0 + 8 * j + 2 * (lane % 4) + v;
            if (m >= M) continue;
            float* out = C + static_cast<size_t>(m) * N + n;
            if (pairs) {
                store_pair(out, d[4 * j + v], d[4 * j + 2 + v]);
            } else {
                out[0] = d[4 * j + v];
                if (n + 1 < N) out[1] = d[4 * j + 2 + v];
            }
        }
    }
}
