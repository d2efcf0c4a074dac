"""What this server is and has: backend, device, kernels."""

from __future__ import annotations

from fastapi import APIRouter

from app import __version__
from app.api.deps import EngineDep
from app.api.schemas import AutoChoiceModel, InfoResponse, KernelListing, KernelModel, QueueModel
from app.engine import Engine

router = APIRouter(prefix="/v1", tags=["info"])


def _kernel_models(engine: Engine) -> list[KernelModel]:
    return [
        KernelModel(
            name=k.name,
            kind=k.kind,
            summary=k.summary,
            dtypes=list(k.dtypes),
            tiles=list(k.tiles),
            default_tile=k.default_tile,
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
            kernel=choice.kernel,
            probe=[choice.shape_class.probe] * 3,
            probe_ms=dict(choice.probe_ms),
        )
        for choice in engine.auto_choices()
    ]
    return KernelListing(backend=engine.backend_name, default="auto", kernels=_kernel_models(engine), auto=auto)


@router.get("/info", summary="Describe the server")
async def info(engine: EngineDep) -> InfoResponse:
    """Backend, readiness, device (name, memory, compute capability, CuPy/CUDA versions), queue and kernels."""
    return InfoResponse(
        service="matmul-service",
        version=__version__,
        backend=engine.backend_name,
        state=engine.state.value,
        failure=engine.failure,
        devices=engine.describe(),
        queue=QueueModel(size=engine.queue_size, depth=engine.queue_depth),
        kernels=_kernel_models(engine),
    )
