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
// int8 up to k = 6144 runs on the second kernel of this file, `matmul_wgmma_pingpong`: a persistent grid whose two
// consumers take whole tiles in turns, one writing its sums while the other multiplies (kernels/tensorcore.py says
// where each is faster).
//
// SPLIT (3xTF32): each operand comes as a big and a small TF32 part, x = big + small. Per tile the consumers
// compute big*big into one accumulator and big*small + small*big into another, and add the two at the end: the
// small products' float32 sums do not round against the big ones' magnitude.

#include "async_copy.cuh"
#include "e4m3_scale.cuh"
#include "tile_order.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

enum OperandKind { BF16 = 0, FP16 = 1, TF32 = 2, S8 = 3, E4M3 = 4 };

constexpr int BM = 128;            // rows of C per block: two consumer warpgroups of 64
constexpr int CONSUMERS = 2;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int ROW_BYTES = 128;     // a tile row: one 128-byte swizzle span of K
constexpr int TENSOR_MAP_BYTES = 128;

template <bool INTEGER> struct Sums { typedef float type; };
template <> struct Sums<true> { typedef int type; };

template <int KIND> struct Operand {
    static constexpr int bytes = KIND == TF32 ? 4 : KIND == S8 || KIND == E4M3 ? 1 : 2;
    static constexpr int tile_k = ROW_BYTES / bytes;   // K per tile: 64 (16-bit), 32 (TF32) or 128 (8-bit)
    static constexpr int mma_k = 32 / bytes;           // K per wgmma: 16, 8 or 32, 32 bytes of a row
    typedef typename Sums<KIND == S8>::type Sum;       // the accumulators' and C's type
};


// ---------------------------------------------------------------------------------------------- mbarriers

__device__ __forceinline__ void barrier_init(u64* barrier, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(count));
}

__device__ __forceinline__ void barrier_expect_bytes(u64* barrier, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void barrier_arrive(u64* barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
}

__device__ __forceinline__ void barrier_wait(u64* barrier, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(shared_address(barrier)),
        "r"(parity)
        : "memory");
}

// -------------------------------------------------------------------------------------- bulk tensor copy

// The box at element (x along K, y along rows) of the tensor `map` describes, into shared memory at `tile`;
// `barrier` counts its bytes when they land.
__device__ __forceinline__ void tma_load(void* tile, const unsigned char* map, u64* barrier, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(shared_address(tile)), "l"(map), "r"(shared_address(barrier)), "r"(x), "r"(y)
        : "memory");
}

// ------------------------------------------------------------------------------------------------ wgmma

// A shared-memory matrix descriptor for a K-major tile of 128-byte rows in the 128-byte swizzle: groups of 8 rows
// 1024 bytes apart (the stride byte offset); the leading byte offset is unused in this layout.
__device__ __forceinline__ u64 tile_descriptor(const void* tile) {
    const u64 address = shared_address(tile);
    return ((address & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<u64>(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving accumulator registers across an asynchronous wgmma.
template <int COUNT> __device__ __forceinline__ void fence_registers(float (&d)[COUNT]) {
#pragma unroll
    for (int i = 0; i < COUNT; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int COUNT> __device__ __forceinline__ void fence_registers(int (&d)[COUNT]) {
#pragma unroll
    for (int i = 0; i < COUNT; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// The accumulator of one warpgroup's 64 x N product: N / 2 float32 registers a thread, in the asm's operand list.
#define WGMMA_D64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_D128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// The accumulators as asm operands, 8 at a time: "f" for float32 sums, "r" for int32 ones.
#define WGMMA_F8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define WGMMA_R8(i) \
    "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), "+r"(d[i + 6]), \
        "+r"(d[i + 7])
#define WGMMA_F64 \
    WGMMA_F8(0), WGMMA_F8(8), WGMMA_F8(16), WGMMA_F8(24), WGMMA_F8(32), WGMMA_F8(40), WGMMA_F8(48), WGMMA_F8(56)
#define WGMMA_F128 \
    WGMMA_F64, WGMMA_F8(64), WGMMA_F8(72), WGMMA_F8(80), WGMMA_F8(88), WGMMA_F8(96), WGMMA_F8(104), WGMMA_F8(112), \
        WGMMA_F8(120)
#define WGMMA_R64 \
    WGMMA_R8(0), WGMMA_R8(8), WGMMA_R8(16), WGMMA_R8(24), WGMMA_R8(32), WGMMA_R8(40), WGMMA_R8(48), WGMMA_R8(56)
#define WGMMA_R128 \
    WGMMA_R64, WGMMA_R8(64), WGMMA_R8(72), WGMMA_R8(80), WGMMA_R8(88), WGMMA_R8(96), WGMMA_R8(104), WGMMA_R8(112), \
        WGMMA_R8(120)
// d = A (64 x K, descriptor a) @ B (K x N, descriptor b, K-major) + (accumulate ? d : 0). The floating-point types
// take the two scales of A and B (1, not negated), and the 16-bit ones two more immediates, the transposes, which
// are 0: both operands are K-major. The integer types take neither.
#define WGMMA_ISSUE(SHAPE, TYPES, LIST, OPERANDS, A, B, P, TAIL)                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\nwgmma.mma_async.sync.aligned." SHAPE "." TYPES \
                 " {" LIST "}, " A ", " B ", p" TAIL ";\n}\n"                                                  \
                 : OPERANDS                                                                                   \
                 : "l"(a), "l"(b), "r"(accumulate))

// The instruction of KIND for a 64 x N warpgroup tile: its REGS = N / 2 accumulators (WGMMA_D and WGMMA_F or
// WGMMA_R of REGS, named by pasting so that they reach WGMMA_ISSUE unexpanded), then the asm operands A, B and P
// (a, b, accumulate).
#define WGMMA_OF_KIND(N, REGS, A, B, P)                                                                          \
    if constexpr (KIND == BF16) {                                                                                \
        WGMMA_ISSUE("m64n" #N "k16", "f32.bf16.bf16", WGMMA_D##REGS, WGMMA_F##REGS, A, B, P, ", 1, 1, 0, 0");    \
    } else if constexpr (KIND == FP16) {                                                                         \
        WGMMA_ISSUE("m64n" #N "k16", "f32.f16.f16", WGMMA_D##REGS, WGMMA_F##REGS, A, B, P, ", 1, 1, 0, 0");      \
    } else if constexpr (KIND == TF32) {                                                                         \
        WGMMA_ISSUE("m64n" #N "k8", "f32.tf32.tf32", WGMMA_D##REGS, WGMMA_F##REGS, A, B, P, ", 1, 1");           \
    } else if constexpr (KIND == E4M3) {                                                                         \
        WGMMA_ISSUE("m64n" #N "k32", "f32.e4m3.e4m3", WGMMA_D##REGS, WGMMA_F##REGS, A, B, P, ", 1, 1");          \
    } else {                                                                                                     \
        WGMMA_ISSUE("m64n" #N "k32", "s32.s8.s8", WGMMA_D##REGS, WGMMA_R##REGS, A, B, P, "");                    \
    }

template <int KIND, int N>
__device__ __forceinline__ void wgmma(typename Operand<KIND>::Sum (&d)[N / 2], u64 a, u64 b, int accumulate) {
    static_assert(N == 128 || N == 256, "a warpgroup tile is 64 x 128 or 64 x 256");
    if constexpr (N == 128) {
        WGMMA_OF_KIND(128, 64, "%64", "%65", "%66")
    } else {
        WGMMA_OF_KIND(256, 128, "%128", "%129", "%130")
    }
}

__device__ __forceinline__ void store_pair(float* out, float first, float second) {
    *reinterpret_cast<float2*>(out) = make_float2(first, second);
}
__device__ __forceinline__ void store_pair(int* out, int first, int second) {
    *reinterpret_cast<int2*>(out) = make_int2(first, second);
}

// Writes a warpgroup's 64 x BN sums into C (M x N, row-major), the tile's corner at (m0, n0), as far as C reaches.
// The accumulator layout of a 64 x BN wgmma: warp w of the warpgroup holds rows 16w..16w+15; lane l holds, for each
// 8 columns j, columns 8j + 2(l % 4) and the next, in rows l / 4 (registers 4j, 4j + 1) and l / 4 + 8 (registers
// 4j + 2, 4j + 3).
template <int BN, typename Sum>
__device__ __forceinline__ void store_warpgroup_tile(Sum* __restrict__ C, const Sum (&d)[BN / 2], int m0, int n0, int M,
                                                     int N) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int row0 = m0 + warp * 16 + lane / 4;
    const int column0 = n0 + 2 * (lane % 4);
    const bool pairs = (N % 2) == 0;  // rows of C start on 8 bytes: two sums per store
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h, column = column0 + 8 * j;
            if (row >= M || column >= N) continue;
            Sum* out = C + static_cast<size_t>(row) * N + column;
            if (pairs && column + 1 < N) {
                store_pair(out, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            } else {
                out[0] = d[4 * j + 2 * h];
                if (column + 1 < N) out[1] = d[4 * j + 2 * h + 1];
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------ the kernel

// maps: the TMA tensor maps in global memory, 128 bytes each: A and B^T, or (SPLIT) A's big and small parts and
// B^T's. amax (E4M3 only, else null): the float32 bits of A's and B^T's largest magnitudes, which their scales
// come from. Launched with THREADS threads, one block per tile of C (1-D grid), and `smem_bytes<...>()` bytes of
// dynamic shared memory.
template <int KIND, int BN, int STAGES, bool SPLIT>
__global__ void __launch_bounds__(THREADS, 1) matmul_wgmma(const unsigned char* __restrict__ maps,
                                                           typename Operand<KIND>::Sum* __restrict__ C, int M, int N,
                                                           int K, const u32* __restrict__ amax) {
    using Op = Operand<KIND>;
    using Sum = typename Op::Sum;
    constexpr int PARTS = SPLIT ? 2 : 1;
    constexpr bool TILE_SUMS = SPLIT || KIND == E4M3;  // each tile's products summed apart, then added here
    constexpr int A_BYTES = BM * ROW_BYTES;
    constexpr int B_BYTES = BN * ROW_BYTES;
    constexpr int STAGE_BYTES = PARTS * (A_BYTES + B_BYTES);
    constexpr int MMAS = Op::tile_k / Op::mma_k;

    extern __shared__ unsigned char shared_raw[];
    // the 128-byte swizzle repeats every 1024 bytes, and the tensor cores expect each tile to start on it
    unsigned char* shared = shared_raw + ((1024 - (shared_address(shared_raw) & 1023)) & 1023);
    u64* full = reinterpret_cast<u64*>(shared + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;

    int tile_m, tile_n;
    tile_of(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, tile_m, tile_n);
    const int m0 = tile_m * BM, n0 = tile_n * BN;
    const int k_tiles = (K + Op::tile_k - 1) / Op::tile_k;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], CONSUMERS * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) barrier_wait(&empty[s], ((kt / STAGES) - 1) & 1);
                unsigned char* stage = shared + s * STAGE_BYTES;
                barrier_expect_bytes(&full[s], STAGE_BYTES);
                const int k0 = kt * Op::tile_k;
                for (int part = 0; part < PARTS; ++part) {
                    tma_load(stage + part * A_BYTES, maps + part * TENSOR_MAP_BYTES, &full[s], k0, m0);
                    tma_load(stage + PARTS * A_BYTES + part * B_BYTES, maps + (PARTS + part) * TENSOR_MAP_BYTES,
                             &full[s], k0, n0);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    constexpr int SPLIT_REGISTERS = SPLIT ? BN / 2 : 1;
    constexpr int TILE_REGISTERS = TILE_SUMS ? BN / 2 : 1;
    Sum d[BN / 2];
    Sum d_small[SPLIT_REGISTERS];  // SPLIT: big*small + small*big, over all of K
    Sum d_tile[TILE_REGISTERS];    // TILE_SUMS: (big*big) over one tile of K
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0;
#pragma unroll
    for (int i = 0; i < SPLIT_REGISTERS; ++i) d_small[i] = 0;

    const int half = (warpgroup - 1) * 64 * ROW_BYTES;  // this warpgroup's 64 rows of the A tile
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        barrier_wait(&full[s], (kt / STAGES) & 1);
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
            // The tensor cores round their sums toward zero (TF32), or keep fewer bits than float32 (FP8): over all
            // of K that error grows with K (9.6e-6 relative at 4096^3 for 3xTF32, 9x SGEMM's error). So each
            // tile's (big) products are summed apart and added here, rounded to nearest, and the tensor cores'
            // sums stay one tile long. SPLIT's small products' sum is 2^-11 of the big one's, so its bias is not
            // worth the registers.
            if constexpr (SPLIT) fence_registers(d_small);
            fence_registers(d_tile);
            wgmma_wait<0>();
            fence_registers(d_tile);
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) d[i] += d_tile[i];
            barrier_arrive(&empty[s]);
        } else {
            // keep this tile's products running; the previous tile's are done, so its stage may be refilled
            wgmma_wait<1>();
            if (kt > 0) barrier_arrive(&empty[(kt - 1) % STAGES]);
        }
    }
    wgmma_wait<0>();
    fence_registers(d);
    if constexpr (SPLIT) fence_registers(d_small);

    // SPLIT: the small products' sums join the big ones'; E4M3: the operands were scaled by 2^e_A and 2^e_B
    if constexpr (SPLIT) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] += d_small[i];
    }
    if constexpr (KIND == E4M3) {
        const int descale = -(e4m3_scale_exponent(__uint_as_float(amax[0])) +
                              e4m3_scale_exponent(__uint_as_float(amax[1])));
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] = ldexpf(d[i], descale);
    }
    store_warpgroup_tile<BN>(C, d, m0 + (warpgroup - 1) * 64, n0, M, N);
}

// ------------------------------------------------------------------------------------ the ping-pong kernel

// Named barriers 1 and 2 (0 is __syncthreads'), 256 threads: a consumer warpgroup arrives, the other waits.
__device__ __forceinline__ void named_barrier_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_barrier_arrive(int id) {
    asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}

// The kernel above writes C while its tensor cores idle: both consumers finish their halves of a tile together, and
// the next block fills its pipeline only after that. For int8, whose products are quick for the bytes of C they
// write (a 128 x 256 tile's 128 KiB of int32 after 1,024 clocks of products a tile of K), that is a fifth of the
// time at 4096^3. Here a grid of one block per SM keeps its producer loading stages across tiles, and the two
// consumers take the block's tiles in turns (ping-pong), each a whole WM x WN tile: while one multiplies, the other
// writes its last tile's sums.
//
// The stages are filled in the order of the block's tiles and their tiles of K. Consumer c takes the block's tiles
// c, c + 2, ..., and begins waiting on a tile's stages only once the other consumer has received every stage of
// the tile before it (named barrier 1 + c). So a stage's `full` barrier is never more than one phase behind the
// consumer that waits on it, which a parity wait needs; and the consumers' products overlap only at the hand-off.
// A consumer's accumulators are WM / 64 warpgroup tiles of 64 x WN: at most 128 registers, so FP8, which also keeps
// each tile's sums apart, stays on the kernel above.
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
    constexpr int STAGE_BYTES = (WM + WN) * ROW_BYTES;
    constexpr int MMAS = Op::tile_k / Op::mma_k;

    extern __shared__ unsigned char shared_raw[];
    unsigned char* shared = shared_raw + ((1024 - (shared_address(shared_raw) & 1023)) & 1023);
    u64* full = reinterpret_cast<u64*>(shared + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;

    const int tiles_m = (M + WM - 1) / WM, tiles_n = (N + WN - 1) / WN;
    const int tiles = tiles_m * tiles_n;
    const int block_tiles = (tiles - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;  // j-th: x + j * grid
    const int k_tiles = (K + Op::tile_k - 1) / Op::tile_k;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], 128);  // released by the one consumer that read it
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

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
                    unsigned char* stage = shared + s * STAGE_BYTES;
                    barrier_expect_bytes(&full[s], STAGE_BYTES);
                    tma_load(stage, maps, &full[s], kt * Op::tile_k, tile_m * WM);
                    tma_load(stage + A_BYTES, maps + TENSOR_MAP_BYTES, &full[s], kt * Op::tile_k, tile_n * WN);
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
        if (j > 0) named_barrier_sync(1 + consumer);
        int it = j * k_tiles;
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
            const int s = it % STAGES;
            barrier_wait(&full[s], (it / STAGES) & 1);
            if (kt == k_tiles - 1 && j + 1 < block_tiles) named_barrier_arrive(2 - consumer);  // the other's turn
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
