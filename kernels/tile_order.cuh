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

// Calls work(tile, stages_before) for each tile of C this block takes: tile blockIdx.x, or (PERSISTENT: a block per
// SM) tiles blockIdx.x, + gridDim.x, ..., with the stages of K (k_tiles a tile) the block's earlier tiles took.
template <bool PERSISTENT, typename Work>
__device__ __forceinline__ void for_each_tile(int tiles, int k_tiles, Work&& work) {
    if constexpr (PERSISTENT) {
        for (int tile = blockIdx.x, stages_before = 0; tile < tiles; tile += gridDim.x, stages_before += k_tiles)
            work(tile, stages_before);
    } else {
        work(blockIdx.x, 0);
    }
}

#endif  // MATMUL_TILE_ORDER_CUH
