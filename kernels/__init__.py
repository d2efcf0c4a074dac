"""CUDA kernel sources (*.cu) and the registry that names them."""
