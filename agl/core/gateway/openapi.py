"""The OpenAPI document's parts the routes cannot declare themselves: they read their
bodies and query strings by hand and answer with orjson, so each route names its
request body, query parameters and answer here, and the models they refer to are
collected for the document's ``components.schemas``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter


class OpenApiExtras:
    """``openapi_extra`` for the routes; ``definitions`` gathers the models they name."""

    def __init__(self) -> None:
        self.definitions: dict[str, Any] = {}

    def body(self, adapter: TypeAdapter[Any]) -> dict[str, Any]:
        return _body(adapter, self.definitions)

    def query(self, model: type[BaseModel]) -> dict[str, Any]:
        return _query(model, self.definitions)

    def returns(self, adapter: TypeAdapter[Any]) -> dict[str, Any]:
        return _returns(adapter, self.definitions)


def _body(adapter: TypeAdapter[Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """A request body for OpenAPI: the models it refers to go to ``definitions`` (the
    document's ``components.schemas``), where its references point."""
    schema = adapter.json_schema(ref_template="#/components/schemas/{model}")
    definitions.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _query(model: type[BaseModel], definitions: dict[str, Any]) -> dict[str, Any]:
    """A route's query parameters for OpenAPI, from the model its handler reads them with
    (the handler takes none from FastAPI, so FastAPI declares none)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions.update(schema.pop("$defs", {}))
    required = set(schema.get("required", ()))
    parameters = []
    for name, field in schema["properties"].items():
        parameter = {"name": name, "in": "query", "required": name in required, "schema": field}
        if "description" in field:
            parameter["description"] = field["description"]
        parameters.append(parameter)
    return {"parameters": parameters}


def _returns(adapter: TypeAdapter[Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """A route's 200 answer for OpenAPI (the routes answer with orjson, not a model)."""
    schema = adapter.json_schema(ref_template="#/components/schemas/{model}")
    definitions.update(schema.pop("$defs", {}))
    content = {"application/json": {"schema": schema}}
    return {"responses": {"200": {"description": "Successful Response", "content": content}}}
