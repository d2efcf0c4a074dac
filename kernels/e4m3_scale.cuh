// FP8 (e4m3) operands scaled per tensor by a power of two, shared by kernels/operands.cu (which scales and rounds)
// and kernels/wgmma.cu (which scales the product back): numerics/precision.py's `e4m3_scale_exponent`, bit for bit.
#ifndef MATMUL_E4M3_SCALE_CUH
#define MATMUL_E4M3_SCALE_CUH

// The exponent e of the power of two that brings the operand's largest magnitude `amax` (finite) to at most 448,
// e4m3's largest finite value, and as close to it as a power of two can: amax * 2^e is in (224, 448], so no
// element of the operand can round past e4m3's range, and multiplying by 2^e rounds nothing. 0 for amax = 0.
__device__ __forceinline__ int e4m3_scale_exponent(float amax) {
    if (amax == 0.0f) return 0;
    int exponent;
    const float fraction = frexpf(amax, &exponent);  // amax = fraction * 2^exponent, fraction in [0.5, 1)
    return (fraction <= 0.875f ? 9 : 8) - exponent;  // 448 = 0.875 * 2^9
}

#endif
