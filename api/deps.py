"""The objects of one api replica, built together by the app's lifespan (api/app.py), and the
dependencies through which the routes take them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from arq import ArqRedis
from fastapi import Depends, Request

from api.generation import Generation
from api.hub import PubSubHub
from api.relay import Relay
from api.served_models import Models
from shared.api_keys import KeyStore
from shared.settings import ApiSettings
from shared.store import RequestStore
from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class Replica:
    settings: ApiSettings
    store: RequestStore
    hub: PubSubHub
    relay: Relay
    arq: ArqRedis  # queues offline batches for the scheduler
    keys: KeyStore | None  # None: auth is off
    models: Models
    model_name: str  # the model this replica serves by default
    tokenizer: Tokenizer  # its tokenizer
    generation: Generation  # its Generation


def replica(request: Request) -> Replica:
    return request.app.state.replica


ReplicaDep = Annotated[Replica, Depends(replica)]


def _settings(r: ReplicaDep) -> ApiSettings:
    return r.settings


def _store(r: ReplicaDep) -> RequestStore:
    return r.store


def _hub(r: ReplicaDep) -> PubSubHub:
    return r.hub


def _relay(r: ReplicaDep) -> Relay:
    return r.relay


def _arq(r: ReplicaDep) -> ArqRedis:
    return r.arq


def _tokenizer(r: ReplicaDep) -> Tokenizer:
    return r.tokenizer


def _generation(r: ReplicaDep) -> Generation:
    return r.generation


def _models(r: ReplicaDep) -> Models:
    return r.models


def _model_name(r: ReplicaDep) -> str:
    return r.model_name


SettingsDep = Annotated[ApiSettings, Depends(_settings)]
StoreDep = Annotated[RequestStore, Depends(_store)]
HubDep = Annotated[PubSubHub, Depends(_hub)]
RelayDep = Annotated[Relay, Depends(_relay)]
ArqDep = Annotated[ArqRedis, Depends(_arq)]
TokenizerDep = Annotated[Tokenizer, Depends(_tokenizer)]
ModelNameDep = Annotated[str, Depends(_model_name)]
GenerationDep = Annotated[Generation, Depends(_generation)]
ModelsDep = Annotated[Models, Depends(_models)]
