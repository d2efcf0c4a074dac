"""The models the inference protocol serves, and what each of them is: its kernel, metadata and configuration.

`matmul` runs the request's `parameters.kernel` (else auto); `matmul_<kernel>` runs one kernel of this backend
(`matmul_tiled`, `matmul_cublas`, ...), so tools that address a model by name alone (perf_analyzer) can still
choose the kernel. Each has version "1".
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import Depends

from app.api.deps import EngineDep
from app.codecs import RequestOptions, inference_v2
from app.engine.engine import EngineFront
from app.errors import InvalidParameter, UnknownModel

MODEL = "matmul"
VERSION = "1"


class ModelCatalogue:
    """Model name -> the kernel it runs (None: the request's parameters.kernel, else auto)."""

    def __init__(self, kernels: list[str], backend: str) -> None:
        self.kernels: dict[str, str | None] = {MODEL: None} | {f"{MODEL}_{name}": name for name in kernels}
        self.backend = backend

    @classmethod
    def of(cls, engine: EngineFront) -> ModelCatalogue:
        """The models of the kernels `engine` offers (auto aside: it is the model `matmul`)."""
        return cls([k.name for k in engine.kernels() if k.kind != "auto"], engine.backend_name)

    def kernel_of(self, model: str, version: str | None = None) -> str | None:
        """The kernel `model` runs; UnknownModel when this server has no such model or version."""
        if model not in self.kernels:
            raise UnknownModel(f"unknown model '{model}'; this server has {list(self.kernels)}")
        if version is not None and version != VERSION:
            raise UnknownModel(f"model '{model}' has no version '{version}'; its only version is '{VERSION}'")
        return self.kernels[model]

    def options_for(self, model: str, options: RequestOptions) -> RequestOptions:
        """The request's options with the model's kernel; a model of one kernel refuses another."""
        fixed_kernel = self.kernel_of(model)
        if fixed_kernel is None:
            return options
        if options.kernel not in (None, fixed_kernel):
            raise InvalidParameter(f"model '{model}' runs kernel '{fixed_kernel}'; use model '{MODEL}' to choose")
        return dataclasses.replace(options, kernel=fixed_kernel)

    def metadata(self, model: str) -> dict[str, Any]:
        """The protocol's model metadata: inputs A (m x k) and B (k x n), output C (m x n)."""

        def tensor(name: str) -> dict[str, Any]:
            return {"name": name, "datatype": "FP32", "shape": [-1, -1]}

        return {
            "name": model,
            "versions": [VERSION],
            "platform": "matmul-service",
            "inputs": [tensor(name) for name in inference_v2.INPUTS],
            "outputs": [tensor(inference_v2.OUTPUT)],
            "parameters": {"backend": self.backend, "datatypes": list(inference_v2.DATATYPES)},
        }

    def config(self, model: str) -> dict[str, Any]:
        """Triton's model configuration extension: a minimal config (no batching dimension)."""

        def tensor(name: str) -> dict[str, Any]:
            return {"name": name, "data_type": "TYPE_FP32", "dims": [-1, -1]}

        return {
            "name": model,
            "platform": "matmul-service",
            "backend": self.backend,
            "max_batch_size": 0,
            "input": [tensor(name) for name in inference_v2.INPUTS],
            "output": [tensor(inference_v2.OUTPUT)],
        }


async def get_catalogue(engine: EngineDep) -> ModelCatalogue:
    return ModelCatalogue.of(engine)


CatalogueDep = Annotated[ModelCatalogue, Depends(get_catalogue)]
