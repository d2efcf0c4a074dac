// Tensor-core rung: Hopper's warpgroup MMA (wgmma, sm_90a) fed by the bulk tensor copy engine (TMA).
//
// What it changes, and why. The FP32 ladder ends at `fast`, near cuBLAS SGEMM on the FMA lanes (66.9 TFLOP/s on
// an H100). The tensor cores do the same product at 495 TFLOP/s in TF32 and 989 in BF16/FP16, but on Hopper only
// through `wgmma`: the older `mma.sync` issues at about half that rate. So this rung:
//   - copies each operand tile global -> shared with one TMA instruction (cp.async.bulk.tensor), which writes it
//     in the 128-byte swizzled layout the tensor cores read without bank conflicts, zero-fills past the matrix's
//     edges (no bounds checks in the main loop) and signals an mbarrier when the bytes have landed;
//   - lets one warp of a producer warpgroup issue those copies STAGES tiles ahead, while two consumer warpgroups
//     each multiply a 64-row half of the block's 128 x BN tile with `wgmma.mma_async`, operands read straight from
//     shared memory by descriptor, sums in float32 registers;
//   - gives registers to the consumers (setmaxnreg): a 64 x 256 float32 accumulator is 128 registers a thread;
//   - walks the tiles in groups of GROUP_M rows of tiles, so the blocks resident together share their A and B
//     panels in L2.
//
// Operands: A is M x K and B is given as B^T, N x K, both "K-major" (K contiguous), the one layout every input
// type of wgmma takes; kernels/operands.cu writes them so from the float32 operands (converting to bf16 or fp16,
// rounding to TF32, splitting for 3xTF32, or scaling and rounding to e4m3), or from int8 ones as they are, with rows
// padded to 16 bytes as TMA requires. C is M x N row-major, float32 (int32 for int8), written straight from the accumulators.
// TF32's products run in kernels/wgmma_rows.cu, which reads both operands as they lie; the TF32 instance here, fed by
// the passes, is what tests and the benchmark hold it to.
//
// S8 (int8): the integer tensor cores multiply int8 by int8 and sum into int32, exactly (the host rules out an
// overflow: k * 128 * 128 must fit). A row of a tile is still 128 bytes, now 128 elements of K, and one wgmma
// takes 32 of them (k32), so each byte copied feeds twice the products of a 16-bit tile: the same pipeline at
// twice the rate, 1,979 TOPS dense on an H100 against BF16's 989.
//
// E4M3 (FP8): float32 operands scaled per tensor by a power of two and rounded to e4m3 (kernels/operands.cu), then
// multiplied as int8 is, 128 elements of K a tile row and k32 an instruction, into float32 sums. The tensor cores
// keep FP8 sums to fewer bits than float32 (about 14: rounding that grows with K), so, as for SPLIT's big products,
// each tile's products are summed apart and added to the float32 total here, and the sum is scaled back by
// 2^-(e_A + e_B) as it is stored (exact, but where it leaves float32's range).
//
// SPLIT (3xTF32): each operand comes as a big and a small TF32 part, x = big + small. Per tile the consumers
// compute big*big into one accumulator and big*small + small*big into another, and add the two at the end: the
// small products' float32 sums do not round against the big ones' magnitude.

#include "async_copy.cuh"
#include "e4m3_scale.cuh"
#include "tile_order.cuh"
#include "wgmma_common.cuh"

// ------------------------------------------------------------------------------------------------ the kernel

// maps: the TMA tensor maps in global memory, 128 bytes each: A and B^T, or (SPLIT) A's big and small parts and
// B^T's. amax (E4M3 only, else null): the float32 bits of A's and B^T's largest magnitudes, which their scales
// come from. Launched with THREADS threads, a 1-D grid of a block per tile of C (PERSISTENT: a block per SM, or per
// tile where there are fewer), and `smem_bytes<...>()` bytes of dynamic shared memory. The next step, for int8, is
// kernels/wgmma_pingpong.cu.
template <int KIND, int BN, int STAGES, bool SPLIT, bool PERSISTENT = false>
__global__ void __launch_bounds__(THREADS, 1) matmul_wgmma(const unsigned char* __restrict__ maps,
                                                           typename Operand<KIND>::Sum* __restrict__ C, int M, int N,
                                                           int K, const u32* __restrict__ amax) {
    using Op = Operand<KIND>;
    using Sum = typename Op::Sum;
    constexpr int PARTS = SPLIT ? 2 : 1;
    constexpr bool TILE_SUMS = SPLIT || KIND == E4M3;  // each tile's products summed apart, then added here
    // A persistent block's next tile reuses the stages: the kinds that release each stage as its products are done
    // (TILE_SUMS) release them all; the others leave their tile's last stage held.
    static_assert(!PERSISTENT || TILE_SUMS, "a persistent grid for the kinds that sum each tile of K apart");
    constexpr int A_BYTES = BM * ROW_BYTES;
    constexpr int B_BYTES = BN * ROW_BYTES;
    constexpr int STAGE_BYTES = PARTS * (A_BYTES + B_BYTES);
    constexpr int MMAS = Op::tile_k / Op::mma_k;

    extern __shared__ unsigned char shared_raw[];
    unsigned char* shared = aligned_tiles(shared_raw);
    u64* full = reinterpret_cast<u64*>(shared + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;

    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int k_tiles = (K + Op::tile_k - 1) / Op::tile_k;
    const int warpgroup = threadIdx.x / 128;

    init_stage_barriers<STAGES>(full, empty, CONSUMERS * 128);

    // A block multiplies its tiles of C (for_each_tile), a persistent block's producer loading a tile's first stages
    // while the consumers still multiply and store the last one. `stages_before` counts the stages a block's earlier
    // tiles took, so that each stage's barriers keep their phases.
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            auto load_tile = [&](int tile, int stages_before) {
                int tile_m, tile_n;
                tile_of(tile, tiles_m, tiles_n, tile_m, tile_n);
                for (int kt = 0; kt < k_tiles; ++kt) {
                    const int stage = stages_before + kt;  // of the block's stages, over all its tiles
                    const int s = stage % STAGES;
                    if (stage >= STAGES) barrier_wait(&empty[s], ((stage / STAGES) - 1) & 1);
                    load_stage<PARTS, A_BYTES, B_BYTES>(shared + s * STAGE_BYTES, maps, &full[s], kt * Op::tile_k,
                                                        tile_m * BM, tile_n * BN);
                }
            };
            for_each_tile<PERSISTENT>(tiles_m * tiles_n, k_tiles, load_tile);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int half = (warpgroup - 1) * 64 * ROW_BYTES;  // this warpgroup's 64 rows of the A tile
    // E4M3: the operands were scaled by 2^e_A and 2^e_B. Read once, before the tiles: a persistent block that read
    // them after each tile's products would wait out the read between its tiles.
    const int descale = KIND == E4M3 ? -(e4m3_scale_exponent(__uint_as_float(amax[0])) +
                                         e4m3_scale_exponent(__uint_as_float(amax[1])))
                                     : 0;
    auto multiply_tile = [&](int tile, int stages_before) {
        int tile_m, tile_n;
        tile_of(tile, tiles_m, tiles_n, tile_m, tile_n);
        constexpr int SPLIT_REGISTERS = SPLIT ? BN / 2 : 1;
        constexpr int TILE_REGISTERS = TILE_SUMS ? BN / 2 : 1;
        Sum d[BN / 2];
        Sum d_small[SPLIT_REGISTERS];  // SPLIT: big*small + small*big, over all of K
        Sum d_tile[TILE_REGISTERS];    // TILE_SUMS: (big*big) over one tile of K
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] = 0;
#pragma unroll
        for (int i = 0; i < SPLIT_REGISTERS; ++i) d_small[i] = 0;

        for (int kt = 0; kt < k_tiles; ++kt) {
            const int s = (stages_before + kt) % STAGES;
            barrier_wait(&full[s], ((stages_before + kt) / STAGES) & 1);
            const unsigned char* stage = shared + s * STAGE_BYTES;
            const u64 a_big = tile_descriptor(stage + half);
            const u64 b_big = tile_descriptor(stage + PARTS * A_BYTES);
            fence_registers(d);
            if constexpr (SPLIT) fence_registers(d_small);
            if constexpr (TILE_SUMS) fence_registers(d_tile);
            wgmma_fence();
#pragma unroll
            for (int step = 0; step < MMAS; ++step) {
                // a step is 32 bytes along K: 2 in the descriptor's address, which counts 16-byte units
                if constexpr (SPLIT) {
                    const u64 a_small = tile_descriptor(stage + A_BYTES + half);
                    const u64 b_small = tile_descriptor(stage + 2 * A_BYTES + B_BYTES);
                    wgmma<KIND, BN>(d_small, a_big + 2 * step, b_small + 2 * step, 1);
                    wgmma<KIND, BN>(d_small, a_small + 2 * step, b_big + 2 * step, 1);
                    wgmma<KIND, BN>(d_tile, a_big + 2 * step, b_big + 2 * step, step > 0);
                } else if constexpr (TILE_SUMS) {
                    wgmma<KIND, BN>(d_tile, a_big + 2 * step, b_big + 2 * step, step > 0);
                } else {
                    wgmma<KIND, BN>(d, a_big + 2 * step, b_big + 2 * step, 1);
                }
            }
            wgmma_commit();
            fence_registers(d);
            if constexpr (TILE_SUMS) {
                // The tensor cores round their sums toward zero (TF32), or keep fewer bits than float32 (FP8): over
                // all of K that error grows with K (9.6e-6 relative at 4096^3 for 3xTF32, 9x SGEMM's error). So
                // each tile's (big) products are summed apart and added here, rounded to nearest, and the tensor
                // cores' sums stay one tile long. SPLIT's small products' sum is 2^-11 of the big one's, so its bias
                // is not worth the registers.
                if constexpr (SPLIT) fence_registers(d_small);
                fence_registers(d_tile);
                wgmma_wait<0>();
                fence_registers(d_tile);
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) d[i] += d_tile[i];
                barrier_arrive(&empty[s]);
            } else {
                // keep this stage's products running; the previous stage's are done, so it may be refilled
                wgmma_wait<1>();
                if (kt > 0) barrier_arrive(&empty[(stages_before + kt - 1) % STAGES]);
            }
        }
        wgmma_wait<0>();
        fence_registers(d);
        if constexpr (SPLIT) fence_registers(d_small);

        // SPLIT: the small products' sums join the big ones'
        if constexpr (SPLIT) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) d[i] += d_small[i];
        }
        if constexpr (KIND == E4M3) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) d[i] = ldexpf(d[i], descale);
        }
        store_warpgroup_tile<BN>(C, d, tile_m * BM + (warpgroup - 1) * 64, tile_n * BN, M, N);
    };
    for_each_tile<PERSISTENT>(tiles_m * tiles_n, k_tiles, multiply_tile);
}
