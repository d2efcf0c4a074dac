// The operands as the tensor-core kernels read them, made from the operands as sent in one pass each.
//
// kernels/wgmma.cu reads A (M x K) and B^T (N x K) "K-major", in the kernel's input type, with rows padded to 16
// bytes (the bulk tensor copy's stride rule; the padding is never read). These kernels write them: A row by row,
// B transposed through 32 x 32 tiles of shared memory so that both the reads and the writes stay coalesced. The
// conversions from float32 are the ones kernels/precision.py defines, bit for bit: round to nearest even into
// bfloat16, into float16 (cvt.rn), or into TF32 (kept in 32 bits), or the TF32 split x = big + small with the small
// part rounded to TF32 as well. NaN and infinities pass through unchanged. int8 operands are copied as they are.
//
// FP8 (TO_E4M3): each operand is multiplied by the power of two 2^e that brings its largest magnitude into (224,
// 448] (e4m3_scale.cuh; `largest_magnitude` measures it first), exactly, then rounded to nearest e4m3 (cvt.rn, even
// on ties; below 2^-6 onto the subnormals' grid of 2^-9). The largest magnitude then rounds to at most 448, e4m3's
// largest finite value, so no element can leave the range: the conversion's saturation is never reached. The
// operands reaching it are finite (the engine refuses NaN and infinities in fp8 before any of this runs).

#include "e4m3_scale.cuh"

typedef unsigned int u32;
typedef unsigned short u16;

enum Conversion { TO_BF16 = 0, TO_FP16 = 1, TO_TF32 = 2, SPLIT_TF32 = 3, COPY_S8 = 4, TO_E4M3 = 5 };

// What a conversion reads: float32, or int8 for the copy.
template <int CONVERSION> struct Source { typedef float type; };
template <> struct Source<COPY_S8> { typedef signed char type; };

__device__ __forceinline__ bool finite_bits(u32 u) { return (u & 0x7f800000u) != 0x7f800000u; }

// float32 bits with the lowest `dropped` fraction bits rounded away, to nearest, ties to even
template <int DROPPED> __device__ __forceinline__ u32 round_bits(u32 u) {
    if (!finite_bits(u)) return u;
    constexpr u32 half = (1u << (DROPPED - 1)) - 1u;
    return (u + half + ((u >> DROPPED) & 1u)) & ~((1u << DROPPED) - 1u);
}

__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(round_bits<13>(__float_as_uint(x))); }

// x * 2^exponent rounded to nearest e4m3, as its 8 bits.
__device__ __forceinline__ unsigned char to_e4m3(float x, int exponent) {
    u16 pair;  // the first source goes to the upper byte, the second to the lower one
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(ldexpf(x, exponent)));
    return static_cast<unsigned char>(pair & 0xff);
}

// What a conversion writes per element: bf16 and fp16 bits, TF32 in a float32 (the split's parts too), int8, or
// e4m3 bits.
template <int CONVERSION> struct Stored { typedef u16 type; };
template <> struct Stored<TO_TF32> { typedef float type; };
template <> struct Stored<SPLIT_TF32> { typedef float type; };
template <> struct Stored<COPY_S8> { typedef signed char type; };
template <> struct Stored<TO_E4M3> { typedef unsigned char type; };

// x converted (the big part, for the split); `exponent` is the operand's scale for TO_E4M3.
template <int CONVERSION>
__device__ __forceinline__ typename Stored<CONVERSION>::type converted(typename Source<CONVERSION>::type x,
                                                                       int exponent) {
    if constexpr (CONVERSION == COPY_S8) {
        return x;
    } else if constexpr (CONVERSION == TO_E4M3) {
        return to_e4m3(x, exponent);
    } else if constexpr (CONVERSION == TO_BF16) {
        return static_cast<u16>(round_bits<16>(__float_as_uint(x)) >> 16);
    } else if constexpr (CONVERSION == TO_FP16) {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    } else {
        return round_tf32(x);
    }
}

// Element `i` of the converted operand (and of its small part, for the split) from the value x.
template <int CONVERSION>
__device__ __forceinline__ void put(void* big, void* small, size_t i, typename Source<CONVERSION>::type x,
                                    int exponent) {
    const auto value = converted<CONVERSION>(x, exponent);
    static_cast<typename Stored<CONVERSION>::type*>(big)[i] = value;
    if constexpr (CONVERSION == SPLIT_TF32) static_cast<float*>(small)[i] = round_tf32(x - value);
}

// Four consecutive elements, read or written with one vector access.
template <typename T> struct alignas(4 * sizeof(T)) Four { T v[4]; };

// Elements i..i+3 of the converted operand (i a multiple of 4) from four consecutive values, one store per part.
template <int CONVERSION>
__device__ __forceinline__ void put_four(void* big, void* small, size_t i, Four<typename Source<CONVERSION>::type> x,
                                         int exponent) {
    using Out = typename Stored<CONVERSION>::type;
    Four<Out> values;
#pragma unroll
    for (int j = 0; j < 4; ++j) values.v[j] = converted<CONVERSION>(x.v[j], exponent);
    reinterpret_cast<Four<Out>*>(static_cast<Out*>(big) + i)[0] = values;
    if constexpr (CONVERSION == SPLIT_TF32) {
        Four<float> rest;
#pragma unroll
        for (int j = 0; j < 4; ++j) rest.v[j] = round_tf32(x.v[j] - values.v[j]);
        reinterpret_cast<Four<float>*>(static_cast<float*>(small) + i)[0] = rest;
    }
}

// The scale exponent of an operand whose largest magnitude's float32 bits `amax` holds (TO_E4M3; 0 for the others,
// whose `amax` is null).
template <int CONVERSION> __device__ __forceinline__ int scale_exponent(const u32* amax) {
    if constexpr (CONVERSION == TO_E4M3) return e4m3_scale_exponent(__uint_as_float(*amax));
    return 0;
}

// x: rows x cols, row-major -> out[r * ld + c]. Block (256, 1), grid (ceil(cols / 256), any).
template <int CONVERSION>
__global__ void convert_rows(const typename Source<CONVERSION>::type* __restrict__ x, void* big, void* small,
                             int rows, int cols, int ld, const u32* __restrict__ amax) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const int exponent = scale_exponent<CONVERSION>(amax);
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        put<CONVERSION>(big, small, static_cast<size_t>(r) * ld + c, x[static_cast<size_t>(r) * cols + c], exponent);
    }
}

// convert_rows four elements a thread: cols and ld multiples of 4, x starting on 4 of its elements. One vector load
// (16 bytes of float32, 4 of int8) and one vector store per part: a warp writes 128 bytes of e4m3 or int8 at once,
// where convert_rows writes 32. Block (256, 1), grid (ceil(cols / 1024), any).
template <int CONVERSION>
__global__ void convert_rows_by_four(const typename Source<CONVERSION>::type* __restrict__ x, void* big, void* small,
                                     int rows, int cols, int ld, const u32* __restrict__ amax) {
    using In = Four<typename Source<CONVERSION>::type>;
    const int c = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= cols) return;
    const int exponent = scale_exponent<CONVERSION>(amax);
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const In four = reinterpret_cast<const In*>(x + static_cast<size_t>(r) * cols + c)[0];
        put_four<CONVERSION>(big, small, static_cast<size_t>(r) * ld + c, four, exponent);
    }
}

constexpr int TILE = 32;
constexpr int TILE_ROWS = 8;

// x: rows x cols, row-major -> out[c * ld + r] (the transpose). Block (32, 8), grid (ceil(cols / 32), any).
template <int CONVERSION>
__global__ void convert_transposed(const typename Source<CONVERSION>::type* __restrict__ x, void* big, void* small,
                                   int rows, int cols, int ld, const u32* __restrict__ amax) {
    const int exponent = scale_exponent<CONVERSION>(amax);
    __shared__ typename Source<CONVERSION>::type tile[TILE][TILE + 1];  // the extra column: reads of a column
                                                                        // fall in different banks
    const int c0 = blockIdx.x * TILE;
    for (int r0 = blockIdx.y * TILE; r0 < rows; r0 += gridDim.y * TILE) {
        for (int i = threadIdx.y; i < TILE; i += TILE_ROWS) {
            const int r = r0 + i, c = c0 + threadIdx.x;
            if (r < rows && c < cols) tile[i][threadIdx.x] = x[static_cast<size_t>(r) * cols + c];
        }
        __syncthreads();
        for (int i = threadIdx.y; i < TILE; i += TILE_ROWS) {
            const int c = c0 + i, r = r0 + threadIdx.x;
            if (r < rows && c < cols) put<CONVERSION>(big, small, static_cast<size_t>(c) * ld + r, tile[threadIdx.x][i], exponent);
        }
        __syncthreads();
    }
}

// *amax = max(*amax, largest |x[i]| of the `count` elements), as float32 bits (whose order is the magnitudes' for
// values >= 0; *amax starts at 0). Blocks of whole warps, any grid: each thread takes every (threads in the
// grid)th element, 16 bytes at a time where x starts on 16 bytes, then the warp's largest goes to one atomic.
__global__ void largest_magnitude(const float* __restrict__ x, size_t count, u32* amax) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    float largest = 0.0f;
    size_t done = 0;
    if (reinterpret_cast<size_t>(x) % 16 == 0) {
        const float4* quads = reinterpret_cast<const float4*>(x);
        for (size_t i = first; i < count / 4; i += stride) {
            const float4 q = quads[i];
            largest = fmaxf(largest, fmaxf(fmaxf(fabsf(q.x), fabsf(q.y)), fmaxf(fabsf(q.z), fabsf(q.w))));
        }
        done = count / 4 * 4;
    }
    for (size_t i = done + first; i < count; i += stride) largest = fmaxf(largest, fabsf(x[i]));
    for (int offset = 16; offset > 0; offset /= 2) {
        largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    }
    if (threadIdx.x % 32 == 0) atomicMax(amax, __float_as_uint(largest));
}
