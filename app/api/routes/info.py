"""What this server is and has: backend, device, kernels."""

from __future__ import annotations

import os
from typing import cast

from fastapi import APIRouter

from app import __version__
from app.api.deps import EngineDep, SettingsDep
from app.api.schemas import AutoChoiceModel, InfoResponse, KernelListing, KernelModel, QueueModel, SlabModel
from app.engine import EngineFront
from app.product import DtypeName

router = APIRouter(prefix="/v1", tags=["info"])


def _kernel_models(engine: EngineFront) -> list[KernelModel]:
    return [
        KernelModel(
            name=k.name,
            kind=k.kind,
            summary=k.summary,
            dtypes=list(k.dtypes),
            tiles=list(k.tiles),
            default_tile=k.default_tile,
            precisions=list(k.precisions),
            stacks=k.stacks,
        )
        for k in engine.kernels()
    ]


@router.get("/kernels", summary="List the kernels")
async def kernels(engine: EngineDep) -> KernelListing:
    """The kernels a request may name on this server's backend, their tiles and dtypes, and what auto picks."""
    auto = [
        AutoChoiceModel(
            shape_class=choice.shape_class.name,
            up_to=choice.shape_class.up_to,
            precision=choice.precision,
            dtype=cast(DtypeName, choice.dtype),
            kernel=choice.kernel,
            probe=[choice.shape_class.probe] * 3,
            probe_ms=dict(choice.probe_ms),
        )
        for choice in engine.auto_choices()
    ]
    return KernelListing(backend=engine.backend_name, default="auto", kernels=_kernel_models(engine), auto=auto)


@router.get("/info", summary="Describe the server")
async def info(engine: EngineDep, settings: SettingsDep) -> InfoResponse:
    """Backend, readiness, processes, devices (name, memory, compute capability, CuPy/CUDA versions, engine
    process), shared memory, queue and kernels."""
    slabs = engine.slab_use()
    return InfoResponse(
        service="matmul-service",
        version=__version__,
        backend=engine.backend_name,
        state=engine.state.value,
        failure=engine.failure,
        http_workers=settings.http_workers,
        http_worker_pid=os.getpid(),
        grpc_port=settings.grpc_port or None,
        slabs=None if slabs is None else SlabModel.model_validate(slabs, from_attributes=True),
        devices=engine.describe(),
        queue=QueueModel(size=engine.queue_size, depth=engine.queue_depth),
        kernels=_kernel_models(engine),
    )
