// The order in which the blocks of a 1-D grid take the tiles of C, shared by the tensor-core rungs.
#ifndef MATMUL_TILE_ORDER_CUH
#define MATMUL_TILE_ORDER_CUH

// Tiles are taken GROUP_M rows of tiles at a time, column by column within the group, so that the blocks resident
// together share their panels of A and B in L2 instead of each streaming its own.
constexpr int GROUP_M = 8;

// The (row, column) of C's tile that block `block` computes.
__device__ __forceinline__ void tile_of(int block, int tiles_m, int tiles_n, int& tile_m, int& tile_n) {
    const int per_group = GROUP_M * tiles_n;
    const int first = (block / per_group) * GROUP_M;
    const int rows = min(tiles_m - first, GROUP_M);
    const int in_group = block % per_group;
    tile_m = first + in_group % rows;
    tile_n = in_group / rows;
}

#endif  // MATMUL_TILE_ORDER_CUH
