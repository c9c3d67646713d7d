"""OpenAI's Models endpoint (`/v1/models`): the models live workers serve, from the catalog."""

from fastapi import APIRouter
from fastapi.responses import Response

from services.sessions.deps import ServicesDep
from shared.http_responses import ORJSONResponse
from shared.url_params import ANY

router = APIRouter()


@router.get("/v1/models")
async def list_models(services: ServicesDep) -> Response:
    """List the models that at least one live worker serves, and their aliases."""
    models = await services.catalog.listing()
    return ORJSONResponse({"object": "list", "data": models})


@router.get(f"/v1/models/{{model_id:{ANY}}}")
async def get_model(model_id: str, services: ServicesDep) -> Response:
    """One live model (or alias): its context length and the parameters its workers honour."""
    return ORJSONResponse(await services.catalog.entry(model_id))
