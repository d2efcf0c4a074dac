// Tensor-core rung, int8's next step: the kernel of kernels/wgmma.cu as a persistent grid whose two consumer
// warpgroups take whole tiles in turns ("ping-pong"), so that one writes its sums while the other multiplies.
//
// What it changes, and why it is faster. wgmma.cu's kernel writes C while its tensor cores idle: both consumers
// finish their halves of a tile together, and the next block fills its pipeline only after that. For int8, whose
// products are quick for the bytes of C they write (a 128 x 256 tile's 128 KiB of int32 after 1,024 clocks of
// products a tile of K), that is a fifth of the time at 4096^3. Here a grid of one block per SM keeps its producer
// loading stages across the block's tiles, and consumer c takes the block's tiles c, c + 2, ..., each a whole
// WM x WN tile, so that the epilogue of one overlaps the products of the other. The cost: a consumer's tile is
// 128 x 128 (its 128 int32 sums a thread; 128 x 256 would need 256), which copies a third more operand bytes per
// product than wgmma.cu's 128 x 256 tiles; the longer k, the more that weighs against the epilogue it hides, so
// kernels/tensorcore.py runs this kernel up to a k it measured and wgmma.cu's past it.
//
// Synchronization. The stages are filled in the order of the block's tiles and their tiles of K; each stage is read
// by one consumer, which releases it. A consumer begins waiting on a tile's stages only once the other has received
// every stage of the tile before it (`hand_off`). So no consumer waits on a stage's `full` barrier while an earlier
// use of that stage is still pending, which a parity wait could not tell from the use it wants; and the consumers'
// products overlap only around the hand-off.

#include "async_copy.cuh"
#include "tile_order.cuh"
#include "wgmma_common.cuh"

// The hand-off between the consumers: named barrier 1 + c (0 is __syncthreads') is consumer c's turn, which the
// other consumer gives (bar.arrive) and c takes (bar.sync), 256 threads in all. Immediate barrier numbers, so that
// the kernel reserves two hardware barriers, not all sixteen.
__device__ __forceinline__ void hand_off(int from) {
    if (from == 0) {
        asm volatile("bar.arrive 2, 256;" ::: "memory");
    } else {
        asm volatile("bar.arrive 1, 256;" ::: "memory");
    }
}
__device__ __forceinline__ void hand_off_wait(int to) {
    if (to == 0) {
        asm volatile("bar.sync 1, 256;" ::: "memory");
    } else {
        asm volatile("bar.sync 2, 256;" ::: "memory");
    }
}

// maps: the TMA tensor maps of A and B^T in global memory (boxes of WM and WN rows). Launched with THREADS threads,
// min(tiles, SMs) blocks, and `smem_bytes()` bytes of dynamic shared memory; K >= 1 (the host answers k = 0 itself:
// with no tile of K the stage counters would go below zero).
template <int KIND, int WM, int WN, int STAGES>
__global__ void __launch_bounds__(THREADS, 1) matmul_wgmma_pingpong(const unsigned char* __restrict__ maps,
                                                                    typename Operand<KIND>::Sum* __restrict__ C,
                                                                    int M, int N, int K) {
    using Op = Operand<KIND>;
    using Sum = typename Op::Sum;
    static_assert(KIND != E4M3, "FP8's tile sums need twice the accumulators");
    static_assert(WM == 64 || WM == 128, "a consumer's tile is one or two warpgroup tiles high");
    constexpr int SUB = WM / 64;
    static_assert(SUB * WN / 2 <= 128, "a consumer's accumulators fit in 128 registers");
    constexpr int A_BYTES = WM * ROW_BYTES;
    constexpr int B_BYTES = WN * ROW_BYTES;
    constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    constexpr int MMAS = Op::tile_k / Op::mma_k;

    extern __shared__ unsigned char shared_raw[];
    unsigned char* shared = aligned_tiles(shared_raw);
    u64* full = reinterpret_cast<u64*>(shared + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;

    const int tiles_m = (M + WM - 1) / WM, tiles_n = (N + WN - 1) / WN;
    const int tiles = tiles_m * tiles_n;
    const int block_tiles = (tiles - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;  // j-th: x + j * grid
    const int k_tiles = (K + Op::tile_k - 1) / Op::tile_k;
    const int warpgroup = threadIdx.x / 128;

    init_stage_barriers<STAGES>(full, empty, 128);  // released by the one consumer that read it

    // `it` counts the stages the block's tiles fill, in order: the j-th tile's are j * k_tiles onwards
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            int it = 0;
            for (int j = 0; j < block_tiles; ++j) {
                int tile_m, tile_n;
                tile_of(blockIdx.x + j * gridDim.x, tiles_m, tiles_n, tile_m, tile_n);
                for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                    const int s = it % STAGES;
                    if (it >= STAGES) barrier_wait(&empty[s], ((it / STAGES) - 1) & 1);
                    load_stage<1, A_BYTES, B_BYTES>(shared + s * STAGE_BYTES, maps, &full[s], kt * Op::tile_k,
                                                    tile_m * WM, tile_n * WN);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;
    for (int j = consumer; j < block_tiles; j += 2) {
        int tile_m, tile_n;
        tile_of(blockIdx.x + j * gridDim.x, tiles_m, tiles_n, tile_m, tile_n);
        Sum d[SUB][WN / 2];
#pragma unroll
        for (int h = 0; h < SUB; ++h) {
#pragma unroll
            for (int i = 0; i < WN / 2; ++i) d[h][i] = 0;
        }
        if (j > 0) hand_off_wait(consumer);
        int it = j * k_tiles;
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
            const int s = it % STAGES;
            barrier_wait(&full[s], (it / STAGES) & 1);
            if (kt == k_tiles - 1 && j + 1 < block_tiles) hand_off(consumer);  // the other's turn
            const unsigned char* stage = shared + s * STAGE_BYTES;
            const u64 b = tile_descriptor(stage + A_BYTES);
#pragma unroll
            for (int h = 0; h < SUB; ++h) fence_registers(d[h]);
            wgmma_fence();
#pragma unroll
            for (int step = 0; step < MMAS; ++step) {
#pragma unroll
                for (int h = 0; h < SUB; ++h) {
                    const u64 a = tile_descriptor(stage + h * 64 * ROW_BYTES);
                    wgmma<KIND, WN>(d[h], a + 2 * step, b + 2 * step, 1);
                }
            }
            wgmma_commit();
#pragma unroll
            for (int h = 0; h < SUB; ++h) fence_registers(d[h]);
            // keep this tile of K's products running; the one before is done, so its stage may be refilled
            wgmma_wait<1>();
            if (kt > 0) barrier_arrive(&empty[(it - 1) % STAGES]);
        }
        wgmma_wait<0>();
#pragma unroll
        for (int h = 0; h < SUB; ++h) fence_registers(d[h]);
        barrier_arrive(&empty[(it - 1) % STAGES]);
#pragma unroll
        for (int h = 0; h < SUB; ++h) store_warpgroup_tile<WN>(C, d[h], tile_m * WM + h * 64, tile_n * WN, M, N);
    }
}
