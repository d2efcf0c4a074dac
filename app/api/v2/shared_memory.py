"""Triton's system shared-memory extension: co-located clients register POSIX shared-memory regions, then name
them in infer requests instead of sending the tensors' bytes.

Off unless MATMUL_SHARED_MEMORY names `system` (404 then). The regions live in the engine processes (app.dataplane
.regions), which map and pin each once, so every HTTP worker can serve a request naming any of them. Errors are
the protocol's `{"error": "..."}` with 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.api.errors import PROTOCOL_PREFIX
from app.api.v2.responses import protocol_error
from app.config import Settings, SharedMemoryKind
from app.errors import BadRequest, NotFound

router = APIRouter(prefix=f"{PROTOCOL_PREFIX}/systemsharedmemory", tags=["inference protocol v2"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: protocol_error(
        "A region misused: a duplicate or unknown name, a key that names no shared-memory object, a "
        "window outside the object, a malformed registration."
    ),
    404: protocol_error("MATMUL_SHARED_MEMORY does not enable system shared memory."),
}
RegionName = Annotated[str, Path(min_length=1, max_length=128, description="The name the region is registered as.")]


class RegionRegistry(Protocol):
    """What these routes ask of the engine processes."""

    async def register_region(self, name: str, key: str, offset: int, byte_size: int) -> None: ...

    async def unregister_region(self, name: str | None) -> None: ...

    async def region_status(self, name: str | None) -> list[dict[str, Any]]: ...


class SystemRegionRegistration(BaseModel):
    """The body of a register request."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(max_length=256, description="The shared-memory object's name, as given to shm_open (`/name`).")
    offset: int = Field(0, ge=0, description="Where the region starts in the object, in bytes.")
    byte_size: int = Field(gt=0, description="The region's size in bytes.")


class SystemRegionStatus(BaseModel):
    name: str
    key: str
    offset: int
    byte_size: int


def system_shared_memory_enabled(settings: Settings) -> bool:
    return SharedMemoryKind.SYSTEM in settings.shared_memory


async def get_regions(request: Request) -> RegionRegistry:
    """The engine processes' regions, when MATMUL_SHARED_MEMORY enables system shared memory."""
    if not system_shared_memory_enabled(request.app.state.settings):
        raise NotFound("system shared memory is off; MATMUL_SHARED_MEMORY=system enables it")
    regions: RegionRegistry = request.app.state.engine
    return regions


RegionsDep = Annotated[RegionRegistry, Depends(get_regions)]


@router.get("/status", summary="Status of every system shared-memory region", responses=_ERRORS)
async def all_status(regions: RegionsDep) -> list[SystemRegionStatus]:
    """Every registered region: its name, the object's key, and the window's offset and size."""
    return [SystemRegionStatus(**status) for status in await regions.region_status(None)]


@router.get("/region/{region}/status", summary="Status of one system shared-memory region", responses=_ERRORS)
async def region_status(region: RegionName, regions: RegionsDep) -> list[SystemRegionStatus]:
    """The region named, as a list of one; 400 when no region has that name."""
    return [SystemRegionStatus(**status) for status in await regions.region_status(region)]


_REGISTRATION_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": SystemRegionRegistration.model_json_schema()}},
    }
}


@router.post(
    "/region/{region}/register",
    summary="Register a system shared-memory region",
    responses=_ERRORS,
    openapi_extra=_REGISTRATION_BODY,
)
async def register(region: RegionName, request: Request, regions: RegionsDep) -> Response:
    """The window [offset, offset + byte_size) of the object `key` names becomes region `region`. The body is read
    as JSON whatever its Content-Type: tritonclient sends none."""
    try:
        registration = SystemRegionRegistration.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'body'}: {error['msg']}" for error in exc.errors(include_url=False)
        )
        raise BadRequest(f"the registration is not valid: {problems}", location=["body"]) from None
    await regions.register_region(region, registration.key, registration.offset, registration.byte_size)
    return Response()


@router.post("/unregister", summary="Unregister every system shared-memory region", responses=_ERRORS)
async def unregister_all(regions: RegionsDep) -> Response:
    """Every region is forgotten; each is unpinned and unmapped once no product in flight uses it."""
    await regions.unregister_region(None)
    return Response()


@router.post("/region/{region}/unregister", summary="Unregister one system shared-memory region", responses=_ERRORS)
async def unregister(region: RegionName, regions: RegionsDep) -> Response:
    """The region is forgotten (a name not registered is no error), and unmapped once no product uses it."""
    await regions.unregister_region(region)
    return Response()
