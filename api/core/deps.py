"""The objects of one api replica, built together by the app's lifespan (api/app.py), and the
dependencies through which the routes take them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from arq import ArqRedis
from fastapi import Depends, Request

from api.core.generation import Generation
from api.core.hub import PubSubHub
from api.core.relay import Relay
from api.core.served_models import Models
from api.core.stream_slots import StreamSlots
from shared.api_keys import KeyStore
from shared.arq_cluster import ArqPool
from shared.settings import ApiSettings
from shared.store import RequestStore
from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class Replica:
    settings: ApiSettings
    store: RequestStore
    hub: PubSubHub
    relay: Relay
    arq: ArqRedis | ArqPool  # queues offline batches for the scheduler (ArqPool: on a Redis Cluster)
    keys: KeyStore | None  # None: auth is off
    models: Models
    model_name: str  # the model this replica serves by default
    tokenizer: Tokenizer  # its tokenizer
    generation: Generation  # its Generation
    streams: StreamSlots  # the stream slots it holds, each tenant's capped over every replica


def replica(request: Request) -> Replica:
    return request.app.state.replica


ReplicaDep = Annotated[Replica, Depends(replica)]


def _part(name: str):
    """A dependency on one of the replica's objects."""
    def part(r: ReplicaDep):
        return getattr(r, name)
    return Depends(part)


SettingsDep = Annotated[ApiSettings, _part("settings")]
StoreDep = Annotated[RequestStore, _part("store")]
HubDep = Annotated[PubSubHub, _part("hub")]
RelayDep = Annotated[Relay, _part("relay")]
ArqDep = Annotated[ArqRedis | ArqPool, _part("arq")]
TokenizerDep = Annotated[Tokenizer, _part("tokenizer")]
ModelNameDep = Annotated[str, _part("model_name")]
GenerationDep = Annotated[Generation, _part("generation")]
ModelsDep = Annotated[Models, _part("models")]
StreamsDep = Annotated[StreamSlots, _part("streams")]
