"""The Open Inference Protocol v2 (KServe / Triton HTTP): its routes, its model catalogue and its statistics."""
