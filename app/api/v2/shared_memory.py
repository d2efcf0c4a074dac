"""Triton's shared-memory extensions: co-located clients register system (POSIX) or CUDA shared-memory regions,
then name them in infer requests instead of sending the tensors' bytes.

Each kind is off unless MATMUL_SHARED_MEMORY names it (`system`, `cuda`; 404 then). The regions live in the engine
processes (app.dataplane.regions): every one maps and pins each system region once, and the engine of a CUDA
region's device opens its handle once, so every HTTP worker can serve a request naming any of them. Errors are the
protocol's `{"error": "..."}` with 400.

The routes of both kinds are the same five, built by `_routes` for each: status of all, status of one, register,
unregister all, unregister one.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.api.deps import settings_of
from app.api.errors import PROTOCOL_PREFIX
from app.api.exchange import reading_body
from app.api.limits import json_limit
from app.api.v2.responses import protocol_error
from app.config import Settings, SharedMemoryKind
from app.errors import BadRequest, NotFound

RegionName = Annotated[str, Path(min_length=1, max_length=128, description="The name the region is registered as.")]


class RegionRegistry(Protocol):
    """What these routes ask of the engine processes."""

    async def register_region(self, name: str, key: str, offset: int, byte_size: int) -> None: ...

    async def register_cuda_region(self, name: str, raw_handle: str, device_id: int, byte_size: int) -> None: ...

    async def unregister_region(self, name: str | None, kind: str = "system") -> None: ...

    async def region_status(self, name: str | None, kind: str = "system") -> list[dict[str, Any]]: ...


class SystemRegionRegistration(BaseModel):
    """The body of a system shared-memory register request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    key: str = Field(max_length=256, description="The shared-memory object's name, as given to shm_open (`/name`).")
    offset: int = Field(0, ge=0, description="Where the region starts in the object, in bytes.")
    byte_size: int = Field(gt=0, description="The region's size in bytes.")


class RawHandle(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    b64: str = Field(max_length=256, description="The cudaIpcMemHandle_t (64 bytes), base64.")


class CudaRegionRegistration(BaseModel):
    """The body of a CUDA shared-memory register request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    raw_handle: RawHandle
    device_id: int = Field(ge=0, description="The CUDA device the memory is on.")
    byte_size: int = Field(gt=0, description="The region's size in bytes.")


class SystemRegionStatus(BaseModel):
    name: str
    key: str
    offset: int
    byte_size: int


class CudaRegionStatus(BaseModel):
    name: str
    device_id: int
    byte_size: int


def shared_memory_enabled(settings: Settings, kind: SharedMemoryKind) -> bool:
    return kind in settings.shared_memory


def check_enabled(settings: Settings, kind: SharedMemoryKind) -> None:
    """NotFound unless MATMUL_SHARED_MEMORY enables this kind (over HTTP and gRPC alike)."""
    if not shared_memory_enabled(settings, kind):
        raise NotFound(f"{kind} shared memory is off; MATMUL_SHARED_MEMORY={kind} enables it")


def _regions(request: Request, kind: SharedMemoryKind) -> RegionRegistry:
    """The engine processes' regions, when MATMUL_SHARED_MEMORY enables this kind."""
    check_enabled(request.app.state.settings, kind)
    regions: RegionRegistry = request.app.state.engine
    return regions


async def _registration(request: Request, model: type[BaseModel]) -> Any:
    """The register request's body, read as JSON whatever its Content-Type (tritonclient sends none), so within
    MATMUL_MAX_JSON_BYTES whatever its Content-Type too; its fields strictly of their types (a string or a boolean is
    no byte count)."""
    try:
        async with reading_body(request, json_limit(settings_of(request))) as body:
            return model.model_validate_json(bytes(body))  # a registration is a few hundred bytes
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'body'}: {error['msg']}" for error in exc.errors(include_url=False)
        )
        raise BadRequest(f"the registration is not valid: {problems}", location=["body"]) from None


def _routes(kind: SharedMemoryKind, registration: type[BaseModel], status: type[BaseModel], what: str) -> APIRouter:
    """The five routes of one kind of shared memory."""
    router = APIRouter(prefix=f"{PROTOCOL_PREFIX}/{kind}sharedmemory", tags=["inference protocol v2"])
    errors: dict[int | str, dict[str, Any]] = {
        400: protocol_error(f"A region misused: a duplicate or unknown name, {what}, a malformed registration."),
        404: protocol_error(f"MATMUL_SHARED_MEMORY does not enable {kind} shared memory."),
    }
    body = {
        "requestBody": {"required": True, "content": {"application/json": {"schema": registration.model_json_schema()}}}
    }

    title = f"{kind} shared-memory region"
    statuses: Any = list[status]  # type: ignore[valid-type]

    @router.get("/status", summary=f"Status of every {title}", responses=errors, response_model=statuses)
    async def all_status(request: Request) -> list[BaseModel]:
        """Every registered region of this kind."""
        return [status(**found) for found in await _regions(request, kind).region_status(None, kind)]

    @router.get("/region/{region}/status", summary=f"Status of one {title}", responses=errors, response_model=statuses)
    async def region_status(region: RegionName, request: Request) -> list[BaseModel]:
        """The region named, as a list of one; 400 when no region of this kind has that name."""
        return [status(**found) for found in await _regions(request, kind).region_status(region, kind)]

    @router.post("/region/{region}/register", summary=f"Register a {title}", responses=errors, openapi_extra=body)
    async def register(region: RegionName, request: Request) -> Response:
        """Register the region under the name in the path."""
        regions = _regions(request, kind)
        given = await _registration(request, registration)
        if isinstance(given, CudaRegionRegistration):
            await regions.register_cuda_region(region, given.raw_handle.b64, given.device_id, given.byte_size)
        else:
            await regions.register_region(region, given.key, given.offset, given.byte_size)
        return Response()

    @router.post("/unregister", summary=f"Unregister every {title}", responses=errors)
    async def unregister_all(request: Request) -> Response:
        """Every region of this kind is forgotten, and closed once no product in flight uses it."""
        await _regions(request, kind).unregister_region(None, kind)
        return Response()

    @router.post("/region/{region}/unregister", summary=f"Unregister one {title}", responses=errors)
    async def unregister(region: RegionName, request: Request) -> Response:
        """The region is forgotten (a name not registered is no error), and closed once no product uses it."""
        await _regions(request, kind).unregister_region(region, kind)
        return Response()

    return router


system_router = _routes(
    SharedMemoryKind.SYSTEM,
    SystemRegionRegistration,
    SystemRegionStatus,
    "a key that names no shared-memory object, a window outside the object",
)
cuda_router = _routes(
    SharedMemoryKind.CUDA,
    CudaRegionRegistration,
    CudaRegionStatus,
    "a handle that does not open on the device named, CUDA shared memory on the CPU backend",
)
