"""What the routes need, taken from the app's state (filled in by the lifespan)."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.generation import Generation
from api.served_models import Models
from api.hub import PubSubHub
from api.relay import Relay
from shared.settings import ApiSettings
from shared.store import RequestStore
from shared.tokenizer import Tokenizer


def _settings(request: Request) -> ApiSettings:
    return request.app.state.settings


def _store(request: Request) -> RequestStore:
    return request.app.state.store


def _hub(request: Request) -> PubSubHub:
    return request.app.state.hub


def _relay(request: Request) -> Relay:
    return request.app.state.relay


def _tokenizer(request: Request) -> Tokenizer:
    return request.app.state.tokenizer


def _generation(request: Request) -> Generation:
    return request.app.state.generation


def _models(request: Request) -> Models:
    return request.app.state.models


def _model_name(request: Request) -> str:
    return request.app.state.model_name


SettingsDep = Annotated[ApiSettings, Depends(_settings)]
StoreDep = Annotated[RequestStore, Depends(_store)]
HubDep = Annotated[PubSubHub, Depends(_hub)]
RelayDep = Annotated[Relay, Depends(_relay)]
TokenizerDep = Annotated[Tokenizer, Depends(_tokenizer)]
ModelNameDep = Annotated[str, Depends(_model_name)]
GenerationDep = Annotated[Generation, Depends(_generation)]
ModelsDep = Annotated[Models, Depends(_models)]
