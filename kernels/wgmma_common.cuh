// What kernels/wgmma.cu and kernels/wgmma_pingpong.cu share: the operand kinds and tile geometry, the mbarriers
// of the stage ring, the bulk tensor copies that fill it, the wgmma instructions that read it, and the stores of a
// warpgroup's sums. Included after async_copy.cuh (shared_address).
#ifndef MATMUL_WGMMA_COMMON_CUH
#define MATMUL_WGMMA_COMMON_CUH

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
#define WGMMA_D88 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87"
#define WGMMA_D96 WGMMA_D88 ", %88, %89, %90, %91, %92, %93, %94, %95"
#define WGMMA_D104 WGMMA_D96 ", %96, %97, %98, %99, %100, %101, %102, %103"
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
#define WGMMA_F88 WGMMA_F64, WGMMA_F8(64), WGMMA_F8(72), WGMMA_F8(80)
#define WGMMA_F96 WGMMA_F88, WGMMA_F8(88)
#define WGMMA_F104 WGMMA_F96, WGMMA_F8(96)
#define WGMMA_R64 \
    WGMMA_R8(0), WGMMA_R8(8), WGMMA_R8(16), WGMMA_R8(24), WGMMA_R8(32), WGMMA_R8(40), WGMMA_R8(48), WGMMA_R8(56)
#define WGMMA_R88 WGMMA_R64, WGMMA_R8(64), WGMMA_R8(72), WGMMA_R8(80)
#define WGMMA_R96 WGMMA_R88, WGMMA_R8(88)
#define WGMMA_R104 WGMMA_R96, WGMMA_R8(96)
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
    static_assert(N == 128 || N == 176 || N == 192 || N == 208 || N == 256,
                  "a warpgroup tile is 64 x 128, 64 x 176, 64 x 192, 64 x 208 or 64 x 256");
    if constexpr (N == 128) {
        WGMMA_OF_KIND(128, 64, "%64", "%65", "%66")
    } else if constexpr (N == 176) {
        WGMMA_OF_KIND(176, 88, "%88", "%89", "%90")
    } else if constexpr (N == 192) {
        WGMMA_OF_KIND(192, 96, "%96", "%97", "%98")
    } else if constexpr (N == 208) {
        WGMMA_OF_KIND(208, 104, "%104", "%105", "%106")
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

// The dynamic shared memory from its first 1024-byte boundary: the 128-byte swizzle repeats every 1024 bytes, and
// the tensor cores expect each tile to start on it (the launch asks for ALIGNMENT_SLACK more).
__device__ __forceinline__ unsigned char* aligned_tiles(unsigned char* shared_raw) {
    return shared_raw + ((1024 - (shared_address(shared_raw) & 1023)) & 1023);
}

// Thread 0 makes each stage's mbarriers: `full` completes when one arrival and the stage's bytes have come, `empty`
// when `releases` consumer threads have let go of it; the whole block waits until they exist.
template <int STAGES> __device__ __forceinline__ void init_stage_barriers(u64* full, u64* empty, u32 releases) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], releases);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// Copies a stage: PARTS tiles of A (A_BYTES each, rows from a_row) then PARTS of B^T (rows from b_row), K from k0,
// the maps in that order; `full` counts every byte.
template <int PARTS, int A_BYTES, int B_BYTES>
__device__ __forceinline__ void load_stage(unsigned char* stage, const unsigned char* maps, u64* full, int k0,
                                           int a_row, int b_row) {
    barrier_expect_bytes(full, PARTS * (A_BYTES + B_BYTES));
    for (int part = 0; part < PARTS; ++part) {
        tma_load(stage + part * A_BYTES, maps + part * TENSOR_MAP_BYTES, full, k0, a_row);
        tma_load(stage + PARTS * A_BYTES + part * B_BYTES, maps + (PARTS + part) * TENSOR_MAP_BYTES, full, k0, b_row);
    }
}

#endif  // MATMUL_WGMMA_COMMON_CUH
