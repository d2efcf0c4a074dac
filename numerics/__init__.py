"""The numerics both sides of the service share, below both `app` and `kernels`: the precision modes and what their
rounding costs (`precision`), the float64 reference products and the error bound every answer states (`reference`),
and the roofline of a product on a device (`roofline`). NumPy only: no CuPy, nothing of the service."""
